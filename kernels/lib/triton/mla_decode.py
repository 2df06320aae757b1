"""Triton MLA decode: flash-decoding over K3's paged latent cache, split along the context.

K3's gated NoPE-MLA at decode reads, for every sequence, its whole latent cache: entries
[c_kv (512) | k_sh (64)] of 576 values a token, bf16 or fp8 (e4m3 with one fp32 scale). Every
head of the rank scores the same entries, and the values are the c_kv part of them, so the cost
is the cache read: at 3-12 heads a rank the arithmetic is a rounding error beside the bytes.

Two kernels:
* `_mla_split_kernel`, one program per (sequence, block of BLOCK_H heads, split of the context):
  it loads its heads' queries once, then walks its split in tiles of BLOCK_N tokens, scores all
  its heads on the tile (q_lat . c_kv + q_sh . k_sh), keeps the online softmax in base 2, and
  accumulates p @ c_kv from the same tile: one read of the cache serves every head of the block
  (heads padded to 16, the dots' smallest side). It writes its normalised partial output and its
  log-sum-exp, or, with one split, the output itself. How a tile travels and which dots score it
  is a `LaunchConfig` (below); every variant computes the same thing. On sm_90 the default is the
  same split kernel in Gluon (lib/triton/mla_decode_gluon.py), this one where that cannot run.
* `_mla_combine_kernel`, one program per (sequence, head, BLOCK_D columns): the softmax-weighted
  merge of the partials, `combine` below; also the entry decode context parallelism (DCP) calls on
  partials exchanged between GPUs. Launched as the split kernel's programmatic dependent (PDL)
  where the config says so, so its launch overlaps the split kernel's tail.

Splits: `split_count` picks, on the host, the number of splits S from the batch, the heads, the
longest context the call can hold (the block table's width) and the SM count, by a small cost
model (waves of programs, per-program streaming rate, the combine's bytes and fixed cost). On the
device each sequence cuts its own length into at most S splits of whole tiles, so a short sequence
in a wide table uses fewer splits and the launch grid stays fixed: CUDA graphs replay it over any
lengths. Splits with no tokens write a log-sum-exp of -inf and nothing else; the combine skips them.

Conventions: the partial log-sum-exp is natural-log, lse = log(sum_j exp(score_j)), score_j =
softmax_scale * (q . entry_j) (* kv_scale for fp8); partial outputs are normalised (sum_j p_j c_kv_j
with p summing to 1), in fp32. A sequence of length 0 gets a zero output (padding rows of a graph).

q [B, H, 576] (bf16 / fp16, unit inner stride), kv_cache [num_blocks, block_size, 576] (q's dtype,
or fp8 e4m3), kv_scale (an fp32 tensor of one element: entry = kv_scale * stored; an fp8 cache needs
it, a 16-bit one may have it), block_table int32 [B, max_blocks], seq_lens int32 [B] (a length past
the table's max_blocks * block_size entries attends over all of them, as the plain spelling does)
-> out [B, H, 512] in q's dtype.
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch

from . import HAVE_TRITON
from . import mla_decode_gluon as gluon_kernel

if HAVE_TRITON:
    import triton
    import triton.language as tl

LATENT = 512  # c_kv, the values
ROPE = 64  # k_sh, the shared key (no RoPE in K3, the name kept from DeepSeek's layout)
ENTRY = LATENT + ROPE
QUERY_DTYPES = (torch.bfloat16, torch.float16)
FP8 = torch.float8_e4m3fn
BLOCK_H = 16  # heads a program serves: the dots' smallest side; K3 has 3-12 heads a rank at TP 32-8
MAX_SPLITS = 512
LOG2E = 1.4426950408889634
#: Triton's CPU interpreter (TRITON_INTERPRET=1, read when triton is imported) multiplies the raw bits
#: of bf16 dot operands (Triton 3.6), so under it the dots take fp32 copies of the same values
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass(frozen=True)
class LaunchConfig:
    """How the split kernel moves and scores a tile.

    block_n: entries a tile; num_warps / num_stages: the split kernel's (num_stages - 1 tiles in
    flight through cp.async, issued after the tile before them is scored);
    prefetch: the next tile's loads issued into registers before this tile's dots, instead of the
      pipeliner's cp.async buffers (the pipeliner leaves an fp8 tile, widened before two dots of
      different operand layouts, unbuffered);
    fp16_dots: an fp8 cache is widened to fp16 (one cvt a pair of values; bf16 takes two more),
      q scaled by a power of two into fp16's range, p in fp16 (finer than bf16);
    gluon: the split kernel in Gluon (lib/triton/mla_decode_gluon.py: one warpgroup, wgmma from the
      cp.async ring, fp8 widened once through shared memory; num_stages is its ring's depth); a call it
      cannot serve (a page not holding whole tiles, not sm_90, the CPU interpreter) takes the cache's
      Triton variant (`resolve`);
    widen_ahead: Gluon on an fp8 cache: two fp16 staging tiles and no fp8 ring, tile i + 1 widened from
      registers while the wgmma score tile i (1), or half then and half while they add its values (2)
      (`_mla_split_gluon_fp8_ahead`);
    pdl: the combine launched as the split kernel's programmatic dependent;
    programs_per_sm, program_rate: what one SM holds of these programs (registers, shared memory)
      and the bytes/s split_count's model lets one program stream (fitted to a split sweep: below).
    A tile sits in one page (one table lookup a tile) wherever the page holds whole tiles (`page_tiles`).
    """

    block_n: int
    num_warps: int
    num_stages: int
    prefetch: bool = False
    fp16_dots: bool = False
    gluon: bool = False
    widen_ahead: int = 0
    pdl: bool = True
    programs_per_sm: int = 1
    program_rate: float = 12e9


#: The variants, by name: the benchmark's arms (bench/bench_mla_decode.py --variants) and the tests'.
#: Registers and shared memory are sm_90 compiles' (tests/test_mla_decode.py reads them again).
#: program_rate is fitted to the H100 split sweep in bench/results/h100_mla_decode_h6_variants_splits.json
#: (tests/test_mla_decode.py test_split_model_rates_are_the_sweeps_fit shows the arithmetic): of the rates
#: whose split choices lose least to the best swept arm, the one whose modelled times fit the arms best.
#: It is not the rate a program streams alone (gluon64's: ~43 GB/s): the model's bandwidth knee is sharp,
#: and HBM only reaches it with every SM busy, which the fitted rate encodes.
VARIANTS: dict[str, LaunchConfig] = {
    # Triton, bf16: 32-entry tiles, two cp.async buffers in flight, mma.sync: 95 registers at 8 warps,
    # 91 KB: two programs an SM
    "page32": LaunchConfig(block_n=32, num_warps=8, num_stages=3, programs_per_sm=2, program_rate=14.5e9),
    # Triton, fp8: 64-entry tiles prefetched into registers, widened to fp16; 255 registers at 8 warps
    "fp16pf": LaunchConfig(block_n=64, num_warps=8, num_stages=1, prefetch=True, fp16_dots=True,
                           programs_per_sm=1, program_rate=23e9),
    # Gluon, bf16: 64-entry tiles, a ring of two (one in flight while one is scored), 255 registers at 4 warps
    # (no spill), 164 KB: one program an SM; 0.042 warp instructions a byte of cache against Triton's 0.10-0.12
    "gluon64": LaunchConfig(block_n=64, num_warps=4, num_stages=2, gluon=True, programs_per_sm=1, program_rate=26e9),
    # Gluon, fp8: a ring of three fp8 tiles (two in flight) and one fp16 staging tile, 228 registers, 200 KB:
    # 0.090 warp instructions a byte of cache against Triton's 0.19-0.38
    "gluon64_fp8": LaunchConfig(block_n=64, num_warps=4, num_stages=3, gluon=True, fp16_dots=True,
                                programs_per_sm=1, program_rate=23e9),
    # Gluon, fp8, the widening beside the tensor cores: two fp16 staging tiles, the next tile in registers;
    # beside the score dot alone (250 registers) or half beside each dot (254 registers); 168 KB, 0.080 warp
    # instructions a byte; not yet measured (program_rate: gluon64_fp8's)
    "gluon64_fp8ahead": LaunchConfig(block_n=64, num_warps=4, num_stages=2, gluon=True, fp16_dots=True,
                                     widen_ahead=2, programs_per_sm=1, program_rate=23e9),
    "gluon64_fp8ahead1": LaunchConfig(block_n=64, num_warps=4, num_stages=2, gluon=True, fp16_dots=True,
                                      widen_ahead=1, programs_per_sm=1, program_rate=23e9),
}
#: per cache element size, variants made but not yet measured on a GPU: benchmark arms (--variants-fp8),
#: tested like the rest, taken by no call unless named; each is kept or deleted once it has run beside the others
TRIAL_VARIANTS: dict[int, tuple[str, ...]] = {2: (), 1: ("gluon64_fp8ahead", "gluon64_fp8ahead1")}
#: per cache element size: (the variant a call takes, the Triton variant it takes where that one cannot run);
#: the benchmark's default arms. From the H100 runs of 2026-12-07 (docs/perf.md): the Gluon kernels are the
#: fastest at 79 of 90 points (the rest: B1 at 1K-4K, within 1.0 µs), the two Triton ones the fastest without.
CACHE_VARIANTS: dict[int, tuple[str, str]] = {2: ("gluon64", "page32"), 1: ("gluon64_fp8", "fp16pf")}

# split_count's model. Parameters, not measurements: bench/bench_mla_decode.py --splits times other
# counts beside the chosen one, and --variants other configs.
MODEL_BANDWIDTH = 3.0e12  # bytes/s the whole GPU streams (an H100 reads ~3.05 TB/s)
PROGRAM_SETUP_S = 2.0e-6  # a program's start: the length, its pages, q (dependent loads), before its first tile
COMBINE_FIXED_S = 2.0e-6  # the combine's launch (less behind PDL) and its two dependent reads


def config_for(cache_dtype: torch.dtype, variant: str | None = None) -> LaunchConfig:
    """VARIANTS[variant], or the variant a call on this cache takes when none is named."""
    name = variant or CACHE_VARIANTS[cache_dtype.itemsize][0]
    if name not in VARIANTS:
        raise ValueError(f"mla_decode: unknown variant {name!r}; known: {', '.join(VARIANTS)}")
    return VARIANTS[name]


def fallback_for(cache_dtype: torch.dtype) -> LaunchConfig:
    """The Triton variant a call on this cache takes where its Gluon variant cannot run."""
    return VARIANTS[CACHE_VARIANTS[cache_dtype.itemsize][1]]


def head_blocks(heads: int) -> int:
    return -(-heads // BLOCK_H)


def split_cost(batch: int, heads: int, max_len: int, sm_count: int, config: LaunchConfig, entry_bytes: int,
               splits: int) -> tuple[int, float]:
    """(used, seconds): the splits that hold tokens of the longest sequence when the call asks for
    `splits`, and the modelled time of the split kernel plus, for used > 1, the combine.

    The batch * head_blocks * used programs run in waves of sm_count * programs_per_sm; each wave
    costs a program's setup plus its `per` tiles at the smaller of its share of the GPU's bandwidth
    and program_rate. used > 1 adds the partials (written and read: 2 KB a head and split each way)
    and the combine's fixed cost."""
    tiles = max(1, -(-max_len // config.block_n))
    per = -(-tiles // splits)
    used = -(-tiles // per)
    items = batch * head_blocks(heads) * used
    slots = sm_count * config.programs_per_sm
    rate = min(MODEL_BANDWIDTH / min(items, slots), config.program_rate)
    cost = -(-items // slots) * (PROGRAM_SETUP_S + per * config.block_n * entry_bytes / rate)
    if used > 1:
        cost += batch * heads * used * LATENT * 4 * 2 / MODEL_BANDWIDTH + COMBINE_FIXED_S
    return used, cost


@functools.lru_cache(maxsize=4096)
def split_count(batch: int, heads: int, max_len: int, sm_count: int, config: LaunchConfig,
                entry_bytes: int = 2 * ENTRY, max_splits: int = MAX_SPLITS) -> int:
    """The number of context splits S for a call: the S in 1..max_splits of the least split_cost
    (ties go to fewer splits)."""
    if batch < 1 or heads < 1 or sm_count < 1:
        raise ValueError(f"split_count: batch={batch}, heads={heads}, sm_count={sm_count} must be positive")
    tiles = max(1, -(-max_len // config.block_n))
    best, best_cost = 1, math.inf
    for s in range(1, min(max_splits, tiles) + 1):
        used, cost = split_cost(batch, heads, max_len, sm_count, config, entry_bytes, s)
        if used < s:  # the same split as a smaller s
            continue
        if cost < best_cost * (1 - 1e-9):
            best, best_cost = used, cost
    return best


def splits_for(batch: int, heads: int, max_len: int, sm_count: int, cache_dtype: torch.dtype,
               variant: str | None = None) -> int:
    """split_count for a call's cache dtype and variant (the kernel's choice when none is given)."""
    return split_count(batch, heads, max_len, sm_count, config_for(cache_dtype, variant),
                       entry_bytes=ENTRY * cache_dtype.itemsize)


_SM_COUNT: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


@functools.lru_cache(maxsize=None)
def _has_pdl(index: int) -> bool:
    """Programmatic dependent launch (griddepcontrol) exists from sm_90 on."""
    return torch.cuda.get_device_capability(index) >= (9, 0)


def combine_blocks(S: int, D: int = LATENT) -> tuple[int, int]:
    """(BLOCK_S, BLOCK_D) of a combine over S partials of D columns: every split in one step up to 256
    (a loop past that), about 8K fp32 values a step, the columns cut so that a small batch still
    spreads over the GPU."""
    block_s = min(256, 1 << max(0, S - 1).bit_length())
    return block_s, max(16, min(D, 8192 // block_s))


if HAVE_TRITON:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    if INTERPRET:
        @triton.jit
        def _dot(a, b, acc):
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        @triton.jit
        def _dot(a, b, acc):
            return tl.dot(a, b, acc)

    @triton.jit
    def _tile_rows(kv_ptr, bt_row, t0, end, kv_sblk, kv_stok, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                   PAGE_TILES: tl.constexpr):
        """The cache addresses of entries t0 .. t0 + BLOCK_N - 1 of a sequence (page 0's for those >= end
        with a lookup a token; with PAGE_TILES the tile sits in one page, looked up once)."""
        toks = t0 + tl.arange(0, BLOCK_N)
        if PAGE_TILES:
            page = tl.load(bt_row + t0 // PAGE, mask=t0 < end, other=0)
            return kv_ptr + page.to(tl.int64) * kv_sblk + (toks % PAGE) * kv_stok
        else:
            pages = tl.load(bt_row + toks // PAGE, mask=toks < end, other=0)
            return kv_ptr + pages.to(tl.int64) * kv_sblk + (toks % PAGE) * kv_stok

    @triton.jit
    def _load_tile(rows, t_ok, LATENT: tl.constexpr, ROPE: tl.constexpr):
        """(c_kv, k_sh) of a tile's rows; rows past the end read as zeros."""
        c_kv = tl.load(rows[:, None] + tl.arange(0, LATENT)[None, :], mask=t_ok[:, None], other=0.0)
        k_sh = tl.load(rows[:, None] + LATENT + tl.arange(0, ROPE)[None, :], mask=t_ok[:, None], other=0.0)
        return c_kv, k_sh

    @triton.jit
    def _attend(q_lat, q_rope, c_kv, k_sh, t_ok, m_i, l_i, acc, qk_scale):
        """One tile into the online softmax of every head of the block: scores in base 2 (qk_scale
        carries log2(e)), the running max m_i, sum l_i and output acc rescaled, p @ c_kv added."""
        dt = q_lat.dtype
        c_kv = c_kv.to(dt)  # fp8: widened in registers (a no-op for a 16-bit cache)
        k_sh = k_sh.to(dt)
        s = _dot(q_lat, tl.trans(c_kv), tl.zeros([q_lat.shape[0], c_kv.shape[0]], tl.float32))
        s = _dot(q_rope, tl.trans(k_sh), s)
        s = tl.where(t_ok[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = _dot(p.to(dt), c_kv, acc * alpha[:, None])
        return m_new, l_i, acc

    # the head count, split count and table width change a launch's integers but not its code: kept out of
    # Triton's specialisation (each value divisible by 16 or equal to 1 would compile its own copy)
    NOT_SPECIALIZED = ("H", "num_splits", "max_len", "bt_sb", "pl_sb", "pl_sh")

    @triton.jit(do_not_specialize=NOT_SPECIALIZED)
    def _mla_split_kernel(q_ptr, kv_ptr, bt_ptr, lens_ptr, kv_scale_ptr, out_ptr, pout_ptr, plse_ptr,
                          qk_scale, H, num_splits, max_len,
                          q_sb, q_sh, kv_sblk, kv_stok, bt_sb,
                          o_sb, o_sh, po_sb, po_sh, po_ss, pl_sb, pl_sh,
                          PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                          LATENT: tl.constexpr, ROPE: tl.constexpr, IS_FP8: tl.constexpr, HAS_SCALE: tl.constexpr,
                          SINGLE: tl.constexpr, PREFETCH: tl.constexpr, PAGE_TILES: tl.constexpr,
                          FP16_DOTS: tl.constexpr, PDL: tl.constexpr):
        if PDL:
            gdc_launch_dependents()  # the combine's programs may be placed once every split program runs
        b = tl.program_id(0)
        hblk = tl.program_id(1)
        split = tl.program_id(2)
        seq_len = tl.minimum(tl.load(lens_ptr + b), max_len)  # a length past the table attends over all of it
        # this sequence's split: whole tiles, at most num_splits of them over its own length
        tiles = tl.cdiv(seq_len, BLOCK_N)
        per = tl.cdiv(tiles, num_splits) * BLOCK_N
        start = split * per
        end = tl.minimum(start + per, seq_len)

        heads = hblk * BLOCK_H + tl.arange(0, BLOCK_H)
        h_ok = heads < H
        lat = tl.arange(0, LATENT)
        rope = tl.arange(0, ROPE)  # k_sh's columns, after c_kv's
        q_rows = q_ptr + b.to(tl.int64) * q_sb + heads[:, None] * q_sh
        q_lat = tl.load(q_rows + lat[None, :], mask=h_ok[:, None], other=0.0)
        q_rope = tl.load(q_rows + LATENT + rope[None, :], mask=h_ok[:, None], other=0.0)
        if HAS_SCALE:
            qk_scale = qk_scale * tl.load(kv_scale_ptr)  # score = scale * kv_scale * (q . stored entry)
        if FP16_DOTS:
            # q times a power of two that puts its largest magnitude in [2^13, 2^14): inside fp16's
            # range whatever q's, and exact; the scores take it back out of qk_scale
            amax = tl.maximum(tl.max(tl.max(tl.abs(q_lat.to(tl.float32)), 1), 0),
                              tl.max(tl.max(tl.abs(q_rope.to(tl.float32)), 1), 0))
            exponent = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
            shift = tl.minimum(tl.maximum(13 - exponent, -100), 100)
            pow2 = ((shift + 127) << 23).to(tl.float32, bitcast=True)
            q_lat = (q_lat.to(tl.float32) * pow2).to(tl.float16)
            q_rope = (q_rope.to(tl.float32) * pow2).to(tl.float16)
            qk_scale = qk_scale / pow2

        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, LATENT], tl.float32)
        bt_row = bt_ptr + b.to(tl.int64) * bt_sb
        # the pages of a tile are looked up one iteration ahead, so that the pipeliner sees the tile's
        # address as a loop-carried value (num_stages - 1 tiles in flight), or the prefetch has it
        rows_next = _tile_rows(kv_ptr, bt_row, start, end, kv_sblk, kv_stok, PAGE, BLOCK_N, PAGE_TILES)
        if PREFETCH:
            ok_next = start + tl.arange(0, BLOCK_N) < end
            c_next, k_next = _load_tile(rows_next, ok_next, LATENT, ROPE)
            for t0 in range(start, end, BLOCK_N):
                c_kv, k_sh, t_ok = c_next, k_next, ok_next
                rows_next = _tile_rows(kv_ptr, bt_row, t0 + BLOCK_N, end, kv_sblk, kv_stok, PAGE, BLOCK_N,
                                       PAGE_TILES)
                ok_next = t0 + BLOCK_N + tl.arange(0, BLOCK_N) < end
                c_next, k_next = _load_tile(rows_next, ok_next, LATENT, ROPE)
                m_i, l_i, acc = _attend(q_lat, q_rope, c_kv, k_sh, t_ok, m_i, l_i, acc, qk_scale)
        else:
            for t0 in range(start, end, BLOCK_N):
                rows = rows_next
                rows_next = _tile_rows(kv_ptr, bt_row, t0 + BLOCK_N, end, kv_sblk, kv_stok, PAGE, BLOCK_N,
                                       PAGE_TILES)
                t_ok = t0 + tl.arange(0, BLOCK_N) < end
                c_kv, k_sh = _load_tile(rows, t_ok, LATENT, ROPE)
                m_i, l_i, acc = _attend(q_lat, q_rope, c_kv, k_sh, t_ok, m_i, l_i, acc, qk_scale)

        has = l_i > 0.0
        o = acc / tl.where(has, l_i, 1.0)[:, None]
        if HAS_SCALE:
            o = o * tl.load(kv_scale_ptr)  # the values are kv_scale * stored c_kv
        if SINGLE:
            out = out_ptr + b.to(tl.int64) * o_sb + heads[:, None] * o_sh + lat[None, :]
            tl.store(out, o.to(out_ptr.dtype.element_ty), mask=h_ok[:, None])  # length 0: zeros
        else:
            pout = pout_ptr + b.to(tl.int64) * po_sb + heads[:, None] * po_sh + split * po_ss + lat[None, :]
            tl.store(pout, o, mask=(h_ok & has)[:, None])
            lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))  # ln
            tl.store(plse_ptr + b.to(tl.int64) * pl_sb + heads * pl_sh + split, lse, mask=h_ok)

    @triton.jit(do_not_specialize=("S", "pl_sb", "pl_sh", "pl_ss", "lo_sb", "lo_sh"))
    def _mla_combine_kernel(pout_ptr, plse_ptr, out_ptr, lse_out_ptr, S,
                            po_sb, po_sh, po_ss, pl_sb, pl_sh, pl_ss, o_sb, o_sh, lo_sb, lo_sh,
                            BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, WRITE_LSE: tl.constexpr,
                            PDL: tl.constexpr):
        if PDL:
            gdc_wait()  # the split kernel's partials, all of them, before the first read
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        cols = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
        lse_row = plse_ptr + b * pl_sb + h * pl_sh
        pout_row = pout_ptr + b * po_sb + h * po_sh
        ss = tl.arange(0, BLOCK_S)
        m = tl.full([BLOCK_S], float("-inf"), tl.float32)
        for s0 in range(0, S, BLOCK_S):  # one step up to BLOCK_S splits
            m = tl.maximum(m, tl.load(lse_row + (s0 + ss) * pl_ss, mask=s0 + ss < S, other=float("-inf")))
        m_all = tl.max(m, 0)
        m_safe = tl.where(m_all > float("-inf"), m_all, 0.0)
        acc = tl.zeros([BLOCK_D], tl.float32)
        den = tl.zeros([BLOCK_S], tl.float32)
        for s0 in range(0, S, BLOCK_S):
            lse = tl.load(lse_row + (s0 + ss) * pl_ss, mask=s0 + ss < S, other=float("-inf"))
            live = lse > float("-inf")  # an empty split (or a rank without tokens of this sequence)
            w = tl.where(live, tl.exp(lse - m_safe), 0.0)
            part = tl.load(pout_row + (s0 + ss)[:, None] * po_ss + cols[None, :], mask=live[:, None], other=0.0)
            acc += tl.sum(w[:, None] * part, 0)
            den += w
        total = tl.sum(den, 0)
        o = acc / tl.where(total > 0.0, total, 1.0)
        tl.store(out_ptr + b * o_sb + h * o_sh + cols, o.to(out_ptr.dtype.element_ty))
        if WRITE_LSE:
            if tl.program_id(2) == 0:
                lse_all = tl.where(total > 0.0, m_safe + tl.log(tl.where(total > 0.0, total, 1.0)), float("-inf"))
                tl.store(lse_out_ptr + b * lo_sb + h * lo_sh, lse_all)


def page_tiles(config: LaunchConfig, page: int) -> bool:
    """Whether a call's tiles each sit in one page (whole tiles a page): one lookup a tile."""
    return page % config.block_n == 0


def resolve(config: LaunchConfig, cache_dtype: torch.dtype, device: torch.device, page: int) -> LaunchConfig:
    """The config a call runs: `config`, or for a Gluon one that cannot serve the call (see
    LaunchConfig.gluon), the cache's Triton variant."""
    if config.gluon and (INTERPRET or gluon_kernel.usable(device, page, config.block_n) is not None):
        return fallback_for(cache_dtype)
    return config


def run(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
        softmax_scale: float, kv_scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
        config: LaunchConfig | None = None, splits: int | None = None,
        partials: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """out [B, H, 512] in q's dtype (or the `out` buffer given, written in place). `config` and
    `splits` override the launch choices (tests, the benchmark's variants and sweeps); `partials`
    (partial_out fp32 [B, H, S, 512], partial_lse fp32 [B, H, S]) are the split kernel's workspace
    when S > 1 (tests poison them; new ones otherwise)."""
    B, H = q.shape[0], q.shape[1]
    page = kv_cache.shape[1]
    is_fp8 = kv_cache.dtype == FP8
    if is_fp8 and kv_scale is None:
        raise ValueError("mla_decode: an fp8 cache needs its kv_scale")
    cfg = resolve(config or config_for(kv_cache.dtype), kv_cache.dtype, q.device, page)
    if out is None:
        out = torch.empty((B, H, LATENT), dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    S = splits or split_count(B, H, block_table.shape[1] * page, sm_count(q.device), cfg,
                              entry_bytes=ENTRY * kv_cache.element_size())
    scale_arg = kv_scale if kv_scale is not None else seq_lens  # any pointer: not read without a scale
    max_len = block_table.shape[1] * page
    qk_scale = float(softmax_scale) * LOG2E
    grid = (B, head_blocks(H), S)
    pdl = (cfg.pdl and not INTERPRET and S > 1
           and _has_pdl(q.device.index if q.device.index is not None else torch.cuda.current_device()))
    common = dict(PAGE=page, BLOCK_H=BLOCK_H, BLOCK_N=cfg.block_n, LATENT=LATENT, ROPE=ROPE, IS_FP8=is_fp8,
                  HAS_SCALE=kv_scale is not None,
                  PREFETCH=cfg.prefetch, PAGE_TILES=page_tiles(cfg, page), FP16_DOTS=cfg.fp16_dots and is_fp8,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    kv_args = (q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0))
    if cfg.gluon:
        single = S == 1
        if not single and partials is None:
            partials = (torch.empty((B, H, S, LATENT), dtype=torch.float32, device=q.device),
                        torch.empty((B, H, S), dtype=torch.float32, device=q.device))
        pout, plse = (out, out) if single else partials
        part_strides = (0, 0, 0, 0, 0) if single else (pout.stride(0), pout.stride(1), pout.stride(2),
                                                        plse.stride(0), plse.stride(1))
        gluon_kernel.launch(grid, q, kv_cache, block_table, seq_lens, scale_arg, out, pout, plse, qk_scale, H, S,
                            max_len, kv_args, (out.stride(0), out.stride(1)), part_strides, page=page, block_h=BLOCK_H,
                            block_n=cfg.block_n, latent=LATENT, rope=ROPE, is_fp8=is_fp8,
                            has_scale=kv_scale is not None, single=single,
                            nbuf=cfg.num_stages, pdl=pdl, widen_ahead=cfg.widen_ahead)
        return out if single else combine(pout, plse, out=out, pdl=pdl)
    if S == 1:
        _mla_split_kernel[grid](q, kv_cache, block_table, seq_lens, scale_arg, out, out, out, qk_scale, H, 1, max_len,
                                *kv_args, out.stride(0), out.stride(1), 0, 0, 0, 0, 0, SINGLE=True, PDL=False,
                                **common)
        return out
    if partials is None:
        partials = (torch.empty((B, H, S, LATENT), dtype=torch.float32, device=q.device),
                    torch.empty((B, H, S), dtype=torch.float32, device=q.device))
    pout, plse = partials
    _mla_split_kernel[grid](q, kv_cache, block_table, seq_lens, scale_arg, out, pout, plse, qk_scale, H, S, max_len,
                            *kv_args, out.stride(0), out.stride(1), pout.stride(0), pout.stride(1),
                            pout.stride(2), plse.stride(0), plse.stride(1), SINGLE=False, PDL=pdl, **common)
    return combine(pout, plse, out=out, pdl=pdl)


def combine(partial_out: torch.Tensor, partial_lse: torch.Tensor, out: torch.Tensor | None = None,
            out_dtype: torch.dtype | None = None, lse_out: torch.Tensor | None = None,
            pdl: bool = False) -> torch.Tensor:
    """The softmax-weighted merge of S partial attention outputs of each (sequence, head).

    partial_out fp32 [B, H, S, D] (unit inner stride, D a power of two): each split's normalised
    output; partial_lse fp32 [B, H, S]: each split's natural-log log-sum-exp of its scaled scores,
    -inf for a split without tokens (its partial_out is not read). out [B, H, D] =
    sum_s exp(lse_s - LSE) * partial_out_s with LSE = log(sum_s exp(lse_s)), in `out`'s dtype
    (`out_dtype`, default fp32, when no buffer is given); zeros where every split is empty.
    lse_out fp32 [B, H], if given, receives LSE (-inf where empty), so merges chain: DCP merges
    each rank's merged partials the same way. pdl: launched as the programmatic dependent of the
    kernel before it on the stream (the split kernel, which signals it). Blocks: combine_blocks."""
    B, H, S, D = partial_out.shape
    if out is None:
        out = torch.empty((B, H, D), dtype=out_dtype or torch.float32, device=partial_out.device)
    if B == 0 or H == 0:
        return out
    if D & (D - 1):
        raise ValueError(f"mla combine: D={D} must be a power of two")
    block_s, block_d = combine_blocks(S, D)
    lse_arg = lse_out if lse_out is not None else partial_lse
    extra = {"launch_pdl": True} if pdl else {}
    _mla_combine_kernel[(B, H, D // block_d)](partial_out, partial_lse, out, lse_arg, S,
                                              partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
                                              partial_lse.stride(0), partial_lse.stride(1), partial_lse.stride(2),
                                              out.stride(0), out.stride(1),
                                              lse_arg.stride(0) if lse_out is not None else 0,
                                              lse_arg.stride(1) if lse_out is not None else 0,
                                              BLOCK_D=block_d, BLOCK_S=block_s, WRITE_LSE=lse_out is not None,
                                              PDL=pdl, num_warps=4, **extra)
    return out
