"""l2_prefetch: bulk L2 prefetch of the next static weights while a collective runs.

Side effect only (it returns nothing yet survives dead-code elimination): it never reads `anchor`,
whose collective may still be in flight; `anchor` only orders it after the collective's launch.
CUDA: lib/triton/l2_prefetch.py (cp.async.bulk.prefetch.L2, sm_90).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from k3fuse.graph_facts import OpTraits

from ..declare import OpDecl, declare
from ..dispatch import Impl, register_impl
from ..lib.reference import prefetch, stock
from ..spec import Spec, call_only

OP = "l2_prefetch"


@dataclass(frozen=True, kw_only=True)
class PrefetchSpec(Spec):
    """The weights to prefetch and the byte budget."""

    op: ClassVar[str] = OP
    weights: int
    budget_bytes: int
    one_cuda_device: bool = call_only(True)
    capability: tuple[int, int] | None = call_only(None)

    @classmethod
    def from_call(cls, anchor, weights, budget_bytes, **_: Any) -> PrefetchSpec:
        one = bool(weights) and all(w.is_cuda and w.device == weights[0].device for w in weights)
        return cls(weights=len(weights), budget_bytes=int(budget_bytes), one_cuda_device=one,
                   capability=torch.cuda.get_device_capability(weights[0].device) if one else None)


def accepts(spec: PrefetchSpec) -> str | None:
    from ..lib.triton import l2_prefetch as kernel

    if not spec.weights or spec.budget_bytes < kernel.ALIGN:
        return "nothing to prefetch"
    if not spec.one_cuda_device:
        return "weights not on one CUDA device"
    if spec.capability is not None and spec.capability < (9, 0):
        return "cp.async.bulk.prefetch needs sm_90"
    return None


def run(anchor, weights, budget_bytes, **_):
    from ..lib.triton import l2_prefetch as kernel

    kernel.run(anchor, weights, budget_bytes)


def _fake(anchor, weights, budget_bytes):
    return None


DECL = OpDecl(OP, "(Tensor anchor, Tensor[] weights, int budget_bytes) -> ()",
              _fake, stock.l2_prefetch, prefetch.l2_prefetch, traits=OpTraits(collective_window=True), side_effect=True,
              spec=PrefetchSpec)
DECLS = (DECL,)
declare(DECL)
register_impl(OP, Impl("triton.l2_prefetch", accepts, run, priority=50, needs=("triton.l2_prefetch",)))
