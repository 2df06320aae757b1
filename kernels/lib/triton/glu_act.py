"""K3's SiTU-GLU as one Triton kernel (SiTU-GLU spelled with torch ops is eight launches: casts,
tanh, sigmoid, muls; Inductor fuses the same thing into one kernel).

No op dispatches to it now (the shared expert's activation stays in the graph, bracketed on the side
stream); kept with its compile test for an activation op. It keeps the model's rounding points: the
inputs are read in the model dtype, the math runs in fp32 exactly as `situ_glu` spells it, and the
result is cast back once.

    out = beta*tanh(g/beta)*sigmoid(g) * linear_beta*tanh(u/linear_beta)
"""
from __future__ import annotations

import torch

from . import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice  # the tanh Inductor's kernels call

BLOCK = 1024
DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # g and u, one dtype, contiguous

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


def situ_glu(g: torch.Tensor, u: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """SiTU-GLU of two projections (same shape and dtype), one launch."""
    out = torch.empty_like(g)
    n = g.numel()
    if n:
        _situ_glu_kernel[(triton.cdiv(n, BLOCK),)](g, u, out, n, float(beta), float(linear_beta),
                                                   BLOCK=BLOCK, num_warps=4)
    return out


__all__ = ["situ_glu", "DTYPES"]
