"""Triton MLA decode: flash-decoding over K3's paged latent cache, split along the context.

K3's gated NoPE-MLA at decode reads, for every sequence, its whole latent cache: entries
[c_kv (512) | k_sh (64)] of 576 values a token, bf16 or fp8 (e4m3 with one fp32 scale). Every
head of the rank scores the same entries, and the values are the c_kv part of them, so the cost
is the cache read: at 3-12 heads a rank the arithmetic is a rounding error beside the bytes.

Two kernels:
* `_mla_split_kernel`, one program per (sequence, block of BLOCK_H heads, split of the context):
  it loads its heads' queries once, then walks its split in tiles of BLOCK_N tokens (each token's
  page from the block table, its 576 values as 16-byte vectors; fp8 widened to the query's dtype
  in registers), scores all its heads on the tile with two dots (q_lat . c_kv + q_sh . k_sh), keeps
  the online softmax in base 2, and accumulates p @ c_kv from the same tile: one read of the cache
  serves every head of the block (heads padded to 16, the dot's smallest M). It writes its
  normalised partial output and its log-sum-exp, or, with one split, the output itself.
* `_mla_combine_kernel`, one program per (sequence, head): the softmax-weighted merge of the
  partials, `combine` below; also the entry decode context parallelism (DCP) calls on partials
  exchanged between GPUs.

Splits: `split_count` picks, on the host, the number of splits S from the batch, the heads, the
longest context the call can hold (the block table's width) and the SM count, by a small cost
model (waves of programs, per-program bandwidth, the combine's bytes and launch). On the device
each sequence cuts its own length into at most S splits of whole tiles, so a short sequence in a
wide table uses fewer splits and the launch grid stays fixed: CUDA graphs replay it over any
lengths. Splits with no tokens write a log-sum-exp of -inf and nothing else; the combine skips them.

Conventions: the partial log-sum-exp is natural-log, lse = log(sum_j exp(score_j)), score_j =
softmax_scale * (q . entry_j) (* kv_scale for fp8); partial outputs are normalised (sum_j p_j c_kv_j
with p summing to 1), in fp32. A sequence of length 0 gets a zero output (padding rows of a graph).

q [B, H, 576] (bf16 / fp16, unit inner stride), kv_cache [num_blocks, block_size, 576] (q's dtype,
or fp8 e4m3 with kv_scale, an fp32 tensor of one element), block_table int32 [B, max_blocks],
seq_lens int32 [B] -> out [B, H, 512] in q's dtype.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from . import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

LATENT = 512  # c_kv, the values
ROPE = 64  # k_sh, the shared key (no RoPE in K3, the name kept from DeepSeek's layout)
ENTRY = LATENT + ROPE
QUERY_DTYPES = (torch.bfloat16, torch.float16)
FP8 = torch.float8_e4m3fn
BLOCK_H = 16  # heads a program serves: the dot's smallest M; K3 has 3-12 heads a rank at TP 32-8
MAX_SPLITS = 256
LOG2E = 1.4426950408889634
#: Triton's CPU interpreter (TRITON_INTERPRET=1, read when triton is imported) multiplies the raw bits
#: of bf16 dot operands (Triton 3.6), so under it the dots take fp32 copies of the same values
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass(frozen=True)
class LaunchConfig:
    """block_n: entries a tile; num_warps / num_stages: the split kernel's (num_stages - 1 tiles
    in flight through cp.async); prefetch: instead, the next tile's loads issued into registers
    before this tile's dots (the pipeliner leaves an fp8 tile, widened before its dots, unbuffered);
    programs_per_sm: how many split programs one SM holds (registers, shared memory), for
    split_count."""

    block_n: int
    num_warps: int
    num_stages: int
    prefetch: bool = False
    programs_per_sm: int = 1


#: by cache element size, read off sm_90 compiles (ptxas -v: registers, spills; shared memory):
#: bf16: 32-entry tiles (36 KB), two cp.async buffers, 108 registers at 8 warps, 91 KB: two programs an SM;
#: fp8: 64-entry tiles (36 KB) prefetched into registers, 255 registers at 8 warps: one program an SM
CONFIGS = {2: LaunchConfig(block_n=32, num_warps=8, num_stages=3, programs_per_sm=2),
           1: LaunchConfig(block_n=64, num_warps=8, num_stages=1, prefetch=True, programs_per_sm=1)}

# The split count's cost model (split_count). Model parameters, not measurements: bench/bench_mla_decode.py
# --splits times other counts beside the chosen one.
MODEL_BANDWIDTH = 3.0e12  # bytes/s the whole GPU streams (H100 copy bandwidth, read + write)
PROGRAM_BANDWIDTH = 20e9  # bytes/s one program streams alone: one 36 KB tile in flight over HBM latency, less its dots
COMBINE_LAUNCH_S = 2e-6  # the combine's launch and drain


def config_for(cache_dtype: torch.dtype) -> LaunchConfig:
    return CONFIGS[cache_dtype.itemsize]


def head_blocks(heads: int) -> int:
    return -(-heads // BLOCK_H)


def split_count(batch: int, heads: int, max_len: int, sm_count: int, *, block_n: int = 32,
                entry_bytes: int = 2 * ENTRY, programs_per_sm: int = 2, max_splits: int = MAX_SPLITS) -> int:
    """The number of context splits S for a call: the S in 1..max_splits that minimises the
    modelled time of the split kernel plus, for S > 1, the combine.

    Each of the batch * head_blocks * used programs streams `per` tiles of `block_n` entries
    (used: the splits that hold tokens of the longest sequence, per = its tiles / S rounded up);
    they run in waves of sm_count * programs_per_sm, each program at the smaller of its share of
    the GPU's bandwidth and what one program streams alone; S > 1 adds the partials (written and
    read, 2 KB a head and split each way) and the combine's launch. Ties go to fewer splits.
    """
    if batch < 1 or heads < 1 or sm_count < 1:
        raise ValueError(f"split_count: batch={batch}, heads={heads}, sm_count={sm_count} must be positive")
    tiles = max(1, -(-max_len // block_n))
    slots = sm_count * programs_per_sm
    items_per_split = batch * head_blocks(heads)
    best, best_cost = 1, math.inf
    for s in range(1, min(max_splits, tiles) + 1):
        per = -(-tiles // s)
        used = -(-tiles // per)
        items = items_per_split * used
        waves = -(-items // slots)
        rate = min(MODEL_BANDWIDTH / min(items, slots), PROGRAM_BANDWIDTH)
        cost = waves * per * block_n * entry_bytes / rate
        if used > 1:
            cost += batch * heads * used * 2 * LATENT * 4 * 2 / MODEL_BANDWIDTH + COMBINE_LAUNCH_S
        if cost < best_cost * (1 - 1e-9):
            best, best_cost = used, cost
    return best


_SM_COUNT: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


if HAVE_TRITON:

    if INTERPRET:
        @triton.jit
        def _dot(a, b, acc):
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        @triton.jit
        def _dot(a, b, acc):
            return tl.dot(a, b, acc)

    @triton.jit
    def _tile_rows(kv_ptr, bt_row, t0, end, kv_sblk, kv_stok, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
        """The cache addresses of entries t0 .. t0 + BLOCK_N - 1 of a sequence (page 0's for those >= end)."""
        toks = t0 + tl.arange(0, BLOCK_N)
        pages = tl.load(bt_row + toks // PAGE, mask=toks < end, other=0)
        return kv_ptr + pages.to(tl.int64) * kv_sblk + (toks % PAGE) * kv_stok

    @triton.jit
    def _load_tile(kv_ptr, bt_row, t0, end, kv_sblk, kv_stok, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                   LATENT: tl.constexpr, ROPE: tl.constexpr):
        """Entries t0 .. t0 + BLOCK_N - 1 of a sequence (those < end; the rest zeros, never read):
        (c_kv [BLOCK_N, LATENT], k_sh [BLOCK_N, ROPE], which tokens are real)."""
        toks = t0 + tl.arange(0, BLOCK_N)
        t_ok = toks < end
        pages = tl.load(bt_row + toks // PAGE, mask=t_ok, other=0)
        rows = kv_ptr + pages.to(tl.int64) * kv_sblk + (toks % PAGE) * kv_stok
        c_kv = tl.load(rows[:, None] + tl.arange(0, LATENT)[None, :], mask=t_ok[:, None], other=0.0)
        k_sh = tl.load(rows[:, None] + LATENT + tl.arange(0, ROPE)[None, :], mask=t_ok[:, None], other=0.0)
        return c_kv, k_sh, t_ok

    @triton.jit
    def _attend(q_lat, q_rope, c_kv, k_sh, t_ok, m_i, l_i, acc, qk_scale):
        """One tile into the online softmax of every head of the block: scores in base 2 (qk_scale
        carries log2(e)), the running max m_i, sum l_i and output acc rescaled, p @ c_kv added."""
        c_kv = c_kv.to(q_lat.dtype)  # fp8: widened in registers (a no-op for a 16-bit cache)
        k_sh = k_sh.to(q_lat.dtype)
        s = _dot(q_lat, tl.trans(c_kv), tl.zeros([q_lat.shape[0], c_kv.shape[0]], tl.float32))
        s = _dot(q_rope, tl.trans(k_sh), s)
        s = tl.where(t_ok[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = _dot(p.to(c_kv.dtype), c_kv, acc * alpha[:, None])
        return m_new, l_i, acc

    @triton.jit
    def _mla_split_kernel(q_ptr, kv_ptr, bt_ptr, lens_ptr, kv_scale_ptr, out_ptr, pout_ptr, plse_ptr,
                          qk_scale, H, num_splits,
                          q_sb, q_sh, kv_sblk, kv_stok, bt_sb,
                          o_sb, o_sh, po_sb, po_sh, po_ss, pl_sb, pl_sh,
                          PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                          LATENT: tl.constexpr, ROPE: tl.constexpr, IS_FP8: tl.constexpr,
                          SINGLE: tl.constexpr, PREFETCH: tl.constexpr):
        b = tl.program_id(0)
        hblk = tl.program_id(1)
        split = tl.program_id(2)
        seq_len = tl.load(lens_ptr + b)
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
        if IS_FP8:
            qk_scale = qk_scale * tl.load(kv_scale_ptr)  # score = scale * kv_scale * (q . entry_fp8)

        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, LATENT], tl.float32)
        bt_row = bt_ptr + b.to(tl.int64) * bt_sb
        if PREFETCH:
            # the next tile's loads are issued before this tile's dots: one tile in flight in registers
            c_next, k_next, ok_next = _load_tile(kv_ptr, bt_row, start, end, kv_sblk, kv_stok,
                                                 PAGE, BLOCK_N, LATENT, ROPE)
            for t0 in range(start, end, BLOCK_N):
                c_kv, k_sh, t_ok = c_next, k_next, ok_next
                c_next, k_next, ok_next = _load_tile(kv_ptr, bt_row, t0 + BLOCK_N, end, kv_sblk, kv_stok,
                                                     PAGE, BLOCK_N, LATENT, ROPE)
                m_i, l_i, acc = _attend(q_lat, q_rope, c_kv, k_sh, t_ok, m_i, l_i, acc, qk_scale)
        else:
            # the pages of a tile are looked up one iteration ahead, so that the pipeliner sees the
            # tile's address as a loop-carried value and keeps num_stages - 1 tiles in flight
            rows_next = _tile_rows(kv_ptr, bt_row, start, end, kv_sblk, kv_stok, PAGE, BLOCK_N)
            for t0 in range(start, end, BLOCK_N):
                rows = rows_next
                rows_next = _tile_rows(kv_ptr, bt_row, t0 + BLOCK_N, end, kv_sblk, kv_stok, PAGE, BLOCK_N)
                t_ok = t0 + tl.arange(0, BLOCK_N) < end
                c_kv = tl.load(rows[:, None] + lat[None, :], mask=t_ok[:, None], other=0.0)
                k_sh = tl.load(rows[:, None] + LATENT + rope[None, :], mask=t_ok[:, None], other=0.0)
                m_i, l_i, acc = _attend(q_lat, q_rope, c_kv, k_sh, t_ok, m_i, l_i, acc, qk_scale)

        has = l_i > 0.0
        o = acc / tl.where(has, l_i, 1.0)[:, None]
        if IS_FP8:
            o = o * tl.load(kv_scale_ptr)  # the values are kv_scale * c_kv_fp8
        if SINGLE:
            out = out_ptr + b.to(tl.int64) * o_sb + heads[:, None] * o_sh + lat[None, :]
            tl.store(out, o.to(out_ptr.dtype.element_ty), mask=h_ok[:, None])  # length 0: zeros
        else:
            pout = pout_ptr + b.to(tl.int64) * po_sb + heads[:, None] * po_sh + split * po_ss + lat[None, :]
            tl.store(pout, o, mask=(h_ok & has)[:, None])
            lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))  # ln
            tl.store(plse_ptr + b.to(tl.int64) * pl_sb + heads * pl_sh + split, lse, mask=h_ok)

    @triton.jit
    def _mla_combine_kernel(pout_ptr, plse_ptr, out_ptr, lse_out_ptr, S,
                            po_sb, po_sh, po_ss, pl_sb, pl_sh, pl_ss, o_sb, o_sh, lo_sb, lo_sh,
                            D: tl.constexpr, BLOCK_S: tl.constexpr, WRITE_LSE: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        lse_row = plse_ptr + b * pl_sb + h * pl_sh
        pout_row = pout_ptr + b * po_sb + h * po_sh
        cols = tl.arange(0, D)
        m = tl.full([BLOCK_S], float("-inf"), tl.float32)
        for s0 in range(0, S, BLOCK_S):
            ss = s0 + tl.arange(0, BLOCK_S)
            m = tl.maximum(m, tl.load(lse_row + ss * pl_ss, mask=ss < S, other=float("-inf")))
        m_all = tl.max(m, 0)
        m_safe = tl.where(m_all > float("-inf"), m_all, 0.0)
        acc = tl.zeros([D], tl.float32)
        den = tl.zeros([BLOCK_S], tl.float32)
        for s0 in range(0, S, BLOCK_S):
            ss = s0 + tl.arange(0, BLOCK_S)
            lse = tl.load(lse_row + ss * pl_ss, mask=ss < S, other=float("-inf"))
            live = lse > float("-inf")  # an empty split (or a rank without tokens of this sequence)
            w = tl.where(live, tl.exp(lse - m_safe), 0.0)
            part = tl.load(pout_row + ss[:, None] * po_ss + cols[None, :], mask=live[:, None], other=0.0)
            acc += tl.sum(w[:, None] * part, 0)
            den += w
        total = tl.sum(den, 0)
        o = acc / tl.where(total > 0.0, total, 1.0)
        tl.store(out_ptr + b * o_sb + h * o_sh + cols, o.to(out_ptr.dtype.element_ty))
        if WRITE_LSE:
            lse_all = tl.where(total > 0.0, m_safe + tl.log(tl.where(total > 0.0, total, 1.0)), float("-inf"))
            tl.store(lse_out_ptr + b * lo_sb + h * lo_sh, lse_all)


def run(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
        softmax_scale: float, kv_scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
        config: LaunchConfig | None = None, splits: int | None = None,
        partials: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """out [B, H, 512] in q's dtype (or the `out` buffer given, written in place). `config` and
    `splits` override the launch choices (tests, the benchmark's sweep); `partials` (partial_out
    fp32 [B, H, S, 512], partial_lse fp32 [B, H, S]) are the split kernel's workspace when S > 1
    (tests poison them; new ones otherwise)."""
    B, H = q.shape[0], q.shape[1]
    page = kv_cache.shape[1]
    cfg = config or config_for(kv_cache.dtype)
    if out is None:
        out = torch.empty((B, H, LATENT), dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    S = splits or split_count(B, H, block_table.shape[1] * page, sm_count(q.device), block_n=cfg.block_n,
                              entry_bytes=ENTRY * kv_cache.element_size(), programs_per_sm=cfg.programs_per_sm)
    is_fp8 = kv_cache.dtype == FP8
    scale_arg = kv_scale if is_fp8 else seq_lens  # any pointer: not read without fp8
    qk_scale = float(softmax_scale) * LOG2E
    grid = (B, head_blocks(H), S)
    common = dict(PAGE=page, BLOCK_H=BLOCK_H, BLOCK_N=cfg.block_n, LATENT=LATENT, ROPE=ROPE, IS_FP8=is_fp8,
                  PREFETCH=cfg.prefetch, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    kv_args = (q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0))
    if S == 1:
        _mla_split_kernel[grid](q, kv_cache, block_table, seq_lens, scale_arg, out, out, out, qk_scale, H, 1,
                                *kv_args, out.stride(0), out.stride(1), 0, 0, 0, 0, 0, SINGLE=True, **common)
        return out
    if partials is None:
        partials = (torch.empty((B, H, S, LATENT), dtype=torch.float32, device=q.device),
                    torch.empty((B, H, S), dtype=torch.float32, device=q.device))
    pout, plse = partials
    _mla_split_kernel[grid](q, kv_cache, block_table, seq_lens, scale_arg, out, pout, plse, qk_scale, H, S,
                            *kv_args, out.stride(0), out.stride(1), pout.stride(0), pout.stride(1),
                            pout.stride(2), plse.stride(0), plse.stride(1), SINGLE=False, **common)
    return combine(pout, plse, out=out)


def combine(partial_out: torch.Tensor, partial_lse: torch.Tensor, out: torch.Tensor | None = None,
            out_dtype: torch.dtype | None = None, lse_out: torch.Tensor | None = None) -> torch.Tensor:
    """The softmax-weighted merge of S partial attention outputs of each (sequence, head).

    partial_out fp32 [B, H, S, D] (unit inner stride): each split's normalised output;
    partial_lse fp32 [B, H, S]: each split's natural-log log-sum-exp of its scaled scores, -inf for
    a split without tokens (its partial_out is not read). out [B, H, D] =
    sum_s exp(lse_s - LSE) * partial_out_s with LSE = log(sum_s exp(lse_s)), in `out`'s dtype
    (`out_dtype`, default fp32, when no buffer is given); zeros where every split is empty.
    lse_out fp32 [B, H], if given, receives LSE (-inf where empty), so merges chain: DCP merges
    each rank's merged partials the same way."""
    B, H, S, D = partial_out.shape
    if out is None:
        out = torch.empty((B, H, D), dtype=out_dtype or torch.float32, device=partial_out.device)
    if B == 0 or H == 0:
        return out
    lse_arg = lse_out if lse_out is not None else partial_lse
    _mla_combine_kernel[(B, H)](partial_out, partial_lse, out, lse_arg, S,
                                partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
                                partial_lse.stride(0), partial_lse.stride(1), partial_lse.stride(2),
                                out.stride(0), out.stride(1),
                                lse_arg.stride(0) if lse_out is not None else 0,
                                lse_arg.stride(1) if lse_out is not None else 0,
                                D=D, BLOCK_S=8, WRITE_LSE=lse_out is not None, num_warps=4)
    return out
