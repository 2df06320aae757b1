"""kda_delta_rule: one KDA delta-rule step (k3fuse/model/layers.py `delta_rule`), fp32 in and out.

  S = recurrent * exp(g)[..., None];  e = beta[..., None] * (v - S^T k)
  S_new = S + k e^T;                  o = S_new^T q
recurrent [T, h, dk, dv], g/k/q [T, h, dk], beta [T, h], v [T, h, dv] -> (S_new, o [T, h, dv]).
CUDA: one pass over the fp32 recurrent state (lib/triton/kda_delta.py).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..declare import OpDecl, declare
from ..dispatch import Impl, register_impl
from ..lib.reference import kda_delta, stock
from ..spec import Spec, call_only, operands_misfit

OP = "kda_delta_rule"


@dataclass(frozen=True, kw_only=True)
class KDADeltaSpec(Spec):
    """recurrent [tokens, heads, dk, dv] and its step operands."""

    op: ClassVar[str] = OP
    heads: int
    dk: int
    dv: int
    dtype: torch.dtype = torch.float32
    fits: str | None = call_only(None)  # why the operands are not CUDA tensors of the step's shapes and strides

    @classmethod
    def from_call(cls, recurrent, g, beta, k, v, q, **_: Any) -> KDADeltaSpec:
        operands = dict(recurrent=recurrent, g=g, beta=beta, k=k, v=v, q=q)
        misfit = operands_misfit(operands, contiguous=False)
        if misfit is not None:
            return cls(tokens=0, heads=0, dk=0, dv=0, fits=misfit)
        if recurrent.dim() != 4:
            return cls(tokens=0, heads=0, dk=0, dv=0, fits=f"recurrent is {tuple(recurrent.shape)}, not [T, h, dk, dv]")
        T, H, dk, dv = recurrent.shape
        fits = None
        want = {"g": (T, H, dk), "beta": (T, H), "k": (T, H, dk), "v": (T, H, dv), "q": (T, H, dk)}
        for name, shape in want.items():
            if tuple(operands[name].shape) != shape:
                fits = f"{name} is {tuple(operands[name].shape)}, expected {shape}"
                break
        else:
            if any(t.dtype != torch.float32 for t in operands.values()):
                fits = "operands must all be fp32"
            elif recurrent.stride(3) != 1 or recurrent.stride(2) != dv:
                fits = f"recurrent's last two dims are not contiguous (strides {recurrent.stride()})"
            elif any(t.stride(-1) != 1 for t in (g, k, v, q)):
                fits = "g, k, v and q need a unit inner stride"
        return cls(tokens=int(T), heads=int(H), dk=int(dk), dv=int(dv), dtype=recurrent.dtype, fits=fits)


def accepts(spec: KDADeltaSpec) -> str | None:
    from ..lib.triton import kda_delta as kernel

    if spec.fits is not None:
        return spec.fits
    if spec.dtype != torch.float32:
        return f"dtype {spec.dtype} (fp32 only)"
    if not 1 <= spec.tokens <= kernel.MAX_TOKENS:
        return f"T={spec.tokens} (needs 1 <= T <= {kernel.MAX_TOKENS})"
    if spec.dk not in kernel.KEY_DIMS:
        return f"dk={spec.dk} (needs dk in {kernel.KEY_DIMS})"
    if not (16 <= spec.dv <= kernel.MAX_DV and spec.dv % 16 == 0):
        return f"dv={spec.dv} (needs a multiple of 16 up to {kernel.MAX_DV})"
    return None


def run(recurrent, g, beta, k, v, q, **_):
    from ..lib.triton import kda_delta as kernel

    return kernel.run(recurrent, g, beta, k, v, q)


def warmup(shapes) -> None:
    """Triton compiles on first launch: launch once per {"M", "heads", "dk", "dv"} on zeros.

    Compiled code depends on dk, the column block, the warps and whether dv divides evenly (and on
    Triton's 16-divisibility of the strides), so warm every token count the graphs will see."""
    from ..lib.triton import kda_delta as kernel

    for s in shapes:
        T, H, dk, dv = s["M"], s["heads"], s["dk"], s["dv"]
        z = functools.partial(torch.zeros, dtype=torch.float32, device=s.get("device", "cuda"))
        args = (z(T, H, dk, dv), z(T, H, dk), z(T, H), z(T, H, dk), z(T, H, dv), z(T, H, dk))
        if accepts(KDADeltaSpec.from_call(*args)) is None:
            kernel.run(*args)


def _fake(recurrent, g, beta, k, v, q, strict=False):
    torch._check(recurrent.dim() == 4, lambda: f"k3fuse.kda_delta_rule: recurrent must be [T, h, dk, dv], "
                                               f"got {tuple(recurrent.shape)}")
    T, h, dk, dv = recurrent.shape
    for what, t, shape in (("g", g, (T, h, dk)), ("beta", beta, (T, h)), ("k", k, (T, h, dk)),
                           ("v", v, (T, h, dv)), ("q", q, (T, h, dk))):
        torch._check(tuple(t.shape) == shape,
                     lambda what=what, t=t, shape=shape: f"k3fuse.kda_delta_rule: {what} is {tuple(t.shape)}, "
                                                         f"expected {shape}")
    return (recurrent.new_empty(recurrent.shape, dtype=torch.float32),
            recurrent.new_empty((T, h, dv), dtype=torch.float32))


DECL = OpDecl(OP, "(Tensor recurrent, Tensor g, Tensor beta, Tensor k, Tensor v, Tensor q, "
                  "bool strict=False) -> (Tensor, Tensor)",
              _fake, stock.kda_delta_rule, kda_delta.kda_delta_rule, spec=KDADeltaSpec)
DECLS = (DECL,)
declare(DECL)
register_impl(OP, Impl("triton.kda_delta", accepts, run, priority=50, warmup=warmup, needs=("triton.kda_delta",)))
