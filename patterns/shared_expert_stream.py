"""The shared-expert branch on a side stream, overlapping the routed experts.

Why: the shared experts (gate/up projections, activation, down projection) do not depend on the
router, so on the GPU they can run on a side stream while the main stream does the router, the
latent projection and the routed experts; their result is only needed at the final sum.

What is a shared-expert branch (structural, not one spelling): a value that
  * is computed only from one activation x (the MoE input) and static weights:
        [y =] down( act(p_0, ..., p_{n-1}) ),   p_i = x @ W_i.T (+ b_i),   down optional (+ bias),
    where `act` is any DAG of pointwise ops (casts included) over the projections: gated MLPs with
    any activation (K3's SiTU-GLU, SiLU, GELU ...), ungated ones (relu^2), with or without biases;
  * is joined to the routed output by an add: `y_routed + y` (TP=1), `y_routed + all_reduce(y)`
    (also the in-place spelling all_reduce -> wait -> copy), or the fused MoE reduction
    k3fuse.gemm_ar_residual[_rmsnorm](act, W_down, residual, addend=y_routed) that rule 1 made (then
    the branch has no down projection); the routed output must itself be computed from x.
A candidate (an MLP of static-weight projections feeding such a join) that cannot be offloaded is
logged as rejected with the reason and the values (its output or an interior value has other
readers, its projections read different inputs, the activation reads a static tensor, the other
addend is not computed from x ...).

Rewrite (per branch), x = the MoE input:
  x_pass = k3fuse.shared_expert_fork(x, [W_i], [b_i], W_down|None, b_down|None, act, site)  before x's
  first reader; every other reader of x (router / latent / routed path) reads x_pass, so no scheduler
  can sink the fork below the routed experts; `act` is the activation's own ATen ops as a program
  (kernels/lib/reference/shared_expert.py), so the fork computes the model's sequence, rounding points
  included, on any GPU or CPU;
  y = k3fuse.shared_expert_join(x_pass, anchor=y_routed, [x, W..., b...], site, out_features)  right
  before the consumer of the branch output (the all_reduce, the add, or the fused reduction). The
  anchor keeps the join after the routed experts; the read list keeps x (and the weights) alive
  until the join, so no buffer planner reuses x's memory while the side stream still reads it.
Collectives never move to the side stream: the region ends before the all-reduce.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch._ops import OpOverload

from k3fuse.rule_api import (ALL_REDUCE, CAST_OPS, TRANSPOSE_LAST2, VIEW_LIKE, WAIT_TENSOR, DecodeContext,
                             GuardFailure, Match, Rule, cast_dtype, failures, is_metadata_check, is_static, node_order,
                             node_value, op_key, op_qualname, skip_transparent, static_weight, token_count)

from ._pattern_tools import erase_dead, trunk_dtype

aten = torch.ops.aten
_FUSED_REDUCTION = {"k3fuse::gemm_ar_residual", "k3fuse::gemm_ar_residual_rmsnorm"}
_DROPPED_KWARGS = frozenset({"device", "layout", "pin_memory", "memory_format"})


class _NotBranch(Exception):
    """Not shaped like a shared-expert MLP at all: nothing to log."""


class _NearMiss(Exception):
    """An MLP of static-weight projections that cannot be offloaded: logged as rejected."""

    def __init__(self, guard: str, message: str, values: dict[str, Any]):
        super().__init__(message)
        self.failure = GuardFailure("site", guard, message, values)


@dataclass
class _Proj:
    """One linear with a static weight: `out` = mm(view(x), t(W)) (+ b)."""

    out: fx.Node
    mm: fx.Node
    x: fx.Node  # the value read, views stripped
    weight: fx.Node
    bias: fx.Node | None
    nodes: list[fx.Node]  # mm and bias add
    layout: list[fx.Node]  # views of the input and the weight transpose (may be shared)


@dataclass
class _Branch:
    out: fx.Node
    projs: list[_Proj]
    act_out: fx.Node
    act_nodes: list[fx.Node]
    down: _Proj | None
    tail: list[fx.Node]  # views between the down projection (or the activation) and `out`
    static_operands: list[fx.Node] = field(default_factory=list)

    @property
    def x(self) -> fx.Node:
        return self.projs[0].x

    def region(self) -> list[fx.Node]:
        nodes = [*self.tail, *self.act_nodes]
        for p in [*self.projs, *([self.down] if self.down else [])]:
            nodes += p.nodes
        return nodes

    def layout(self) -> list[fx.Node]:
        return [n for p in [*self.projs, *([self.down] if self.down else [])] for n in p.layout]


def _real_users(node: fx.Node) -> list[fx.Node]:
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


def _linear(node: Any) -> _Proj | None:
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
    return _Proj(node, mm, x, weight, bias, [*nodes, mm], [*xviews, *wlayout])


def _keeps_features(node: fx.Node) -> bool:
    out, src = node_value(node), node_value(node.args[0]) if node.args else None
    return (isinstance(out, torch.Tensor) and isinstance(src, torch.Tensor) and out.dim() >= 1
            and src.dim() >= 1 and str(out.shape[-1]) == str(src.shape[-1]))


def _is_pointwise(node: fx.Node) -> bool:
    t = node.target
    if t in CAST_OPS:
        return cast_dtype(node) is not None  # a pure dtype cast, no device or layout change
    return isinstance(t, OpOverload) and torch.Tag.pointwise in t.tags


def _activation(act_out: fx.Node) -> tuple[list[_Proj], list[fx.Node], list[fx.Node]]:
    """The projections and pointwise nodes computing `act_out`; raises _NotBranch otherwise."""
    projs: dict[fx.Node, _Proj] = {}
    act: list[fx.Node] = []
    static: list[fx.Node] = []
    seen: set[fx.Node] = set()
    stack = [act_out]
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        p = _linear(v)
        if p is not None:
            projs[v] = p
            continue
        if is_static(v):
            static.append(v)
            continue
        if v.op != "call_function":
            raise _NotBranch
        if v.target in VIEW_LIKE:
            if not _keeps_features(v):
                raise _NotBranch
        elif not _is_pointwise(v):
            raise _NotBranch
        act.append(v)
        stack.extend(v.all_input_nodes)
    if not projs or not act:
        raise _NotBranch  # a plain linear, or pointwise ops on something else
    return list(projs.values()), act, static


def _branch(out: fx.Node) -> _Branch:
    """The shared-expert structure ending at `out`; raises _NotBranch when it is none."""
    if not isinstance(out, fx.Node) or out.op != "call_function":
        raise _NotBranch
    core, tail = skip_transparent(out)
    down = _linear(core)
    act_out = down.x if down is not None else core
    if not isinstance(act_out, fx.Node) or act_out.op != "call_function":
        raise _NotBranch
    projs, act, static = _activation(act_out)
    order = node_order(out.graph)
    if len({p.x for p in projs}) != 1:
        raise _NotBranch  # projections of different values (e.g. the routed and shared outputs summed)
    projs.sort(key=lambda p: order[p.mm])
    act.sort(key=order.__getitem__)
    return _Branch(out, projs, act_out, act, down, list(tail), static)


def _branch_at(out: fx.Node, consumer: fx.Node) -> _Branch:
    """`_branch`, where a branch without a down projection only counts when the fused MoE reduction
    (which took the down projection) consumes it: elsewhere it is a router or a gate, not an MLP."""
    b = _branch(out)
    if b.down is None and op_qualname(consumer) not in _FUSED_REDUCTION:
        raise _NotBranch
    return b


def _encode_arg(arg: Any, index: dict[fx.Node, int], where: fx.Node) -> Any:
    if isinstance(arg, fx.Node):
        return {"$": index[arg]}
    if isinstance(arg, torch.dtype):
        return {"dtype": str(arg).removeprefix("torch.")}
    if isinstance(arg, (list, tuple)):
        return [_encode_arg(a, index, where) for a in arg]
    if isinstance(arg, dict):
        return {k: _encode_arg(v, index, where) for k, v in arg.items()}
    if arg is None or isinstance(arg, (bool, int, float, str)):
        return arg
    raise _NearMiss("activation_program", "the activation has an argument the fork cannot carry",
                    {"node": where.name, "op": str(where.target), "argument": repr(arg)[:80]})


def _program(b: _Branch) -> str:
    """The activation as a JSON program of its own ATen ops over the projections (see
    kernels/lib/reference/shared_expert.py); layout-only views are dropped (the fork runs on [T, F])."""
    index: dict[fx.Node, int] = {p.out: i for i, p in enumerate(b.projs)}
    steps: list[list[Any]] = []
    for n in b.act_nodes:
        if n.target in VIEW_LIKE or (cast_dtype(n) is not None and node_value(n.args[0]) is not None
                                      and node_value(n.args[0]).dtype == cast_dtype(n)):
            index[n] = index[n.args[0]]  # same value, another layout (or a no-op cast)
            continue
        t = n.target
        kwargs = {k: v for k, v in n.kwargs.items() if k not in _DROPPED_KWARGS}
        steps.append([f"{t.namespace}::{t._opname}.{t._overloadname}",
                      _encode_arg(list(n.args), index, n), _encode_arg(kwargs, index, n)])
        index[n] = len(b.projs) + len(steps) - 1
    return json.dumps({"n": len(b.projs), "steps": steps, "out": {"$": index[b.act_out]}},
                      separators=(",", ":"))


def _lead_shape(node: fx.Node) -> list[str] | None:
    v = node_value(node)
    return [str(s) for s in v.shape[:-1]] if isinstance(v, torch.Tensor) else None


def _check_structure(b: _Branch) -> None:
    """What makes an MLP of static-weight projections unfit for the fork (raises _NearMiss)."""
    if is_static(b.x):
        raise _NearMiss("branch_input", "the branch input is a static tensor, not an activation",
                        {"input": b.x.name})
    with_bias = [p.mm.name for p in b.projs if p.bias is not None]
    if with_bias and len(with_bias) != len(b.projs):
        raise _NearMiss("projection_bias", "some projections have a bias and some do not",
                        {"with_bias": with_bias, "projections": [p.mm.name for p in b.projs]})
    if b.static_operands:
        raise _NearMiss("activation_reads_static", "the activation reads a static tensor besides the "
                        "projections' weights and biases", {"static": [s.name for s in b.static_operands]})
    region = set(b.region())
    inside = region | set(b.layout())
    for n in region - {b.out}:
        outside = [u.name for u in _real_users(n) if u not in inside]
        if outside:
            raise _NearMiss("interior_use", "a value inside the branch is also read outside it",
                            {"node": n.name, "users": outside})
    if _lead_shape(b.out) != _lead_shape(b.x):
        raise _NearMiss("output_shape", "the branch output's token dims differ from its input's",
                        {"input": _lead_shape(b.x), "output": _lead_shape(b.out)})


@dataclass
class _Site:
    branch: _Branch
    consumer: fx.Node  # the node the join goes right before
    routed: fx.Node  # the routed output (the join is ordered after it)
    program: str = ""
    chain: list[fx.Node] = field(default_factory=list)  # all_reduce, wait [, copy, views] to the add


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


def _candidates(graph: fx.Graph) -> list[tuple[fx.Node, fx.Node, Any, list[fx.Node], fx.Node]]:
    """(branch output, consumer, routed, reduction chain, join node) for every add-like join."""
    out = []
    for node in graph.nodes:
        if op_qualname(node) in _FUSED_REDUCTION and len(node.args) > 3 and node.args[3] is not None:
            out.append((node.args[0], node, node.args[3], [], node))
        elif (node.target is aten.add.Tensor and len(node.args) == 2 and node.kwargs.get("alpha", 1) == 1
              and all(isinstance(a, fx.Node) and not is_static(a) for a in node.args)):
            for side, other in (node.args, node.args[::-1]):
                branch_out, consumer, chain = _through_reduction(side)
                out.append((branch_out, node if consumer is side else consumer, other, chain, node))
    return out


def shared_mlp_linears(graph: fx.Graph) -> set[fx.Node]:
    """The mm nodes of the input projections (gate/up) of every shared-expert branch in `graph`, for
    rules that must tell the shared expert's projections from other linears of the same input."""
    found: set[fx.Node] = set()
    for branch_out, consumer, *_ in _candidates(graph):
        try:
            b = _branch_at(branch_out, consumer)
        except _NotBranch:
            continue
        found |= {p.mm for p in b.projs}
    return found


def _ancestors_include(node: fx.Node, target: fx.Node) -> bool:
    seen, stack = set(), [node]
    while stack:
        v = stack.pop()
        if v is target:
            return True
        if v in seen:
            continue
        seen.add(v)
        stack.extend(v.all_input_nodes)
    return False


def _variant(b: _Branch) -> str:
    n = len(b.projs)
    if n == 2:
        base = "mlp" if b.down else "gate_up"
    elif n == 1:
        base = "ungated_mlp" if b.down else "up_act"
    else:
        base = f"mlp{n}" if b.down else f"act{n}"
    if any(p.bias is not None for p in [*b.projs, *([b.down] if b.down else [])]):
        base += "+bias"
    dtype = node_value(b.x).dtype if isinstance(node_value(b.x), torch.Tensor) else None
    return base if dtype in (None, torch.float32) else f"{base}[{str(dtype).removeprefix('torch.')}]"


class SharedExpertStream(Rule):
    """Shared-expert branch -> side stream (fork at its input, join before the sum with y_routed)."""

    name = "shared_expert_stream"
    emits = ("shared_expert_fork",)  # the join is an event wait, not a dispatched kernel
    description = ("shared-expert branch (static-weight projections of the MoE input, any pointwise activation, "
                   "optional down projection, joined to the routed output by an add) -> "
                   "k3fuse.shared_expert_fork/join: runs on a side stream while the router and routed experts "
                   "run; collectives stay on the main stream")

    def patterns(self) -> list:
        return []  # structural (see `find`)

    def find(self, graph: fx.Graph, ctx: DecodeContext) -> list[Match]:
        found: list[Match] = []
        seen: set[fx.Node] = set()
        order = node_order(graph)
        for branch_out, consumer, routed, chain, join_node in _candidates(graph):
            if branch_out in seen:
                continue
            try:
                b = _branch_at(branch_out, consumer)
            except _NotBranch:
                continue
            seen.add(branch_out)
            m = self._match(graph, b, chain)
            try:
                _check_structure(b)
                self._check_join(b, consumer, routed, chain, join_node, order)
                program = _program(b)
            except _NearMiss as miss:
                m.refused = miss.failure
            else:
                m.payload = _Site(b, consumer, routed, program, chain)
            found.append(m)
        return found

    @staticmethod
    def _match(graph: fx.Graph, b: _Branch, chain: list[fx.Node]) -> Match:
        inputs: dict[str, fx.Node] = {"x": b.x}
        for i, p in enumerate(b.projs):
            inputs[f"w{i}"] = p.weight
            if p.bias is not None:
                inputs[f"b{i}"] = p.bias
        if b.down is not None:
            inputs["w_down"] = b.down.weight
            if b.down.bias is not None:
                inputs["b_down"] = b.down.bias
        order = node_order(graph)
        nodes = sorted(set(b.region()), key=order.__getitem__)
        return Match(variant=_variant(b), graph=graph, inputs=inputs, scalars={}, outputs=[b.out], nodes=nodes)

    @staticmethod
    def _check_join(b: _Branch, consumer: fx.Node, routed: Any, chain: list[fx.Node], join_node: fx.Node,
                    order: dict[fx.Node, int]) -> None:
        out = b.out
        users = _real_users(out)

        def refuse(message: str, **values: Any) -> None:
            raise _NearMiss("shared_output_use", message,
                            {"output": out.name, "users": [u.name for u in users], **values})

        if chain:  # through all_reduce -> wait [-> copy]: out feeds the all_reduce (and the copy's dst)
            allowed = {chain[0]} | {n for n in chain if n.target is aten.copy.default and n.args[0] is out}
            if set(users) - allowed:
                refuse("the shared-expert output has other consumers than the sum with the routed output")
            for prev, nxt in zip(chain, [*chain[1:], join_node]):
                if [u for u in _real_users(prev) if u is not out] != [nxt]:
                    refuse("the reduced shared output has other consumers", node=prev.name)
        elif users != [consumer]:
            refuse("the shared-expert output has other consumers than the sum with the routed output")
        if op_qualname(consumer) in _FUSED_REDUCTION and b.down is not None:
            refuse("the fused MoE reduction already takes a down projection: the branch must end at the activation")
        if not isinstance(routed, fx.Node) or order[routed] > order[join_node]:
            refuse("the routed output is computed after the shared output's consumer")
        if order[routed] > order[consumer] and not chain:
            refuse("the routed output is computed after the shared output's consumer")
        # (with a chain, a scheduler issued the shared all-reduce before the routed output exists, e.g.
        # Inductor's post-grad graph: the rewrite moves the chain after the routed output, see rewrite)
        if not _ancestors_include(routed, b.x):
            raise _NearMiss("moe_join", "the other addend is not computed from the branch input (not a routed "
                            "output: a residual add of a dense MLP?)", {"addend": routed.name, "input": b.x.name})

    def check_site(self, match: Match, ctx: DecodeContext) -> list[GuardFailure]:
        weights = [static_weight(n, name) for name, n in match.inputs.items() if name != "x"]
        return failures(*weights, token_count(match["x"], ctx, dim=None), trunk_dtype(match["x"], "x", ctx.dtype))

    def rewrite(self, match: Match, ctx: DecodeContext) -> list[fx.Node]:
        s: _Site = match.payload
        b, graph, x = s.branch, match.graph, match["x"]
        ops = torch.ops.k3fuse
        site = sum(1 for n in graph.nodes if op_qualname(n) == "k3fuse::shared_expert_fork")
        region = set(match.nodes) | set(b.layout())
        order = node_order(graph)
        if order[s.routed] > order[s.consumer]:  # all_reduce -> wait [-> copy] issued early: after the routed output
            prev = s.routed
            for n in sorted(s.chain, key=order.__getitem__):
                if order[n] < order[s.routed]:
                    prev.append(n)
                    prev = n
            order = node_order(graph)
        first_reader = min((u for u in x.users if not is_metadata_check(u)), key=order.__getitem__)
        proj = [p.weight for p in b.projs]
        proj_bias = [p.bias for p in b.projs if p.bias is not None]
        w_down = b.down.weight if b.down else None
        b_down = b.down.bias if b.down else None
        out = b.out
        fork = match.insert(ops.shared_expert_fork.default, (x, proj, proj_bias, w_down, b_down, s.program, site,
                                                             ctx.strict), before=first_reader, provenance=out)
        for user in list(x.users):  # the main stream reads x through the fork
            if user is not fork and user not in region and not is_metadata_check(user):
                user.replace_input_with(x, fork)
        reads = [x, *proj, *proj_bias, *(t for t in (w_down, b_down) if t is not None)]
        join = match.insert(ops.shared_expert_join.default, (fork, s.routed, reads, site, int(node_value(out).shape[-1])),
                            before=s.consumer, provenance=out)
        out.replace_all_uses_with(join, delete_user_cb=lambda u: u is not join and not is_metadata_check(u))
        erase_dead(graph, [*match.nodes, *b.layout()])
        match.note(site=site, side_region=_side_region(b), activation=_act_ops(b), projections=len(proj),
                   join_before=s.consumer.name, anchor=s.routed.name)
        return [fork, join]


def _side_region(b: _Branch) -> str:
    parts = ["gate/up" if len(b.projs) == 2 else f"{len(b.projs)} projection(s)", "activation"]
    return "/".join(parts + (["down"] if b.down else []))


def _act_ops(b: _Branch) -> list[str]:
    return [n.target._opname for n in b.act_nodes if n.target not in VIEW_LIKE]


__all__ = ["SharedExpertStream", "shared_mlp_linears"]
