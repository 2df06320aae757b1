"""Lamport push of an activation into every rank's one-shot all-reduce buffer (no GEMM).

Why: the MoE tail's all-reduce (k3fuse.allreduce_rmsnorm) has no projection in front of it whose
epilogue could push, so this small kernel does what the GEMM push epilogues of
lib/cute/gemv.py and lib/triton/splitk_gemm.py do: x [T, H] (any float dtype) as fp32 into slot
[rank] of buffer b of every rank's symmetric workspace (kernels/collective.py), with -0.0
written as +0.0 (-0.0 is the "not written" sentinel the epilogue polls for). b is read on the device
from the workspace's int64 protocol word gen[3] (rotated by the epilogue's last CTA), never a
host-side value, so a captured CUDA graph pushes into the right buffer on every replay.
The epilogue (lib/cute/oneshot_epilogue.py, has_residual=False) then polls, sums in rank order and normalises.
Not an implementation of its own: kernels/ops/allreduce_rmsnorm.py calls it.
"""
from __future__ import annotations

import torch

from . import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

BLOCK = 1024

if HAVE_TRITON:

    @triton.jit
    def _push_kernel(x_ptr, push_ptr, gen_ptr, n, WORLD: tl.constexpr, RANK: tl.constexpr,
                     MAXT: tl.constexpr, H: tl.constexpr, BLOCK: tl.constexpr):
        # x is [T, H] contiguous and slot [b, RANK] of the buffer is [MAXT, H] row-major, so element i
        # of x lands at ((b * WORLD + RANK) * MAXT) * H + i; 64-bit offsets throughout
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        v = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.where(v == 0.0, 0.0, v)          # -0.0 is the sentinel: write +0.0 instead
        buf = tl.load(gen_ptr + 3).to(tl.int64)  # buffer index in {0, 1, 2}, never a remainder
        off = (buf * WORLD + RANK) * MAXT * H + offs
        for r in tl.static_range(WORLD):
            base = tl.load(push_ptr + r).to(tl.pointer_type(tl.float32))
            tl.store(base + off, v, mask=mask)


def _args(x: torch.Tensor, ptrs: torch.Tensor, gen: torch.Tensor, rank: int, max_tokens: int):
    T, H = x.shape
    grid = (triton.cdiv(T * H, BLOCK),)
    return grid, (x, ptrs, gen, T * H), dict(WORLD=ptrs.numel(), RANK=rank, MAXT=max_tokens, H=H, BLOCK=BLOCK,
                                            num_warps=4)


def run(x: torch.Tensor, ptrs: torch.Tensor, gen: torch.Tensor, rank: int, max_tokens: int) -> None:
    """Push x [T, H] (contiguous) into slot [rank] of buffer gen[3] of every rank (ptrs int64[W])."""
    grid, args, kw = _args(x, ptrs, gen, rank, max_tokens)
    _push_kernel[grid](*args, **kw)


def precompile(x: torch.Tensor, ptrs: torch.Tensor, gen: torch.Tensor, rank: int, max_tokens: int) -> None:
    """Compile (and cache) exactly the kernel `run` would launch, without launching it."""
    grid, args, kw = _args(x, ptrs, gen, rank, max_tokens)
    _push_kernel.warmup(*args, grid=grid, **kw)
