"""The K3 rules on whole decode models written as transformers 5 writes Kimi Linear, DeepSeek-V3, Kimi K2.5
and a K3: tests/thirdparty_models.py's `HFDecodeModel`, hidden states [B, 1, H], the KDA
conv state updated in place as HF's cache is.

Each model runs through the doors (k3fuse.apply on torch.export; torch.compile(backend="k3fuse") with the
eager compiler; k3fuse.inductor_pass) at TP 1 in this process and at TP 2 on two gloo ranks, in strict
mode, for STEPS decode steps (states carried) against the unrewritten model. Expected per layer:
    model         kda_delta  kda_conv  fused_routing        routed_experts       moe_combine  shared_expert
    kimi_linear   1          1         1 (one group)        0: SiLU refused      1 (flat)     1
    deepseek_v3   -          -         0: 2 of 4 groups     0: SiLU refused      1 (flat)     1
    kimi_k25      -          -         1 (one group)        0: SiLU refused      1 (flat)     1
    k3            1          1         1 (one group)        1 (packed gate_up)   1 (flat)     1
At TP 2 also oproj_allreduce_residual (the KDA / attention out-projection, plain+norm) and moe_front_sharded
(the router) once per layer, and the shared expert, whose partial joins the routed partial in the MoE's one
all-reduce (flattened to [T, H] for the add: its tokens equal its input's), is bracketed as at TP 1. The
MoE's joined reduction itself is no oproj site (it reduces two partials; the op adds a reduced addend).
The refused sites are logged with the reason that names the difference.
Through k3fuse.inductor_pass the router stays stock: Inductor's post-grad passes rewrite the group mask's
`scatter` into a one-hot compare before the hook runs, and the not_matched event says where the graph
diverged from HF's spelling (the export and backend doors see HF's own ops).
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.utils._pytree as pytree
from thirdparty_models import HF_KINDS, HFDecodeModel

from k3fuse.dist import launch

N_LAYERS = 2
BATCH = 3
STEPS = 3
TOL = 2e-5
RULES = ("kda_delta_rule", "kda_short_conv", "fused_routing", "routed_experts", "moe_combine",
         "shared_expert_stream", "oproj_allreduce_residual", "moe_front_sharded")
#: the op each rule inserts (called once per site and step)
OPS = {"kda_delta_rule": "kda_delta_rule", "kda_short_conv": "kda_short_conv", "fused_routing": "route_topk",
       "routed_experts": "routed_experts", "moe_combine": "moe_combine", "moe_front_sharded": "moe_front_sharded",
       "oproj_allreduce_residual": "gemm_ar_residual_rmsnorm", "decode_gemm": "decode_gemm"}
GROUP_LIMITED = ("group-limited routing: each token takes its experts from its best 2 of 4 expert groups, "
                 "k3fuse.route_topk from all 8 experts (it would pick others)")
SILU = ("the experts compute SiLU-GLU, silu(g) * u; k3fuse.routed_experts computes K3's SiTU-GLU, another "
        "function of the same projections")


def expected_per_layer(kind: str, tp: int) -> dict[str, int]:
    mixer, _, act, n_group, topk_group = HF_KINDS[kind]
    kda = int(mixer == "kda")
    return {"kda_delta_rule": kda, "kda_short_conv": kda, "fused_routing": int(topk_group >= n_group),
            "routed_experts": int(act == "situ"), "moe_combine": 1, "shared_expert_stream": 1,
            "oproj_allreduce_residual": int(tp > 1), "moe_front_sharded": int(tp > 1)}


def refused_per_layer(kind: str) -> dict[str, tuple[str, str]]:
    """rule -> (guard, reason) of the sites the model's semantics keep stock."""
    _, _, act, n_group, topk_group = HF_KINDS[kind]
    out = {}
    if topk_group < n_group:
        out["fused_routing"] = ("group_limited", GROUP_LIMITED)
    if act == "silu":
        out["routed_experts"] = ("activation", SILU)
    return out


def _inputs():
    gen = torch.Generator().manual_seed(21)
    return [torch.randn(BATCH, 1, HFDecodeModel.HIDDEN, generator=gen) for _ in range(STEPS)]


def _clone(states):
    return tuple(s.clone() for s in states)


def _run_steps(fn, model) -> float:
    """STEPS steps of `fn` and of `model` from the same states (the conv states updated in place, the
    recurrent states returned and carried): the largest difference in outputs and states."""
    conv, rec = model.init_states(BATCH)
    conv_f, rec_f, conv_m, rec_m = _clone(conv), rec, _clone(conv), rec
    err = 0.0
    for x in _inputs():
        with torch.no_grad():
            y_f, rec_f = fn(x, conv_f, rec_f)
            y_m, rec_m = model(x, conv_m, rec_m)
        leaves = zip(pytree.tree_leaves((y_f, rec_f, conv_f)), pytree.tree_leaves((y_m, rec_m, conv_m)))
        err = max(err, max(float((a - b).abs().max()) for a, b in leaves))
    return err


def run_door(door: str, model, ctx) -> dict:
    import k3fuse
    from k3fuse import runtime
    from k3fuse.matcher import decomposition_table

    log = k3fuse.RewriteLog()
    x0 = _inputs()[0]
    conv, rec = model.init_states(BATCH)
    torch._dynamo.reset()
    if door == "export":
        ep = torch.export.export(model, (x0, _clone(conv), rec)).run_decompositions(decomposition_table())
        program, log = k3fuse.apply(ep, ctx, decompose=False)
        fn = program.module()
    elif door == "compile.eager":
        fn = torch.compile(model, backend="k3fuse", fullgraph=True,
                           options={"compiler": "eager", "context": ctx, "log": log})
    else:
        compiled = torch.compile(model, fullgraph=True)
        hook = k3fuse.inductor_pass(ctx, log=log)

        def fn(*args, _compiled=compiled):
            with torch._inductor.config.patch(post_grad_custom_post_pass=hook, force_disable_caches=True):
                return _compiled(*args)
    with torch.no_grad():
        fn(x0, _clone(conv), rec)  # compile (the doors that compile lazily)
    runtime.reset_stats()
    with runtime.strict():
        err = _run_steps(fn, model)
    summary = log.summary()
    return {"door": door, "err": err, "fallbacks": runtime.fallbacks(),
            "calls": {op: sum(impls.values()) for op, impls in runtime.stats().items()},
            "applied": {r: summary.get(r, {}).get("applied", 0) for r in (*RULES, "decode_gemm")},
            "variants": {r: dict(summary.get(r, {}).get("variants", {})) for r in RULES},
            "refused": [(e.rule, e.guard, e.reason) for e in log.events
                        if e.decision == "rejected" and e.rule in ("fused_routing", "routed_experts")],
            "not_matched": {e.rule: e.reason for e in log.events if e.decision == "not_matched"}}


def _check(res: dict, kind: str, tp: int) -> None:
    expected = {r: n * N_LAYERS for r, n in expected_per_layer(kind, tp).items()}
    if res["door"] == "inductor_pass":  # the post-grad graph's group mask is a one-hot compare, not a scatter
        expected["fused_routing"] = 0
        assert res["not_matched"]["fused_routing"].startswith("grouped: "), res["not_matched"]
        assert "not aten.scatter" in res["not_matched"]["fused_routing"], res["not_matched"]
    assert {r: res["applied"][r] for r in RULES} == expected, res
    assert res["err"] < TOL, res["err"]
    assert res["fallbacks"] == {}
    refused = Counter(res["refused"])
    assert refused == Counter({(r, g, why): N_LAYERS for r, (g, why) in refused_per_layer(kind).items()}), refused
    if expected["kda_delta_rule"]:
        assert res["variants"]["kda_delta_rule"] == {"broadcast": N_LAYERS}
        assert res["variants"]["kda_short_conv"] == {"conv1d": N_LAYERS}
    if expected["fused_routing"]:
        assert res["variants"]["fused_routing"] == {"grouped": N_LAYERS}
    if expected["routed_experts"]:
        assert res["variants"]["routed_experts"] == {"batched": N_LAYERS}
    calls = Counter({OPS[r]: n * STEPS for r, n in res["applied"].items() if n and r in OPS})
    if res["door"] != "inductor_pass":  # Inductor lowers the side-stream markers away
        calls["shared_expert_fork"] = calls["shared_expert_join"] = N_LAYERS * STEPS
    assert res["calls"] == dict(calls), (res["calls"], dict(calls))


@pytest.mark.parametrize("kind", list(HF_KINDS))
def test_tp1_export(kind):
    import k3fuse

    _check(run_door("export", HFDecodeModel(kind, n_layers=N_LAYERS).eval(), k3fuse.DecodeContext(strict=True)),
           kind, 1)


@pytest.mark.slow
@pytest.mark.parametrize("door", ["compile.eager", "inductor_pass"])
@pytest.mark.parametrize("kind", ["kimi_linear", "k3"])
def test_tp1_compile_doors(kind, door):
    import k3fuse

    _check(run_door(door, HFDecodeModel(kind, n_layers=N_LAYERS).eval(), k3fuse.DecodeContext(strict=True)),
           kind, 1)


def _worker(rank: int, world_size: int) -> dict:
    import k3fuse

    ctx = k3fuse.DecodeContext.from_process_group(strict=True)
    out = {}
    for kind in HF_KINDS:
        model = HFDecodeModel(kind, world_size, rank, n_layers=N_LAYERS).eval()
        doors = ("export", "compile.eager") if kind in ("kimi_linear", "k3") else ("export",)
        for door in doors:
            out[(kind, door)] = run_door(door, model, ctx)
    return out


@pytest.fixture(scope="module")
def tp2() -> list[dict]:
    return launch(_worker, 2, backend="gloo", timeout_s=900)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(HF_KINDS))
def test_tp2_every_rule_fires_or_names_the_difference(tp2, kind):
    for out in tp2:
        for (k, _), res in out.items():
            if k == kind:
                _check(res, kind, 2)
