"""moe_combine: the routed experts' weighted combine (k3fuse.spelling `moe_combine`) and its cast.

out[t] = sum over slots j of weights[t, j] * z[t*k + j], accumulated in fp32, returned in z's dtype
(the trunk's: the model's `.to(x.dtype)` is part of the op). z [T*k, L] in pair order, weights fp32
[T, k] -> [T, L]. Stock: the model's spelling and cast; reference: the slot-order sum
(lib/reference/moe_combine.py); CUDA: one Triton program per (token, column block), the slots
looped in order (lib/triton/moe_combine.py), the reference's bits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..declare import OpDecl, declare
from ..dispatch import Impl, register_impl
from ..lib.reference import moe_combine as reference
from ..lib.reference import stock
from ..spec import Spec, call_only, operands_misfit

OP = "moe_combine"


@dataclass(frozen=True, kw_only=True)
class MoECombineSpec(Spec):
    """z [tokens * top_k, L] in `dtype`, weights fp32 [tokens, top_k]."""

    op: ClassVar[str] = OP
    L: int
    top_k: int
    dtype: torch.dtype  # z's, the output's
    fits: str | None = call_only(None)  # why z / weights are not CUDA [T*k, L] / fp32 [T, k] with unit inner strides

    @classmethod
    def from_call(cls, z, weights, top_k, **_: Any) -> MoECombineSpec:
        fits = operands_misfit(dict(z=z, weights=weights), contiguous=False) or _layout_misfit(z, weights, top_k)
        if fits is not None:
            return cls(tokens=0, L=0, top_k=int(top_k), dtype=torch.float32, fits=fits)
        return cls(tokens=int(weights.shape[0]), L=int(z.shape[1]), top_k=int(top_k), dtype=z.dtype)


def _layout_misfit(z, weights, top_k) -> str | None:
    """Why tensor operands are not z [T*top_k, L] with a unit inner stride and fp32 weights [T, top_k]."""
    if z.dim() != 2 or weights.dim() != 2 or weights.shape[1] != top_k or z.shape[0] != weights.shape[0] * top_k:
        return f"z {tuple(z.shape)} / weights {tuple(weights.shape)} are not [T*top_k, L] / [T, top_k={top_k}]"
    if weights.dtype != torch.float32:
        return f"weights dtype {weights.dtype} (fp32 only)"
    if z.stride(1) != 1:
        return f"z needs a unit inner stride (strides {z.stride()})"
    return None


def accepts(spec: MoECombineSpec) -> str | None:
    from ..lib.triton import moe_combine as kernel

    if spec.fits is not None:
        return spec.fits
    if spec.dtype not in kernel.DTYPES:
        return f"dtype {spec.dtype} (bf16/fp16/fp32 z only)"
    if not 1 <= spec.tokens <= kernel.MAX_TOKENS:
        return f"T={spec.tokens} (needs 1 <= T <= {kernel.MAX_TOKENS})"
    if not 1 <= spec.top_k <= kernel.MAX_TOP_K:
        return f"top_k={spec.top_k} (needs 1 <= top_k <= {kernel.MAX_TOP_K})"
    if spec.L < 1:
        return f"L={spec.L} (needs L >= 1)"
    return None


def run(z, weights, top_k, **_):
    from ..lib.triton import moe_combine as kernel

    return kernel.run(z, weights, top_k)


def warmup(shapes) -> None:
    """Triton compiles on first launch: launch once per {"M", "L", "top_k", "dtype"} on zeros (the
    compiled code depends on top_k, the column block, whether it divides L, and the 16-divisibility
    of L and the strides), so warm every token count the graphs will see."""
    from ..lib.triton import moe_combine as kernel

    for s in shapes:
        dev, dtype = s.get("device", "cuda"), s.get("dtype", torch.bfloat16)
        T, L, k = s["M"], s["L"], s["top_k"]
        z = torch.zeros((T * k, L), dtype=dtype, device=dev)
        weights = torch.zeros((T, k), dtype=torch.float32, device=dev)
        if accepts(MoECombineSpec.from_call(z, weights, k)) is None:
            kernel.run(z, weights, k)


def _fake(z, weights, top_k, strict=False):
    name = "k3fuse.moe_combine"
    torch._check(z.dim() == 2, lambda: f"{name}: z must be the expert outputs [T*top_k, L], got {tuple(z.shape)}")
    torch._check(weights.dim() == 2 and weights.shape[1] == top_k,
                 lambda: f"{name}: weights must be [T, top_k={top_k}], got {tuple(weights.shape)}")
    torch._check(z.shape[0] == weights.shape[0] * top_k,
                 lambda: f"{name}: {z.shape[0]} rows of z for {weights.shape[0]} tokens x top_k={top_k}")
    torch._check(weights.dtype == torch.float32,
                 lambda: f"{name}: weights must be float32 (the router's), got {weights.dtype}")
    torch._check(z.dtype.is_floating_point, lambda: f"{name}: z must be floating point, got {z.dtype}")
    return z.new_empty((weights.shape[0], z.shape[1]))


DECL = OpDecl(OP, "(Tensor z, Tensor weights, int top_k, bool strict=False) -> Tensor",
              _fake, stock.moe_combine, reference.moe_combine, spec=MoECombineSpec)
DECLS = (DECL,)
declare(DECL)
register_impl(OP, Impl("triton.moe_combine", accepts, run, priority=50, warmup=warmup, needs=("triton.moe_combine",)))
