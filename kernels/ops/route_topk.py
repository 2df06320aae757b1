"""route_topk: the model's `route` in one op.

scores = sigmoid(logits); idx = top-k of scores + b_corr (ties to the lowest expert index);
weights = scores[idx] / (sum + eps) * routed_scaling, the sum taken in selection order. logits fp32
[T, E], b_corr fp32 [E] -> (weights fp32 [T, k], idx int64 [T, k]). Not a collective: every rank
computes it from the same (all-gathered) logits, same bits. CUDA: one Triton program per token
(lib/triton/route_topk.py).

Non-finite scores, decided. Where `validate --skew inf` (or nan) found k3fuse's routing agreeing 0.000
with float64 and stock 1.000, nothing was computed wrongly: an infinite or NaN bias makes hundreds of
experts' biased scores exactly equal (+inf for half of them, NaN for all), and among equal scores
every rule of choice is as good as another. The op takes the lowest expert index, the same on every
rank and device (reference, Triton kernel); stock's torch.topk takes an order of its own (on CPU its
partial sort's, which float64 repeats: hence stock's 1.000). What each does:
* NaN biased score (a NaN logit or bias): ranks above every number, as torch.topk and torch.sort
  rank it; its weight is NaN, so are the token's other weights (their sum is), in both;
* +inf / -inf biased score: ranks as that infinity; the weights are the unbiased sigmoids, finite;
* equal biased scores (equal numbers, equal infinities, NaNs): the op picks the lowest index; stock
  picks an equally ranked expert of torch's choosing.
So the two agree on the ranking always (the multiset of selected biased scores, NaN counted as
NaN) and on the experts wherever no two scores tie across the k-th place: a flip between equal scores
is a tie, never an error (`k3fuse validate` counts it as one). Non-finite scores are a broken model or
checkpoint, not a routing regime: `validate --skew` takes finite values only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..declare import OpDecl, declare
from ..dispatch import Impl, register_impl
from ..lib.reference import routing, stock
from ..spec import Spec, call_only, operands_misfit

OP = "route_topk"


@dataclass(frozen=True, kw_only=True)
class RouteTopkSpec(Spec):
    """logits [tokens, E], b_corr [E]."""

    op: ClassVar[str] = OP
    E: int
    top_k: int
    dtype: torch.dtype = torch.float32
    fits: str | None = call_only(None)  # why logits / b_corr are not CUDA [T, E] / fp32 [E] with unit strides

    @classmethod
    def from_call(cls, logits, b_corr, top_k, routed_scaling, eps=1e-20, **_: Any) -> RouteTopkSpec:
        fits = operands_misfit(dict(logits=logits, b_corr=b_corr), contiguous=False) or _layout_misfit(logits, b_corr)
        if fits is not None:
            return cls(tokens=0, E=0, top_k=int(top_k), fits=fits)
        return cls(tokens=int(logits.shape[0]), E=int(logits.shape[1]), top_k=int(top_k), dtype=logits.dtype)


def _layout_misfit(logits, b_corr) -> str | None:
    """Why tensor operands are not [T, E] logits and an fp32 [E] bias with unit inner strides."""
    if logits.dim() != 2 or b_corr.dim() != 1 or b_corr.shape[0] != logits.shape[1]:
        return f"logits {tuple(logits.shape)} / b_corr {tuple(b_corr.shape)} are not [T, E] / [E]"
    if b_corr.dtype != torch.float32:
        return f"b_corr dtype {b_corr.dtype} (fp32 only)"
    if logits.stride(1) != 1 or b_corr.stride(0) != 1:
        return "logits and b_corr need a unit inner stride"
    return None


def accepts(spec: RouteTopkSpec) -> str | None:
    from ..lib.triton import route_topk as kernel

    if (missing := kernel.missing_features()) is not None:
        return missing
    if spec.fits is not None:
        return spec.fits
    if spec.dtype != torch.float32:
        return f"dtype {spec.dtype} (fp32 logits only)"
    if not 1 <= spec.tokens <= kernel.MAX_TOKENS:
        return f"T={spec.tokens} (needs 1 <= T <= {kernel.MAX_TOKENS})"
    if not 1 <= spec.E <= kernel.MAX_EXPERTS:
        return f"E={spec.E} (needs 1 <= E <= {kernel.MAX_EXPERTS})"
    if not 1 <= spec.top_k <= min(kernel.MAX_TOP_K, spec.E):
        return f"top_k={spec.top_k} (needs 1 <= top_k <= {kernel.MAX_TOP_K} and <= E)"
    return None


def run(logits, b_corr, top_k, routed_scaling, eps=1e-20, **_):
    from ..lib.triton import route_topk as kernel

    return kernel.run(logits, b_corr, top_k, routed_scaling, eps)


def warmup(shapes) -> None:
    """Triton compiles on first launch: launch once per {"M", "E", "top_k"} on zeros (the compiled
    code depends on E's block, top_k and the row stride's 16-divisibility)."""
    from ..lib.triton import route_topk as kernel

    for s in shapes:
        dev = s.get("device", "cuda")
        logits = torch.zeros((s["M"], s["E"]), dtype=torch.float32, device=dev)
        b_corr = torch.zeros((s["E"],), dtype=torch.float32, device=dev)
        if accepts(RouteTopkSpec.from_call(logits, b_corr, s["top_k"], 1.0)) is None:
            kernel.run(logits, b_corr, s["top_k"], 1.0)


def _fake(logits, b_corr, top_k, routed_scaling, eps=1e-20, strict=False):
    torch._check(logits.dim() == 2, lambda: f"k3fuse.route_topk: logits must be [T, E], got {tuple(logits.shape)}")
    torch._check(logits.dtype == torch.float32,
                 lambda: f"k3fuse.route_topk: logits must be float32 (the fp32 router), got {logits.dtype}")
    E = logits.shape[1]
    torch._check(b_corr.dim() == 1 and b_corr.shape[0] == E,
                 lambda: f"k3fuse.route_topk: b_corr is {tuple(b_corr.shape)}, expected [E] = ({E},)")
    torch._check(b_corr.dtype == torch.float32,
                 lambda: f"k3fuse.route_topk: b_corr must be float32, got {b_corr.dtype}")
    torch._check(1 <= top_k, lambda: f"k3fuse.route_topk: top_k={top_k} must be at least 1")
    torch._check(top_k <= E, lambda: f"k3fuse.route_topk: top_k={top_k} exceeds the {E} experts")
    T = logits.shape[0]
    return (logits.new_empty((T, top_k), dtype=torch.float32),
            logits.new_empty((T, top_k), dtype=torch.int64))


DECL = OpDecl(OP, "(Tensor logits, Tensor b_corr, int top_k, float routed_scaling, float eps=1e-20, "
                  "bool strict=False) -> (Tensor, Tensor)",
              _fake, stock.route_topk, routing.route_topk, spec=RouteTopkSpec)
DECLS = (DECL,)
declare(DECL)
register_impl(OP, Impl("triton.route_topk", accepts, run, priority=50, warmup=warmup, needs=("triton.route_topk",)))
