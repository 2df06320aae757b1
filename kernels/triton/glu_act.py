"""Gated activations of the shared-expert branch as one Triton kernel (CUDA side stream).

Why: the side stream runs eager ops (it is outside Inductor), and SiTU-GLU spelled with torch ops
is eight launches (casts, tanh, sigmoid, muls); Inductor fuses the same thing into one kernel on
the stock path. This kernel keeps the model's rounding points: the inputs are read in the model
dtype, the math runs in fp32 exactly as `situ_glu` spells it, and the result is cast back once.

    out = beta*tanh(g/beta)*sigmoid(g) * linear_beta*tanh(u/linear_beta)     ("situ_glu:B:L")
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice  # the tanh Inductor's kernels call

    HAVE_TRITON = True
except Exception:  # pragma: no cover - CPU CI without triton
    HAVE_TRITON = False

BLOCK = 1024

if HAVE_TRITON:

    @triton.jit
    def _situ_glu_kernel(g_ptr, u_ptr, out_ptr, n, beta, linear_beta, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        gate = beta * libdevice.tanh(g / beta) * tl.sigmoid(g)
        lin = linear_beta * libdevice.tanh(u / linear_beta)
        tl.store(out_ptr + offs, (gate * lin).to(out_ptr.dtype.element_ty), mask=mask)


def supports(g: torch.Tensor, u: torch.Tensor) -> bool:
    return (HAVE_TRITON and g.is_cuda and g.shape == u.shape and g.dtype == u.dtype
            and g.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and g.is_contiguous() and u.is_contiguous())


def situ_glu(g: torch.Tensor, u: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """SiTU-GLU of two projections (same shape and dtype), one launch."""
    out = torch.empty_like(g)
    n = g.numel()
    if n:
        _situ_glu_kernel[(triton.cdiv(n, BLOCK),)](g, u, out, n, float(beta), float(linear_beta),
                                                   BLOCK=BLOCK, num_warps=4)
    return out


__all__ = ["situ_glu", "supports"]
