"""The K3 rules on the whole model (k3fuse/model/model.py), 2 gloo ranks, strict mode, one graph per layer type.

What is proved, for the `small` preset (layers: KDA + dense MLP, KDA + MoE x 2, MLA + MoE), plain and AttnRes
residuals, torch.compile(backend="k3fuse") region by region (DecodeStep):
* every rule that applies fires in every graph it applies to: the KDA and the MLA out-projections with their
  all-reduce and residual (+ the next norm), the dense MLP's down projection and the MoE's final reduction, the
  sharded MoE front, routing, routed experts, combine, shared expert, KDA conv and delta rule, the remaining
  projections as decode GEMMs; MLA attention itself stays stock here: the mla_decode rule finds the site and
  declines it by name (the small preset's entry is 64 + 16, not K3's 512 + 64; tests/test_mla_decode_rule.py
  runs the rule on the small preset with K3's MLA widths);
* at run time every layer runs its fused ops (runtime counters per step = the layer kinds' sum), with no
  fallback in strict mode, and the tokens, logits and every state (KDA, KV cache) match the eager model;
* five graphs (embedding, the three layer types, head) serve the four layers;
* every rejection in the log carries its reason.
"""
from __future__ import annotations

import inspect
from collections import Counter

import pytest
import torch

from k3fuse.dist import launch

STEPS = 4
BATCH = 3

#: applied rewrites over the five graphs at TP 2 (per graph type, not per layer): oproj in the KDA+dense graph
#: (KDA out-proj + norm; the dense down + residual), the KDA+MoE and MLA+MoE graphs (out-proj + norm; the MoE
#: reduction + residual); the MoE rules once in each of the two MoE graphs; decode_gemm on every plain
#: projection, the shared expert's gate and up among them
EXPECTED_TP2 = {"oproj_allreduce_residual": 6, "moe_front_sharded": 2, "fused_routing": 2, "routed_experts": 2,
                "moe_combine": 2, "shared_expert_stream": 2, "kda_short_conv": 2, "kda_delta_rule": 2,
                "decode_gemm": 27}


def _per_step_calls(kinds, tp: int, compiler: str) -> Counter:
    """Fused-op calls one decode step makes, from the model's layer kinds (TP >= 2). The eager compiler calls the
    shared expert's side-stream markers; under Inductor the backend outlined each region into one op and its join
    (kernels/ops/shared_expert.py)."""
    calls: Counter = Counter()
    for k in kinds:
        calls["gemm_ar_residual_rmsnorm"] += 1  # the attention's out-projection + residual + the MLP's norm
        calls["gemm_ar_residual"] += 1  # the dense MLP's down projection, or the MoE's final reduction
        if k.attn == "kda":
            calls["kda_short_conv"] += 1
            calls["kda_delta_rule"] += 1
            calls["decode_gemm"] += 7  # q k v g f_a f_b b
        else:
            calls["decode_gemm"] += 4  # q_a q_b kv_a g
        if k.mlp == "dense":
            calls["decode_gemm"] += 2  # gate up
        else:
            markers = (("shared_expert_fork", "shared_expert_join") if compiler == "eager"
                       else ("shared_expert_region", "shared_expert_region_join"))
            for op in ("moe_front_sharded", "route_topk", "routed_experts", "moe_combine", *markers):
                calls[op] += 1
            calls["decode_gemm"] += 3  # W_up; the shared expert's gate and up (its down feeds the reduction)
    calls["decode_gemm"] += 1  # the LM head's slice
    return calls


def _run(rank: int, world: int, residual: str, compiler: str) -> dict:
    import k3fuse
    from k3fuse.model import DecodeStep, K3Model, get_config
    from k3fuse.model.layers import MLADecode

    cfg = get_config("small", residual=residual)
    model = K3Model(cfg, seed=0, tp_size=world, rank=rank)
    rlog = k3fuse.RewriteLog()
    ctx = k3fuse.DecodeContext.from_process_group(strict=True)
    torch._dynamo.reset()
    fused = DecodeStep(model, backend="k3fuse", options={"compiler": compiler, "context": ctx, "log": rlog})
    eager = DecodeStep(model)
    s_f, s_e = model.new_state(BATCH, 16, block_size=4), model.new_state(BATCH, 16, block_size=4)
    tokens = torch.tensor([5, 17, 301])
    k3fuse.reset_stats()
    err = 0.0
    with torch.no_grad(), k3fuse.strict():
        for _ in range(STEPS):
            tok_f, logits_f = fused(tokens, s_f)
            tok_e, logits_e = eager(tokens, s_e)
            assert torch.equal(tok_f, tok_e)
            err = max(err, float((logits_f - logits_e).abs().max()))
            tokens = tok_e
    for a, b in zip(s_f.kv + s_f.recurrent + s_f.conv, s_e.kv + s_e.recurrent + s_e.conv):
        err = max(err, float((a.float() - b.float()).abs().max()))
    lines, start = inspect.getsourcelines(MLADecode.forward)
    mla_lines = range(start, start + len(lines))
    in_mla = lambda e: e.source and e.source.rsplit(":", 1)[0].endswith("layers.py") and \
        int(e.source.rsplit(":", 1)[1]) in mla_lines  # noqa: E731
    mla_graphs = {e.graph_id for e in rlog.events if e.decision == "applied" and in_mla(e)}
    mla_oproj = [e.variant for e in rlog.events if e.rule == "oproj_allreduce_residual" and e.decision == "applied"
                 and e.graph_id in mla_graphs]
    return {"err": err, "applied": {r: s["applied"] for r, s in rlog.summary().items()},
            "graphs": len({e.graph_id for e in rlog.events}), "stats": k3fuse.stats(),
            "fallbacks": k3fuse.runtime.fallbacks(), "mla_oproj": mla_oproj, "kinds": model.kinds,
            "rejections": [(e.rule, e.guard, e.reason) for e in rlog.events if e.decision == "rejected"]}


def _worker(rank: int, world: int) -> dict:
    return {(residual, compiler): _run(rank, world, residual, compiler)
            for residual, compiler in (("plain", "eager"), ("attnres", "eager"), ("plain", "inductor"))}


@pytest.fixture(scope="module")
def tp2() -> list[dict]:
    return launch(_worker, 2, backend="gloo", timeout_s=1500)


@pytest.mark.slow
@pytest.mark.parametrize("case", [("plain", "eager"), ("attnres", "eager"), ("plain", "inductor")])
def test_rules_fire_on_every_layer_type_and_keep_the_tokens(tp2, case):
    for rank, ranks in enumerate(tp2):
        res = ranks[case]
        assert res["err"] < 1e-4, (rank, res["err"])
        assert res["fallbacks"] == {}, res["fallbacks"]
        assert res["graphs"] == 5  # embedding, kda+dense, kda+moe, mla+moe, head
        applied = {r: n for r, n in res["applied"].items() if n}
        assert applied == EXPECTED_TP2, applied
        # the MLA layer's out-projection, its all-reduce and the residual (+ the MLP's norm) are one fused op
        # (in the MLA + MoE graph: the out-projection's fused op, and the MoE's final reduction's)
        assert len(res["mla_oproj"]) == 2 and any(v.startswith(("plain+norm", "attnres")) for v in res["mla_oproj"]), \
            res["mla_oproj"]
        calls = {op: sum(impls.values()) for op, impls in res["stats"].items()}
        assert calls == {op: n * STEPS for op, n in _per_step_calls(res["kinds"], 2, case[1]).items()}
        for rule, guard, reason in res["rejections"]:
            assert guard and reason, (rule, guard, reason)
        assert {guard for rule, guard, _ in res["rejections"] if rule == "mla_decode"} == {"entry"}, res["rejections"]
