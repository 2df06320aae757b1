"""Gated activations of the shared-expert branch as one Triton kernel (CUDA side stream).

Why: the side stream runs eager ops (it is outside Inductor), and SiTU-GLU spelled with torch ops
is eight launches (casts, tanh, sigmoid, muls); Inductor fuses the same thing into one kernel on
the stock path. This kernel keeps the model's rounding points: the inputs are read in the model
dtype, the math runs in fp32 exactly as `situ_glu` spells it, and the result is cast back once.

    out = beta*tanh(g/beta)*sigmoid(g) * linear_beta*tanh(u/linear_beta)     ("situ_glu:B:L")
"""
from __future__ import annotations

import json

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


#: K3's SiTU-GLU in a 16-bit trunk as shared_expert_stream copies it out of the model's graph (a JSON
#: program, kernels/lib/reference/shared_expert.py), with "B" / "L" where beta / linear_beta stand.
#: tests/test_shared_expert_structural.py pins it to what the rule extracts from the reference model.
_SITU_PROGRAM = {
    "n": 2,
    "steps": [
        ["prims::convert_element_type.default", [{"$": 0}, {"dtype": "float32"}], {}],
        ["prims::convert_element_type.default", [{"$": 1}, {"dtype": "float32"}], {}],
        ["aten::div.Tensor", [{"$": 2}, "B"], {}],
        ["aten::tanh.default", [{"$": 4}], {}],
        ["aten::mul.Tensor", [{"$": 5}, "B"], {}],
        ["aten::sigmoid.default", [{"$": 2}], {}],
        ["aten::mul.Tensor", [{"$": 6}, {"$": 7}], {}],
        ["aten::div.Tensor", [{"$": 3}, "L"], {}],
        ["aten::tanh.default", [{"$": 9}], {}],
        ["aten::mul.Tensor", [{"$": 10}, "L"], {}],
        ["aten::mul.Tensor", [{"$": 8}, {"$": 11}], {}],
        ["prims::convert_element_type.default", [{"$": 12}, {"dtype": "OUT"}], {}],
    ],
    "out": {"$": 13},
}


def situ_params(act: str) -> tuple[float, float] | None:
    """(beta, linear_beta) when `act` is K3's SiTU-GLU (named "situ_glu:B:L" or the program the rule
    copies from the model), else None: only then may this kernel replace the fork's activation."""
    if act.startswith("situ_glu:"):
        _, beta, linear_beta = act.split(":")
        return float(beta), float(linear_beta)
    if not act.startswith("{"):
        return None
    try:
        prog = json.loads(act)
        steps = prog["steps"]
        beta, linear_beta = steps[2][1][1], steps[7][1][1]
        out_dtype = steps[11][1][1]["dtype"]
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    if not (isinstance(beta, float) and isinstance(linear_beta, float) and out_dtype in ("bfloat16", "float16")):
        return None
    template = json.dumps(_SITU_PROGRAM).replace('"B"', repr(beta)).replace('"L"', repr(linear_beta))
    template = template.replace('"OUT"', json.dumps(out_dtype))
    return (beta, linear_beta) if json.loads(template) == prog else None


def situ_glu(g: torch.Tensor, u: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """SiTU-GLU of two projections (same shape and dtype), one launch."""
    out = torch.empty_like(g)
    n = g.numel()
    if n:
        _situ_glu_kernel[(triton.cdiv(n, BLOCK),)](g, u, out, n, float(beta), float(linear_beta),
                                                   BLOCK=BLOCK, num_warps=4)
    return out


__all__ = ["situ_glu", "situ_params", "DTYPES"]
