"""The K3 rules on decode graphs written the way HF transformers / engines write them (issue 13).

tests/thirdparty_models.py has the models: in-place `dist.all_reduce(t)` after every row-parallel
projection, HF RMSNorm, a DeepSeek-V3-style group-limited sigmoid router with correction bias and
routed scaling (router-only front: the experts read the MoE input), a Nemotron-H-style latent MoE
(the router input also feeds fc1_latent_proj and the relu^2 shared expert) and a softmax router.
Each runs through the three doors (offline k3fuse.apply; torch.compile(backend="k3fuse") with the
eager and the inductor compiler; k3fuse.inductor_pass as post_grad_custom_post_pass) at TP 1 in
this process and at TP 2 on two gloo ranks, in strict mode, against the unrewritten model.

Expected applied rewrites per decoder layer (mixer + MoE), TP 2:
    model     oproj (variants)          moe_front        shared_expert_stream  decode_gemm        weight_prefetch
    deepseek  2 (plain+norm, moe+norm)  1 router         1 (SiLU-gated)        1 (mixer in)       1 (routed AR)
    nemotron  2 (plain+norm, moe+norm)  1 router+latent  1 (relu^2, ungated)   2 (mixer in, fc2)  1 (latent AR)
    softmax   1 (plain+norm: mixer)     1 router         0 (none)              1 (mixer in)       1 (routed AR)
Every model also has one moe_combine per layer (at TP 1 and 2): its experts' weighted sum over the slots,
`(y.view(T, k, width) * weights.unsqueeze(-1)).sum(1).type(x.dtype)`, is K3's combine spelling.
The shared expert's gate/up projections go to the side stream with it (its down projection into the
fused MoE reduction), so decode_gemm takes only what is left. weight_prefetch is off by default and
named here (K3FUSE_RULES=+weight_prefetch) so its rewrites stay covered.
TP 1: no collectives: oproj and moe_front rejected by contract; the shared expert (down projection
included) goes to the side stream and decode_gemm takes every other static linear (deepseek 3:
mixer in/out, router; nemotron 5: mixer in/out, router, fc1, fc2; softmax 3: mixer in/out, router).
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.utils._pytree as pytree
from thirdparty_models import DecodeModel, SingleReductionMoE

from k3fuse.dist import launch


# weight_prefetch is off by default; these tests cover its rewrites too (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("with_weight_prefetch")

RULES = ("oproj_allreduce_residual", "moe_front_sharded", "moe_combine", "shared_expert_stream", "decode_gemm",
         "weight_prefetch")
N_LAYERS = 2
TOKENS = 3
STEPS = 3
TOL = 2e-5
DOORS = ("export", "compile.eager", "compile.inductor", "inductor_pass")


def expected_per_layer(kind: str, tp: int) -> dict[str, int]:
    """The shared expert's projections stay in the graph, bracketed on the side stream: decode_gemm takes
    them (TP 1: gate, up, down / up, down; TP 2: gate, up / up, the down went into the MoE reduction)."""
    shared = 0 if kind == "softmax" else 1
    if tp == 1:
        return {"oproj_allreduce_residual": 0, "moe_front_sharded": 0, "moe_combine": 1, "shared_expert_stream": shared,
                "decode_gemm": {"deepseek": 6, "nemotron": 7, "softmax": 3}[kind], "weight_prefetch": 0}
    if kind == "softmax":  # no shared expert: the MoE output is the reduced routed sum (no oproj site)
        return {"oproj_allreduce_residual": 1, "moe_front_sharded": 1, "moe_combine": 1, "shared_expert_stream": 0,
                "decode_gemm": 1, "weight_prefetch": 1}
    # weight_prefetch (opted in here): DeepSeek's routed all-reduce is read next by the shared expert's
    # join, a sync with no static weight before it (the shared weights were read on the side stream
    # already), so that site is refused (no_static_weights); Nemotron's feeds fc2_latent_proj's weight
    return {"oproj_allreduce_residual": 2, "moe_front_sharded": 1, "moe_combine": 1, "shared_expert_stream": 1,
            "decode_gemm": {"deepseek": 3, "nemotron": 3}[kind], "weight_prefetch": {"deepseek": 0, "nemotron": 1}[kind]}


FRONT_VARIANT = {"deepseek": "router", "softmax": "router", "nemotron": "router+latent"}


def _applied(log) -> dict[str, int]:
    s = log.summary()
    return {r: s.get(r, {}).get("applied", 0) for r in RULES}


def _variants(log, rule: str) -> dict[str, int]:
    return dict(log.summary().get(rule, {}).get("variants", {}))


def _calls() -> dict[str, int]:
    from k3fuse import runtime

    return {op: sum(impls.values()) for op, impls in runtime.stats().items()}


def _steps(fn, model) -> float:
    g = torch.Generator().manual_seed(3)
    err = 0.0
    for _ in range(STEPS):
        x = torch.randn(TOKENS, DecodeModel.HIDDEN, generator=g)
        with torch.no_grad():
            a, b = fn(x), model(x)
        err = max(err, max(float((p - q).abs().max()) for p, q in zip(pytree.tree_leaves(a), pytree.tree_leaves(b))))
    return err


def run_door(door: str, model: torch.nn.Module, ctx) -> dict:
    """Rewrite `model` through one door, run STEPS strict steps; summary, variants, error, op calls."""
    import k3fuse
    from k3fuse import runtime
    from k3fuse.matcher import decomposition_table

    rlog = k3fuse.RewriteLog()
    x0 = torch.randn(TOKENS, DecodeModel.HIDDEN)
    torch._dynamo.reset()
    if door == "export":
        ep = torch.export.export(model, (x0,)).run_decompositions(decomposition_table())
        new_ep, rlog = k3fuse.apply(ep, ctx, decompose=False)
        fn = new_ep.module()
    elif door.startswith("compile."):
        fn = torch.compile(model, backend="k3fuse", fullgraph=True,
                           options={"compiler": door.split(".")[1], "context": ctx, "log": rlog})
    else:
        fn = torch.compile(model, fullgraph=True)
        pass_ = k3fuse.inductor_pass(ctx, log=rlog)

        def run(x: torch.Tensor, _fn=fn):
            with torch._inductor.config.patch(post_grad_custom_post_pass=pass_, force_disable_caches=True):
                return _fn(x)
        fn = run
    with torch.no_grad():
        fn(x0)  # compile (the doors that compile lazily)
    runtime.reset_stats()
    with runtime.strict():
        err = _steps(fn, model)
    return {"door": door, "applied": _applied(rlog), "front": _variants(rlog, "moe_front_sharded"),
            "oproj": _variants(rlog, "oproj_allreduce_residual"), "err": err, "calls": _calls(),
            "fallbacks": runtime.fallbacks(), "not_matched": [e.to_dict() for e in rlog.select(None, "not_matched")]}


def _near_misses(ctx) -> dict:
    """Graphs where a rule's anchor op is there but its pattern is not: the not_matched reasons."""
    import k3fuse

    out = {}
    x, r = torch.randn(TOKENS, 32), torch.randn(TOKENS, 32)
    _, log = k3fuse.apply(torch.export.export(SingleReductionMoE(ctx.tp_size, ctx.rank), (x, r)), ctx)
    out["single_reduction"] = [e.to_dict() for e in log.select("oproj_allreduce_residual", "not_matched")]
    model = DecodeModel("softmax", ctx.tp_size, ctx.rank, n_layers=1, temperature=2.0)
    _, log = k3fuse.apply(torch.export.export(model, (x,)), ctx)
    out["temperature"] = [e.to_dict() for e in log.select("moe_front_sharded", "not_matched")]
    return out


def _worker(rank: int, world_size: int) -> dict:
    import k3fuse

    ctx = k3fuse.DecodeContext.from_process_group(strict=True)
    out: dict = {}
    for kind in ("deepseek", "nemotron"):
        model = DecodeModel(kind, world_size, rank, n_layers=N_LAYERS).eval()
        for door in DOORS:
            out[(kind, door)] = run_door(door, model, ctx)
    out[("softmax", "export")] = run_door("export", DecodeModel("softmax", world_size, rank, n_layers=1).eval(), ctx)
    out["near_miss"] = _near_misses(ctx)
    return out


@pytest.fixture(scope="module")
def tp2() -> list[dict]:
    return launch(_worker, 2, backend="gloo", timeout_s=900)


def _check(res: dict, kind: str, tp: int, n_layers: int) -> None:
    expected = {k: v * n_layers for k, v in expected_per_layer(kind, tp).items()}
    assert res["applied"] == expected, res["not_matched"]
    assert res["err"] < TOL, res["err"]
    assert res["fallbacks"] == {}
    if tp > 1:
        assert res["front"] == {FRONT_VARIANT[kind]: n_layers}
        if kind != "softmax":
            assert res["oproj"] == {"plain+norm": n_layers, "moe+norm": n_layers}
    calls = Counter()
    for op, n in (("decode_gemm", expected["decode_gemm"]), ("moe_front_sharded", expected["moe_front_sharded"]),
                  ("l2_prefetch", expected["weight_prefetch"]), ("moe_combine", expected["moe_combine"])):
        if n:
            calls[op] = n * STEPS
    fused = expected["oproj_allreduce_residual"] * STEPS
    if fused:
        calls["gemm_ar_residual_rmsnorm"] = fused
    # the markers run node by node; the backend's Inductor calls the region it outlined and its join; the post-grad
    # pass's Inductor lowers the markers away
    markers, outlined = ("shared_expert_fork", "shared_expert_join"), ("shared_expert_region", "shared_expert_region_join")
    side = {"export": markers, "compile.eager": markers, "compile.inductor": outlined}.get(res["door"], ())
    for op in side if expected["shared_expert_stream"] else ():
        calls[op] = expected["shared_expert_stream"] * STEPS
    assert res["calls"] == dict(calls)


@pytest.mark.slow
@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize("kind", ["deepseek", "nemotron"])
def test_tp2_rules_fire_at_every_site_and_keep_the_numbers(tp2, kind, door):
    for res in (out[(kind, door)] for out in tp2):
        _check(res, kind, 2, N_LAYERS)


@pytest.mark.slow
def test_tp2_softmax_router_only_front(tp2):
    for out in tp2:
        _check(out[("softmax", "export")], "softmax", 2, 1)


@pytest.mark.slow
def test_tp2_near_miss_reasons(tp2):
    """The anchor op is there, the pattern is not: not_matched names the candidate and the divergence."""
    for out in tp2:
        (e,) = out["near_miss"]["single_reduction"]
        assert e["reason"] == ("plain+norm: the _c10d_functional.all_reduce input is aten.add (add), not aten.mm")
        assert e["values"] == {"candidate": "all_reduce", "diverged_at": "add", "expected": "aten.mm",
                               "found": "aten.add", "output": "add_1"}
        (e,) = out["near_miss"]["temperature"]
        assert e["reason"] == "router: the score function softmax (div_1) reads aten.div (div), not a router linear"
        assert e["values"] == {"topk": "topk", "diverged_at": "div", "op": "aten.div", "reader": "div_1"}


@pytest.mark.parametrize("door", ["export", "compile.eager"])
@pytest.mark.parametrize("kind", ["deepseek", "nemotron", "softmax"])
def test_tp1_counts_and_numbers(kind, door):
    import k3fuse

    ctx = k3fuse.DecodeContext(strict=True)
    res = run_door(door, DecodeModel(kind, n_layers=N_LAYERS).eval(), ctx)
    _check(res, kind, 1, N_LAYERS)
