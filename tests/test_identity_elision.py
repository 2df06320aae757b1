"""A pattern op at its scalar identity that Inductor removed before k3fuse saw the graph.

Inductor's joint-graph pass drops `x * 1`, `x / 1`, `x + 0`, `x - 0` before any post-grad pass runs;
from torch 2.14 also with a literal scalar, so K3's router at `routed_scaling` 1.0 (the small preset's)
reaches k3fuse without its final `* routed_scaling`. Proved here:
* torch.compile(backend="k3fuse") under Inductor and eager, and k3fuse as Inductor's post-grad pass, at scale
  1.0 and 2.5: fused_routing fires and k3fuse.route_topk runs on every call in strict mode (the counters,
  not only the log), same answers;
* the matcher, on the router's graph with that mul erased as Inductor erases it: the site matches with
  `routed_scaling` bound to 1.0 and the division as its output; with the mul in the graph (any scale)
  the match keeps it.
"""
from __future__ import annotations

from contextlib import ExitStack

import pytest
import torch
from torch import nn

import k3fuse
from k3fuse import runtime
from k3fuse.matcher import compiled_patterns, find_matches, trace_aten
from k3fuse.patterns.fused_routing import FusedRouting
from k3fuse.spelling import route

T, HIDDEN, E, TOP_K = 3, 16, 8, 2
aten = torch.ops.aten


class Router(nn.Module):
    """K3's router: an fp32 linear to E logits, then `spelling.route` (the model's own code)."""

    def __init__(self, routed_scaling: float):
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        self.weight = nn.Parameter(torch.randn(E, HIDDEN, generator=gen), requires_grad=False)
        self.register_buffer("b_corr", 0.1 * torch.randn(E, generator=gen))
        self.routed_scaling = routed_scaling

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(h @ self.weight.t(), self.b_corr, TOP_K, self.routed_scaling)


def _compiled(router: Router, door: str, ctx: k3fuse.DecodeContext, log: k3fuse.RewriteLog, stack: ExitStack):
    """The router compiled through a door: the backend with either compiler, or plain torch.compile with
    k3fuse as Inductor's post-grad pass (SGLang's way; installed while `stack` is open)."""
    if door == "post_grad":
        stack.enter_context(torch._inductor.config.patch(post_grad_custom_post_pass=k3fuse.inductor_pass(ctx, log=log),
                                                         force_disable_caches=True))
        return torch.compile(router)
    return torch.compile(router, backend="k3fuse", options={"compiler": door, "context": ctx, "log": log})


@pytest.mark.parametrize("door", ["inductor", "eager", "post_grad"])
@pytest.mark.parametrize("routed_scaling", [1.0, 2.5])
def test_router_fires_and_runs_route_topk_at_any_scaling(door, routed_scaling):
    router = Router(routed_scaling).eval()
    log = k3fuse.RewriteLog()
    ctx = k3fuse.DecodeContext(strict=True, enabled_rules=frozenset({"fused_routing"}))
    torch._dynamo.reset()
    steps = [torch.randn(T, HIDDEN, generator=torch.Generator().manual_seed(s)) for s in range(2)]
    with ExitStack() as stack, torch.no_grad(), runtime.strict():
        compiled = _compiled(router, door, ctx, log, stack)
        runtime.reset_stats()
        for h in steps:
            weights, idx = compiled(h)
            ref_weights, ref_idx = router(h)
            assert torch.equal(idx, ref_idx)
            torch.testing.assert_close(weights, ref_weights)
    assert log.applied("fused_routing") == 1, [(e.decision, e.reason) for e in log.events]
    (event,) = [e for e in log.events if e.decision == "applied"]
    assert event.values["routed_scaling"] == routed_scaling
    # an applied rewrite whose op never runs (the graph Inductor compiled lost it) fails here
    assert runtime.stats() == {"route_topk": {"reference": len(steps)}}


def _router_graph(routed_scaling: float, erase_identity: bool) -> torch.fx.Graph:
    """`route` traced to ATen; `erase_identity`: its final mul replaced by its operand, as Inductor does at 1.0."""
    gm = trace_aten(lambda logits, b: route(logits, b, TOP_K, routed_scaling), [torch.randn(T, E), torch.randn(E)])
    if erase_identity:
        (mul,) = [n for n in gm.graph.nodes if n.target is aten.mul.Tensor and n.args[1] == routed_scaling]
        mul.replace_all_uses_with(mul.args[0])
        gm.graph.erase_node(mul)
    gm.graph.eliminate_dead_code()  # topk's unread values, as in the graphs the doors hand over
    return gm.graph


def _only_match(graph: torch.fx.Graph):
    (match,) = find_matches(graph, compiled_patterns(FusedRouting()))
    assert match.refused is None, match.refused
    return match


def test_matcher_reads_the_erased_unit_scale_as_routed_scaling_1():
    graph = _router_graph(1.0, erase_identity=True)
    assert not any(n.target is aten.mul.Tensor for n in graph.nodes)
    match = _only_match(graph)
    assert match.scalars["routed_scaling"] == 1.0 and match.scalars["top_k"] == TOP_K
    assert match.outputs[0].target is aten.div.Tensor


@pytest.mark.parametrize("routed_scaling", [1.0, 2.5])
def test_matcher_keeps_the_scale_op_when_the_graph_has_it(routed_scaling):
    match = _only_match(_router_graph(routed_scaling, erase_identity=False))
    assert match.scalars["routed_scaling"] == routed_scaling
    assert match.outputs[0].target is aten.mul.Tensor
