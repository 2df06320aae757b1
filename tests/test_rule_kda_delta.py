"""kda_delta_rule on CPU: the op, its reference and stock sequence, the rule through all three doors.

* the fp32 reference against the float64 oracle (tests/reference_f64.py), K3 head dim included;
* the stock sequence is the model's `delta_rule`, bit for bit;
* the rule fires once per KDA layer through torch.compile(backend="k3fuse", compiler="eager"),
  k3fuse.inductor_pass and k3fuse.apply on torch.export, at TP1 (here) and TP2 (2 gloo ranks),
  and the rewritten program matches the unrewritten model (output and state, 4 decode steps) in
  strict mode with runtime.stats() showing only the reference;
* each of einsum's four bmm forms (T = 1 / h = 1) is matched; broadcast or non-fp32 operands are
  refused with the values logged; on a GPU context a head dim the kernel does not serve is refused;
* the Triton kernel compiles for sm_90 (no GPU needed) and covers K3's shapes at every token count.
"""
from __future__ import annotations

import pytest
import reference_f64
import torch
import torch.utils._pytree as pytree

import k3fuse
from k3fuse import runtime
from k3fuse.dist import launch
from k3fuse.kernels.lib.reference import kda_delta as ref_kda
from k3fuse.kernels.lib.reference import stock
from k3fuse.model import K3DecodeStack, get_config
from k3fuse.model.layers import delta_rule
from stack_helpers import reference_then_stock

RULE = "kda_delta_rule"
N_LAYERS = 2
STEPS = 4
BATCH = 3
TOL = 2e-5
H100 = (9, 0)


def _operands(T: int, h: int, dk: int, dv: int, seed: int = 0, dtype=torch.float32):
    """Decode-like operands: unit-norm k, q scaled by dk^-1/2, beta in (0, 1), g in (-5, 0)."""
    gen = torch.Generator().manual_seed(seed)

    def rn(*shape):
        return torch.randn(*shape, generator=gen)

    S = rn(T, h, dk, dv) * 0.5
    g = -5.0 * torch.sigmoid(rn(T, h, dk))
    beta = torch.sigmoid(rn(T, h))
    k = torch.nn.functional.normalize(rn(T, h, dk), dim=-1)
    v = rn(T, h, dv)
    q = torch.nn.functional.normalize(rn(T, h, dk), dim=-1) * dk ** -0.5
    return tuple(t.to(dtype) for t in (S, g, beta, k, v, q))


# --- op, reference, stock ---------------------------------------------------------------------------
@pytest.mark.parametrize("T,h,dk,dv", [(1, 2, 16, 16), (3, 4, 16, 16), (7, 2, 32, 32), (2, 3, 128, 128),
                                       (5, 1, 64, 48)])
def test_reference_matches_float64_oracle(T, h, dk, dv):
    args = _operands(T, h, dk, dv, seed=T * 100 + dk)
    S_ref, o_ref = reference_f64.delta_rule(*args)
    S, o = ref_kda.kda_delta_rule(*args)
    assert S.dtype == o.dtype == torch.float32 and S.shape == (T, h, dk, dv) and o.shape == (T, h, dv)
    torch.testing.assert_close(S.double(), S_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-5, atol=1e-5)


def test_stock_is_the_models_delta_rule_bit_for_bit():
    for T, h in ((1, 2), (3, 4), (2, 1)):
        args = _operands(T, h, 16, 16, seed=T)
        for a, b in zip(stock.kda_delta_rule(*args), delta_rule(*args)):
            assert torch.equal(a, b)


def test_op_strict_on_cpu_counts_the_reference_and_disable_runs_stock():
    reference_then_stock(torch.ops.k3fuse.kda_delta_rule, _operands(3, 2, 16, 16), delta_rule)


def test_fake_impl_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        args = tuple(torch.empty(s) for s in ((5, 3, 16, 8), (5, 3, 16), (5, 3), (5, 3, 16), (5, 3, 8), (5, 3, 16)))
        S, o = torch.ops.k3fuse.kda_delta_rule(*args)
    assert S.shape == (5, 3, 16, 8) and o.shape == (5, 3, 8) and S.dtype == o.dtype == torch.float32


# --- the rule on small modules -----------------------------------------------------------------------
class Step(torch.nn.Module):
    """The model's delta_rule on graph inputs, followed by a consumer of each output."""

    def forward(self, recurrent, g, beta, k, v, q):
        S, o = delta_rule(recurrent, g, beta, k, v, q)
        return S * 1.0, o + 1.0


@pytest.mark.parametrize("T,h,variant", [(3, 4, "tokens"), (1, 4, "one_token"), (3, 1, "one_head"),
                                         (1, 1, "one_token_one_head")])
def test_each_einsum_form_is_matched(T, h, variant):
    args = _operands(T, h, 16, 16)
    new_ep, log = k3fuse.apply(torch.export.export(Step(), args), k3fuse.DecodeContext(strict=True))
    assert log.applied(RULE) == 1, log.summary()
    assert log.summary()[RULE]["variants"] == {variant: 1}
    runtime.reset_stats()
    with runtime.strict():
        out = new_ep.module()(*args)
    assert runtime.stats() == {RULE: {"reference": 1}}
    for a, b in zip(out, Step()(*args)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("T,h", [(3, 4), (1, 4), (3, 1), (1, 1)])
def test_structural_form_alone_matches_every_einsum_form(monkeypatch, T, h):
    """Without the traced forms, the structural matcher (Inductor's door) finds the same sites."""
    from k3fuse.patterns.kda_delta_rule import KDADeltaRule

    monkeypatch.setattr(KDADeltaRule, "patterns", lambda self: [])
    args = _operands(T, h, 16, 16)
    new_ep, log = k3fuse.apply(torch.export.export(Step(), args), k3fuse.DecodeContext())
    assert log.applied(RULE) == 1 and log.summary()[RULE]["variants"] == {"layout": 1}
    for a, b in zip(new_ep.module()(*args), Step()(*args)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class WrongContraction(torch.nn.Module):
    """S k instead of S^T k in the first contraction (square head, so the shapes still agree)."""

    def forward(self, recurrent, g, beta, k, v, q):
        S = recurrent * torch.exp(g).unsqueeze(-1)
        e = beta.unsqueeze(-1) * (v - torch.einsum("thvk,thk->thv", S, k))
        S = S + k.unsqueeze(-1) * e.unsqueeze(-2)
        return S, torch.einsum("thkv,thk->thv", S, q)


@pytest.mark.parametrize("T,h", [(3, 4), (1, 4)])
def test_a_different_contraction_is_not_matched(T, h):
    _, log = k3fuse.apply(torch.export.export(WrongContraction(), _operands(T, h, 16, 16)), k3fuse.DecodeContext())
    assert log.applied(RULE) == 0 and not log.rejected(RULE)


def test_broadcast_and_non_fp32_operands_are_refused_with_values():
    args = list(_operands(3, 2, 16, 16))
    args[1] = args[1][0]  # g [h, dk], broadcast over tokens
    _, log = k3fuse.apply(torch.export.export(Step(), tuple(args)), k3fuse.DecodeContext())
    (e,) = log.rejected(RULE)
    assert (e.level, e.guard) == ("site", "shape") and e.values["g"] == ["2", "16"]
    assert log.applied(RULE) == 0

    args64 = _operands(3, 2, 16, 16, dtype=torch.float64)
    _, log = k3fuse.apply(torch.export.export(Step(), args64), k3fuse.DecodeContext())
    (e,) = log.rejected(RULE)
    assert (e.level, e.guard) == ("site", "dtype") and e.values["recurrent"] == "torch.float64"


def test_more_than_64_tokens_is_rejected():
    _, log = k3fuse.apply(torch.export.export(Step(), _operands(65, 2, 16, 16)), k3fuse.DecodeContext())
    (e,) = log.rejected(RULE)
    assert (e.level, e.guard, e.values["tokens"]) == ("site", "token_range", 65)


# --- the K3 stack through the three doors -----------------------------------------------------------
def _max_diff(a, b) -> float:
    return max(float((x.double() - y.double()).abs().max())
               for x, y in zip(pytree.tree_leaves(a), pytree.tree_leaves(b)))


def _run_steps(fn, model, xs) -> float:
    state_f = state_m = model.init_state(xs[0].shape[0])
    err = 0.0
    for x in xs:
        y_f, state_f = fn(x, pytree.tree_map(lambda t: t.contiguous(), state_f))
        y_m, state_m = model(x, state_m)
        err = max(err, _max_diff((y_f, state_f), (y_m, state_m)))
    return err


def _strict_steps(fn, model, xs) -> dict:
    runtime.reset_stats()
    with runtime.strict():
        err = _run_steps(fn, model, xs)
    return {"err": err, "stats": runtime.stats().get(RULE, {}), "fallbacks": runtime.fallbacks()}


def _three_doors(tp_size: int, rank: int) -> dict:
    """k3fuse.apply on torch.export, torch.compile(backend="k3fuse") with the eager compiler, and
    k3fuse.inductor_pass under torch.compile's Inductor; per door the rule's applied count,
    variants, the largest difference to the model over STEPS strict steps and the op's stats."""
    ctx = k3fuse.DecodeContext.from_process_group() if tp_size > 1 else k3fuse.DecodeContext()
    model = K3DecodeStack(get_config("tiny", n_layers=N_LAYERS), tp_size=tp_size, rank=rank, seed=5)
    gen = torch.Generator().manual_seed(11)
    xs = [torch.randn(BATCH, model.config.hidden, generator=gen) for _ in range(STEPS)]
    out = {}

    ep = torch.export.export(model, (xs[0], model.init_state(BATCH)))
    new_ep, log = k3fuse.apply(ep, ctx)
    out["export"] = {"applied": log.applied(RULE), "variants": log.summary()[RULE]["variants"],
                     **_strict_steps(new_ep.module(), model, xs)}

    rlog = k3fuse.RewriteLog()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="k3fuse", fullgraph=True,
                             options={"compiler": "eager", "context": ctx, "log": rlog})
    res = _strict_steps(compiled, model, xs)
    out["compile"] = {"applied": rlog.applied(RULE), "variants": rlog.summary()[RULE]["variants"], **res}

    ilog = k3fuse.RewriteLog()
    torch._dynamo.reset()
    with torch._inductor.config.patch(post_grad_custom_post_pass=k3fuse.inductor_pass(ctx, log=ilog),
                                      force_disable_caches=True), torch.no_grad():
        res = _strict_steps(torch.compile(model, fullgraph=True), model, xs)
    out["inductor_pass"] = {"applied": ilog.applied(RULE), "variants": ilog.summary()[RULE]["variants"], **res}
    return out


def _tp_worker(rank: int, world_size: int) -> dict:
    return _three_doors(world_size, rank)


def _check_doors(out: dict) -> None:
    # Inductor's post-grad graph lays the bmm operands out its own way: the structural form
    for door, variant in (("export", "tokens"), ("compile", "tokens"), ("inductor_pass", "layout")):
        res = out[door]
        assert res["applied"] == N_LAYERS, (door, res)
        assert res["variants"] == {variant: N_LAYERS}, (door, res)
        assert res["err"] < TOL, (door, res["err"])
        assert res["fallbacks"] == {} and res["stats"] == {"reference": N_LAYERS * STEPS}, (door, res)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_three_doors(tp):
    for out in [_three_doors(1, 0)] if tp == 1 else launch(_tp_worker, tp, backend="gloo", timeout_s=600):
        _check_doors(out)


# --- the Triton kernel on CPU: compile for sm_90, coverage ------------------------------------------
def test_triton_kernel_compiles_for_sm90():
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    from k3fuse.kernels.lib.triton import kda_delta

    ptrs = ("s_ptr", "g_ptr", "b_ptr", "k_ptr", "v_ptr", "q_ptr", "so_ptr", "o_ptr")
    ints = ("H", "DV", "s_st", "s_sh", "g_st", "g_sh", "b_st", "b_sh", "k_st", "k_sh", "v_st", "v_sh", "q_st",
            "q_sh")
    sig = {**{p: "*fp32" for p in ptrs}, **{i: "i32" for i in ints},
           "DK": "constexpr", "BLOCK_V": "constexpr", "EVEN_V": "constexpr"}
    # what Triton specialises at run time for K3 (pointers and 16-divisible ints: DV, the strides)
    attrs = {(i,): [["tt.divisibility", 16]] for i in (*range(8), 9, 10, 11, 14, 15, 16, 17, 18, 19, 20, 21)}
    for T, heads, dk, dv in ((64, 96, 128, 128), (1, 12, 128, 128), (3, 8, 16, 16), (2, 2, 32, 48)):
        cfg = kda_delta.pick_config(T, heads, dk, dv)
        even = dv % cfg["BLOCK_V"] == 0
        src = triton.compiler.ASTSource(fn=kda_delta._kda_delta_kernel, signature=sig, attrs=attrs,
                                        constexprs={"DK": dk, "BLOCK_V": cfg["BLOCK_V"], "EVEN_V": even})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg["num_warps"]})
        ptx = k.asm["ptx"]
        assert "ex2.approx" in ptx and ".local" not in ptx  # the decay, and no register spills
        assert "atom." not in ptx  # no atomics: a fixed reduction order
        if (dk, dv) == (128, 128):  # the state streams in 16-byte vectors, evicted first, once each way
            assert "ld.global.L1::evict_first.L2::cache_hint.v4.b32" in ptx
            assert "st.global.L1::evict_first.L2::cache_hint.v4.b32" in ptx


def test_kernel_covers_k3_shapes_and_names_its_limits():
    pytest.importorskip("triton")
    from k3fuse.guards import kernel_covers
    from k3fuse.kernels import dispatch

    from k3fuse.kernels.ops.kda_delta import KDADeltaSpec

    for heads in (96, 48, 12):  # K3 at TP 1, 2, 8
        assert dispatch.coverage(KDADeltaSpec(heads=heads, dk=128, dv=128), range(1, 65)) == {}
    ctx = k3fuse.DecodeContext(device_capability=H100)
    f = kernel_covers(ctx, KDADeltaSpec(heads=8, dk=24, dv=24), tokens=None)
    assert f is not None and (f.level, f.guard, f.values["tokens"]) == ("site", "kernel_shape", "1-64")
    assert any(lim.startswith("triton.kda_delta: dk=24") for lim in f.values["limits"])
    assert kernel_covers(k3fuse.DecodeContext(), KDADeltaSpec(heads=8, dk=24, dv=24), tokens=3) is None


def test_rule_on_a_gpu_context_refuses_a_head_dim_no_kernel_serves():
    pytest.importorskip("triton")
    gpu = k3fuse.DecodeContext(device_capability=H100, enabled_rules=frozenset({RULE}))
    for head_dim, applied in ((16, 1), (24, 0)):
        model = K3DecodeStack(get_config("tiny", n_layers=1, head_dim=head_dim), seed=0)
        x = torch.randn(2, model.config.hidden)
        _, log = k3fuse.apply(torch.export.export(model, (x, model.init_state(2))), gpu)
        assert log.applied(RULE) == applied
        if not applied:
            (e,) = log.rejected(RULE)
            assert (e.guard, e.values["dk"], e.values["tokens"]) == ("kernel_shape", 24, "2")
