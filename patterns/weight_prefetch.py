"""Prefetch the next consumers' static weights into L2 while a native collective is in flight.

Why: between an all_reduce and its wait_tensor the SMs and HBM are idle for several microseconds
(6-10 us per small all-reduce at decode); the ops right after the wait (e.g. the latent RMSNorm
and W_up after the routed experts' all-reduce) are weight-bound. Loading their weights into L2
during the exchange hides part of that read.

Rewrite: for every all_reduce whose wait_tensor is still in the graph after the fusing rules,
    h = all_reduce(t); k3fuse.l2_prefetch(h, [W...], budget_bytes); y = wait_tensor(h)
where [W...] are the static weights read by the nodes that depend on y, in the order they are read,
up to and including the next synchronisation point (the next collective or fused collective op),
listed until they cover `budget_bytes` (the op prefetches in list order and stops at the budget, so a
weight larger than what is left is prefetched in part). Weight-only rule: only static placeholders are listed; the handle h is an
ordering anchor, never read (the engine's verifier checks both after the rule).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from k3fuse.rule_api import (ALL_REDUCE, CAST, TRANSPOSE_LAST2, WAIT_TENSOR, ContextError, DecodeContext,
                             GuardFailure, Match, PatternSpec, Rule, failures, is_collective, is_static, is_sync,
                             is_transparent, op_key, op_qualname, token_count)

#: half of an H100/H200 L2 (50 MB): room for the weights without evicting the activations
DEFAULT_BUDGET_BYTES = 24 << 20


@dataclass(frozen=True)
class PrefetchSettings:
    """How much a prefetch may pull into L2 per collective (bytes of static weights, in the order
    the graph reads them after the wait)."""

    budget_bytes: int = DEFAULT_BUDGET_BYTES

    def __post_init__(self) -> None:
        if not isinstance(self.budget_bytes, int) or isinstance(self.budget_bytes, bool) or self.budget_bytes < 1:
            raise ContextError(f"budget_bytes must be a positive int, got {self.budget_bytes!r}",
                               "pass e.g. PrefetchSettings(budget_bytes=24 << 20)")
_PREFETCH = "k3fuse::l2_prefetch"


def static_source(node: fx.Node) -> fx.Node | None:
    """The static placeholder `node` is a layout view or cast of (W, W.T, W.float()), else None."""
    while True:
        if is_static(node):
            return node
        if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
            return None
        if not (is_transparent(node) or op_key(node) in (TRANSPOSE_LAST2, CAST)):
            return None
        node = node.args[0]


def _nbytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    return int(val.numel() * val.element_size()) if isinstance(val, torch.Tensor) else 0


def next_static_weights(wait: fx.Node) -> list[fx.Node]:
    """Static weights read by the dependents of `wait`, in graph order, up to the next sync point."""
    reached = {wait}
    weights: list[fx.Node] = []
    node = wait.next
    while node.op != "output":
        if any(i in reached for i in node.all_input_nodes):
            reached.add(node)
            for i in node.all_input_nodes:
                w = static_source(i)
                if w is not None and w not in weights:
                    weights.append(w)
            if is_sync(node) or is_collective(node):
                break
        node = node.next
    return weights


class WeightPrefetch(Rule):
    """Between a collective and its wait: l2_prefetch of the next consumers' static weights."""

    name = "weight_prefetch"
    emits = ("l2_prefetch",)
    # off: the bulk prefetch competes for HBM with the collective's neighbours instead of hiding
    # the next weight read (the layer benchmark, docs/perf.md)
    default_on = False
    default_off_reason = "measured slower on 2 x H200: 1.15x with it, 1.20x without at 1 token"
    description = ("all_reduce ... wait_tensor still in the graph -> k3fuse.l2_prefetch(handle, [next "
                   "consumers' static weights], budget) between them (weights only, never activations)")

    settings_type = PrefetchSettings

    def __init__(self, settings: PrefetchSettings | None = None, *, budget_bytes: int | None = None) -> None:
        if settings is not None and budget_bytes is not None:
            raise TypeError("pass settings or budget_bytes, not both")
        self.settings = settings or PrefetchSettings(**({} if budget_bytes is None else {"budget_bytes": budget_bytes}))

    @property
    def budget_bytes(self) -> int:
        return self.settings.budget_bytes

    def patterns(self) -> list[PatternSpec]:
        return []  # structural: every native all_reduce / wait_tensor pair (see `find`)

    def find(self, graph: fx.Graph, ctx: DecodeContext) -> list[Match]:
        budget = self.settings_in(ctx).budget_bytes
        found = []
        for ar in graph.nodes:
            if ar.target is not ALL_REDUCE:
                continue
            if any(op_qualname(u) == _PREFETCH for u in ar.users):
                continue  # already prefetching (a second pipeline run)
            waits = [u for u in ar.users if u.target is WAIT_TENSOR]
            if len(waits) != 1:
                continue
            chosen, total = [], 0
            for w in next_static_weights(waits[0]):
                if total >= budget:
                    break
                chosen.append(w)
                total += _nbytes(w)
            m = Match(variant="all_reduce", graph=graph, inputs={"collective": ar}, scalars={},
                      outputs=[waits[0]], nodes=[], payload=chosen)
            if not chosen:
                m.refused = GuardFailure("site", "no_static_weights", "the collective's consumers read no static "
                                         "weight before the next sync point", {"collective": ar.name})
            found.append(m)
        return found

    def check_site(self, match: Match, ctx: DecodeContext) -> list[GuardFailure]:
        handle = match["collective"]
        return failures(token_count(handle.args[0], ctx, what="tokens"))

    def rewrite(self, match: Match, ctx: DecodeContext) -> list[fx.Node]:
        weights = match.payload
        budget = self.settings_in(ctx).budget_bytes
        prefetch = match.insert(torch.ops.k3fuse.l2_prefetch.default, (match["collective"], weights, budget))
        match.note(weights=[w.name for w in weights], bytes=sum(_nbytes(w) for w in weights),
                   budget_bytes=budget)
        return [prefetch]


__all__ = ["WeightPrefetch", "PrefetchSettings", "DEFAULT_BUDGET_BYTES", "next_static_weights", "static_source"]
