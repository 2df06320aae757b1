"""The normalisation's engine-spelling machinery on ops of a test library (fast, no engine).

The real engines' ops are exercised in tests/test_engine_vllm.py and tests/test_engine_sglang.py
(marker `engines`); here: an in-place all-reduce spelled directly (not functionalised), restored
where nothing fused it, and a prior engine fusion named in the not-matched reason.
"""
from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from k3fuse import engine_ops, vocabulary
from k3fuse.context import DecodeContext
from k3fuse.log import RewriteLog
from k3fuse.matcher import trace_aten
from k3fuse.patterns.oproj_allreduce_residual import OProjAllReduceResidual
from k3fuse.pipeline import run_pipeline

_lib = torch.library.Library("k3fuse_spelling_test", "FRAGMENT")
_lib.define("inplace_sum(Tensor(a!) tensor, str group_name) -> ()")
_lib.define("fused_allreduce_norm(Tensor x, Tensor residual, Tensor w, float eps, str group) -> (Tensor, Tensor)")
_lib.define("outplace_sum(Tensor tensor, str group_name) -> Tensor")
_lib.impl("inplace_sum", lambda tensor, group_name: None, "CompositeExplicitAutograd")
_lib._register_fake("outplace_sum", lambda tensor, group_name: torch.empty_like(tensor))
_lib._register_fake("fused_allreduce_norm", lambda x, residual, w, eps, group: (torch.empty_like(residual),
                                                                                 torch.empty_like(residual)))
ops = torch.ops.k3fuse_spelling_test


def _ops(graph: torch.fx.Graph) -> list[str]:
    return [str(n.target) for n in graph.nodes if n.op == "call_function"]


def test_inplace_all_reduce_becomes_functional_and_goes_back(monkeypatch):
    monkeypatch.setitem(engine_ops._ENGINE_SPELLINGS, "k3fuse_spelling_test::inplace_sum", engine_ops.AllReduceSpelling(
        "k3fuse_spelling_test::inplace_sum", "test", resolve=lambda name: f"c10d-{name}", mutates=True))

    def f(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        ops.inplace_sum(y, "tp:0")
        return y + 1

    gm = make_fx(f, tracing_mode="fake")(torch.randn(4, 8))
    before = _ops(gm.graph)
    done = engine_ops.translate_engine_ops(gm.graph, trace_aten)
    assert len(done) == 1
    after = {n.target: n for n in gm.graph.nodes if n.op == "call_function"}
    ar, copy_back = after[torch.ops._c10d_functional.all_reduce.default], after[torch.ops.aten.copy_.default]
    assert ar.args[1:] == ("sum", "c10d-tp:0")
    assert after[torch.ops.aten.add.Tensor].args[0] is copy_back  # the later reader reads the sum
    assert vocabulary.copied_value(copy_back).target is torch.ops._c10d_functional.wait_tensor.default
    assert engine_ops.restore_engine_ops(gm.graph, done) == 1
    gm.graph.lint()
    assert _ops(gm.graph) == before


def test_a_site_an_engine_already_fused_is_named_in_the_not_matched_reason(monkeypatch):
    advice = "the engine's own all-reduce + norm fusion took this site; switch it off"
    monkeypatch.setitem(engine_ops._ENGINE_SPELLINGS, "k3fuse_spelling_test::fused_allreduce_norm",
                        engine_ops.PriorFusion("k3fuse_spelling_test::fused_allreduce_norm", "test",
                                              ("_c10d_functional::all_reduce",), advice))

    def f(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, norm_w: torch.Tensor):  # noqa: ANN202
        return ops.fused_allreduce_norm(torch.nn.functional.linear(x, w), residual, norm_w, 1e-6, "tp:0")

    gm = make_fx(f, tracing_mode="fake")(torch.randn(4, 8), torch.randn(16, 8), torch.randn(4, 16), torch.randn(16))
    log = RewriteLog()
    run_pipeline(gm, DecodeContext(tp_size=2, group_name="tp"), rules=[OProjAllReduceResidual()], log=log)
    (event,) = log.events
    assert event.decision == "not_matched" and event.reason.startswith(advice)
    assert event.values["taken_by"] == ["test k3fuse_spelling_test::fused_allreduce_norm (fused_allreduce_norm)"]


def test_vllms_flashinfer_fusion_is_registered_with_its_switch():
    spelling = engine_ops.engine_spellings()["vllm::flashinfer_trtllm_fused_allreduce_norm"]
    assert isinstance(spelling, engine_ops.PriorFusion) and "pass_config.fuse_allreduce_rms=false" in spelling.advice
    assert spelling.takes == (OProjAllReduceResidual.site_op._schema.name,)


def test_fp32_residual_norm_is_matched_in_the_trunk_dtype_and_restored(monkeypatch):
    """An engine registered for the fp32-residual norm (SGLang is): its bf16 graph matches the bf16
    pattern (the static-weight guard is what rejects it) and goes back as it came."""
    monkeypatch.setitem(engine_ops._ENGINE_SPELLINGS, "k3fuse_spelling_test::outplace_sum", engine_ops.AllReduceSpelling(
        "k3fuse_spelling_test::outplace_sum", "SGLang", resolve=lambda name: "tp"))

    def f(x, w, residual, norm_w):  # noqa: ANN001, ANN202
        y = ops.outplace_sum(torch.nn.functional.linear(x, w), "tp:0")
        total = y.float() + residual.float()
        kept = total.to(torch.bfloat16)
        normed = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (normed * norm_w).to(torch.bfloat16), kept

    bf16 = {"dtype": torch.bfloat16}
    gm = make_fx(f, tracing_mode="fake")(torch.randn(4, 8, **bf16), torch.randn(16, 8, **bf16),
                                         torch.randn(4, 16, **bf16), torch.randn(16, **bf16))
    before = _ops(gm.graph)
    log = RewriteLog()
    run_pipeline(gm, DecodeContext(tp_size=2, group_name="tp"), rules=[OProjAllReduceResidual()], log=log)
    assert [(e.decision, e.guard, e.variant) for e in log] == [("rejected", "static_weight", "plain+norm[bfloat16]")]
    assert sorted(_ops(gm.graph)) == sorted(before)
