"""What a shared-expert MLP branch is, structurally, and where it joins the routed output.

Read by shared_expert_stream (which moves the branch to the side stream) and by moe_front_sharded
(which must tell the shared expert's projections from the latent projection of the same input).

A branch is a value computed only from one activation x (the MoE input) and static weights:
    [y =] down( act(p_0, ..., p_{n-1}) ),   p_i = x @ W_i.T (+ b_i),   down optional (+ bias),
where `act` is any DAG of pointwise ops (casts included) over the projections. It joins the routed
output by an add: `y_routed + y`, `y_routed + all_reduce(y)` (also the in-place spelling all_reduce
-> wait -> copy), or the fused MoE reduction k3fuse.gemm_ar_residual[_rmsnorm](act, W_down, residual,
addend=y_routed) (then the branch has no down projection).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch._ops import OpOverload

from k3fuse.rule_api import (ALL_REDUCE, CAST_OPS, TRANSPOSE_LAST2, VIEW_LIKE, WAIT_TENSOR, cast_dtype,
                             is_metadata_check, is_static, node_order, node_value, op_key, op_qualname,
                             skip_transparent)

aten = torch.ops.aten
#: the fused MoE reduction oproj_allreduce_residual inserts: its argument 0 is the branch's activation
#: (the op took the down projection), argument 3 the routed output
FUSED_REDUCTION = frozenset({"k3fuse::gemm_ar_residual", "k3fuse::gemm_ar_residual_rmsnorm"})


class NotBranch(Exception):
    """Not shaped like a shared-expert MLP at all: nothing to log."""


@dataclass
class Projection:
    """One linear with a static weight: `out` = mm(view(x), t(W)) (+ b)."""

    out: fx.Node
    mm: fx.Node
    x: fx.Node  # the value read, views stripped
    weight: fx.Node
    bias: fx.Node | None
    nodes: list[fx.Node]  # mm and bias add
    layout: list[fx.Node]  # views of the input and the weight transpose (may be shared)


@dataclass
class MLPBranch:
    out: fx.Node
    projs: list[Projection]
    act_out: fx.Node
    act_nodes: list[fx.Node]
    down: Projection | None
    tail: list[fx.Node]  # views between the down projection (or the activation) and `out`
    static_operands: list[fx.Node] = field(default_factory=list)

    @property
    def x(self) -> fx.Node:
        return self.projs[0].x

    def linears(self) -> list[Projection]:
        return [*self.projs, *([self.down] if self.down else [])]

    def region(self) -> list[fx.Node]:
        """The nodes that compute: projections, activation, down projection, tail views."""
        return [*self.tail, *self.act_nodes, *(n for p in self.linears() for n in p.nodes)]

    def layout(self) -> list[fx.Node]:
        """Views of the input and the weights' transposes the projections read (may be shared)."""
        return [n for p in self.linears() for n in p.layout]


def real_users(node: fx.Node) -> list[fx.Node]:
    return [u for u in node.users if not is_metadata_check(u)]


def _static_transposed(wt: Any) -> tuple[fx.Node, list[fx.Node]] | None:
    """W if `wt` is W.T (views allowed) of a static [N, K] weight, with the layout nodes passed."""
    if not isinstance(wt, fx.Node) or wt.op != "call_function":
        return None
    src, views = skip_transparent(wt)
    if not isinstance(src, fx.Node) or src.op != "call_function" or op_key(src) != TRANSPOSE_LAST2:
        return None
    w, wviews = skip_transparent(src.args[0])
    if not is_static(w) or not isinstance(node_value(w), torch.Tensor) or node_value(w).dim() != 2:
        return None
    return w, [*views, src, *wviews]


def linear_of(node: Any) -> Projection | None:
    """The static-weight linear computing `node` (mm, or mm + static bias), else None."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    bias, nodes, mm = None, [], node
    if node.target is aten.add.Tensor and len(node.args) == 2 and node.kwargs.get("alpha", 1) == 1:
        for a, b in (node.args, node.args[::-1]):
            if isinstance(a, fx.Node) and a.target is aten.mm.default and isinstance(b, fx.Node) and is_static(b):
                bv, av = node_value(b), node_value(a)
                if (isinstance(bv, torch.Tensor) and isinstance(av, torch.Tensor) and bv.dim() == 1
                        and bv.dtype == av.dtype):
                    mm, bias, nodes = a, b, [node]
                    break
        else:
            return None
    if mm.target is not aten.mm.default or len(mm.args) != 2:
        return None
    found = _static_transposed(mm.args[1])
    if found is None:
        return None
    weight, wlayout = found
    x, xviews = skip_transparent(mm.args[0])
    if not isinstance(x, fx.Node):
        return None
    return Projection(node, mm, x, weight, bias, [*nodes, mm], [*xviews, *wlayout])


def _keeps_features(node: fx.Node) -> bool:
    out, src = node_value(node), node_value(node.args[0]) if node.args else None
    return (isinstance(out, torch.Tensor) and isinstance(src, torch.Tensor) and out.dim() >= 1
            and src.dim() >= 1 and str(out.shape[-1]) == str(src.shape[-1]))


def _is_pointwise(node: fx.Node) -> bool:
    t = node.target
    if t in CAST_OPS:
        return cast_dtype(node) is not None  # a pure dtype cast, no device or layout change
    return isinstance(t, OpOverload) and torch.Tag.pointwise in t.tags


def _activation(act_out: fx.Node) -> tuple[list[Projection], list[fx.Node], list[fx.Node]]:
    """The projections and pointwise nodes computing `act_out`; raises NotBranch otherwise."""
    projs: dict[fx.Node, Projection] = {}
    act: list[fx.Node] = []
    static: list[fx.Node] = []
    seen: set[fx.Node] = set()
    stack = [act_out]
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        p = linear_of(v)
        if p is not None:
            projs[v] = p
            continue
        if is_static(v):
            static.append(v)
            continue
        if v.op != "call_function":
            raise NotBranch
        if v.target in VIEW_LIKE:
            if not _keeps_features(v):
                raise NotBranch
        elif not _is_pointwise(v):
            raise NotBranch
        act.append(v)
        stack.extend(v.all_input_nodes)
    if not projs or not act:
        raise NotBranch  # a plain linear, or pointwise ops on something else
    return list(projs.values()), act, static


def branch_ending_at(out: fx.Node) -> MLPBranch:
    """The shared-expert structure ending at `out`; raises NotBranch when it is none."""
    if not isinstance(out, fx.Node) or out.op != "call_function":
        raise NotBranch
    core, tail = skip_transparent(out)
    down = linear_of(core)
    act_out = down.x if down is not None else core
    if not isinstance(act_out, fx.Node) or act_out.op != "call_function":
        raise NotBranch
    projs, act, static = _activation(act_out)
    order = node_order(out.graph)
    if len({p.x for p in projs}) != 1:
        raise NotBranch  # projections of different values (e.g. the routed and shared outputs summed)
    projs.sort(key=lambda p: order[p.mm])
    act.sort(key=order.__getitem__)
    return MLPBranch(out, projs, act_out, act, down, list(tail), static)


def branch_at(out: fx.Node, consumer: fx.Node) -> MLPBranch:
    """`branch_ending_at`, where a branch without a down projection only counts when the fused MoE
    reduction (which took the down projection) consumes it: elsewhere it is a router or a gate."""
    b = branch_ending_at(out)
    if b.down is None and op_qualname(consumer) not in FUSED_REDUCTION:
        raise NotBranch
    return b


@dataclass(frozen=True)
class JoinCandidate:
    """An add-like join of a possible branch output with another value (the routed output)."""

    branch_out: fx.Node
    consumer: fx.Node  # what reads the branch output first: the all_reduce, the add, the fused reduction
    routed: Any  # the other addend
    chain: tuple[fx.Node, ...]  # all_reduce, wait [, copy, views] from the branch output to the add
    join: fx.Node  # the add (or the fused reduction)


def _through_reduction(side: fx.Node) -> tuple[fx.Node, fx.Node, list[fx.Node]]:
    """(branch output, consumer, chain) for the addend `side`: through wait(all_reduce(t)) or the
    in-place copy(t, wait(all_reduce(t))) to t; otherwise `side` itself and no chain."""
    v, views = skip_transparent(side)
    chain = list(views)
    if isinstance(v, fx.Node) and v.target is aten.copy.default and len(v.args) >= 2:
        chain.append(v)
        v = v.args[1]
    if isinstance(v, fx.Node) and v.target is WAIT_TENSOR:
        ar = v.args[0]
        if isinstance(ar, fx.Node) and ar.target is ALL_REDUCE and isinstance(ar.args[0], fx.Node):
            return ar.args[0], ar, [ar, v, *chain]
    return side, side, []


def join_candidates(graph: fx.Graph) -> list[JoinCandidate]:
    """Every add-like join in `graph`, each operand taken once as the possible branch output."""
    out = []
    for node in graph.nodes:
        if op_qualname(node) in FUSED_REDUCTION and len(node.args) > 3 and node.args[3] is not None:
            out.append(JoinCandidate(node.args[0], node, node.args[3], (), node))
        elif (node.target is aten.add.Tensor and len(node.args) == 2 and node.kwargs.get("alpha", 1) == 1
              and all(isinstance(a, fx.Node) and not is_static(a) for a in node.args)):
            for side, other in (node.args, node.args[::-1]):
                branch_out, consumer, chain = _through_reduction(side)
                out.append(JoinCandidate(branch_out, node if consumer is side else consumer, other, tuple(chain),
                                         node))
    return out


def shared_mlp_linears(graph: fx.Graph) -> set[fx.Node]:
    """The mm nodes of the input projections (gate/up) of every shared-expert branch in `graph`, for
    rules that must tell the shared expert's projections from other linears of the same input."""
    found: set[fx.Node] = set()
    for c in join_candidates(graph):
        try:
            b = branch_at(c.branch_out, c.consumer)
        except NotBranch:
            continue
        found |= {p.mm for p in b.projs}
    return found


__all__ = ["FUSED_REDUCTION", "NotBranch", "Projection", "MLPBranch", "JoinCandidate", "real_users", "linear_of",
           "branch_ending_at", "branch_at", "join_candidates", "shared_mlp_linears"]
