"""CPU proof of the K3 rules on the tiny reference stack, multi-rank (gloo), through both doors.

Each launch runs every check a rank can do in one process and returns plain results; the tests
below read them. What is proved:
* every rule fires exactly the expected number of times per layer (EXPECTED_PER_LAYER, per TP,
  residual mode and door), with the expected spelling variant;
* the rewritten program (torch.export + k3fuse.apply, and torch.compile(backend="k3fuse"))
  matches the unrewritten model, output and persistent KDA state, over 8 decode steps, in strict
  mode with no fallback in runtime.stats();
* each rule can be disabled alone and the others still fire (counts per the table);
* every guard rejection is logged with its reason and values: TP=1, more than 64 tokens, E not
  divisible by TP, multicast required (refused: k3fuse never uses it);
* strict mode raises outside the guarded range (dynamic token dim called with 65 tokens);
* top-k selection after moe_front_sharded is identical on every rank;
* Inductor's generated code launches the shared-expert fork before the routed experts.

Expected applied rewrites per layer (tiny K3 stack, residual "plain" and "attnres" alike):

    rule                      TP=1  TP=2  TP=4  variant per layer
    oproj_allreduce_residual    0     2     2   plain: plain+norm, moe+norm | attnres: attnres, moe
    moe_front_sharded           0     1     1   router+latent
    moe_combine                 1     1     1   the routed experts' weighted combine (reads z and the weights only)
    shared_expert_stream        1     1     1   TP>=2: gate_up (rule 1 took W_down) | TP=1: mlp
    kda_short_conv              1     1     1   the KDA short conv over [q; k; v] (independent of the others)
    kda_delta_rule              1     1     1   the KDA delta-rule step (independent of the other rules)
    decode_gemm                11     8     8   q k v g f_a f_b(+dt_bias) b W_up; TP=1 also W_o, router, W_down
    weight_prefetch             0     1     1   the routed-latent all-reduce (the only one left)

At TP=1 oproj and moe_front are rejected by their contract guard (tp >= 2) and logged.
`expected_per_layer` below is this table, plus the one-rule-disabled columns.
"""
from __future__ import annotations

import io
import re
from collections import Counter

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn

from k3fuse.dist import launch


# weight_prefetch is off by default; these tests cover its rewrites too (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("with_weight_prefetch")


RULES = ("oproj_allreduce_residual", "moe_front_sharded", "moe_combine", "shared_expert_stream", "kda_short_conv",
         "kda_delta_rule", "decode_gemm", "weight_prefetch")
N_LAYERS = 2
BATCH = 3
STEPS = 8
TOL = 2e-5


# --- the expected-count table ---------------------------------------------------------------------
def expected_per_layer(tp: int, disabled: str | None = None) -> dict[str, int]:
    """Applied rewrites per K3 layer (KDA + LatentMoE) of the reference stack.

    TP >= 2, all rules:  oproj 2 (KDA out-proj + MoE final reduction), moe_front 1, shared 1 (gate/up/SiTU
                         bracketed on the side stream, the down projection went into the MoE reduction),
                         kda_short_conv 1, kda_delta_rule 1, decode_gemm 10 (q, k, v, g, f_a, f_b[+dt_bias], b,
                         W_up, and the shared gate and up inside the bracket), weight_prefetch 1 (the
                         routed-latent all-reduce).
    TP = 1:              oproj 0 and moe_front 0 (contract: tp >= 2), shared 1 (whole MLP), kda_short_conv 1,
                         kda_delta_rule 1, decode_gemm 14 (+ W_o, router, W_down, shared down), prefetch 0 (no
                         collective).
    kda_short_conv and kda_delta_rule touch no projection or collective: 1 per layer whichever other rule is
    disabled; moe_combine (1 per layer at every TP) neither: it reads the routed experts' z and the weights.
    The shared expert's projections stay in the graph (bracketed or not), so decode_gemm takes them either way.
    Disabling one rule at TP >= 2 hands its projections to decode_gemm:
      -oproj: decode_gemm +2 (W_o, shared down), prefetch 3 (KDA, latent, shared all-reduce)
      -moe_front: decode_gemm +2 (router, W_down);  -shared: decode_gemm unchanged.
    """
    if tp == 1:
        table = {"oproj_allreduce_residual": 0, "moe_front_sharded": 0, "moe_combine": 1, "shared_expert_stream": 1,
                 "kda_short_conv": 1, "kda_delta_rule": 1, "decode_gemm": 14, "weight_prefetch": 0}
    else:
        table = {"oproj_allreduce_residual": 2, "moe_front_sharded": 1, "moe_combine": 1, "shared_expert_stream": 1,
                 "kda_short_conv": 1, "kda_delta_rule": 1, "decode_gemm": 10, "weight_prefetch": 1}
        if disabled == "oproj_allreduce_residual":
            table.update(decode_gemm=12, weight_prefetch=3)
        elif disabled == "moe_front_sharded":
            table["decode_gemm"] = 12
    if disabled is not None:
        table[disabled] = 0
    return table


def expected_variants(tp: int, residual: str, disabled: str | None = None) -> dict[str, dict[str, int]]:
    """Variants per layer: oproj (plain+norm, moe+norm) or (attnres, moe); shared gate_up or mlp."""
    out: dict[str, dict[str, int]] = {}
    if tp > 1 and disabled != "oproj_allreduce_residual":
        out["oproj_allreduce_residual"] = ({"plain+norm": 1, "moe+norm": 1} if residual == "plain"
                                           else {"attnres": 1, "moe": 1})
    if disabled != "shared_expert_stream":
        fused_down = tp > 1 and disabled != "oproj_allreduce_residual"
        out["shared_expert_stream"] = {"gate_up" if fused_down else "mlp": 1}
    return out


def expected_total(tp: int, n_layers: int, disabled: str | None = None) -> dict[str, int]:
    """Whole-graph totals (export door and torch.compile with the eager compiler).

    Not covered by the table: with torch.compile's *inductor* compiler, Inductor's joint-graph pass
    folds the AttnRes block restart `p = zeros_like(p) + y` into `p = y`, so at a restart layer the KDA
    site is a bare all-reduce: oproj fires once less and weight_prefetch once more there.
    """
    return {k: v * n_layers for k, v in expected_per_layer(tp, disabled).items()}


#: rejections per layer when the graph has 65 tokens (static): nothing fuses, so decode_gemm sees
#: every projection (14: KDA 7, W_o, router, W_down, W_up, shared gate/up/down), prefetch every
#: all-reduce (3: KDA out-proj, routed latent, shared), kda_short_conv the short conv (1) and kda_delta_rule
#: the delta-rule step (1), moe_combine the routed experts' combine (1)
TOKENS65_REJECTED_PER_LAYER = {"oproj_allreduce_residual": 2, "moe_front_sharded": 1, "moe_combine": 1,
                               "shared_expert_stream": 1,
                               "kda_short_conv": 1, "kda_delta_rule": 1, "decode_gemm": 14, "weight_prefetch": 3}


def _expected_op_calls(tp: int, residual: str, n_layers: int, compiler: str = "eager") -> dict[str, int]:
    """k3fuse ops per decode step with every rule on (what runtime.stats() counts per step). The side-stream
    markers run where the graph runs node by node; under the backend's Inductor, the region they bracket
    (outlined into one op) and its join run instead."""
    per = expected_per_layer(tp)
    calls = {"decode_gemm": per["decode_gemm"], "kda_short_conv": per["kda_short_conv"],
             "kda_delta_rule": per["kda_delta_rule"], "route_topk": 1, "routed_experts": 1,
             "moe_combine": per["moe_combine"]}
    if compiler == "inductor":
        calls.update(shared_expert_region=1, shared_expert_region_join=1)
    else:
        calls.update(shared_expert_fork=1, shared_expert_join=1)
    if tp > 1:
        fused = "gemm_ar_residual_rmsnorm" if residual == "plain" else "gemm_ar_residual"
        calls.update({fused: 2, "moe_front_sharded": 1, "l2_prefetch": 1})
    return {k: v * n_layers for k, v in calls.items()}


# --- helpers used inside the ranks ------------------------------------------------------------------
def _inputs(hidden: int, steps: int = STEPS, batch: int = BATCH, seed: int = 7) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, hidden, generator=g) for _ in range(steps)]


def _summary(log) -> dict:
    return {rule: {"applied": s["applied"], "variants": s["variants"], "why": s["why"]}
            for rule, s in log.summary().items()}


def _events(log, decision: str) -> list[dict]:
    return [{k: e.to_dict()[k] for k in ("rule", "level", "guard", "reason", "values", "variant")}
            for e in log.select(None, decision)]


def _max_diff(a, b) -> float:
    return max(float((x.double() - y.double()).abs().max()) for x, y in zip(pytree.tree_leaves(a), pytree.tree_leaves(b)))


def _run_steps(fn, model, xs) -> tuple[float, float]:
    """Max |diff| of output and of the persistent state between fn and the unrewritten model."""
    state_f = state_m = model.init_state(xs[0].shape[0])
    out_err = state_err = 0.0
    for x in xs:
        y_f, state_f = fn(x, state_f)
        y_m, state_m = model(x, state_m)
        out_err = max(out_err, _max_diff(y_f, y_m))
        state_err = max(state_err, _max_diff(state_f, state_m))
    return out_err, state_err


def _k3_ops(graph) -> Counter:
    from k3fuse.graph_facts import op_qualname

    return Counter(q.split("::")[1] for q in (op_qualname(n) for n in graph.nodes) if q and q.startswith("k3fuse::"))


def _stats_without_fallback() -> dict:
    from k3fuse import runtime

    stats = runtime.stats()
    return {"stats": stats, "fallbacks": runtime.fallbacks()}


def _export(model, x, dynamic: bool = False):
    """torch.export of one decode step, decomposed once (k3fuse.apply(..., decompose=False) reuses it)."""
    from k3fuse.matcher import decomposition_table

    kwargs = {"dynamic_shapes": model.export_dynamic_shapes(max_tokens=128)} if dynamic else {}
    ep = torch.export.export(model, (x, model.init_state(x.shape[0])), **kwargs)
    return ep, ep.run_decompositions(decomposition_table())


def _export_door(model, decomposed, xs, ctx) -> dict:
    """k3fuse.apply on the decomposed program, then STEPS strict steps against the model."""
    import k3fuse
    from k3fuse import runtime

    new_ep, log = k3fuse.apply(decomposed, ctx, decompose=False)
    runtime.reset_stats()
    with runtime.strict():
        out_err, state_err = _run_steps(new_ep.module(), model, xs)
    return {"summary": _summary(log), "ops": _k3_ops(new_ep.graph), "out_err": out_err, "state_err": state_err,
            "applied": _events(log, "applied"), "rejected": _events(log, "rejected"), **_stats_without_fallback(),
            "ep": new_ep}


def _contiguous_state(fn):
    """The state in contiguous buffers between steps, as an engine keeps it (the model's conv-window
    slice is strided; a new stride would only make Dynamo recompile the same graph)."""
    def step(x, state):
        return fn(x, pytree.tree_map(lambda t: t.contiguous(), state))
    return step


def _compile_door(model, xs, ctx, compiler: str = "eager") -> dict:
    """torch.compile(backend="k3fuse"); with Inductor also the generated code of the first call."""
    import k3fuse
    from k3fuse import runtime
    from torch._inductor.utils import run_and_get_code

    rlog = k3fuse.RewriteLog()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="k3fuse", fullgraph=True,
                             options={"compiler": compiler, "context": ctx, "log": rlog})
    code = ""
    if compiler == "inductor":
        _, (code, *_) = run_and_get_code(compiled, xs[0], model.init_state(xs[0].shape[0]))
    runtime.reset_stats()
    with runtime.strict():
        out_err, state_err = _run_steps(_contiguous_state(compiled), model, xs)
    return {"code": code, "compiler": compiler, "summary": _summary(rlog), "out_err": out_err, "state_err": state_err,
            **_stats_without_fallback()}


class MoEFront(nn.Module):
    """The K3 MoE front alone: fp32 router -> sigmoid/top-k, latent projection, shared gate/up."""

    def __init__(self, n_experts: int, latent: int, hidden: int = 32, top_k: int = 4, seed: int = 3):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w_r = nn.Parameter(torch.randn(n_experts, hidden, generator=g) / hidden ** 0.5, requires_grad=False)
        self.b_corr = nn.Parameter(torch.randn(n_experts, generator=g) * 0.05, requires_grad=False)
        self.w_down = nn.Parameter(torch.randn(latent, hidden, generator=g) / hidden ** 0.5, requires_grad=False)
        self.top_k = top_k

    def forward(self, x: torch.Tensor):
        from k3fuse.model.layers import route

        weights, idx = route(torch.nn.functional.linear(x.float(), self.w_r.float()), self.b_corr, self.top_k, 1.0)
        return weights, idx, torch.nn.functional.linear(x, self.w_down)


def _front_case(n_experts: int, latent: int, ctx) -> dict:
    import k3fuse

    torch.manual_seed(0)
    module = MoEFront(n_experts, latent)
    x = torch.randn(16, 32)  # 16 tokens: many top-k decisions
    new_ep, log = k3fuse.apply(torch.export.export(module, (x,)), ctx)
    w, idx, lat = new_ep.module()(x)
    w0, idx0, lat0 = module(x)
    return {"idx": idx, "weights": w, "latent": lat, "same_idx_as_unrewritten": bool(torch.equal(idx, idx0)),
            "err": max(_max_diff(w, w0), _max_diff(lat, lat0)), "summary": _summary(log),
            "rejected": _events(log, "rejected")}


# --- the rank workers ---------------------------------------------------------------------------
def _tp_worker(rank: int, world_size: int) -> dict:
    import k3fuse
    from k3fuse import runtime
    from k3fuse.model import K3DecodeStack, get_config

    out: dict = {}
    ctx = k3fuse.DecodeContext.from_process_group()
    for residual in ("plain", "attnres"):
        cfg = get_config("tiny", residual=residual, n_layers=N_LAYERS, attn_res_block=2)
        model = K3DecodeStack(cfg, tp_size=world_size, rank=rank, seed=5)
        xs = _inputs(cfg.hidden)
        extras = world_size == 2 and residual == "plain"
        ep, decomposed = _export(model, xs[0])
        res = _export_door(model, decomposed, xs, ctx)
        res.pop("ep")
        out[("export", residual)] = res
        # TP2 plain compiles with Inductor (its generated code is checked), the others with eager
        out[("compile", residual)] = _compile_door(model, xs, ctx, "inductor" if extras else "eager")
        if not extras:
            continue
        if rank == 0:  # the K3 graph the verifier tests rewrite by hand
            buf = io.BytesIO()
            torch.export.save(ep, buf)
            out["program"] = buf.getvalue()
        out["disabled"] = {}
        for rule in RULES:
            new, log = k3fuse.apply(decomposed, ctx.with_(disabled_rules=frozenset({rule})), decompose=False)
            out["disabled"][rule] = {"summary": _summary(log), "err": _run_steps(new.module(), model, xs[:2])}
        out["multicast"] = {}
        only_oproj = frozenset({"oproj_allreduce_residual"})
        for policy in ("require", "auto"):
            mctx = k3fuse.DecodeContext.from_process_group(multicast=policy, enabled_rules=only_oproj)
            _, log = k3fuse.apply(decomposed, mctx, decompose=False)
            out["multicast"][policy] = {"summary": _summary(log), "rejected": _events(log, "rejected"),
                                        "applied": _events(log, "applied")}
        # one-layer stacks for the rest: a dynamic token dim (1..128) so strict mode can be called
        # outside 1..64, a graph specialised to 65 tokens, and a bf16 trunk
        cfg1 = get_config("tiny", residual="plain", n_layers=1)
        m1 = K3DecodeStack(cfg1, tp_size=world_size, rank=rank, seed=5)
        dyn = _export_door(m1, _export(m1, xs[0], dynamic=True)[1], xs[:2], ctx)
        dyn_ep = dyn.pop("ep")
        out["dynamic"] = dyn
        x65, s65 = torch.randn(65, cfg.hidden), m1.init_state(65)
        runtime.reset_stats()
        with runtime.strict():
            try:
                dyn_ep.module()(x65, s65)
                out["dynamic_65_strict"] = None
            except runtime.K3FuseFallbackError as exc:
                out["dynamic_65_strict"] = str(exc)
        runtime.reset_stats()
        y65, _ = dyn_ep.module()(x65, s65)
        out["dynamic_65_lenient"] = {"err": _max_diff(y65, m1(x65, s65)[0]), "stats": runtime.fallbacks()}
        _, log = k3fuse.apply(_export(m1, torch.randn(65, cfg.hidden))[1], ctx, decompose=False)
        out["tokens65"] = {"summary": _summary(log), "rejected": _events(log, "rejected")}
        m16 = K3DecodeStack(get_config("tiny", residual="plain", n_layers=1, dtype="bfloat16"),
                            tp_size=world_size, rank=rank, seed=5)
        xs16 = [x.to(torch.bfloat16) for x in xs[:2]]
        new16, log16 = k3fuse.apply(_export(m16, xs16[0])[1], ctx, decompose=False)
        out["bf16"] = {"summary": _summary(log16), "err": _run_steps(new16.module(), m16, xs16)}
    # moe_front_sharded alone: top-k identical on every rank; E not divisible by TP rejected
    out["front"] = _front_case(16, 8 * world_size, ctx)
    out["front_bad_e"] = _front_case(4 * world_size + 1, 8 * world_size, ctx)
    return out


# --- fixtures: one launch per TP size -------------------------------------------------------------
@pytest.fixture(scope="module")
def tp2() -> list[dict]:
    return launch(_tp_worker, 2, backend="gloo", timeout_s=600)


@pytest.fixture(scope="module")
def tp4() -> list[dict]:
    return launch(_tp_worker, 4, backend="gloo", timeout_s=600)


def _applied(summary: dict) -> dict[str, int]:
    return {rule: summary.get(rule, {}).get("applied", 0) for rule in RULES}


def _variants(summary: dict, n_layers: int) -> dict[str, dict[str, int]]:
    return {rule: {v: c // n_layers for v, c in summary[rule]["variants"].items()}
            for rule in ("oproj_allreduce_residual", "shared_expert_stream") if summary.get(rule, {}).get("variants")}


# --- tests ---------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("tp_name", ["tp2", "tp4"])
@pytest.mark.parametrize("door", ["export", "compile"])
@pytest.mark.parametrize("residual", ["plain", "attnres"])
def test_rules_fire_as_expected_and_keep_the_numbers(request, tp_name, door, residual):
    results = request.getfixturevalue(tp_name)
    tp = len(results)
    for rank, out in enumerate(results):
        res = out[(door, residual)]
        assert _applied(res["summary"]) == expected_total(tp, N_LAYERS), f"rank {rank}"
        assert _variants(res["summary"], N_LAYERS) == expected_variants(tp, residual)
        assert res["out_err"] < TOL and res["state_err"] < TOL, (rank, res["out_err"], res["state_err"])
        assert res["fallbacks"] == {}, res["fallbacks"]
        calls = {op: sum(impls.values()) for op, impls in res["stats"].items()}
        compiler = res.get("compiler", "eager")
        assert calls == {op: n * STEPS for op, n in _expected_op_calls(tp, residual, N_LAYERS, compiler).items()}
        if door == "export":  # the graph holds the side-stream end markers too (they count nothing)
            assert dict(res["ops"]) == {**_expected_op_calls(tp, residual, N_LAYERS), "shared_expert_end": N_LAYERS}


@pytest.mark.slow
def test_each_rule_can_be_disabled_alone(tp2):
    for out in tp2:
        for rule, res in out["disabled"].items():
            assert _applied(res["summary"]) == expected_total(2, N_LAYERS, disabled=rule), rule
            assert res["summary"][rule]["why"] == {"contract:rule_disabled": 1}
            assert max(res["err"]) < TOL, (rule, res["err"])


@pytest.mark.slow
def test_multicast_policy_is_a_logged_guard(tp2):
    for out in tp2:
        mc = out["multicast"]
        (req,) = [e for e in mc["require"]["rejected"] if e["rule"] == "oproj_allreduce_residual"]
        assert req["level"] == "contract" and req["guard"] == "multicast"
        assert "k3fuse never uses it" in req["reason"] and "unicast" in req["reason"]
        assert req["values"] == {"policy": "require", "ops": ["gemm_ar_residual", "gemm_ar_residual_rmsnorm"]}
        assert mc["require"]["summary"]["oproj_allreduce_residual"]["applied"] == 0
        applied = [e for e in mc["auto"]["applied"] if e["rule"] == "oproj_allreduce_residual"]
        assert len(applied) == 2 * N_LAYERS


@pytest.mark.slow
def test_more_than_64_tokens_is_rejected_with_values(tp2):
    for out in tp2:
        res = out["tokens65"]
        applied = _applied(res["summary"])
        assert applied == {r: 0 for r in RULES}
        for rule, n in TOKENS65_REJECTED_PER_LAYER.items():  # a one-layer stack
            rejected = [e for e in res["rejected"] if e["rule"] == rule]
            assert len(rejected) == n, rule
            for e in rejected:
                assert e["guard"] == "token_range" and e["level"] == "site"
                assert e["reason"] == "tokens outside the context's token range"
                assert e["values"]["tokens"] == 65 and list(e["values"]["range"]) == [1, 64]


@pytest.mark.slow
def test_strict_mode_inside_range_and_raises_outside(tp2):
    for out in tp2:
        dyn = out["dynamic"]  # one layer exported with a dynamic token dim (1..128), run with 3 tokens
        assert _applied(dyn["summary"]) == expected_total(2, 1)
        assert dyn["fallbacks"] == {} and dyn["out_err"] < TOL and dyn["state_err"] < TOL
        assert out["dynamic_65_strict"] is not None and "fell back in strict mode: tokens 65 outside [1, 64]" \
            in out["dynamic_65_strict"]
        lenient = out["dynamic_65_lenient"]
        assert lenient["err"] < TOL  # the stock sequence inside the op
        # the ops with a call guard (the collective ones); decode_gemm and the fork have none
        assert lenient["stats"] == {"gemm_ar_residual_rmsnorm": {"fallback:tokens 65 outside [1, 64]": 2},
                                    "moe_front_sharded": {"fallback:tokens 65 outside [1, 64]": 1}}


@pytest.mark.slow
def test_bf16_trunk_cast_spellings(tp2):
    for out in tp2:
        res = out["bf16"]  # a one-layer stack
        assert _applied(res["summary"]) == expected_total(2, 1)
        variants = {rule: s["variants"] for rule, s in res["summary"].items() if s["variants"]}
        assert variants == {"oproj_allreduce_residual": {"plain+norm[bfloat16]": 1, "moe+norm[bfloat16]": 1},
                            "moe_front_sharded": {"router+latent[bfloat16]": 1},
                            "shared_expert_stream": {"gate_up[bfloat16]": 1},
                            "kda_short_conv": {"window[bfloat16]": 1}, "kda_delta_rule": {"tokens": 1},
                            "decode_gemm": {"linear": 10}, "weight_prefetch": {"all_reduce": 1},
                            "fused_routing": {"sigmoid": 1}, "routed_experts": {"gathered[bfloat16]": 1},
                            "moe_combine": {"combine[bfloat16]": 1}}
        assert max(res["err"]) < 0.05, res["err"]  # bf16: the fused ops round once where the model rounds often


@pytest.mark.slow
@pytest.mark.parametrize("tp_name", ["tp2", "tp4"])
def test_moe_front_topk_identical_on_every_rank_and_e_divisibility(request, tp_name):
    results = request.getfixturevalue(tp_name)
    tp = len(results)
    for out in results:
        front = out["front"]
        assert front["summary"]["moe_front_sharded"]["applied"] == 1
        assert front["same_idx_as_unrewritten"] and front["err"] < TOL
        assert torch.equal(front["idx"], results[0]["front"]["idx"])
        assert torch.equal(front["weights"], results[0]["front"]["weights"])  # bitwise: gathered fp32 logits
        bad = out["front_bad_e"]
        (e,) = [e for e in bad["rejected"] if e["rule"] == "moe_front_sharded"]
        assert e["guard"] == "divisible" and e["values"] == {"n_experts": 4 * tp + 1, "by": tp}
        assert e["reason"] == f"n_experts is not divisible by {tp}"
        assert bad["summary"]["moe_front_sharded"]["applied"] == 0


def test_tp1_counts_guards_and_numbers():
    """TP = 1 in this process: oproj and moe_front rejected by contract (values logged), the rest fire."""
    import k3fuse
    from k3fuse.model import K3DecodeStack, get_config

    ctx = k3fuse.DecodeContext()
    for residual in ("plain", "attnres"):
        cfg = get_config("tiny", residual=residual, n_layers=N_LAYERS, attn_res_block=2)
        model = K3DecodeStack(cfg, seed=5)
        xs = _inputs(cfg.hidden)
        res = _export_door(model, _export(model, xs[0])[1], xs, ctx)
        assert _applied(res["summary"]) == expected_total(1, N_LAYERS)
        assert _variants(res["summary"], N_LAYERS) == expected_variants(1, residual)
        assert res["out_err"] < TOL and res["state_err"] < TOL and res["fallbacks"] == {}
        for rule in ("oproj_allreduce_residual", "moe_front_sharded"):
            (e,) = [e for e in res["rejected"] if e["rule"] == rule]
            assert (e["level"], e["guard"], e["values"]) == ("contract", "tp_size", {"tp_size": 1, "minimum": 2})
            assert e["reason"] == "needs tp >= 2"
        comp = _compile_door(model, xs, ctx)
        assert _applied(comp["summary"]) == expected_total(1, N_LAYERS)
        assert comp["out_err"] < TOL and comp["fallbacks"] == {}


@pytest.mark.slow
def test_inductor_calls_the_outlined_shared_expert_region(tp2):
    """TP2 plain went through torch.compile(backend="k3fuse") with Inductor: Inductor launches its own kernels
    on one stream, so the backend outlined each bracketed region into one op (run on the side stream on a
    GPU) and its join; Inductor's code calls those, no marker, and the region's projections left its code
    for the region's own graph (the runtime counts them, test_rules_fire_as_expected_and_keep_the_numbers)."""
    res = tp2[0][("compile", "plain")]
    assert res["compiler"] == "inductor" and res["summary"]["shared_expert_stream"]["applied"] == N_LAYERS
    code = res["code"]
    assert "shared_expert_fork" not in code and "shared_expert_end" not in code and "shared_expert_join" not in code
    assert code.count("k3fuse.shared_expert_region.default(") == N_LAYERS
    assert code.count("k3fuse.shared_expert_region_join.default(") == N_LAYERS
    assert 0 < code.count("k3fuse.decode_gemm.default(") < expected_total(2, N_LAYERS)["decode_gemm"]
    # each region is called before its layer's routed experts (it overlaps them), its join after
    at = {op: [m.start() for m in re.finditer(re.escape(f"k3fuse.{op}.default("), code)]
          for op in ("shared_expert_region", "routed_experts", "shared_expert_region_join")}
    for start in at["shared_expert_region"]:
        routed = min(p for p in at["routed_experts"] if p > start)
        assert routed < min(p for p in at["shared_expert_region_join"] if p > start)
