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

A rule's result is rejected with `ReorderingError` (naming the node) when any of these holds:

1. *Handle discipline*: a collective handle is read by anything but its ``wait_tensor`` or an
   *collective-window op* (``OpTraits(collective_window=True)``: ops that take the handle only to be ordered inside the
   collective's window, like ``k3fuse.l2_prefetch`` between ``all_reduce`` and ``wait_tensor``), or such an op
   reads a non-static value besides handles. Inside a collective's window only static weights
   may be read.
2. *No hoisting across a sync*: for a non-static value V and a sync node S present both before
   and after the rule: if before the rule no reader of V came before S, then after the rule no
   reader of V may come before S. (Moving reads later is always allowed; a reader that is itself
   new counts like any other.)
3. *Side-stream brackets* (`SideStreamError`): the nodes strictly between a fork and its end
   (ops declared `OpTraits(side_stream="fork" / "end" / "join")`, paired by the site number, their
   last argument) run on a side stream, so each site has one fork, one end after it and one join
   after that; a node in the window is a computation (no collective, wait, sync or other marker)
   that reads only the fork's output, other window nodes and static values; window values are read
   outside the window only by the end and the join; the fork's output only inside the window; and
   the end and the join take the same region output.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch.fx as fx

from .graph_facts import is_collective, is_handle, is_static_value, is_sync, is_wait, node_order, op_traits


class ReorderingError(RuntimeError):
    """A rule moved a read of a non-static tensor across a synchronisation point."""

    def __init__(self, message: str, node: fx.Node, rule: str | None = None):
        super().__init__(message)
        self.node = node
        self.rule = rule


class SideStreamError(ReorderingError):
    """A side-stream bracket that would run main-stream work on the side stream, or read a side-stream
    value before the main stream waits for it."""


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


def _markers(graph: fx.Graph) -> dict[str, dict[object, list[fx.Node]]]:
    """Side-stream markers by role, then by site."""
    found: dict[str, dict[object, list[fx.Node]]] = {"fork": {}, "end": {}, "join": {}}
    for node in graph.nodes:
        role = op_traits(node).side_stream
        if role is not None:
            found[role].setdefault(node.args[-1], []).append(node)
    return found


def check_side_streams(graph: fx.Graph, rule: str | None = None) -> None:
    """Condition 3: every side-stream bracket is well formed (raises SideStreamError)."""
    markers = _markers(graph)
    order = node_order(graph)
    sites = set(markers["fork"]) | set(markers["end"]) | set(markers["join"])
    for site in sorted(sites, key=repr):
        forks, ends, joins = (markers[role].get(site, []) for role in ("fork", "end", "join"))
        first = (forks + ends + joins)[0]
        if not (len(forks) == len(ends) == len(joins) == 1):
            raise SideStreamError(f"{_by(rule)}side-stream site {site} has {len(forks)} fork(s), {len(ends)} end(s) "
                                  f"and {len(joins)} join(s); each needs exactly one", first, rule)
        fork, end, join = forks[0], ends[0], joins[0]
        if not order[fork] < order[end] < order[join]:
            raise SideStreamError(f"{_by(rule)}side-stream site {site}: {fork.name}, {end.name} and {join.name} are not "
                                  "in fork, end, join order", first, rule)
        window = [n for n in graph.nodes if order[fork] < order[n] < order[end]]
        _check_window(site, fork, end, join, window, rule)


def _check_window(site: object, fork: fx.Node, end: fx.Node, join: fx.Node, window: list[fx.Node],
                  rule: str | None) -> None:
    inside = {fork, *window}
    where = f"side-stream site {site} ({fork.name} .. {end.name})"
    for n in window:
        if n.op != "call_function" or is_sync(n) or is_collective(n) or is_handle(n) or op_traits(n).side_stream:
            raise SideStreamError(f"{_by(rule)}{n.name} sits inside {where}: only computations on the region's "
                                  "values may run on the side stream", n, rule)
        foreign = [i.name for i in n.all_input_nodes if i not in inside and not is_static_value(i)]
        if foreign:
            raise SideStreamError(f"{_by(rule)}{n.name} inside {where} reads {', '.join(foreign)} of the main "
                                  f"stream; the region reads main-stream values only through {fork.name}", n, rule)
        early = [u.name for u in n.users if u not in inside and u is not end and u is not join]
        if early:
            raise SideStreamError(f"{_by(rule)}{', '.join(early)} reads {n.name}, computed on the side stream in "
                                  f"{where}, without waiting at {join.name}", n, rule)
    outside = [u.name for u in fork.users if u not in inside]
    if outside:
        raise SideStreamError(f"{_by(rule)}{', '.join(outside)} reads {fork.name}'s side-stream copy outside {where}",
                              fork, rule)
    if end.args[0] not in window or join.args[0] is not end.args[0]:
        raise SideStreamError(f"{_by(rule)}{where}: {end.name} and {join.name} must take the region's output "
                              f"(a node inside the window)", end, rule)


def check_reordering(before: GraphSnapshot, graph: fx.Graph, rule: str | None = None) -> None:
    """Raise ReorderingError if the rule that turned `before` into `graph` broke any condition."""
    check_handles(graph, rule)
    check_side_streams(graph, rule)
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


__all__ = ["ReorderingError", "SideStreamError", "snapshot", "check_reordering", "check_handles",
           "check_side_streams", "GraphSnapshot"]
