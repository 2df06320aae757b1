"""kda_short_conv: KDA's short causal depthwise conv over [q; k; v] (k3fuse/spelling.py `short_conv`).

  window = [conv_state | cat(q, k, v)]          [T, C, K], newest tap last
  conv   = silu(sum_j window[..., j] * w[:, j])  fp32 [T, C], the taps in fp32
  state  = window[..., 1:]                       [T, C, K-1] in the state's dtype
conv_state [T, C, K-1], q/k/v [T, C/3] (one trunk dtype), weight fp32 [C, K] -> (conv, new_state).
CUDA: one kernel reads the state, q, k, v and the weights once and writes both outputs once
(lib/triton/kda_conv.py).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..declare import OpDecl, declare
from ..dispatch import Impl, register_impl
from ..lib.reference import kda_conv, stock
from ..spec import Spec, call_only, operands_misfit

OP = "kda_short_conv"


@dataclass(frozen=True, kw_only=True)
class KDAConvSpec(Spec):
    """conv_state [tokens, channels, taps - 1] in `dtype`, q/k/v [tokens, channels / 3], fp32 weights."""

    op: ClassVar[str] = OP
    channels: int
    taps: int
    dtype: torch.dtype = torch.bfloat16
    fits: str | None = call_only(None)  # why the operands are not CUDA tensors of the conv's shapes and strides

    @classmethod
    def from_call(cls, conv_state, q, k, v, weight, **_: Any) -> KDAConvSpec:
        operands = dict(conv_state=conv_state, q=q, k=k, v=v, weight=weight)
        misfit = operands_misfit(operands, contiguous=False) or operands_mismatch(conv_state, q, k, v, weight)
        if misfit is not None:
            return cls(tokens=0, channels=0, taps=0, fits=misfit)
        T, C, km1 = conv_state.shape
        fits = None
        if conv_state.stride(2) != 1 or conv_state.stride(1) != km1:
            fits = f"conv_state's last two dims are not contiguous (strides {conv_state.stride()})"
        elif any(t.stride(1) != 1 for t in (q, k, v)):
            fits = "q, k and v need a unit inner stride"
        elif not weight.is_contiguous():
            fits = f"weight is not contiguous (strides {weight.stride()})"
        return cls(tokens=int(T), channels=int(C), taps=int(km1) + 1, dtype=conv_state.dtype, fits=fits)


def operands_mismatch(conv_state, q, k, v, weight) -> str | None:
    """Why tensor operands are not conv_state [T, C, K-1], q/k/v [T, C/3] in its dtype and an fp32
    weight [C, K]; None when they are (shapes and dtypes only: the fake impl says the same)."""
    if conv_state.dim() != 3:
        return f"conv_state is {tuple(conv_state.shape)}, not [T, C, K-1]"
    T, C, km1 = conv_state.shape
    want = (T, C // 3)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if C % 3 != 0 or tuple(t.shape) != want:
            return f"{name} is {tuple(t.shape)}, expected [T, C/3] = {want} for conv_state {tuple(conv_state.shape)}"
        if t.dtype != conv_state.dtype:
            return f"{name} dtype {t.dtype} differs from conv_state's {conv_state.dtype}"
    if tuple(weight.shape) != (C, km1 + 1):
        return f"weight is {tuple(weight.shape)}, expected [C, K] = {(C, km1 + 1)}"
    if weight.dtype != torch.float32:
        return f"weight dtype {weight.dtype} (fp32 only)"
    return None


def accepts(spec: KDAConvSpec) -> str | None:
    from ..lib.triton import kda_conv as kernel

    if spec.fits is not None:
        return spec.fits
    if spec.dtype not in kernel.DTYPES:
        return f"dtype {spec.dtype} (needs one of {', '.join(str(d) for d in kernel.DTYPES)})"
    if spec.tokens < 1:
        return f"T={spec.tokens} (needs T >= 1)"
    if not 2 <= spec.taps <= kernel.MAX_TAPS:
        return f"K={spec.taps} (needs 2 <= K <= {kernel.MAX_TAPS})"
    if spec.channels < 3 or spec.channels % 3 != 0:
        return f"C={spec.channels} (needs a positive multiple of 3: [q; k; v])"
    return None


def run(conv_state, q, k, v, weight, **_):
    from ..lib.triton import kda_conv as kernel

    return kernel.run(conv_state, q, k, v, weight)


def warmup(shapes) -> None:
    """Triton compiles on first launch: launch once per {"M", "channels", "taps", "dtype"} on zeros.

    Compiled code depends on K, the dtype and Triton's 16-divisibility of the width and the token
    strides (the state's stride is C * (K-1)), so warm every shape the graphs will see."""
    from ..lib.triton import kda_conv as kernel

    for s in shapes:
        T, C, K = s["M"], s["channels"], s["taps"]
        z = functools.partial(torch.zeros, dtype=s.get("dtype", torch.bfloat16), device=s.get("device", "cuda"))
        args = (z(T, C, K - 1), z(T, C // 3), z(T, C // 3), z(T, C // 3),
                torch.zeros((C, K), dtype=torch.float32, device=s.get("device", "cuda")))
        if accepts(KDAConvSpec.from_call(*args)) is None:
            kernel.run(*args)


def _fake(conv_state, q, k, v, weight, strict=False):
    torch._check(conv_state.dim() == 3 and q.dim() == k.dim() == v.dim() == 2 and weight.dim() == 2,
                 lambda: f"k3fuse.{OP}: conv_state must be [T, C, K-1], q/k/v [T, C/3] and weight [C, K], got "
                         f"{tuple(conv_state.shape)}, {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}, "
                         f"{tuple(weight.shape)}")
    T, C, km1 = conv_state.shape
    for what, t in (("q", q), ("k", k), ("v", v)):
        torch._check(3 * t.shape[1] == C and t.shape[0] == T,
                     lambda what=what, t=t: f"k3fuse.{OP}: {what} is {tuple(t.shape)}, expected [T, C/3] for "
                                            f"conv_state {tuple(conv_state.shape)}")
        torch._check(t.dtype == conv_state.dtype,
                     lambda what=what, t=t: f"k3fuse.{OP}: {what} dtype {t.dtype} differs from conv_state's "
                                            f"{conv_state.dtype}")
    torch._check(weight.shape[0] == C and weight.shape[1] == km1 + 1,
                 lambda: f"k3fuse.{OP}: weight is {tuple(weight.shape)}, expected [C, K] = ({C}, {km1 + 1})")
    torch._check(weight.dtype == torch.float32, lambda: f"k3fuse.{OP}: weight must be float32, got {weight.dtype}")
    return (conv_state.new_empty((T, C), dtype=torch.float32),
            conv_state.new_empty((T, C, km1)))


DECL = OpDecl(OP, "(Tensor conv_state, Tensor q, Tensor k, Tensor v, Tensor weight, bool strict=False) "
                  "-> (Tensor, Tensor)",
              _fake, stock.kda_short_conv, kda_conv.kda_short_conv, spec=KDAConvSpec)
DECLS = (DECL,)
declare(DECL)
register_impl(OP, Impl("triton.kda_conv", accepts, run, priority=50, warmup=warmup, needs=("triton.kda_conv",)))
