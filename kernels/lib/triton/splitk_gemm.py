"""Triton split-K decode GEMM on tensor cores (swap-AB), 1..64 tokens, deterministic.

Why: at 8..64 tokens CUDA-core FMA becomes compute-bound (64 tokens x 7168 x 6144 is 5.6 GFLOP),
so the weights go through `tl.dot` (wgmma/mma on Hopper) with the weight tile as the wide operand
(swap-AB: y^T = W @ x^T, tokens padded to 16), and K is split so that enough CTAs stream weights
to fill the 132 SMs. Split partials go to an fp32 workspace; the last CTA of each column tile
(arrival counter, acq_rel) sums them in split order 0..S-1, so results are deterministic and
batch-invariant in the reduction order, adds the bias, casts and resets the counter (graph-safe).

y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]).
"""
from __future__ import annotations

import functools

import torch

from . import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from triton.language.extra.cuda import gdc_launch_dependents

BLOCK_K = 128
MAX_M = 64
MIN_BLOCK_N = 16  # the narrowest column tile (one counter per tile of the split-K reduction)

if HAVE_TRITON:

    @triton.jit
    def _store_out(total, b_ptr, y_ptr, stride_ym, offs_n, offs_m, m_mask, N, push_ptr, gen_ptr,
                   HAS_BIAS: tl.constexpr, PUSH_WORLD: tl.constexpr, PUSH_RANK: tl.constexpr,
                   PUSH_MAXT: tl.constexpr, EVEN_N: tl.constexpr):
        n_ok = offs_n < N
        if HAS_BIAS:
            if EVEN_N:
                total += tl.load(b_ptr + offs_n).to(tl.float32)[:, None]
            else:
                total += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        if PUSH_WORLD == 0:
            y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
            if EVEN_N:
                tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=m_mask[None, :])
            else:
                tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=n_ok[:, None] & m_mask[None, :])
        else:
            # Lamport push (kernels/lib/cute/oneshot_epilogue.py): fp32 into slot [rank] of buffer gen%3
            # of every rank; -0.0 is the "not written" sentinel, so write +0.0 instead
            # gen_ptr: the workspace's int64 protocol words; [3] is the buffer index in {0, 1, 2},
            # rotated by the epilogue (never a signed remainder of a wrapping counter); 64-bit offsets
            buf = tl.load(gen_ptr + 3).to(tl.int64)
            val = tl.where(total == 0.0, 0.0, total)
            off = (((buf * PUSH_WORLD + PUSH_RANK) * PUSH_MAXT + offs_m[None, :].to(tl.int64)) * N
                   + offs_n[:, None].to(tl.int64))
            for r in tl.static_range(PUSH_WORLD):
                base = tl.load(push_ptr + r).to(tl.pointer_type(tl.float32))
                tl.store(base + off, val, mask=n_ok[:, None] & m_mask[None, :])

    @triton.jit
    def _splitk_kernel(x_ptr, w_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr, push_ptr, gen_ptr, w2_ptr,
                       M, N, N1, stride_xm, stride_wn, stride_w2n, stride_ym,
                       K_SPLIT: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                       PUSH_WORLD: tl.constexpr, PUSH_RANK: tl.constexpr, PUSH_MAXT: tl.constexpr,
                       EVEN_N: tl.constexpr, TWO_W: tl.constexpr, PDL_TRIGGER: tl.constexpr):
        if PDL_TRIGGER:   # the next kernel (a gather launched with PDL) may start while this one runs
            gdc_launch_dependents()
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        offs_kk = tl.arange(0, BLOCK_K)
        m_mask = offs_m < M
        k0 = pid_k * K_SPLIT
        # TWO_W: output rows [0, N1) come from w, rows [N1, N) from w2 (the sharded MoE front's
        # router and latent slices, one launch without a stacked copy); N1 % BLOCK_N == 0, so a
        # column tile never straddles the two
        w_base = w_ptr
        row0 = pid_n * BLOCK_N
        stride_w = stride_wn
        if TWO_W:
            if row0 >= N1:
                w_base = w2_ptr
                row0 = row0 - N1
                stride_w = stride_w2n
        w_ptrs = (w_base + (row0 + tl.arange(0, BLOCK_N))[:, None].to(tl.int64) * stride_w
                  + (k0 + offs_kk)[None, :])
        x_ptrs = x_ptr + offs_m[None, :] * stride_xm + (k0 + offs_kk)[:, None]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        n_ok = offs_n < N
        for _ in range(0, K_SPLIT // BLOCK_K):
            if EVEN_N:
                w = tl.load(w_ptrs, eviction_policy="evict_first")
            else:  # a skinny or odd N (e.g. W_b, 48 rows at TP 2): the last tile is masked
                w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0, eviction_policy="evict_first")
            xt = tl.load(x_ptrs, mask=m_mask[None, :], other=0.0, eviction_policy="evict_last")
            acc = tl.dot(w, xt, acc)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        if SPLIT_K == 1:
            _store_out(acc, b_ptr, y_ptr, stride_ym, offs_n, offs_m, m_mask, N, push_ptr, gen_ptr,
                       HAS_BIAS, PUSH_WORLD, PUSH_RANK, PUSH_MAXT, EVEN_N)
        else:
            ws_tile = ws_ptr + offs_m[None, :] * N + offs_n[:, None]   # [S, M, N], n contiguous
            tl.store(ws_tile + pid_k * M * N, acc, mask=n_ok[:, None] & m_mask[None, :])
            tl.debug_barrier()
            old = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if old == SPLIT_K - 1:
                total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                for s in tl.static_range(SPLIT_K):   # fixed order: deterministic
                    total += tl.load(ws_tile + s * M * N, mask=n_ok[:, None] & m_mask[None, :],
                                     other=0.0, cache_modifier=".cg")
                _store_out(total, b_ptr, y_ptr, stride_ym, offs_n, offs_m, m_mask, N, push_ptr,
                           gen_ptr, HAS_BIAS, PUSH_WORLD, PUSH_RANK, PUSH_MAXT, EVEN_N)
                tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")


def pick_config(M: int, N: int, K: int, sms: int = 132, rows_first: int | None = None) -> dict | None:
    """BLOCK_N, BLOCK_K, SPLIT_K, warps, stages for a shape; None when unsupported.

    The measured table (splitk_tuned.py) first. Otherwise what the H200 sweep showed wins: one
    CTA per SM streaming a 64-column tile through a 5-stage cp.async pipeline, K split only as
    far as needed to give about one CTA per SM (each split keeping >= 2 K blocks).
    rows_first: the rows of the first of two weights (run's weight2); a column tile must not
    straddle the two, so the tile width divides it (None when even 16 does not).
    """
    if K % BLOCK_K or M > MAX_M or M < 1:
        return None
    if rows_first is not None:
        if rows_first % MIN_BLOCK_N:
            return None
        widths = [b for b in (64, 32, 16) if rows_first % b == 0 and N % b == 0] or [MIN_BLOCK_N]
        block_n = widths[0]
    else:
        tuned = _tuned(M, N, K)
        if tuned is not None:
            return tuned
        # full 64/32-column tiles where N allows; else 16-column tiles with the last one masked
        block_n = 64 if N % 64 == 0 else (32 if N % 32 == 0 else 16)
    tiles = -(-N // block_n)
    kb = K // BLOCK_K
    split = 1
    for s in range(1, kb + 1):
        if kb % s == 0 and kb // s >= 2 and tiles * s <= sms:
            split = s
    return dict(BLOCK_N=block_n, SPLIT_K=split, BLOCK_M=_block_m(M), BLOCK_K=BLOCK_K, num_warps=4,
                num_stages=5)


def _block_m(M: int) -> int:
    return max(16, 1 << (M - 1).bit_length())


def _tuned(M: int, N: int, K: int) -> dict | None:
    """The config measured fastest on H200 for (N, K) and M's BLOCK_M bucket, if swept."""
    try:
        from .splitk_tuned import TUNED
    except Exception:
        return None
    cfg = TUNED.get((N, K, _block_m(M)))
    if cfg is None:
        return None
    return dict(cfg, BLOCK_M=_block_m(M))


_ws: dict = {}


def _workspace(device: torch.device, N: int, split: int):
    """fp32 partials [split, 64, N] + zeroed counters, one set per (device, stream) pair."""
    stream = torch.cuda.current_stream(device).cuda_stream
    key = (device.index, stream, N, split)
    ws = _ws.get(key)
    if ws is None:
        ws = (torch.empty((split, MAX_M, N), dtype=torch.float32, device=device),
              torch.zeros((-(-N // MIN_BLOCK_N),), dtype=torch.int32, device=device))
        _ws[key] = ws
    return ws


_scratch_t: dict = {}


def _scratch(device: torch.device) -> torch.Tensor:
    t = _scratch_t.get(device)
    if t is None:
        t = _scratch_t[device] = torch.zeros(4, dtype=torch.int32, device=device)
    return t


@functools.lru_cache(maxsize=8)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            out_dtype: torch.dtype | None, out: torch.Tensor | None, config: dict | None,
            push: tuple | None, warmup: bool, weight2: torch.Tensor | None = None,
            pdl_trigger: bool = False):
    M, K = x.shape
    N1 = weight.shape[0]
    N = N1 + (weight2.shape[0] if weight2 is not None else 0)
    cfg = config or pick_config(M, N, K, _num_sms(x.device.index or 0),
                                rows_first=N1 if weight2 is not None else None)
    if out is None:
        out = torch.empty((M, N), dtype=out_dtype or x.dtype, device=x.device) if push is None else x
    split = cfg["SPLIT_K"]
    if split > 1:
        ws, cnt = _workspace(x.device, N, split)
    else:
        ws, cnt = out, _scratch(x.device)
    bk = cfg.get("BLOCK_K", BLOCK_K)
    grid = (-(-N // cfg["BLOCK_N"]), split)
    if push is None:
        ptrs, gen, pw, pr, pm = cnt, cnt, 0, 0, 1
    else:
        ptrs, gen, pr, pm = push
        pw = ptrs.numel()
    w2 = weight2 if weight2 is not None else weight
    args = (x, weight, bias if bias is not None else weight, out, ws, cnt, ptrs, gen, w2,
            M, N, N1, x.stride(0), weight.stride(0), w2.stride(0), out.stride(0))
    kw = dict(K_SPLIT=K // split, SPLIT_K=split, BLOCK_N=cfg["BLOCK_N"], BLOCK_M=cfg["BLOCK_M"],
              BLOCK_K=bk, HAS_BIAS=bias is not None, PUSH_WORLD=pw, PUSH_RANK=pr, PUSH_MAXT=pm,
              EVEN_N=N % cfg["BLOCK_N"] == 0, TWO_W=weight2 is not None, PDL_TRIGGER=pdl_trigger,
              num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if warmup:
        _splitk_kernel.warmup(*args, grid=grid, **kw)
    else:
        _splitk_kernel[grid](*args, **kw)
    return out


def run(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None,
        config: dict | None = None, push: tuple | None = None,
        weight2: torch.Tensor | None = None, pdl_trigger: bool = False) -> torch.Tensor:
    """y = x @ weight.T (+ bias); push=(ptr_table int64[W], gen int64[4], rank, max_tokens) writes
    fp32 into every rank's Lamport buffer instead (see kernels/lib/cute/oneshot_epilogue.py).
    weight2 (no bias): y = x @ cat([weight, weight2]).T without the copy (rows of weight first).
    pdl_trigger: let a next kernel launched with programmatic dependent launch start at once."""
    return _launch(x, weight, bias, out_dtype, out, config, push, warmup=False, weight2=weight2,
                   pdl_trigger=pdl_trigger)


def precompile(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None, config: dict | None = None,
               push: tuple | None = None, weight2: torch.Tensor | None = None, pdl_trigger: bool = False) -> None:
    """Compile (and cache) exactly the kernel `run` would launch with these arguments, without
    launching it: the fused all-reduce compiles everything before its first remote store."""
    _launch(x, weight, bias, out_dtype, None, config, push, warmup=True, weight2=weight2, pdl_trigger=pdl_trigger)


