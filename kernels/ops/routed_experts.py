"""routed_experts: the model's routed experts (k3fuse/spelling.py `routed_experts`) in one op.

For each (token, slot) pair p: z[p] = w2[e_p] @ situ_glu(w1[e_p] @ a[p // k], w3[e_p] @ a[p // k]),
rounded to a's dtype after each projection, as the model's spelling. a [T, L], experts int64
[T*k], w1/w3 [E, I, L], w2 [E, L, I] -> z [T*k, L]. Stock: the model's spelling (grouped GEMMs on
CUDA); reference: the gathered bmm (any device); CUDA: lib/triton/routed_experts.py (each selected
expert's weights read once).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from k3fuse.spelling import routed_experts, routed_experts_gathered

from ..declare import OpDecl, declare
from ..dispatch import Impl, register_impl
from ..spec import Spec, call_only, operands_misfit

OP = "routed_experts"


@dataclass(frozen=True, kw_only=True)
class RoutedExpertsSpec(Spec):
    """a [tokens, L], w1/w3 [E, I, L], w2 [E, L, I], experts [tokens * top_k]."""

    op: ClassVar[str] = OP
    E: int
    I: int  # noqa: E741 (the model's name for the expert intermediate size)
    L: int
    top_k: int
    dtype: torch.dtype
    fits: str | None = call_only(None)  # why the operands are not CUDA, contiguous, agreeing tensors

    @classmethod
    def from_call(cls, a, experts, w1, w3, w2, top_k, situ_beta, situ_linear_beta, **_: Any) -> RoutedExpertsSpec:
        fits = (operands_misfit(dict(a=a, experts=experts, w1=w1, w3=w3, w2=w2))
                or _shapes_misfit(a, experts, w1, w3, w2, top_k))
        if fits is not None:
            return cls(tokens=0, E=0, I=0, L=0, top_k=int(top_k), dtype=torch.float32, fits=fits)
        E, I, L = w1.shape
        return cls(tokens=int(a.shape[0]), E=int(E), I=int(I), L=int(L), top_k=int(top_k), dtype=a.dtype)


def _shapes_misfit(a, experts, w1, w3, w2, top_k) -> str | None:
    """Why tensor operands do not have the op's shapes and one dtype."""
    if a.dim() != 2 or w1.dim() != 3 or w1.shape != w3.shape or w2.dim() != 3:
        return (f"a {tuple(a.shape)} / w1 {tuple(w1.shape)} / w3 {tuple(w3.shape)} / w2 {tuple(w2.shape)} "
                "are not [T, L] / [E, I, L] / [E, I, L] / [E, L, I]")
    if a.shape[1] != w1.shape[2] or tuple(w2.shape) != (w1.shape[0], w1.shape[2], w1.shape[1]):
        return f"a {tuple(a.shape)}, w1 {tuple(w1.shape)}, w2 {tuple(w2.shape)} do not agree on E, I, L"
    if experts.dtype != torch.int64 or experts.dim() != 1 or experts.shape[0] != a.shape[0] * top_k:
        return f"experts {experts.dtype} {tuple(experts.shape)} is not int64 [T*top_k]"
    if not a.dtype == w1.dtype == w3.dtype == w2.dtype:
        return f"dtypes differ: a {a.dtype}, w1 {w1.dtype}, w3 {w3.dtype}, w2 {w2.dtype}"
    return None


def accepts(spec: RoutedExpertsSpec) -> str | None:
    from ..lib.triton import routed_experts as kernel

    if (missing := kernel.missing_features()) is not None:
        return missing
    if spec.fits is not None:
        return spec.fits
    T = spec.tokens
    if spec.dtype not in kernel.DTYPES:
        return f"dtype {spec.dtype} (bf16/fp16 only)"
    if not 1 <= T <= kernel.MAX_TOKENS:
        return f"T={T} (needs 1 <= T <= {kernel.MAX_TOKENS})"
    if not 1 <= spec.E <= kernel.MAX_EXPERTS:
        return f"E={spec.E} (needs 1 <= E <= {kernel.MAX_EXPERTS})"
    if not 1 <= T * spec.top_k <= kernel.MAX_PAIRS:
        return f"T*top_k={T * spec.top_k} (needs <= {kernel.MAX_PAIRS})"
    if spec.I < 16 or spec.L < 16:
        return f"I={spec.I}, L={spec.L} (needs both >= 16 for tl.dot)"
    return None


def run(a, experts, w1, w3, w2, top_k, situ_beta, situ_linear_beta, **_):
    from ..lib.triton import routed_experts as kernel

    return kernel.run(a, experts, w1, w3, w2, top_k, situ_beta, situ_linear_beta)


def warmup(shapes) -> None:
    """Triton compiles on first launch: launch once per {"M", "E", "I", "L", "top_k", "dtype"} on
    small inputs (the compiled code depends on the block sizes, which follow the shapes)."""
    from ..lib.triton import routed_experts as kernel

    for s in shapes:
        dev, dtype = s.get("device", "cuda"), s.get("dtype", torch.bfloat16)
        T, E, I, L, k = s["M"], s["E"], s["I"], s["L"], s["top_k"]
        a = torch.zeros((T, L), dtype=dtype, device=dev)
        experts = torch.arange(T * k, device=dev, dtype=torch.int64) % E
        w1 = torch.empty((E, I, L), dtype=dtype, device=dev)  # values never matter: the output is dropped
        w2 = torch.empty((E, L, I), dtype=dtype, device=dev)
        if accepts(RoutedExpertsSpec.from_call(a, experts, w1, w1, w2, k, 1.0, 1.0)) is None:
            kernel.run(a, experts, w1, w1, w2, k, 1.0, 1.0)


def _fake(a, experts, w1, w3, w2, top_k, situ_beta, situ_linear_beta, strict=False):
    name = "k3fuse.routed_experts"
    torch._check(a.dim() == 2, lambda: f"{name}: a must be the latent [T, L], got {tuple(a.shape)}")
    torch._check(experts.dim() == 1 and experts.dtype == torch.int64,
                 lambda: f"{name}: experts must be int64 [T*top_k], got {experts.dtype} {tuple(experts.shape)}")
    torch._check(experts.shape[0] == a.shape[0] * top_k,
                 lambda: f"{name}: {experts.shape[0]} expert ids for {a.shape[0]} tokens x top_k={top_k}")
    torch._check(w1.dim() == 3 and w1.shape == w3.shape and w1.shape[2] == a.shape[1],
                 lambda: f"{name}: w1/w3 must be [E, I, L={a.shape[1]}], got {tuple(w1.shape)} / {tuple(w3.shape)}")
    torch._check(w2.dim() == 3 and w2.shape[0] == w1.shape[0] and w2.shape[1] == a.shape[1]
                 and w2.shape[2] == w1.shape[1],
                 lambda: f"{name}: w2 must be [E, L, I] = {(w1.shape[0], a.shape[1], w1.shape[1])}, "
                         f"got {tuple(w2.shape)}")
    torch._check(a.dtype == w1.dtype == w3.dtype == w2.dtype,
                 lambda: f"{name}: a and the expert weights must share a dtype: {a.dtype}, {w1.dtype}, "
                         f"{w3.dtype}, {w2.dtype}")
    return a.new_empty((experts.shape[0], a.shape[1]))


DECL = OpDecl(OP, "(Tensor a, Tensor experts, Tensor w1, Tensor w3, Tensor w2, int top_k, float situ_beta, "
                  "float situ_linear_beta, bool strict=False) -> Tensor",
              _fake, routed_experts, routed_experts_gathered, spec=RoutedExpertsSpec)
DECLS = (DECL,)
declare(DECL)
register_impl(OP, Impl("triton.routed_experts", accepts, run, priority=50, warmup=warmup,
                       needs=("triton.routed_experts",)))
