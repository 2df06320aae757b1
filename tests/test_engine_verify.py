"""The weight-only reordering verifier names the node that moved a non-static read across a sync."""
from __future__ import annotations

import pytest
import torch
import torch.distributed._functional_collectives as funcol
import torch.fx as fx
from engine_helpers import op_counts
from torch.fx.experimental.proxy_tensor import make_fx

import k3fuse  # noqa: F401  (registers torch.ops.k3fuse.*)
from k3fuse.context import DecodeContext
from k3fuse.pipeline import run_pipeline
from k3fuse.rule import Match, PatternSpec, Rule
from k3fuse.verify import ReorderingError, check_handles, check_reordering, snapshot

aten = torch.ops.aten


def step_graph() -> fx.Graph:
    """x @ w.T -> all_reduce -> wait -> +1, then + tanh(state): state is read only after the wait."""

    def step(x, w, state):
        y = funcol.all_reduce(torch.mm(x, w.t()), "sum", "tp")
        y = y + 1
        return y + torch.tanh(state)

    g = make_fx(step, tracing_mode="fake")(torch.randn(4, 8), torch.randn(16, 8), torch.randn(4, 16)).graph
    for n in g.nodes:
        if n.op == "placeholder":
            n.meta["k3fuse_static"] = n.name == "w_1"
    return g


def node(g: fx.Graph, name: str) -> fx.Node:
    return next(n for n in g.nodes if n.name == name)


def test_unchanged_graph_passes():
    g = step_graph()
    check_reordering(snapshot(g), g)


def test_hoisting_an_activation_read_above_a_wait_is_rejected():
    g = step_graph()
    before = snapshot(g)
    node(g, "wait_tensor").prepend(node(g, "tanh"))  # a buggy rule moves tanh(state) before the wait
    with pytest.raises(ReorderingError, match="tanh reads non-static state_1 before sync wait_tensor") as err:
        check_reordering(before, g, rule="bad_rule")
    assert err.value.node.name == "tanh" and err.value.rule == "bad_rule"


def test_new_node_reading_activation_before_the_wait_is_rejected():
    g = step_graph()
    before = snapshot(g)
    with g.inserting_before(node(g, "wait_tensor")):
        peek = g.call_function(aten.neg.default, (node(g, "state_1"),))
    peek.name = "early_peek"
    node(g, "add_1").update_arg(1, peek)
    with pytest.raises(ReorderingError, match="early_peek reads non-static state_1"):
        check_reordering(before, g)


def test_hoisting_a_weight_read_is_allowed():
    g = step_graph()
    before = snapshot(g)
    with g.inserting_before(node(g, "all_reduce")):
        scaled = g.call_function(aten.mul.Tensor, (node(g, "w_1"), 2.0))
    with g.inserting_before(node(g, "wait_tensor")):
        g.call_function(torch.ops.k3fuse.l2_prefetch.default, (node(g, "all_reduce"), [node(g, "w_1")], 1 << 20))
    assert scaled.op == "call_function"
    check_reordering(before, g)


def test_prefetch_reading_an_activation_inside_the_collective_window_is_rejected():
    g = step_graph()
    with g.inserting_before(node(g, "wait_tensor")):
        pf = g.call_function(torch.ops.k3fuse.l2_prefetch.default,
                             (node(g, "all_reduce"), [node(g, "w_1"), node(g, "x_1")], 1 << 20))
    pf.name = "prefetch"
    with pytest.raises(ReorderingError, match="prefetch reads collective handle all_reduce .* non-static x_1"):
        check_handles(g)


def test_reading_the_collective_output_without_wait_is_rejected():
    g = step_graph()
    node(g, "add").replace_input_with(node(g, "wait_tensor"), node(g, "all_reduce"))
    with pytest.raises(ReorderingError, match="add reads collective handle all_reduce"):
        check_handles(g)


class HoistTanh(Rule):
    """A deliberately wrong rule: recomputes tanh(state) at the top of the graph."""

    name = "hoist_tanh"

    def patterns(self):
        return [PatternSpec("tanh", lambda s: torch.tanh(s), lambda: (torch.randn(4),))]

    def rewrite(self, match: Match, ctx):
        g = match.graph
        first_op = next(n for n in g.nodes if n.op == "call_function")
        with g.inserting_before(first_op):
            new = g.call_function(aten.tanh.default, (match["s"],))
        match.replace([new])
        return [new]


def test_pipeline_runs_the_verifier_after_each_rule():
    g = step_graph()
    with pytest.raises(ReorderingError, match="rule hoist_tanh: tanh_default reads non-static state_1"):
        run_pipeline(g, DecodeContext(), rules=[HoistTanh()])
    assert op_counts(g)["_c10d_functional::wait_tensor"] == 1
