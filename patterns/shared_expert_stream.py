"""The shared-expert branch on a side stream, overlapping the routed experts.

Why: the shared experts (gate/up projections, activation, down projection) do not depend on the
router, so on the GPU they can run on a side stream while the main stream does the router, the
latent projection and the routed experts; their result is only needed at the final sum.

What is a shared-expert branch (structural, not one spelling: patterns/_mlp_branch.py): a value
computed only from the MoE input x and static weights, `[y =] down(act(p_0, ..., p_{n-1}))` with
`p_i = x @ W_i.T (+ b_i)` and `act` any DAG of pointwise ops (K3's SiTU-GLU, SiLU, GELU, relu^2 ...),
joined to the routed output by an add (`y_routed + y`, through an all_reduce or its in-place copy
spelling, or the fused MoE reduction rule 1 made; the routed output must itself be computed from
x). A candidate that cannot be offloaded is logged as rejected with the reason and the values
(its output or an interior value has other readers, the activation reads a static tensor, the
other addend is not computed from x ...).

Rewrite (per branch): the branch's own nodes stay in the graph, bracketed by markers
(kernels/ops/shared_expert.py; the verifier checks every bracket):
  x_side = k3fuse.shared_expert_fork(x, site)     before x's first reader
  the branch's nodes, moved right after the fork, reading x_side (the views of x and the weights'
  transposes they read are copied into the window, so the main stream keeps its own)
  k3fuse.shared_expert_end(y, site)               right after them
  y' = k3fuse.shared_expert_join(y, anchor=y_routed, keep_alive=[x], site)   right before y's
  consumer (the all_reduce, the add or the fused reduction), which reads y'.
Later rules see the branch's nodes as any others (decode_gemm takes its projections). The anchor
orders the join after the routed experts; keep_alive holds x until the join. Collectives never
move to the side stream: the region ends before the all-reduce.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from k3fuse.rule_api import (VIEW_LIKE, DecodeContext, GuardFailure, Match, Rule, Variant, failures,
                             is_layout_only, is_metadata_check, is_static, node_order, node_value, op_qualname,
                             static_weight, token_count)

from ._mlp_branch import (FUSED_REDUCTION, JoinCandidate, MLPBranch, NotBranch, branch_at, join_candidates,
                          real_users)
from ._pattern_tools import erase_dead, trunk_dtype

aten = torch.ops.aten
_FORK = "k3fuse::shared_expert_fork"


class _NearMiss(Exception):
    """An MLP of static-weight projections that cannot be offloaded: logged as rejected."""

    def __init__(self, guard: str, message: str, values: dict[str, Any]):
        super().__init__(message)
        self.failure = GuardFailure("site", guard, message, values)


def _lead_shape(node: fx.Node) -> list[str] | None:
    v = node_value(node)
    return [str(s) for s in v.shape[:-1]] if isinstance(v, torch.Tensor) else None


def _tokens(node: fx.Node) -> str | None:
    """The product of the leading dims (symbolic ones too), as text: [B, 1, H] and its view [B, H]
    (HF's 3-D hidden states, a partial flattened to join the routed one) hold the same tokens."""
    v = node_value(node)
    if not isinstance(v, torch.Tensor) or v.dim() < 1:
        return None
    n: Any = 1
    for d in v.shape[:-1]:
        n = n * d
    return str(n)


def _check_structure(b: MLPBranch) -> None:
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
    copies = [n.name for n in b.layout() if not is_layout_only(n)]
    if copies:
        raise _NearMiss("input_layout", "the projections read their input through a copy, not a view",
                        {"nodes": copies})
    region = set(b.region())
    inside = region | set(b.layout())
    for n in region - {b.out}:
        outside = [u.name for u in real_users(n) if u not in inside]
        if outside:
            raise _NearMiss("interior_use", "a value inside the branch is also read outside it",
                            {"node": n.name, "users": outside})
    if _tokens(b.out) is None or _tokens(b.out) != _tokens(b.x):
        raise _NearMiss("output_shape", "the branch output's tokens differ from its input's",
                        {"input": _lead_shape(b.x), "output": _lead_shape(b.out)})


def _check_join(b: MLPBranch, c: JoinCandidate, order: dict[fx.Node, int]) -> None:
    """The branch output feeds only its join with a routed output computed from the branch input
    (raises _NearMiss)."""
    out, chain, routed = b.out, list(c.chain), c.routed
    users = real_users(out)

    def refuse(message: str, **values: Any) -> None:
        raise _NearMiss("shared_output_use", message, {"output": out.name, "users": [u.name for u in users], **values})

    if chain:  # through all_reduce -> wait [-> copy]: out feeds the all_reduce (and the copy's dst)
        allowed = {chain[0]} | {n for n in chain if n.target is aten.copy.default and n.args[0] is out}
        if set(users) - allowed:
            refuse("the shared-expert output has other consumers than the sum with the routed output")
        for prev, nxt in zip(chain, [*chain[1:], c.join]):
            if [u for u in real_users(prev) if u is not out] != [nxt]:
                refuse("the reduced shared output has other consumers", node=prev.name)
    elif users != [c.consumer]:
        refuse("the shared-expert output has other consumers than the sum with the routed output")
    if op_qualname(c.consumer) in FUSED_REDUCTION and b.down is not None:
        refuse("the fused MoE reduction already takes a down projection: the branch must end at the activation")
    if not isinstance(routed, fx.Node) or order[routed] > order[c.join]:
        refuse("the routed output is computed after the shared output's consumer")
    if order[routed] > order[c.consumer] and not chain:
        refuse("the routed output is computed after the shared output's consumer")
    # (with a chain, a scheduler issued the shared all-reduce before the routed output exists, e.g.
    # Inductor's post-grad graph: the rewrite moves the chain after the routed output, see rewrite)
    if not _ancestors_include(routed, b.x):
        raise _NearMiss("moe_join", "the other addend is not computed from the branch input (not a routed "
                        "output: a residual add of a dense MLP?)", {"addend": routed.name, "input": b.x.name})


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


def _variant(b: MLPBranch) -> Variant:
    n = len(b.projs)
    if n == 2:
        form = "mlp" if b.down else "gate_up"
    elif n == 1:
        form = "ungated_mlp" if b.down else "up_act"
    else:
        form = f"mlp{n}" if b.down else f"act{n}"
    if any(p.bias is not None for p in b.linears()):
        form += "+bias"
    x = node_value(b.x)
    return Variant(form, x.dtype if isinstance(x, torch.Tensor) else None)


@dataclass
class _Site:
    """What `find` worked out for one branch."""

    branch: MLPBranch
    join: JoinCandidate


def _order_chain_after_routed(graph: fx.Graph, c: JoinCandidate) -> None:
    """A scheduler issued the branch's all_reduce -> wait [-> copy] before the routed output exists
    (Inductor's post-grad graph): move that chain right after the routed output, where the join goes."""
    order = node_order(graph)
    if order[c.routed] <= order[c.consumer]:
        return
    prev = c.routed
    for n in sorted(c.chain, key=order.__getitem__):
        if order[n] < order[c.routed]:
            prev.append(n)
            prev = n


def _bracket(graph: fx.Graph, b: MLPBranch, fork: fx.Node) -> fx.Node:
    """Move the branch's nodes right after `fork`, reading the fork's copy of x instead of x; returns
    the last node of the window. The views of x and the weights' transposes the projections read are
    copied into the window (the originals may have other readers); metadata checks of window nodes
    move with them."""
    order = node_order(graph)
    copies: dict[fx.Node, fx.Node] = {b.x: fork}
    position: dict[fx.Node, int] = {}  # where each window node stood before: the window keeps that order
    layout = sorted(dict.fromkeys(b.layout()), key=order.__getitem__)
    with graph.inserting_before(fork.next):
        for n in layout:
            copies[n] = graph.node_copy(n, lambda a: copies.get(a, a))
            position[copies[n]] = order[n]
    region = set(b.region())
    for n in region:
        n.args = fx.node.map_arg(n.args, lambda a: copies.get(a, a))
        n.kwargs = fx.node.map_arg(n.kwargs, lambda a: copies.get(a, a))
    erase_dead(graph, layout)
    window = region | {copies[n] for n in layout}
    window |= {u for n in window for u in n.users if is_metadata_check(u)}
    last = fork
    for n in sorted(window, key=lambda n: position.get(n, order.get(n, -1))):
        last.append(n)
        last = n
    return last


class SharedExpertStream(Rule):
    """Shared-expert branch -> side stream (fork at its input, end after it, join before the sum with y_routed)."""

    name = "shared_expert_stream"
    emits = ("shared_expert_fork",)  # end and join are stream bookkeeping, not dispatched kernels
    description = ("shared-expert branch (static-weight projections of the MoE input, any pointwise activation, "
                   "optional down projection, joined to the routed output by an add) -> its own nodes bracketed "
                   "by k3fuse.shared_expert_fork/end/join: a side stream while the router and routed experts run "
                   "(executed node by node; Inductor compiles it on the main stream); collectives stay on the main "
                   "stream")

    def patterns(self) -> list:
        return []  # structural (see `find`)

    def find(self, graph: fx.Graph, ctx: DecodeContext) -> list[Match]:
        found: list[Match] = []
        seen: set[fx.Node] = set()
        order = node_order(graph)
        for c in join_candidates(graph):
            if c.branch_out in seen:
                continue
            try:
                b = branch_at(c.branch_out, c.consumer)
            except NotBranch:
                continue
            seen.add(c.branch_out)
            m = self._match(graph, b)
            try:
                _check_structure(b)
                _check_join(b, c, order)
            except _NearMiss as miss:
                m.refused = miss.failure
            else:
                m.payload = _Site(b, c)
            found.append(m)
        return found

    @staticmethod
    def _match(graph: fx.Graph, b: MLPBranch) -> Match:
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
        key = _variant(b)
        return Match(variant=str(key), key=key, graph=graph, inputs=inputs, scalars={}, outputs=[b.out], nodes=nodes)

    def check_site(self, match: Match, ctx: DecodeContext) -> list[GuardFailure]:
        weights = [static_weight(n, name) for name, n in match.inputs.items() if name != "x"]
        return failures(*weights, token_count(match["x"], ctx, dim=None), trunk_dtype(match["x"], "x", ctx.dtype))

    def rewrite(self, match: Match, ctx: DecodeContext) -> list[fx.Node]:
        s: _Site = match.payload
        b, c, graph, x = s.branch, s.join, match.graph, match["x"]
        ops = torch.ops.k3fuse
        site = sum(1 for n in graph.nodes if op_qualname(n) == _FORK)
        _order_chain_after_routed(graph, c)
        order = node_order(graph)
        first_reader = min((u for u in x.users if not is_metadata_check(u)), key=order.__getitem__)
        fork = match.insert(ops.shared_expert_fork.default, (x, site), before=first_reader, provenance=b.out)
        last = _bracket(graph, b, fork)
        end = match.insert(ops.shared_expert_end.default, (b.out, site), before=last.next, provenance=b.out)
        join = match.insert(ops.shared_expert_join.default, (b.out, c.routed, [x], site), before=c.consumer,
                            provenance=b.out)
        b.out.replace_all_uses_with(join, delete_user_cb=lambda u: u not in (end, join) and not is_metadata_check(u))
        match.note(site=site, side_region=_side_region(b), activation=_act_ops(b), projections=len(b.projs),
                   join_before=c.consumer.name, anchor=c.routed.name)
        return [fork, end, join]


def _side_region(b: MLPBranch) -> str:
    parts = ["gate/up" if len(b.projs) == 2 else f"{len(b.projs)} projection(s)", "activation"]
    return "/".join(parts + (["down"] if b.down else []))


def _act_ops(b: MLPBranch) -> list[str]:
    return [n.target._opname for n in b.act_nodes if n.target not in VIEW_LIKE]


__all__ = ["SharedExpertStream"]
