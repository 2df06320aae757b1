"""The weight-only reordering verifier, run by the pipeline after every rule.

Rewrites may load static weights early (fusing, prefetching) but must never make a read of a
non-static tensor (activation, peer-written buffer, decode state) happen earlier relative to a
synchronisation point than it did before. Terms, precisely:

* *static value*: a placeholder the door marked static (``graph_facts.mark_static``) (parameters,
  buffers and constants the graph never mutates) or a ``get_attr`` constant. Every other value
  is non-static.
* *sync node*: an op after which data written elsewhere becomes valid: ``wait_tensor`` and every
  op declared with ``OpTraits(sync=True)`` (k3fuse's join and fused collectives; `k3fuse.graph_facts`).
* *collective handle*: the output of a ``_c10d_functional`` collective before its ``wait_tensor``.
* *reader* of a value: a node that takes it as a direct input; "before" means earlier in graph
  order (the order the code runs in).

A rule's result is rejected with `ReorderingError` (naming the node) when either holds:

1. *Handle discipline*: a collective handle is read by anything but its ``wait_tensor`` or an
   *collective-window op* (``OpTraits(collective_window=True)``: ops that take the handle only to be ordered inside the
   collective's window, like ``k3fuse.l2_prefetch`` between ``all_reduce`` and ``wait_tensor``), or such an op
   reads a non-static value besides handles. Inside a collective's window only static weights
   may be read.
2. *No hoisting across a sync*: for a non-static value V and a sync node S present both before
   and after the rule: if before the rule no reader of V came before S, then after the rule no
   reader of V may come before S. (Moving reads later is always allowed; a reader that is itself
   new counts like any other.)
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch.fx as fx

from .graph_facts import is_handle, is_static_value, is_sync, is_wait, node_order, op_traits


class ReorderingError(RuntimeError):
    """A rule moved a read of a non-static tensor across a synchronisation point."""

    def __init__(self, message: str, node: fx.Node, rule: str | None = None):
        super().__init__(message)
        self.node = node
        self.rule = rule


@dataclass
class GraphSnapshot:
    """Order and readers of a graph before a rule, for comparison afterwards."""

    order: dict[fx.Node, int]
    readers: dict[fx.Node, frozenset[fx.Node]]
    syncs: list[fx.Node]


def snapshot(graph: fx.Graph) -> GraphSnapshot:
    order = node_order(graph)
    readers = {n: frozenset(n.users) for n in graph.nodes}
    return GraphSnapshot(order, readers, [n for n in graph.nodes if is_sync(n)])


def check_handles(graph: fx.Graph, rule: str | None = None) -> None:
    """Condition 1: readers of a collective handle read only statics and handles otherwise."""
    for node in graph.nodes:
        if not is_handle(node):
            continue
        for user in node.users:
            if is_wait(user) or is_handle(user):
                continue
            if not op_traits(user).collective_window:
                raise ReorderingError(
                    f"{_by(rule)}{user.name} reads collective handle {node.name} before its wait_tensor", user, rule)
            bad = [i for i in user.all_input_nodes if not (is_handle(i) or is_static_value(i))]
            if bad:
                raise ReorderingError(
                    f"{_by(rule)}{user.name} reads collective handle {node.name} before its wait_tensor and also "
                    f"non-static {', '.join(b.name for b in bad)}; inside a collective's window only static weights "
                    f"may be read",
                    user, rule,
                )


def check_reordering(before: GraphSnapshot, graph: fx.Graph, rule: str | None = None) -> None:
    """Raise ReorderingError if the rule that turned `before` into `graph` broke either condition."""
    check_handles(graph, rule)
    after = node_order(graph)
    syncs = [s for s in before.syncs if s in after]
    if not syncs:
        return
    kept_order = [n for n in graph.nodes if n in before.order]
    order_kept = all(before.order[a] < before.order[b] for a, b in zip(kept_order, kept_order[1:]))
    candidates: Iterable[fx.Node]
    if order_kept:  # surviving nodes kept their order: only new readers can have been hoisted
        candidates = [v for v in graph.nodes if v in before.readers and set(v.users) - before.readers[v]]
    else:
        candidates = [v for v in graph.nodes if v in before.readers]
    for value in candidates:
        readers = [u for u in value.users if _reads(u, value)]
        if is_static_value(value) or not readers:
            continue
        first_before = min((before.order[r] for r in before.readers[value] if r in before.order), default=None)
        reader = min(readers, key=after.__getitem__)
        for s in syncs:
            all_after_s = first_before is None or first_before > before.order[s]
            if all_after_s and before.order[value] < before.order[s] and after[reader] < after[s]:
                raise ReorderingError(
                    f"{_by(rule)}{reader.name} reads non-static {value.name} before sync {s.name}; before the rule "
                    f"every read of {value.name} came after {s.name}",
                    reader, rule,
                )


def _reads(user: fx.Node, value: fx.Node) -> bool:
    """False when `user` takes `value` only in ordering-only argument positions (OpTraits)."""
    positions = op_traits(user).ordering_args
    if not positions:
        return True
    return any(a is value for i, a in enumerate(user.args) if i not in positions) or value in user.kwargs.values()


def _by(rule: str | None) -> str:
    return f"rule {rule}: " if rule else ""


__all__ = ["ReorderingError", "snapshot", "check_reordering", "check_handles", "GraphSnapshot"]
