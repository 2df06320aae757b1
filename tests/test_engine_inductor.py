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


# --- what the engines need from the pass object -------------------------------------------------

class _Range:
    """vLLM's compile range as the pass sees it (start and end inclusive)."""

    def __init__(self, start, end):
        self.start, self.end = start, end


def test_pass_survives_deepcopy_and_pickling_and_keys_by_hex_uuid():
    import copy
    import json
    import pickle

    log = RewriteLog()
    p = k3fuse.inductor_pass({"tokens": (1, 8)}, rules=[LinearResidualRule()], log=log)
    uid = p.uuid()
    assert isinstance(uid, str) and int(uid, 16) >= 0 and json.dumps([uid])  # vLLM json.dumps the uuids
    clone = copy.deepcopy(p)
    assert clone.log is log and clone.uuid() == uid
    shipped = pickle.loads(pickle.dumps(p))
    assert shipped._ctx is None and shipped.uuid() == uid  # rebuilt from the process it lands in
    model, h = ResidualStack(layers=1).eval(), torch.randn(4, 16)
    compile_with(clone, model, h)
    assert log.applied("linear_residual") == 1  # the deep copy wrote into the caller's log


def test_is_applicable_for_range_is_the_decode_token_guard():
    p = k3fuse.inductor_pass({"tokens": (1, 64)}, rules=[])
    assert p.is_applicable_for_range(_Range(1, 64)) and p.is_applicable_for_range(_Range(8, 8))
    assert not p.is_applicable_for_range(_Range(1, 8192)) and not p.is_applicable_for_range(_Range(65, 128))


def test_pass_added_twice_is_an_error():
    from k3fuse.engines import EngineError

    first = k3fuse.inductor_pass(k3fuse.DecodeContext(), rules=[LinearResidualRule()])
    with torch._inductor.config.patch(post_grad_custom_post_pass=first):
        with pytest.raises(EngineError, match="already holds k3fuse's pass"):
            k3fuse.inductor_pass(k3fuse.DecodeContext())
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    first(gm.graph)
    with pytest.raises(EngineError, match="ran twice on one graph"):
        K3FusePass(k3fuse.DecodeContext(), rules=[])(gm.graph)


def test_engine_versions_and_missing_tp_group_are_clear_errors():
    from k3fuse.engines import EngineError, find_tp_group, sglang, vllm

    for version in ("0.27.0", "0.32.0", "0.34.0", "0.34.2+cpu"):
        assert vllm.ENGINE.check_version(version) == version
    for version in ("0.26.1", "0.35.0"):
        with pytest.raises(EngineError, match=rf"vLLM {version} is not supported.*0.27.0 up to \(not including\) 0.35"):
            vllm.ENGINE.check_version(version)
    for version in ("0.5.17", "0.5.21", "0.5.23", "0.5.23.post1"):
        assert sglang.ENGINE.check_version(version) == version
    for version in ("0.5.16", "0.5.24", "0.6.0"):
        with pytest.raises(EngineError, match=rf"SGLang {version} is not supported.*0.5.17 up to .*0.5.24"):
            sglang.ENGINE.check_version(version)
    with pytest.raises(EngineError, match="no vLLM TP group in this process"):
        find_tp_group("vllm")
    with pytest.raises(EngineError, match="unknown TP group source"):
        K3FusePass(None, group="megatron")
    with pytest.raises(EngineError, match="no SGLang TP group"):
        K3FusePass(None, group="sglang").ctx  # noqa: B018  built on first use
    assert find_tp_group("auto").group is None  # no engine, no torch.distributed: one rank


def test_sglang_install_sets_the_global_hook_once():
    from torch._inductor import config as inductor_config

    from k3fuse.engines import EngineError
    from k3fuse.engines import sglang_hook as sglang

    with inductor_config.patch(post_grad_custom_post_pass=None):
        installed = sglang.install({"tokens": (1, 64)})
        assert inductor_config.post_grad_custom_post_pass is installed and installed.group == "sglang"
        with pytest.raises(EngineError, match="already installed"):
            sglang.install()
        sglang.plugin()  # the entry point after an explicit install: no second pass
        assert inductor_config.post_grad_custom_post_pass is installed


def _lazy_context_worker(rank: int, world_size: int) -> tuple:
    import copy
    import pickle

    import torch.distributed as dist

    p = k3fuse.inductor_pass({"tokens": (1, 8)})  # no context: built from torch's default group on first use
    shipped = pickle.loads(pickle.dumps(copy.deepcopy(p)))
    return (p.ctx.tp_size, p.ctx.rank, p.ctx.group_name == dist.group.WORLD.group_name, p.ctx.tokens,
            shipped.ctx.rank, shipped.uuid() == p.uuid())


@pytest.mark.slow
def test_context_is_built_from_torchs_default_group_when_the_pass_runs():
    from k3fuse.dist import launch

    assert launch(_lazy_context_worker, 2, timeout_s=120) == [(2, 0, True, (1, 8), 0, True),
                                                              (2, 1, True, (1, 8), 1, True)]
