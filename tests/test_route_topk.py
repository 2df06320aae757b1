"""route_topk on CPU: the op, its reference and stock sequence, the Triton kernel through Triton's
interpreter, and the fused_routing rule on the K3 stack.

* the reference is the model's `route` (idx identical, weights to an ulp: its sum runs in selection
  order), breaks ties to the lowest index whatever torch.topk does, puts NaN first; the stock
  sequence is the model's `route` bit for bit; the fake impl names bad shapes and dtypes;
* the Triton kernel runs on CPU through TRITON_INTERPRET=1 in a subprocess (the variable must be
  set before triton is imported, and must not leak into the other tests) at K3's E=896, k=16 and
  T in {1, 3, 17, 64}: outputs pre-filled with NaN / -7 are all written, idx equals the reference's
  exactly, weights equal the reference's bit for bit when both use the same sigmoid (the
  interpreter's exp is numpy's, torch's CPU sigmoid is its own: within 1e-6 relative otherwise),
  adversarial ties (few distinct logits, -inf / +inf biases, NaN logits) pick what the reference
  picks; the kernel also compiles for sm_90 (PTX: IEEE division, no atomics, no spills);
* the rule (off by default, named here) fires once per layer through k3fuse.apply and
  torch.compile(backend="k3fuse"), fp32 and bf16 trunks, TP1 and TP2 (after moe_front_sharded
  replaced the logits' producer), strict mode with runtime.stats() showing only the reference; the
  routing of the rewritten router is the model's (idx equal) and the same bits on every rank; a
  softmax router is not matched, with the reason; on a GPU context a shape no kernel covers is
  refused.
"""
from __future__ import annotations

import textwrap

import pytest
import torch
from torch import nn

import k3fuse
from k3fuse import runtime
from k3fuse.dist import launch
from k3fuse.kernels.lib.reference import routing, stock
from k3fuse.model.layers import route
from stack_helpers import compiled_door, max_diff, strict_steps, tiny_stack
from triton_interpreter import run_in_interpreter

RULE, OP = "fused_routing", "route_topk"
N_LAYERS = 2
STEPS = 3
BATCH = 3
TOL = 2e-5
H100 = (9, 0)
DEFAULTS = frozenset({"oproj_allreduce_residual", "moe_front_sharded", "shared_expert_stream", "kda_delta_rule",
                      "decode_gemm"})


def _logits(T: int, E: int, seed: int = 0, scale: float = 2.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, E, generator=g) * scale, torch.randn(E, generator=g) * 0.05


# --- reference, stock, fake ----------------------------------------------------------------------
@pytest.mark.parametrize("T,E,k,scale", [(1, 896, 16, 2.5), (17, 896, 16, 1.0), (5, 16, 4, 1.0), (3, 64, 1, 0.5)])
def test_reference_is_the_models_route(T, E, k, scale):
    logits, b = _logits(T, E, seed=T + E)
    w, idx = routing.route_topk(logits, b, k, scale)
    w0, idx0 = route(logits, b, k, scale)
    assert w.dtype == torch.float32 and idx.dtype == torch.int64 and w.shape == idx.shape == (T, k)
    assert w.is_contiguous() and idx.is_contiguous()
    assert torch.equal(idx, idx0)
    torch.testing.assert_close(w, w0, rtol=1e-6, atol=0)  # only the sum's order differs


def test_stock_is_the_models_route_bit_for_bit():
    logits, b = _logits(9, 896, seed=1)
    for a, c in zip(stock.route_topk(logits, b, 16, 2.5), route(logits, b, 16, 2.5)):
        assert torch.equal(a, c)


def test_reference_breaks_ties_to_the_lowest_index_and_puts_nan_first():
    E, k = 64, 8
    b = torch.zeros(E)
    logits = torch.zeros(3, E)
    logits[1, [5, 9, 40]] = 1.0          # three clear winners, then 61 equal scores
    logits[2, [50, 7]] = float("nan")    # NaN sorts above every number, NaNs by index
    w, idx = routing.route_topk(logits, b, k, 1.0)
    assert idx[0].tolist() == list(range(k))
    assert idx[1].tolist() == [5, 9, 40, 0, 1, 2, 3, 4]
    assert idx[2].tolist() == [7, 50, 0, 1, 2, 3, 4, 5] and torch.isnan(w[2]).all()
    # equal scores through the bias: every even expert gets +0.25, every odd one nothing
    b2 = torch.tensor([0.25 if e % 2 == 0 else 0.0 for e in range(E)])
    _, idx2 = routing.route_topk(torch.zeros(1, E), b2, k, 1.0)
    assert idx2[0].tolist() == [0, 2, 4, 6, 8, 10, 12, 14]
    # the weights are the unbiased scores, renormalised: equal scores -> equal weights
    assert torch.equal(routing.route_topk(torch.zeros(1, E), b2, k, 2.0)[0], torch.full((1, k), 0.25))


def test_op_strict_on_cpu_counts_the_reference_and_disable_runs_stock():
    logits, b = _logits(4, 896)
    runtime.reset_stats()
    with runtime.strict():
        w, idx = torch.ops.k3fuse.route_topk(logits, b, 16, 2.5)
    assert runtime.stats() == {OP: {"reference": 1}}
    w_ref, idx_ref = routing.route_topk(logits, b, 16, 2.5)
    assert torch.equal(w, w_ref) and torch.equal(idx, idx_ref)
    runtime.reset_stats()
    with k3fuse.disable():
        w1, idx1 = torch.ops.k3fuse.route_topk(logits, b, 16, 2.5)
    assert runtime.stats() == {OP: {"fallback:disabled": 1}}
    w0, idx0 = route(logits, b, 16, 2.5)
    assert torch.equal(w1, w0) and torch.equal(idx1, idx0)


def test_fake_impl_shapes_and_messages():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        w, idx = torch.ops.k3fuse.route_topk(torch.empty(5, 896), torch.empty(896), 16, 2.5)
        assert w.shape == idx.shape == (5, 16) and w.dtype == torch.float32 and idx.dtype == torch.int64
        for args, message in (((torch.empty(5, 896, dtype=torch.bfloat16), torch.empty(896)), "must be float32"),
                              ((torch.empty(5, 896), torch.empty(895)), r"expected \[E\] = \(896,\)"),
                              ((torch.empty(896), torch.empty(896)), r"must be \[T, E\]")):
            with pytest.raises(Exception, match=message):
                torch.ops.k3fuse.route_topk(*args, 16, 2.5)
        with pytest.raises(Exception, match="top_k=900 exceeds the 896 experts"):
            torch.ops.k3fuse.route_topk(torch.empty(5, 896), torch.empty(896), 900, 2.5)


# --- the Triton kernel through Triton's interpreter (a subprocess: TRITON_INTERPRET must be set
# before triton is imported) ------------------------------------------------------------------------
INTERPRETER_SCRIPT = textwrap.dedent("""
    import json, os, sys
    assert os.environ["TRITON_INTERPRET"] == "1"
    import numpy as np
    import torch
    from k3fuse.kernels.lib.triton import route_topk as K
    from k3fuse.kernels.lib.reference import routing
    assert K.INTERPRET and K.HAVE_TRITON

    E, k, scale = 896, 16, 2.5

    def np_sigmoid(x):  # what the interpreter computes: numpy's float32 exp, IEEE division
        xn = x.contiguous().numpy()
        return torch.from_numpy(np.divide(np.float32(1), np.float32(1) + np.exp(-xn)))

    def case(name, logits, b):
        T = logits.shape[0]
        w = torch.full((T, k), float("nan")); idx = torch.full((T, k), -7, dtype=torch.int64)
        K.run(logits, b, k, scale, out=(w, idx))
        w_ref, idx_ref = routing.route_topk(logits, b, k, scale)          # torch's CPU sigmoid
        w_np, idx_np = routing.route_from_scores(np_sigmoid(logits), b, k, scale)  # the same sigmoid
        finite = torch.isfinite(w_ref)
        rel = ((w - w_ref).abs() / w_ref.abs().clamp_min(1e-30))[finite]
        return {"case": name, "T": T, "written": bool((idx != -7).all()) and bool((~torch.isnan(w) | torch.isnan(w_ref)).all()),
                "idx_equal_ref": bool(torch.equal(idx, idx_ref)), "idx_equal_np": bool(torch.equal(idx, idx_np)),
                "w_bitwise_np": bool(torch.equal(w, w_np) or torch.equal(w.nan_to_num(7.0), w_np.nan_to_num(7.0))),
                "w_bitwise_ref": bool(torch.equal(w.nan_to_num(7.0), w_ref.nan_to_num(7.0))),
                "w_max_rel_ref": float(rel.max()) if rel.numel() else 0.0,
                "nan_equal": bool(torch.equal(torch.isnan(w), torch.isnan(w_ref)))}

    out = []
    for T in (1, 3, 17, 64):
        g = torch.Generator().manual_seed(T)
        out.append(case("random", torch.randn(T, E, generator=g) * 2, torch.randn(E, generator=g) * 0.05))
    g = torch.Generator().manual_seed(99)
    # ties: logits from three values and a bias from two: hundreds of equal biased scores per row
    levels = torch.tensor([-1.0, 0.0, 0.5])
    logits = levels[torch.randint(0, 3, (17, E), generator=g)]
    b = torch.tensor([0.0, 0.125])[torch.randint(0, 2, (E,), generator=g)]
    out.append(case("ties", logits, b))
    out.append(case("all_equal", torch.zeros(3, E), torch.zeros(E)))
    # -inf / +inf biases: 10 finite experts, 6 ties at -inf; two +inf experts
    b = torch.full((E,), float("-inf")); b[torch.arange(10) * 80 + 3] = 0.0
    out.append(case("minus_inf", torch.randn(3, E, generator=g), b))
    b = torch.zeros(E); b[[700, 11]] = float("inf")
    out.append(case("plus_inf", torch.randn(3, E, generator=g), b))
    logits = torch.randn(3, E, generator=g); logits[1, [600, 5]] = float("nan")
    out.append(case("nan", logits, torch.randn(E, generator=g) * 0.05))
    # a row stride that is not E (logits a slice of a wider tensor)
    wide = torch.randn(5, E + 64, generator=g)
    out.append(case("row_stride", wide[:, :E], torch.randn(E, generator=g) * 0.05))
    print("RESULT " + json.dumps(out))
""")


@pytest.fixture(scope="module")
def interpreter_results() -> list[dict]:
    return run_in_interpreter(INTERPRETER_SCRIPT, timeout=600)


def test_interpreter_random_logits_at_k3_shapes(interpreter_results):
    random = [r for r in interpreter_results if r["case"] == "random"]
    assert [r["T"] for r in random] == [1, 3, 17, 64]
    for r in random:
        assert r["written"] and r["idx_equal_ref"] and r["idx_equal_np"], r
        assert r["w_bitwise_np"], r       # same sigmoid: the same bits
        assert r["w_max_rel_ref"] < 1e-6, r  # torch's CPU sigmoid: an ulp or two apart


@pytest.mark.parametrize("case", ["ties", "all_equal", "minus_inf", "plus_inf", "nan", "row_stride"])
def test_interpreter_adversarial_ties(interpreter_results, case):
    (r,) = [r for r in interpreter_results if r["case"] == case]
    assert r["written"] and r["idx_equal_ref"] and r["idx_equal_np"] and r["nan_equal"], r
    assert r["w_bitwise_np"], r
    if case in ("all_equal", "ties"):  # sigmoid(0) = 0.5 exactly, so these also match torch's bits
        assert r["w_bitwise_ref"] or r["w_max_rel_ref"] < 1e-6, r


def test_triton_kernel_compiles_for_sm90():
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    from k3fuse.kernels.lib.triton import route_topk

    sig = {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "w_ptr": "*fp32", "idx_ptr": "*i64", "E": "i32",
           "l_st": "i32", "routed_scaling": "fp32", "eps": "fp32", "TOP_K": "constexpr", "BLOCK_E": "constexpr",
           "BLOCK_K": "constexpr"}
    attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 5)}
    for E, k in ((896, 16), (256, 8), (2048, 32)):
        cfg = route_topk.pick_config(E, k)
        src = triton.compiler.ASTSource(fn=route_topk._route_topk_kernel, signature=sig, attrs=attrs,
                                        constexprs={"TOP_K": k, "BLOCK_E": cfg["BLOCK_E"], "BLOCK_K": cfg["BLOCK_K"]})
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg["num_warps"]}).asm["ptx"]
        assert "div.rn.f32" in ptx and "div.full.f32" not in ptx  # IEEE division, as torch's sigmoid
        assert "atom." not in ptx and ".local" not in ptx  # no atomics, no register spills


def test_kernel_covers_k3_shapes_and_names_its_limits():
    pytest.importorskip("triton")
    from k3fuse.guards import kernel_covers
    from k3fuse.kernels import dispatch

    from k3fuse.kernels.ops.route_topk import RouteTopkSpec

    assert dispatch.coverage(RouteTopkSpec(E=896, top_k=16), range(1, 65)) == {}
    ctx = k3fuse.DecodeContext(device_capability=H100)
    f = kernel_covers(ctx, RouteTopkSpec(E=4096, top_k=16), tokens=None)
    assert f is not None and (f.guard, f.values["tokens"]) == ("kernel_shape", "1-64")
    assert any(lim.startswith("triton.route_topk: E=4096") for lim in f.values["limits"])


# --- the rule --------------------------------------------------------------------------------------
class Front(nn.Module):
    """The K3 router: fp32 logits -> the model's `route` (softmax=True: a softmax score instead)."""

    def __init__(self, n_experts: int = 64, hidden: int = 32, top_k: int = 8, scale: float = 2.5,
                 softmax: bool = False):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.w_r = nn.Parameter(torch.randn(n_experts, hidden, generator=g) / hidden ** 0.5, requires_grad=False)
        self.b_corr = nn.Parameter(torch.randn(n_experts, generator=g) * 0.05, requires_grad=False)
        self.top_k, self.scale, self.softmax = top_k, scale, softmax

    def forward(self, x):
        logits = nn.functional.linear(x.float(), self.w_r.float())
        if not self.softmax:
            return route(logits, self.b_corr, self.top_k, self.scale)
        scores = torch.softmax(logits, dim=-1)
        _, idx = torch.topk(scores + self.b_corr, self.top_k, dim=-1)
        w = scores.gather(-1, idx)
        return w / (w.sum(-1, keepdim=True) + 1e-20) * self.scale, idx


def _named(ctx_kw=None, **kw) -> k3fuse.DecodeContext:
    return k3fuse.DecodeContext(enabled_rules=DEFAULTS | {RULE}, **(ctx_kw or {}), **kw)


def test_rule_on_the_router_captures_top_k_and_scale_and_keeps_the_routing():
    module, x = Front(), torch.randn(16, 32)
    new_ep, log = k3fuse.apply(torch.export.export(module, (x,)), _named(strict=True))
    (e,) = [e for e in log.events if e.rule == RULE and e.decision == "applied"]
    assert e.variant == "sigmoid" and e.values["top_k"] == 8 and e.values["routed_scaling"] == 2.5
    runtime.reset_stats()
    with runtime.strict():
        w, idx = new_ep.module()(x)
    assert runtime.stats()[OP] == {"reference": 1} and runtime.fallbacks() == {}
    w0, idx0 = module(x)
    assert torch.equal(idx, idx0)
    torch.testing.assert_close(w, w0, rtol=1e-6, atol=0)


def test_rule_runs_by_default_and_the_environment_turns_it_off(monkeypatch):
    _, log = k3fuse.apply(torch.export.export(Front(), (torch.randn(4, 32),)), k3fuse.DecodeContext())
    assert log.applied(RULE) == 1
    monkeypatch.setenv("K3FUSE_RULES", "-fused_routing")
    _, log = k3fuse.apply(torch.export.export(Front(), (torch.randn(4, 32),)), k3fuse.DecodeContext())
    (e,) = log.rejected(RULE)
    assert log.applied(RULE) == 0 and e.guard == "rule_disabled"


def test_softmax_router_is_not_matched_with_the_reason():
    _, log = k3fuse.apply(torch.export.export(Front(softmax=True), (torch.randn(4, 32),)), _named())
    assert log.applied(RULE) == 0 and not log.rejected(RULE)
    (e,) = [e for e in log.events if e.rule == RULE and e.decision == "not_matched"]
    assert e.reason.startswith("sigmoid: the top-k") and "selects from softmax" in e.reason, e.reason
    assert e.values["kind"] == "softmax"


def test_gpu_context_refuses_experts_no_kernel_covers():
    pytest.importorskip("triton")
    gpu = _named(device_capability=H100)
    for n_experts, applied in ((64, 1), (4096, 0)):
        _, log = k3fuse.apply(torch.export.export(Front(n_experts=n_experts), (torch.randn(4, 32),)), gpu)
        assert log.applied(RULE) == applied
        if not applied:
            (e,) = log.rejected(RULE)
            assert (e.guard, e.values["E"], e.values["tokens"]) == ("kernel_shape", 4096, "4")


# --- the K3 stack: both doors, fp32 and bf16 trunks, TP1 and TP2 ----------------------------------------
def _strict_steps(fn, model, xs) -> dict:
    res = strict_steps(fn, model, xs)
    return {**res, "stats": res["stats"].get(OP, {})}


def _paired(fn_a, fn_b, state, xs) -> float:
    """Largest difference of two programs run side by side from the same state."""
    state_a = state_b = state
    err = 0.0
    for x in xs:
        y_a, state_a = fn_a(x, state_a)
        y_b, state_b = fn_b(x, state_b)
        err = max(err, max_diff((y_a, state_a), (y_b, state_b)))
    return err


def _stack(tp_size: int, rank: int) -> dict:
    ctx = (k3fuse.DecodeContext.from_process_group(enabled_rules=DEFAULTS | {RULE}, strict=True) if tp_size > 1
           else _named(strict=True))
    out = {}
    for dtype in ("float32", "bfloat16"):
        model, xs = tiny_stack(dtype, tp_size, rank, N_LAYERS, BATCH, STEPS)
        ep = torch.export.export(model, (xs[0], model.init_state(BATCH)))
        new_ep, log = k3fuse.apply(ep, ctx)
        out[("export", dtype)] = {"summary": log.summary(), **_strict_steps(new_ep.module(), model, xs)}
        if dtype == "bfloat16":  # the same program rewritten without fused_routing: only the routing differs
            base_ep, _ = k3fuse.apply(ep, ctx.with_(enabled_rules=DEFAULTS))
            out[("export", dtype)]["err_vs_defaults"] = _paired(new_ep.module(), base_ep.module(),
                                                                model.init_state(BATCH), xs)
        if dtype == "float32":
            res = compiled_door(model, xs, ctx)
            out[("compile", dtype)] = {**res, "stats": res["stats"].get(OP, {})}
    # the router alone: the rewritten routing against the model's, and across ranks
    module, x = Front(n_experts=64, top_k=8), torch.randn(16, 32, generator=torch.Generator().manual_seed(2))
    new_ep, log = k3fuse.apply(torch.export.export(module, (x,)), ctx)
    w, idx = new_ep.module()(x)
    w0, idx0 = module(x)
    out["front"] = {"applied": log.applied(RULE), "w": w, "idx": idx, "idx_equal_model": bool(torch.equal(idx, idx0)),
                    "w_err": float((w - w0).abs().max())}
    return out


def _tp_worker(rank: int, world_size: int) -> dict:
    return _stack(world_size, rank)


def _check_stack(out: dict, tp: int) -> None:
    for (door, dtype), res in ((k, v) for k, v in out.items() if isinstance(k, tuple)):
        s = res["summary"]
        assert s[RULE]["applied"] == N_LAYERS and s[RULE]["variants"] == {"sigmoid": N_LAYERS}, (door, dtype, s[RULE])
        assert s["moe_front_sharded"]["applied"] == (N_LAYERS if tp > 1 else 0), (door, dtype)
        assert s["shared_expert_stream"]["applied"] == N_LAYERS, (door, dtype)  # its join still finds its anchor
        assert res["fallbacks"] == {} and res["stats"] == {"reference": N_LAYERS * STEPS}, (door, dtype, res)
        if dtype == "float32":
            assert res["err"] < TOL, (door, dtype, res["err"])
        else:  # bf16: the other rules' roundings differ from the model's; the routing adds nothing
            assert res["err"] < 0.25 and res["err_vs_defaults"] < 1e-2, (door, dtype, res)
    front = out["front"]
    assert front["applied"] == 1 and front["idx_equal_model"] and front["w_err"] < 1e-6, front


def test_k3_stack_tp1_both_doors_fp32_and_bf16():
    _check_stack(_stack(1, 0), 1)


@pytest.mark.slow
def test_k3_stack_tp2_after_moe_front_sharded_and_identical_on_every_rank():
    results = launch(_tp_worker, 2, backend="gloo", timeout_s=600)
    for out in results:
        _check_stack(out, 2)
    a, b = (r["front"] for r in results)
    assert torch.equal(a["idx"], b["idx"]) and torch.equal(a["w"], b["w"])  # same bits on every rank
