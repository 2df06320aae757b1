"""Inductor door: k3fuse.inductor_pass(ctx) as post_grad_custom_post_pass, chained and cache-keyed."""
from __future__ import annotations

import pytest
import torch
from engine_helpers import LINEAR_RESIDUAL, Capture, LinearResidualRule, ResidualStack, op_counts
from torch._inductor.custom_graph_pass import CustomGraphPass

import k3fuse
from k3fuse.inductor import K3FusePass
from k3fuse.log import RewriteLog


class Recorder(CustomGraphPass):
    """A pass someone installed before k3fuse: it must keep running."""

    def __init__(self):
        self.seen = []

    def __call__(self, graph):
        self.seen.append(op_counts(graph))

    def uuid(self):
        return b"recorder-v1"


def compile_with(pass_, model, h):
    torch._dynamo.reset()
    with torch._inductor.config.patch(post_grad_custom_post_pass=pass_, force_disable_caches=True), torch.no_grad():
        return torch.compile(model)(h)


def test_inductor_pass_rewrites_and_chains_existing_pass():
    model, h = ResidualStack(layers=2).eval(), torch.randn(4, 16)
    previous = Recorder()
    after = Capture("after")
    log = RewriteLog()
    with torch._inductor.config.patch(post_grad_custom_post_pass=previous):
        p = k3fuse.inductor_pass(k3fuse.DecodeContext(), rules=[LinearResidualRule(), after], log=log)
    assert isinstance(p, K3FusePass) and p.chain is previous
    out = compile_with(p, model, h)
    assert len(previous.seen) == 1 and previous.seen[0][LINEAR_RESIDUAL] == 0
    assert after.counts[-1][LINEAR_RESIDUAL] == 2 and after.counts[-1]["aten::addmm"] == 0
    assert log.applied("linear_residual") == 2 and log.events[0].door == "inductor"
    with torch.no_grad():
        torch.testing.assert_close(out, model(h))


def test_uuid_changes_with_context_rules_and_chain():
    base = k3fuse.inductor_pass(k3fuse.DecodeContext(), rules=[LinearResidualRule()])
    same = k3fuse.inductor_pass(k3fuse.DecodeContext(), rules=[LinearResidualRule()])
    other_ctx = k3fuse.inductor_pass(k3fuse.DecodeContext(tokens=(1, 8)), rules=[LinearResidualRule()])
    other_rules = k3fuse.inductor_pass(k3fuse.DecodeContext(), rules=[])
    with torch._inductor.config.patch(post_grad_custom_post_pass=Recorder()):
        chained = k3fuse.inductor_pass(k3fuse.DecodeContext(), rules=[LinearResidualRule()])
    assert base.uuid() == same.uuid()
    assert len({base.uuid(), other_ctx.uuid(), other_rules.uuid(), chained.uuid()}) == 4


def test_without_static_metadata_site_guards_reject():
    """Called outside compile (no TracingContext): nothing is static, so nothing is fused, and it says why."""
    gm = torch.fx.experimental.proxy_tensor.make_fx(
        lambda h, w: h + torch.nn.functional.linear(h, w), tracing_mode="fake")(torch.randn(4, 16), torch.randn(16, 16))
    log = RewriteLog()
    k3fuse.inductor_pass(k3fuse.DecodeContext(), rules=[LinearResidualRule()], log=log)(gm.graph)
    assert log.applied() == 0
    assert [(e.decision, e.guard) for e in log] == [("rejected", "static_weight")]


@pytest.mark.parametrize("tokens", [(1, 64)])
def test_inductor_pass_with_k3fuse_rules_env(monkeypatch, tokens):
    monkeypatch.setenv("K3FUSE_RULES", "-linear_residual")
    model, h = ResidualStack(layers=1).eval(), torch.randn(4, 16)
    log = RewriteLog()
    compile_with(k3fuse.inductor_pass({"tokens": tokens}, rules=[LinearResidualRule()], log=log), model, h)
    assert [(e.decision, e.guard) for e in log] == [("rejected", "rule_disabled")]
