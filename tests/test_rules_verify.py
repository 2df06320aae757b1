"""The weight-only reordering verifier (k3fuse.verify) on K3 graphs, and the rules' structural promises.

The graph is the tiny two-layer K3 stack at TP=2, exported in this process under a fake process group
(tracing never runs a collective). Rules built here break the weight-only rule on purpose; the pipeline
must refuse each one with a ReorderingError that names the offending node.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx

import k3fuse
from k3fuse import compat
from k3fuse.matcher import decomposition_table
from k3fuse.offline import mark_static_placeholders, static_placeholder_names
from k3fuse.patterns import SharedExpertStream, WeightPrefetch, all_rules
from k3fuse.pipeline import default_rules
from k3fuse.pipeline import run_pipeline
from k3fuse.rule import Match, Rule
from k3fuse.graph_facts import op_qualname
from k3fuse.verify import ReorderingError


@pytest.fixture(scope="module")
def k3_program():
    """Decomposed ExportedProgram of the 2-layer tiny K3 stack, TP=2 rank 0, and its context."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from k3fuse.model import K3DecodeStack, get_config

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model = K3DecodeStack(get_config("tiny", n_layers=2), tp_size=2, rank=0, seed=5)
        ep = torch.export.export(model, (torch.randn(3, 128), model.init_state(3)))
        ctx = k3fuse.DecodeContext.from_process_group()
    finally:
        dist.destroy_process_group()
    return ep.run_decompositions(decomposition_table()), ctx


@pytest.fixture
def k3_graph(k3_program) -> fx.GraphModule:
    """A fresh copy of the graph with the static placeholders marked, as the offline door does."""
    import copy

    ep, _ = k3_program
    gm = copy.deepcopy(ep.graph_module)
    mark_static_placeholders(gm.graph, static_placeholder_names(ep))
    return gm


def _first(gm: fx.GraphModule, target) -> fx.Node:
    return next(n for n in gm.graph.nodes if n.target is target)


class _PrefetchAlso(WeightPrefetch):
    """A broken prefetch: lists `extra` (a non-static value) with the weights of the first site."""

    name = "bad_prefetch"

    def __init__(self, extra: str):
        super().__init__()
        self.extra = extra

    def find(self, graph, ctx):
        matches = super().find(graph, ctx)[:1]
        extra = next(n for n in graph.nodes if n.name == self.extra)
        matches[0].payload = [*matches[0].payload, extra]  # the weights the rewrite will prefetch
        return matches


class _HoistStateRead(Rule):
    """A broken rewrite: layer 1's KDA state is read (cloned) before layer 0's first wait_tensor."""

    name = "hoist_state_read"

    def find(self, graph, ctx):
        wait = next(n for n in graph.nodes if n.target is compat.WAIT_TENSOR)
        state = next(n for n in graph.nodes if n.name == "state_recurrent_1")
        return [Match("hoist", graph, {"state": state}, {}, [wait], [])]

    def rewrite(self, match, ctx):
        graph, state, wait = match.graph, match["state"], match.outputs[0]
        with graph.inserting_before(wait):
            copy = graph.call_function(torch.ops.aten.clone.default, (state,))
        copy.meta["val"] = state.meta["val"]
        state.replace_all_uses_with(copy, delete_user_cb=lambda u: u is not copy)
        return [copy]


def test_k3_rules_pass_the_verifier_and_prefetch_only_static_weights(k3_program, k3_graph, monkeypatch):
    _, ctx = k3_program
    monkeypatch.setenv("K3FUSE_RULES", "+weight_prefetch")  # off by default (docs/perf.md): named here
    log = run_pipeline(k3_graph, ctx, verify_each_rule=True)
    assert log.applied("weight_prefetch") == 2
    for node in k3_graph.graph.nodes:
        if op_qualname(node) != "k3fuse::l2_prefetch":
            continue
        handle, weights, budget = node.args
        assert handle.target is compat.ALL_REDUCE and node.next.target is compat.WAIT_TENSOR  # inside the window
        assert weights and all(w.op == "placeholder" and w.meta["k3fuse_static"] for w in weights)
        # the latent all-reduce: the latent norm weight and W_up are read right after it
        assert [w.name.rsplit("_", 2)[-2:] for w in weights[:2]] == [["norm", "weight"], ["w", "up"]]


def test_prefetch_list_follows_read_order_up_to_the_budget(k3_program, k3_graph):
    _, ctx = k3_program
    run_pipeline(k3_graph, ctx, rules=[WeightPrefetch(budget_bytes=1)])
    prefetches = [n for n in k3_graph.graph.nodes if op_qualname(n) == "k3fuse::l2_prefetch"]
    assert len(prefetches) == 3 * 2  # nothing fused: KDA, latent and shared all-reduce of both layers
    for node in prefetches:
        handle, weights, budget = node.args
        assert budget == 1 and len(weights) == 1  # the first weight read after the wait already covers it
    latent = prefetches[1]
    assert latent.args[1][0].name.endswith("latent_norm_weight")


def test_prefetch_of_an_activation_is_rejected_naming_the_node(k3_program, k3_graph):
    _, ctx = k3_program
    activation = _first(k3_graph, compat.ALL_REDUCE).args[0].name  # the partial sum being reduced
    with pytest.raises(ReorderingError, match=rf"reads collective handle .* and also non-static {activation}") as err:
        run_pipeline(k3_graph, ctx, rules=[_PrefetchAlso(activation)])
    assert op_qualname(err.value.node) == "k3fuse::l2_prefetch" and err.value.rule == "bad_prefetch"


def test_prefetch_of_the_decode_state_is_rejected(k3_program, k3_graph):
    _, ctx = k3_program
    with pytest.raises(ReorderingError, match="non-static state_conv_1") as err:
        run_pipeline(k3_graph, ctx, rules=[_PrefetchAlso("state_conv_1")])
    assert op_qualname(err.value.node) == "k3fuse::l2_prefetch"


def test_decode_state_read_moved_before_a_wait_is_rejected(k3_program, k3_graph):
    _, ctx = k3_program
    wait = _first(k3_graph, compat.WAIT_TENSOR).name
    with pytest.raises(ReorderingError, match=rf"reads non-static state_recurrent_1 before sync {wait}") as err:
        run_pipeline(k3_graph, ctx, rules=[_HoistStateRead()])
    assert err.value.node.target is torch.ops.aten.clone.default and err.value.rule == "hoist_state_read"


def test_side_stream_never_carries_a_collective(k3_program, k3_graph):
    """Without the fused reduction the whole shared MLP goes to the side stream; its all-reduce stays on
    the main stream after the join (the join's anchor, the routed output, is ordering, not a read)."""
    _, ctx = k3_program
    log = run_pipeline(k3_graph, ctx.with_(disabled_rules=frozenset({"oproj_allreduce_residual"})),
                       verify_each_rule=True)
    assert log.applied("shared_expert_stream") == 2
    nodes = list(k3_graph.graph.nodes)
    forks = {n.args[-1]: n for n in nodes if op_qualname(n) == "k3fuse::shared_expert_fork"}
    ends = {n.args[-1]: n for n in nodes if op_qualname(n) == "k3fuse::shared_expert_end"}
    joins = {n.args[-1]: n for n in nodes if op_qualname(n) == "k3fuse::shared_expert_join"}
    assert sorted(forks) == sorted(ends) == sorted(joins) == [0, 1]
    for site, join in joins.items():
        (ar,) = join.users
        assert ar.target is compat.ALL_REDUCE  # the reduction of the shared partial, main stream
        fork, end = forks[site], ends[site]
        window = nodes[nodes.index(fork) + 1:nodes.index(end)]
        # the whole MLP (its projections now decode_gemm) and nothing of a collective in the window
        assert [op_qualname(n) for n in window].count("k3fuse::decode_gemm") == 3
        assert not any((op_qualname(n) or "").startswith("_c10d_functional") for n in window)
        assert end.args[0] is join.args[0] and join.args[0] in window
        # the join keeps the MoE input (what the side stream read) alive until it
        assert join.args[2] == [fork.args[0]]


def test_default_rules_are_the_contract_order():
    assert [r.name for r in all_rules()] == ["oproj_allreduce_residual", "moe_tail_allreduce_norm", "moe_front_sharded",
                                             "fused_routing", "routed_experts", "moe_combine", "shared_expert_stream",
                                             "kda_short_conv", "kda_delta_rule", "mla_decode", "decode_gemm",
                                             "weight_prefetch"]
    # off by default: weight_prefetch (measured slower in the layer) and moe_tail_allreduce_norm (not yet
    # measured)
    rules = default_rules()
    assert [r.name for r in rules] == ["oproj_allreduce_residual", "moe_front_sharded", "fused_routing",
                                       "routed_experts", "moe_combine", "shared_expert_stream", "kda_short_conv",
                                       "kda_delta_rule", "mla_decode", "decode_gemm"]
    assert all(r.description for r in rules) and "gemm_ar_residual" in rules[0].emits
    assert default_rules()[5] is not rules[5] and isinstance(rules[5], SharedExpertStream)  # fresh instances
