"""Triton MoE combine: the routed experts' weighted sum over the slots, in one coalesced pass over z.

Why: Inductor compiles the model's `(z.float().view(T, k, L) * w[..., None]).sum(1)` to a
persistent reduction over the slot dim whose loads stride by L across the slots, far from the
bandwidth its 7.3 MB (64 tokens at K3's L = 3584, k = 16) would take
(docs/perf/2026-12-04-w4a16-ncu-combine-conv.md 0m).

One program owns (token t, block of BLOCK_L columns): it loops over the k slots in slot order,
each iteration one contiguous, vectorised row segment z[t*k + j, block] (16-byte loads where L and
the row stride allow), and keeps an fp32 accumulator in registers:
    acc = ((w[t, 0] * z[t*k] + w[t, 1] * z[t*k + 1]) + ...)   then one cast to the output dtype.
The slot loop is unrolled (TOP_K is a constexpr), so all k loads of a program are in flight at
once. Launched without FMA contraction (`enable_fp_fusion=False`): each product and each add is
rounded once, in slot order, as the reference (kernels/lib/reference/moe_combine.py) computes it,
so the two give the same bits on one device. No workspace, no atomics, a fixed order: deterministic,
batch-invariant (a token's row does not depend on the others) and CUDA-graph safe once compiled.

z [T*k, L] (unit inner stride, any row stride), weights fp32 [T, k] (any strides) -> out [T, L] in
z's dtype, new and contiguous (or the `out` buffer given).
"""
from __future__ import annotations

import torch

from . import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

MAX_TOKENS = 64
MAX_TOP_K = 64  # the slot loop is unrolled (K3: 16)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MIN_PROGRAMS = 264  # 2 per SM on H200: below this, narrower column blocks for more programs
BLOCKS = (1024, 512, 256, 128)  # column blocks, widest first

if HAVE_TRITON:

    @triton.jit
    def _slot(z_row, w_at, in_l, EVEN_L: tl.constexpr):
        """One slot's term: its row segment in fp32 times its routing weight."""
        if EVEN_L:
            zj = tl.load(z_row, eviction_policy="evict_first")
        else:
            zj = tl.load(z_row, mask=in_l, other=0.0, eviction_policy="evict_first")
        return zj.to(tl.float32) * tl.load(w_at)

    @triton.jit
    def _moe_combine_kernel(z_ptr, w_ptr, out_ptr, L, z_st, w_st, w_sk,
                            TOP_K: tl.constexpr, BLOCK_L: tl.constexpr, EVEN_L: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
        rows = z_ptr + t * TOP_K * z_st + cols  # slot 0's segment; slot j is j rows further
        # slot 0's product starts the sum (not 0 + it: the reference's first term, signed zeros included)
        acc = _slot(rows, w_ptr + t * w_st, cols < L, EVEN_L)
        for j in tl.static_range(1, TOP_K):
            acc = acc + _slot(rows + j * z_st, w_ptr + t * w_st + j * w_sk, cols < L, EVEN_L)
        out = out_ptr + t * L + cols
        if EVEN_L:
            tl.store(out, acc.to(out_ptr.dtype.element_ty))
        else:
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=cols < L)


def pick_config(T: int, L: int, dtype: torch.dtype) -> dict:
    """BLOCK_L: the widest column block that still gives MIN_PROGRAMS programs (else the narrowest);
    warps so that each thread holds one 16-byte vector per slot (at least one warp)."""
    block = next((b for b in BLOCKS if T * -(-L // b) >= MIN_PROGRAMS), BLOCKS[-1])
    per_thread = max(1, 16 // dtype.itemsize)
    return {"BLOCK_L": block, "num_warps": max(1, min(4, block // (32 * per_thread)))}


def run(z: torch.Tensor, weights: torch.Tensor, top_k: int, out: torch.Tensor | None = None,
        config: dict | None = None) -> torch.Tensor:
    """out [T, L] in z's dtype; `out` a contiguous buffer to write instead of a new one; `config`
    overrides pick_config's choices (tests, benchmarks)."""
    T, L = weights.shape[0], z.shape[1]
    cfg = {**pick_config(T, L, z.dtype), **(config or {})}
    if out is None:
        out = torch.empty((T, L), dtype=z.dtype, device=z.device)
    else:
        assert out.is_contiguous() and tuple(out.shape) == (T, L) and out.dtype == z.dtype
    if T == 0 or L == 0:
        return out
    grid = (T, -(-L // cfg["BLOCK_L"]))
    _moe_combine_kernel[grid](z, weights, out, L, z.stride(0), weights.stride(0), weights.stride(1),
                              TOP_K=int(top_k), BLOCK_L=cfg["BLOCK_L"], EVEN_L=L % cfg["BLOCK_L"] == 0,
                              num_warps=cfg["num_warps"], enable_fp_fusion=False)
    return out
