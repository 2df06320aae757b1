"""Gluon MLA decode split kernel for sm_90: the tile's bytes through cp.async, both dots as wgmma.

The same computation as lib/triton/mla_decode.py `_mla_split_kernel` (same arguments, partials and
log-sum-exp conventions, same combine), written where Triton's compiler would not place things:

* one warpgroup a program; the tile's tokens are the dots' M (64), the 16 padded heads their N:
  s^T = c_kv q_lat^T + k_sh q_sh^T and o^T += c_kv^T p^T, both wgmma reading the tile straight from
  shared memory (the second through a transposed view), so the tile never passes through registers;
* tiles of BLOCK_N tokens in one page each (one table lookup a tile, looked up a tile ahead),
  copied by cp.async into a ring of NBUF buffers; the copy of tile i + NBUF - 1 is issued before
  tile i is scored, so NBUF - 1 tiles are in flight while the tensor cores work;
* an fp8 tile is widened once, in shared memory: 16 bytes a thread from the fp8 ring into
  registers, cvt to fp16 (one instruction a pair), stored to a 16-bit staging tile both dots read
  (Triton widens it in each dot's operand layout, with byte-wise loads for the transposed one); q is
  scaled by a power of two into fp16's range for it, as the Triton kernel's fp16_dots does;
* the outputs leave through a coalesced layout (the wgmma accumulator holds a head's 512 values
  across 128 threads).

Requires the page size to be a multiple of BLOCK_N (K3's 64) and an sm_90 GPU; `usable` says
whether a call qualifies, and mla_decode.run takes the Triton kernel otherwise. Triton's CPU
interpreter does not run Gluon: this kernel's numerics are tested on the GPU
(tests/gpu/test_mla_decode_gpu.py), its sm_90 compile on CPU (tests/test_mla_decode.py).
"""
from __future__ import annotations

import torch

from . import HAVE_TRITON

GLUON_IMPORT_ERROR: str | None = None
if HAVE_TRITON:
    try:
        from triton.experimental import gluon
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared,
                                                                      warpgroup_mma, warpgroup_mma_init,
                                                                      warpgroup_mma_wait)
    except Exception as exc:  # pragma: no cover - a Triton without Gluon's Hopper API
        GLUON_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
else:  # pragma: no cover
    GLUON_IMPORT_ERROR = "triton unavailable"

NUM_WARPS = 4  # one warpgroup: wgmma's M of 64 is one tile's tokens
#: the deepest ring that fits an SM's 227 KB beside q, p (and fp8's staging tile), by cache element size:
#: 64-entry tiles are 72 KB in bf16, 36 KB in fp8
MAX_RING = {2: 2, 1: 3}


def usable(device: torch.device, page: int, block_n: int) -> str | None:
    """None when the Gluon kernel can serve a call, else why not."""
    if GLUON_IMPORT_ERROR is not None:
        return f"gluon unavailable ({GLUON_IMPORT_ERROR})"
    if page % block_n:
        return f"page {page} does not hold whole {block_n}-entry tiles"
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return "not an sm_90 GPU"
    return None


if GLUON_IMPORT_ERROR is None:

    @gluon.jit
    def _launch_dependents():
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _issue_tile(ring, rope_ring, buf, kv_ptr, page, t0, end, kv_sblk, kv_stok,
                    PAGE: gl.constexpr, BLOCK_N: gl.constexpr, LATENT: gl.constexpr, ROPE: gl.constexpr,
                    LAT_LAYOUT: gl.constexpr, ROPE_LAYOUT: gl.constexpr):
        """cp.async of tokens t0 .. t0 + BLOCK_N - 1 (all in `page`) into ring slot `buf`; rows at or
        past `end` are zero-filled (no read)."""
        base = kv_ptr + page.to(gl.int64) * kv_sblk + (t0 % PAGE).to(gl.int64) * kv_stok
        rows = gl.arange(0, BLOCK_N, gl.SliceLayout(1, LAT_LAYOUT))
        cols = gl.arange(0, LATENT, gl.SliceLayout(0, LAT_LAYOUT))
        ptrs = base + rows[:, None] * kv_stok + gl.max_contiguous(gl.multiple_of(cols, 16), 16)[None, :]
        ok = (t0 + rows < end)[:, None]
        async_copy.async_copy_global_to_shared(ring.index(buf), ptrs, mask=ok)
        rrows = gl.arange(0, BLOCK_N, gl.SliceLayout(1, ROPE_LAYOUT))
        rcols = gl.arange(0, ROPE, gl.SliceLayout(0, ROPE_LAYOUT))
        rptrs = base + LATENT + rrows[:, None] * kv_stok + gl.max_contiguous(gl.multiple_of(rcols, 16), 16)[None, :]
        rok = (t0 + rrows < end)[:, None]
        async_copy.async_copy_global_to_shared(rope_ring.index(buf), rptrs, mask=rok)

    @gluon.jit
    def _split_bounds(lens_ptr, b, split, num_splits, max_len, BLOCK_N: gl.constexpr):
        """(start, end, tiles) of this program's split: whole tiles, at most num_splits over the sequence (its
        length capped at the table's max_len entries)."""
        seq_len = gl.minimum(gl.load(lens_ptr + b), max_len)
        per = gl.cdiv(gl.cdiv(seq_len, BLOCK_N), num_splits) * BLOCK_N
        start = split * per
        end = gl.minimum(start + per, seq_len)
        return start, end, gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)

    @gluon.jit
    def _stage_queries(q_ptr, b, hblk, H, q_sb, q_sh, kv_scale_ptr, qk_scale, q_smem, qr_smem,
                       IS_FP8: gl.constexpr, HAS_SCALE: gl.constexpr, BLOCK_H: gl.constexpr, LATENT: gl.constexpr,
                       ROPE: gl.constexpr, num_warps: gl.constexpr):
        """This block's heads' queries into shared memory in the dots' dtype; returns the scores' scale
        (log2(e) and softmax_scale in it, kv_scale with HAS_SCALE; for fp8, q taken through a power of two
        that puts |q|'s largest into [2^13, 2^14): inside fp16's range and exact)."""
        Q_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
        QR_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        dt: gl.constexpr = q_smem.dtype
        heads_q = hblk * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(1, Q_LAYOUT))
        q_lat = gl.load(q_ptr + b.to(gl.int64) * q_sb + heads_q[:, None] * q_sh
                        + gl.arange(0, LATENT, gl.SliceLayout(0, Q_LAYOUT))[None, :],
                        mask=(heads_q < H)[:, None], other=0.0)
        heads_r = hblk * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(1, QR_LAYOUT))
        q_rope = gl.load(q_ptr + b.to(gl.int64) * q_sb + heads_r[:, None] * q_sh + LATENT
                         + gl.arange(0, ROPE, gl.SliceLayout(0, QR_LAYOUT))[None, :],
                         mask=(heads_r < H)[:, None], other=0.0)
        if HAS_SCALE:
            qk_scale = qk_scale * gl.load(kv_scale_ptr)
        if IS_FP8:
            amax = gl.maximum(gl.max(gl.max(gl.abs(q_lat.to(gl.float32)), 1), 0),
                              gl.max(gl.max(gl.abs(q_rope.to(gl.float32)), 1), 0))
            exponent = ((amax.to(gl.int32, bitcast=True) >> 23) & 0xFF) - 127
            shift = gl.minimum(gl.maximum(13 - exponent, -100), 100)
            pow2 = ((shift + 127) << 23).to(gl.float32, bitcast=True)
            q_lat = (q_lat.to(gl.float32) * pow2).to(dt)
            q_rope = (q_rope.to(gl.float32) * pow2).to(dt)
            qk_scale = qk_scale / pow2
        q_smem.store(q_lat.to(dt))
        qr_smem.store(q_rope.to(dt))
        return qk_scale

    @gluon.jit
    def _write_result(acc, m_i, l_i, b, hblk, split, H, kv_scale_ptr, out_ptr, pout_ptr, plse_ptr,
                      o_sb, o_sh, po_sb, po_sh, po_ss, pl_sb, pl_sh,
                      HAS_SCALE: gl.constexpr, SINGLE: gl.constexpr, BLOCK_H: gl.constexpr, LATENT: gl.constexpr,
                      num_warps: gl.constexpr):
        """acc (o^T, [LATENT, BLOCK_H], unnormalised), m_i and l_i (base 2) into the output (one split) or
        this split's partial and log-sum-exp, through a coalesced layout (the wgmma accumulator holds a
        head's 512 values across 128 threads)."""
        OUT_LAYOUT: gl.constexpr = gl.BlockedLayout([4, 1], [32, 1], [1, num_warps], [0, 1])  # [LATENT, BLOCK_H]
        has = l_i > 0.0
        o = acc / gl.where(has, l_i, 1.0)[None, :]
        if HAS_SCALE:
            o = o * gl.load(kv_scale_ptr)  # the values are kv_scale * stored c_kv
        o = gl.convert_layout(o, OUT_LAYOUT)
        d = gl.arange(0, LATENT, gl.SliceLayout(1, OUT_LAYOUT))
        heads = hblk * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(0, OUT_LAYOUT))
        h_ok = heads < H
        if SINGLE:
            out = out_ptr + b.to(gl.int64) * o_sb + heads[None, :] * o_sh + d[:, None]
            gl.store(out, o.to(out_ptr.dtype.element_ty), mask=h_ok[None, :])
        else:
            has_o = gl.convert_layout(has, gl.SliceLayout(0, OUT_LAYOUT))
            pout = pout_ptr + b.to(gl.int64) * po_sb + heads[None, :] * po_sh + split * po_ss + d[:, None]
            gl.store(pout, o, mask=(h_ok & has_o)[None, :])
            lse = gl.where(has, (m_i + gl.log2(gl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
            heads_c = hblk * BLOCK_H + gl.arange(0, BLOCK_H, m_i.type.layout)
            gl.store(plse_ptr + b.to(gl.int64) * pl_sb + heads_c * pl_sh + split, lse, mask=heads_c < H)

    @gluon.jit(do_not_specialize=("H", "num_splits", "max_len", "bt_sb", "pl_sb", "pl_sh"))  # as the Triton kernel's
    def _mla_split_gluon(q_ptr, kv_ptr, bt_ptr, lens_ptr, kv_scale_ptr, out_ptr, pout_ptr, plse_ptr,
                         qk_scale, H, num_splits, max_len,
                         q_sb, q_sh, kv_sblk, kv_stok, bt_sb,
                         o_sb, o_sh, po_sb, po_sh, po_ss, pl_sb, pl_sh,
                         PAGE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
                         LATENT: gl.constexpr, ROPE: gl.constexpr, IS_FP8: gl.constexpr, HAS_SCALE: gl.constexpr,
                         SINGLE: gl.constexpr, NBUF: gl.constexpr, PDL: gl.constexpr,
                         num_warps: gl.constexpr):
        if PDL:
            _launch_dependents()
        # --- layouts ----------------------------------------------------------------------------------
        kv_dt: gl.constexpr = kv_ptr.dtype.element_ty
        if IS_FP8:
            dt: gl.constexpr = gl.float16
            VEC: gl.constexpr = 16  # bytes a cp.async and a widening load: 16 fp8 values
        else:
            dt: gl.constexpr = kv_dt
            VEC: gl.constexpr = 8
        # a warp covers whole rows of 16-byte vectors; ROPE columns take ROPE / VEC threads a row
        LAT_LAYOUT: gl.constexpr = gl.BlockedLayout([1, VEC], [1, 32], [num_warps, 1], [1, 0])
        ROPE_LAYOUT: gl.constexpr = gl.BlockedLayout([1, VEC], [32 * VEC // ROPE, ROPE // VEC], [num_warps, 1], [1, 0])
        WIDEN_COLS: gl.constexpr = 128
        WIDEN_LAYOUT: gl.constexpr = gl.BlockedLayout([1, VEC], [32 * VEC // WIDEN_COLS, WIDEN_COLS // VEC],
                                                      [num_warps, 1], [1, 0])
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                      instr_shape=[16, BLOCK_H, 16])
        COL: gl.constexpr = gl.SliceLayout(0, MMA)  # per head
        ROW: gl.constexpr = gl.SliceLayout(1, MMA)  # per token

        # --- this program's split ----------------------------------------------------------------------
        b = gl.program_id(0)
        hblk = gl.program_id(1)
        split = gl.program_id(2)
        start, end, n_tiles = _split_bounds(lens_ptr, b, split, num_splits, max_len, BLOCK_N)
        bt_row = bt_ptr + b.to(gl.int64) * bt_sb

        # --- shared memory -----------------------------------------------------------------------------
        lat_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, LATENT], dt)
        rope_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, ROPE], dt)
        if IS_FP8:  # the fp8 ring is only read back by this program's threads: rows of 16-byte vectors
            ring_sl: gl.constexpr = gl.SwizzledSharedLayout(vec=VEC, per_phase=1, max_phase=1, order=[1, 0])
            ring = gl.allocate_shared_memory(kv_dt, [NBUF, BLOCK_N, LATENT], ring_sl)
            rope_ring = gl.allocate_shared_memory(kv_dt, [NBUF, BLOCK_N, ROPE], ring_sl)
            stage = gl.allocate_shared_memory(dt, [BLOCK_N, LATENT], lat_sl)
            stage_rope = gl.allocate_shared_memory(dt, [BLOCK_N, ROPE], rope_sl)
        else:  # the ring is what the wgmma read
            ring = gl.allocate_shared_memory(kv_dt, [NBUF, BLOCK_N, LATENT], lat_sl)
            rope_ring = gl.allocate_shared_memory(kv_dt, [NBUF, BLOCK_N, ROPE], rope_sl)
        q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, LATENT], dt)
        qr_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, ROPE], dt)
        p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_H], dt)
        q_smem = gl.allocate_shared_memory(dt, [BLOCK_H, LATENT], q_sl)
        qr_smem = gl.allocate_shared_memory(dt, [BLOCK_H, ROPE], qr_sl)
        p_smem = gl.allocate_shared_memory(dt, [BLOCK_N, BLOCK_H], p_sl)

        # --- the first NBUF - 1 tiles in flight before q is even read ----------------------------------
        for j in gl.static_range(NBUF - 1):
            t_j = start + j * BLOCK_N
            page_j = gl.load(bt_row + t_j // PAGE, mask=t_j < end, other=0)
            _issue_tile(ring, rope_ring, j, kv_ptr, page_j, t_j, end, kv_sblk, kv_stok,
                        PAGE, BLOCK_N, LATENT, ROPE, LAT_LAYOUT, ROPE_LAYOUT)
            async_copy.commit_group()
        t_next = start + (NBUF - 1) * BLOCK_N
        page_next = gl.load(bt_row + t_next // PAGE, mask=t_next < end, other=0)

        # --- q: this block's heads, into shared memory (fp8: fp16 scaled by a power of two) -----------
        qk_scale = _stage_queries(q_ptr, b, hblk, H, q_sb, q_sh, kv_scale_ptr, qk_scale, q_smem, qr_smem,
                                  IS_FP8, HAS_SCALE, BLOCK_H, LATENT, ROPE, num_warps)

        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, COL)
        l_rows = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, MMA)  # the softmax sums, per row: one reduction at the end
        acc = gl.zeros([LATENT, BLOCK_H], gl.float32, MMA)  # o^T
        s_zero = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, MMA)
        tok = gl.arange(0, BLOCK_N, ROW)
        for i in range(n_tiles):
            # every warp is past tile i - 1's dots before its slot is refilled with tile i + NBUF - 1
            gl.thread_barrier()
            _issue_tile(ring, rope_ring, (i + NBUF - 1) % NBUF, kv_ptr, page_next, t_next, end, kv_sblk, kv_stok,
                        PAGE, BLOCK_N, LATENT, ROPE, LAT_LAYOUT, ROPE_LAYOUT)
            async_copy.commit_group()
            t_next += BLOCK_N
            page_next = gl.load(bt_row + t_next // PAGE, mask=t_next < end, other=0)  # a tile ahead
            # tile i's bytes: this thread's copies landed, handed to the wgmma's async proxy, then everyone's
            async_copy.wait_group(NBUF - 1)
            fence_async_shared()
            gl.thread_barrier()
            slot = i % NBUF
            if IS_FP8:  # widened a column block at a time: fewer registers live
                for c in gl.static_range(LATENT // WIDEN_COLS):
                    lat = ring.index(slot).slice(c * WIDEN_COLS, WIDEN_COLS, 1).load(WIDEN_LAYOUT)
                    stage.slice(c * WIDEN_COLS, WIDEN_COLS, 1).store(lat.to(dt))
                rope = rope_ring.index(slot).load(ROPE_LAYOUT)
                stage_rope.store(rope.to(dt))
                fence_async_shared()
                gl.thread_barrier()
                a_lat = stage
                a_rope = stage_rope
            else:
                a_lat = ring.index(slot)
                a_rope = rope_ring.index(slot)
            s_t = warpgroup_mma(a_lat, q_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s_t = warpgroup_mma(a_rope, qr_smem.permute((1, 0)), s_t, is_async=True)
            s_t = warpgroup_mma_wait(0, deps=(s_t,))
            t0 = start + i * BLOCK_N
            s_t = gl.where((t0 + tok < end)[:, None], s_t * qk_scale, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s_t, 0))
            alpha = gl.exp2(m_i - m_new)
            p_t = gl.exp2(s_t - m_new[None, :])
            l_rows = l_rows * alpha[None, :] + p_t
            p_smem.store(p_t.to(dt))
            fence_async_shared()
            gl.thread_barrier()
            acc = warpgroup_mma(a_lat.permute((1, 0)), p_smem, acc * alpha[None, :], is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            m_i = m_new
        async_copy.wait_group(0)  # the ring's prefetches past the split, before the program ends
        _write_result(acc, m_i, gl.sum(l_rows, 0), b, hblk, split, H, kv_scale_ptr, out_ptr, pout_ptr, plse_ptr,
                      o_sb, o_sh, po_sb, po_sh, po_ss, pl_sb, pl_sh, HAS_SCALE, SINGLE, BLOCK_H, LATENT, num_warps)


    @gluon.jit
    def _load_fp8_words(kv_ptr, page, t0, end, kv_sblk, kv_stok, PAGE: gl.constexpr, BLOCK_N: gl.constexpr,
                        BYTES: gl.constexpr, byte0: gl.constexpr, LAYOUT: gl.constexpr):
        """Bytes byte0 .. byte0 + BYTES - 1 of tokens t0 .. t0 + BLOCK_N - 1 (all in `page`) into registers as
        int32 words, four fp8 values each (a loop-carried fp8 tensor would take a register a byte), 16 bytes
        a load; rows at or past `end` read as zeros (no read)."""
        row0 = kv_ptr + page.to(gl.int64) * kv_sblk + (t0 % PAGE).to(gl.int64) * kv_stok + byte0
        words = row0.to(gl.pointer_type(gl.int32), bitcast=True)
        rows = gl.arange(0, BLOCK_N, gl.SliceLayout(1, LAYOUT))
        cols = gl.arange(0, BYTES // 4, gl.SliceLayout(0, LAYOUT))
        ptrs = words + rows[:, None] * (kv_stok // 4) + gl.max_contiguous(gl.multiple_of(cols, 4), 4)[None, :]
        return gl.load(ptrs, mask=(t0 + rows < end)[:, None], other=0)

    @gluon.jit
    def _widen_words(words, dst):
        """int32 words of four e4m3 values each -> fp16 into `dst` (an int32 view of the fp16 staging
        tile, two values a word): one cvt a pair, in order."""
        lo, hi = gl.inline_asm_elementwise(
            "{ .reg .b16 l, h; mov.b32 {l, h}, $2; cvt.rn.f16x2.e4m3x2 $0, l; cvt.rn.f16x2.e4m3x2 $1, h; }",
            "=r,=r,r", [words], dtype=(gl.int32, gl.int32), is_pure=True, pack=1)
        pairs = gl.join(lo, hi)
        dst.store(gl.reshape(pairs, [words.shape[0], 2 * words.shape[1]]))

    @gluon.jit
    def _load_tile_words(kv_ptr, page, t0, end, kv_sblk, kv_stok, PAGE: gl.constexpr, BLOCK_N: gl.constexpr,
                         LATENT: gl.constexpr, ROPE: gl.constexpr, CHUNK: gl.constexpr, XL: gl.constexpr,
                         XR: gl.constexpr):
        """A tile's fp8 entries as int32 words: c_kv in four column blocks of CHUNK bytes, then k_sh."""
        gl.static_assert(LATENT == 4 * CHUNK)
        x0 = _load_fp8_words(kv_ptr, page, t0, end, kv_sblk, kv_stok, PAGE, BLOCK_N, CHUNK, 0, XL)
        x1 = _load_fp8_words(kv_ptr, page, t0, end, kv_sblk, kv_stok, PAGE, BLOCK_N, CHUNK, CHUNK, XL)
        x2 = _load_fp8_words(kv_ptr, page, t0, end, kv_sblk, kv_stok, PAGE, BLOCK_N, CHUNK, 2 * CHUNK, XL)
        x3 = _load_fp8_words(kv_ptr, page, t0, end, kv_sblk, kv_stok, PAGE, BLOCK_N, CHUNK, 3 * CHUNK, XL)
        xr = _load_fp8_words(kv_ptr, page, t0, end, kv_sblk, kv_stok, PAGE, BLOCK_N, ROPE, LATENT, XR)
        return x0, x1, x2, x3, xr

    @gluon.jit
    def _widen_tile(x0, x1, x2, x3, xr, lat_words, rope_words, CHUNK: gl.constexpr):
        """A tile's words widened into a staging tile (int32 views of its c_kv and k_sh parts)."""
        _widen_words(x0, lat_words.slice(0, CHUNK // 2, 1))
        _widen_words(x1, lat_words.slice(CHUNK // 2, CHUNK // 2, 1))
        _widen_words(x2, lat_words.slice(CHUNK, CHUNK // 2, 1))
        _widen_words(x3, lat_words.slice(3 * CHUNK // 2, CHUNK // 2, 1))
        _widen_words(xr, rope_words)

    @gluon.jit(do_not_specialize=("H", "num_splits", "max_len", "bt_sb", "pl_sb", "pl_sh"))
    def _mla_split_gluon_fp8_ahead(q_ptr, kv_ptr, bt_ptr, lens_ptr, kv_scale_ptr, out_ptr, pout_ptr, plse_ptr,
                                     qk_scale, H, num_splits, max_len,
                                     q_sb, q_sh, kv_sblk, kv_stok, bt_sb,
                                     o_sb, o_sh, po_sb, po_sh, po_ss, pl_sb, pl_sh,
                                     PAGE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
                                     LATENT: gl.constexpr, ROPE: gl.constexpr, SINGLE: gl.constexpr,
                                     PDL: gl.constexpr, BESIDE_VALUES: gl.constexpr, num_warps: gl.constexpr):
        """The fp8 split kernel with the widening beside the tensor cores' work: two fp16 staging tiles,
        the fp8 tiles loaded into registers (int32 words, 16 bytes a load) a tile ahead, no fp8 ring.

        Per iteration i: tile i's score dot is issued, and while it runs, tile i + 1 is widened from
        registers into the other staging tile (tile i - 1's dots, its last readers, are done) and tile
        i + 2 loaded; then the scores, the softmax, p to shared memory and tile i's value dot. With
        BESIDE_VALUES, half of the widening and loading waits for the value dot and runs beside it. Both
        dots are waited for within the iteration (a wgmma left running over the loop's back edge made
        ptxas serialise them all: C7515)."""
        if PDL:
            _launch_dependents()
        dt: gl.constexpr = gl.float16
        CHUNK: gl.constexpr = 128  # c_kv bytes a load block
        XL: gl.constexpr = gl.BlockedLayout([1, 4], [32 * 16 // CHUNK, CHUNK // 16], [num_warps, 1], [1, 0])
        XR: gl.constexpr = gl.BlockedLayout([1, 4], [32 * 16 // ROPE, ROPE // 16], [num_warps, 1], [1, 0])
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                      instr_shape=[16, BLOCK_H, 16])
        COL: gl.constexpr = gl.SliceLayout(0, MMA)  # per head
        ROW: gl.constexpr = gl.SliceLayout(1, MMA)  # per token

        b = gl.program_id(0)
        hblk = gl.program_id(1)
        split = gl.program_id(2)
        start, end, n_tiles = _split_bounds(lens_ptr, b, split, num_splits, max_len, BLOCK_N)
        bt_row = bt_ptr + b.to(gl.int64) * bt_sb

        lat_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, LATENT], dt)
        rope_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, ROPE], dt)
        # the staging tiles' int32 views: the same bytes and swizzle, two fp16 values a word
        lat_wl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=lat_sl.swizzle_byte_width, element_bitwidth=32)
        rope_wl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=rope_sl.swizzle_byte_width,
                                                     element_bitwidth=32)
        stage = gl.allocate_shared_memory(dt, [2, BLOCK_N, LATENT], lat_sl)
        stage_rope = gl.allocate_shared_memory(dt, [2, BLOCK_N, ROPE], rope_sl)
        q_smem = gl.allocate_shared_memory(dt, [BLOCK_H, LATENT],
                                           gl.NVMMASharedLayout.get_default_for([BLOCK_H, LATENT], dt))
        qr_smem = gl.allocate_shared_memory(dt, [BLOCK_H, ROPE],
                                            gl.NVMMASharedLayout.get_default_for([BLOCK_H, ROPE], dt))
        p_smem = gl.allocate_shared_memory(dt, [BLOCK_N, BLOCK_H],
                                           gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_H], dt))

        # tiles 0 and 1 into registers before q is read; tile 0 widened into staging tile 0
        page0 = gl.load(bt_row + start // PAGE, mask=start < end, other=0)
        x0, x1, x2, x3, xr = _load_tile_words(kv_ptr, page0, start, end, kv_sblk, kv_stok, PAGE, BLOCK_N, LATENT,
                                              ROPE, CHUNK, XL, XR)
        qk_scale = _stage_queries(q_ptr, b, hblk, H, q_sb, q_sh, kv_scale_ptr, qk_scale, q_smem, qr_smem,
                                  True, True, BLOCK_H, LATENT, ROPE, num_warps)
        _widen_tile(x0, x1, x2, x3, xr, stage.index(0)._reinterpret(gl.int32, [BLOCK_N, LATENT // 2], lat_wl),
                    stage_rope.index(0)._reinterpret(gl.int32, [BLOCK_N, ROPE // 2], rope_wl), CHUNK)
        t_next = start + BLOCK_N
        page_next = gl.load(bt_row + t_next // PAGE, mask=t_next < end, other=0)
        x0, x1, x2, x3, xr = _load_tile_words(kv_ptr, page_next, t_next, end, kv_sblk, kv_stok, PAGE, BLOCK_N,
                                              LATENT, ROPE, CHUNK, XL, XR)
        t_next += BLOCK_N
        page_next = gl.load(bt_row + t_next // PAGE, mask=t_next < end, other=0)
        fence_async_shared()
        gl.thread_barrier()

        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, COL)
        l_rows = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, MMA)  # the softmax sums, per row: one reduction at the end
        s_zero = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, MMA)
        acc = gl.zeros([LATENT, BLOCK_H], gl.float32, MMA)  # o^T
        tok = gl.arange(0, BLOCK_N, ROW)
        for i in range(n_tiles):
            cur = i % 2
            nxt = 1 - cur
            lat_words = stage.index(nxt)._reinterpret(gl.int32, [BLOCK_N, LATENT // 2], lat_wl)
            s_t = warpgroup_mma(stage.index(cur), q_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s_t = warpgroup_mma(stage_rope.index(cur), qr_smem.permute((1, 0)), s_t, is_async=True)
            # while the tensor cores score tile i: the first half of tile i + 1 widened into the other staging
            # tile (tile i - 1's dots, its last readers, are done), that half of tile i + 2 loaded
            if i + 1 < n_tiles:
                _widen_words(x0, lat_words.slice(0, CHUNK // 2, 1))
                _widen_words(x1, lat_words.slice(CHUNK // 2, CHUNK // 2, 1))
                if not BESIDE_VALUES:
                    _widen_words(x2, lat_words.slice(CHUNK, CHUNK // 2, 1))
                    _widen_words(x3, lat_words.slice(3 * CHUNK // 2, CHUNK // 2, 1))
                    _widen_words(xr, stage_rope.index(nxt)._reinterpret(gl.int32, [BLOCK_N, ROPE // 2], rope_wl))
            x0 = _load_fp8_words(kv_ptr, page_next, t_next, end, kv_sblk, kv_stok, PAGE, BLOCK_N, CHUNK, 0, XL)
            x1 = _load_fp8_words(kv_ptr, page_next, t_next, end, kv_sblk, kv_stok, PAGE, BLOCK_N, CHUNK, CHUNK, XL)
            if not BESIDE_VALUES:
                x2 = _load_fp8_words(kv_ptr, page_next, t_next, end, kv_sblk, kv_stok, PAGE, BLOCK_N, CHUNK, 2 * CHUNK,
                                     XL)
                x3 = _load_fp8_words(kv_ptr, page_next, t_next, end, kv_sblk, kv_stok, PAGE, BLOCK_N, CHUNK, 3 * CHUNK,
                                     XL)
                xr = _load_fp8_words(kv_ptr, page_next, t_next, end, kv_sblk, kv_stok, PAGE, BLOCK_N, ROPE, LATENT, XR)

            s = warpgroup_mma_wait(0, deps=(s_t,))
            t0 = start + i * BLOCK_N
            s = gl.where((t0 + tok < end)[:, None], s * qk_scale, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, 0))
            alpha = gl.exp2(m_i - m_new)
            p_t = gl.exp2(s - m_new[None, :])
            l_rows = l_rows * alpha[None, :] + p_t
            p_smem.store(p_t.to(dt))
            fence_async_shared()  # p (and the staging tile widened so far) to the wgmma's async proxy
            gl.thread_barrier()
            acc = warpgroup_mma(stage.index(cur).permute((1, 0)), p_smem, acc * alpha[None, :], is_async=True)
            m_i = m_new
            if BESIDE_VALUES:  # while they add tile i's values: the rest of tile i + 1, and of tile i + 2's loads
                if i + 1 < n_tiles:
                    _widen_words(x2, lat_words.slice(CHUNK, CHUNK // 2, 1))
                    _widen_words(x3, lat_words.slice(3 * CHUNK // 2, CHUNK // 2, 1))
                    _widen_words(xr, stage_rope.index(nxt)._reinterpret(gl.int32, [BLOCK_N, ROPE // 2], rope_wl))
                x2 = _load_fp8_words(kv_ptr, page_next, t_next, end, kv_sblk, kv_stok, PAGE, BLOCK_N, CHUNK, 2 * CHUNK,
                                     XL)
                x3 = _load_fp8_words(kv_ptr, page_next, t_next, end, kv_sblk, kv_stok, PAGE, BLOCK_N, CHUNK, 3 * CHUNK,
                                     XL)
                xr = _load_fp8_words(kv_ptr, page_next, t_next, end, kv_sblk, kv_stok, PAGE, BLOCK_N, ROPE, LATENT, XR)
            t_next += BLOCK_N
            page_next = gl.load(bt_row + t_next // PAGE, mask=t_next < end, other=0)  # a tile ahead of the loads
            acc = warpgroup_mma_wait(0, deps=(acc,))
            if BESIDE_VALUES:
                fence_async_shared()  # the rest of tile i + 1's staging tile; p free again
                gl.thread_barrier()
        _write_result(acc, m_i, gl.sum(l_rows, 0), b, hblk, split, H, kv_scale_ptr, out_ptr, pout_ptr, plse_ptr,
                      o_sb, o_sh, po_sb, po_sh, po_ss, pl_sb, pl_sh, True, SINGLE, BLOCK_H, LATENT, num_warps)


def launch(grid, q, kv_cache, block_table, seq_lens, scale_arg, out, pout, plse, qk_scale, H, S, max_len, kv_args,
           out_strides, part_strides, *, page, block_h, block_n, latent, rope, is_fp8, has_scale, single, nbuf,
           pdl, widen_ahead=0) -> None:
    """The Gluon split kernel over `grid`, arguments as mla_decode.run passes the Triton one; a ring of
    `nbuf` tiles (at most MAX_RING's for the cache); `widen_ahead` (fp8 only): the kernel that widens the
    next tile while the tensor cores score this one (1), or half of it then, half beside the value dot (2)."""
    args = (q, kv_cache, block_table, seq_lens, scale_arg, out, pout, plse, qk_scale, H, S, max_len, *kv_args,
            *out_strides, *part_strides)
    if widen_ahead and is_fp8:
        _mla_split_gluon_fp8_ahead[grid](*args, PAGE=page, BLOCK_H=block_h, BLOCK_N=block_n, LATENT=latent,
                                         ROPE=rope, SINGLE=single, PDL=pdl, BESIDE_VALUES=widen_ahead == 2,
                                         num_warps=NUM_WARPS)
        return
    _mla_split_gluon[grid](*args, PAGE=page, BLOCK_H=block_h, BLOCK_N=block_n, LATENT=latent, ROPE=rope, IS_FP8=is_fp8,
                           HAS_SCALE=has_scale, SINGLE=single, NBUF=min(nbuf, MAX_RING[kv_cache.element_size()]), PDL=pdl,
                           num_warps=NUM_WARPS)
