"""allreduce_rmsnorm and the moe_tail_allreduce_norm rule on CPU (issue 9 item 3).

* the op's reference (fp32 all-reduce over gloo, RMSNorm of the fp32 sum) against a float64
  oracle at TP 2, T in {1, 3, 17, 64}, fp32 and bf16; the same bits on both ranks; the stock
  sequence is the model's (functional all-reduce + spelling.rms_norm) bit for bit; strict mode
  counts only "reference"; the kill switch runs stock; the fake impl gives shapes and names bad
  norm weights;
* the rule (off by default, named here) fires once per layer on the reference K3 stack (tiny) at
  TP 2 through k3fuse.apply and torch.compile(backend="k3fuse"), fp32 and bf16 trunks, after
  oproj_allreduce_residual (which takes the same number of sites with or without it: the latent
  all-reduce is not one of its sites); the outputs equal the model's within TOL (fp32) / BF16_TOL;
  it is logged rule_disabled unless named, rejected by tp_size at TP 1, and a graph whose
  all-reduce is not followed by an RMSNorm gets a near-miss naming the diverging node.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import k3fuse
from k3fuse import runtime
from k3fuse.dist import launch
from k3fuse.kernels.lib.reference import allreduce as ref_allreduce
from k3fuse.kernels.lib.reference import stock
from k3fuse.model import K3DecodeStack, get_config
from k3fuse.spelling import all_reduce_sum, rms_norm
from stack_helpers import compiled_door, max_diff, strict_steps, tiny_stack

RULE, OP = "moe_tail_allreduce_norm", "allreduce_rmsnorm"
N_LAYERS, STEPS, BATCH = 2, 2, 3
TOL = 2e-5          # fp32 trunk: the op sums in fp32 like the model; only summation order may differ
BF16_TOL = 0.25     # bf16 trunk, whole stack: the other rules' roundings already differ from the model's
EPS = 1e-5
TOKENS = (1, 3, 17, 64)
L = 3584
DEFAULTS = frozenset({"oproj_allreduce_residual", "moe_front_sharded", "shared_expert_stream", "kda_delta_rule",
                      "decode_gemm"})


def _named(**kw) -> k3fuse.DecodeContext:
    return k3fuse.DecodeContext(enabled_rules=DEFAULTS | {RULE}, **kw)


# --- op: fake, TP 1 ---------------------------------------------------------------------------------
def test_fake_impl_shapes_and_messages():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        s, n = torch.ops.k3fuse.allreduce_rmsnorm(torch.empty(5, 64, dtype=torch.bfloat16),
                                                  torch.empty(64, dtype=torch.bfloat16), EPS, "g", 2)
        assert s.shape == n.shape == (5, 64) and s.dtype == n.dtype == torch.bfloat16
        with pytest.raises(Exception, match=r"norm_weight is \(63,\), expected \[L\] = \(64,\)"):
            torch.ops.k3fuse.allreduce_rmsnorm(torch.empty(5, 64), torch.empty(63), EPS, "g", 2)
        with pytest.raises(Exception, match="must be floating point"):
            torch.ops.k3fuse.allreduce_rmsnorm(torch.empty(5, 64, dtype=torch.int32), torch.empty(64), EPS, "g", 2)


def test_tp1_reference_is_the_norm_and_disable_runs_stock():
    x, w = torch.randn(3, 64), torch.randn(64) * 0.1 + 1
    runtime.reset_stats()
    with runtime.strict():
        s, n = torch.ops.k3fuse.allreduce_rmsnorm(x, w, EPS, "", 1)
    assert runtime.stats() == {OP: {"reference": 1}}
    assert torch.equal(s, x) and s.data_ptr() != x.data_ptr()
    torch.testing.assert_close(n, rms_norm(x, w, EPS), rtol=1e-6, atol=1e-6)
    runtime.reset_stats()
    with k3fuse.disable():
        s1, n1 = torch.ops.k3fuse.allreduce_rmsnorm(x, w, EPS, "", 1)
    assert runtime.stats() == {OP: {"fallback:disabled": 1}}
    assert torch.equal(s1, x) and torch.equal(n1, rms_norm(x, w, EPS))


def test_reference_does_not_write_its_input():
    x = torch.randn(2, 8, dtype=torch.float64)
    x0 = x.clone()
    ref_allreduce.allreduce_rmsnorm(x, torch.ones(8, dtype=torch.float64), EPS, "", 1)
    assert torch.equal(x, x0)


# --- TP 2 over gloo: op vs float64, stock, the rule on the K3 stack ---------------------------------------


def _op_checks(rank: int, world: int) -> dict:
    import torch.distributed as dist

    group = dist.group.WORLD.group_name
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(7)
        w = (torch.randn(L, generator=g) * 0.1 + 1).to(dtype)
        for T in TOKENS:
            parts = [torch.randn(T, L, generator=torch.Generator().manual_seed(100 * T + r)).to(dtype)
                     for r in range(world)]
            x = parts[rank]
            runtime.reset_stats()
            with runtime.strict():
                s, n = torch.ops.k3fuse.allreduce_rmsnorm(x, w, EPS, group, world)
            stats = runtime.stats()
            s64 = sum(p.double() for p in parts)
            n64 = s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + EPS) * w.double()
            s0, n0 = stock.allreduce_rmsnorm(x, w, EPS, group, world)
            model = rms_norm(torch.ops._c10d_functional.wait_tensor(
                torch.ops._c10d_functional.all_reduce(x, "sum", group)), w, EPS)
            out[(str(dtype), T)] = {
                "stats": stats, "s": s, "n": n, "shape_ok": s.shape == n.shape == x.shape,
                "dtype_ok": s.dtype == n.dtype == dtype,
                # errors relative to the float64 oracle, in units of the output dtype's epsilon
                "s_err": float(((s.double() - s64).abs() / (s64.abs() + 1)).max()),
                "n_err": float(((n.double() - n64).abs() / (n64.abs() + 1)).max()),
                "stock_is_model": bool(torch.equal(n0, model)),
                "vs_stock": max_diff((s, n), (s0, n0)),
            }
    return out


class AllReduceAdd(nn.Module):
    """An all-reduce followed by an add, not an RMSNorm: no site for the rule."""

    def __init__(self, group: str):
        super().__init__()
        self.group = group
        self.w = nn.Parameter(torch.ones(16), requires_grad=False)

    def forward(self, x):
        return all_reduce_sum(x, self.group) + self.w


def _stack(rank: int, world: int) -> dict:
    import torch.distributed as dist

    group = dist.group.WORLD.group_name
    ctx = k3fuse.DecodeContext.from_process_group(enabled_rules=DEFAULTS | {RULE}, strict=True)
    out = {}
    for dtype in ("float32", "bfloat16"):
        model, xs = tiny_stack(dtype, world, rank, N_LAYERS, BATCH, STEPS)
        if dtype == "float32":
            out[("compile", dtype)] = compiled_door(model, xs, ctx)
        ep = torch.export.export(model, (xs[0], model.init_state(BATCH)))
        new_ep, log = k3fuse.apply(ep, ctx)
        targets = [n.target for n in new_ep.graph.nodes if n.op == "call_function"]
        applied = [e for e in log.events if e.rule == RULE and e.decision == "applied"]
        out[("export", dtype)] = {
            "summary": log.summary(), "ops": targets.count(torch.ops.k3fuse.allreduce_rmsnorm.default),
            "strict_arg": [n.args[-1] for n in new_ep.graph.nodes
                           if n.target is torch.ops.k3fuse.allreduce_rmsnorm.default],
            "events": [(e.variant, e.values.get("eps"), e.values.get("sum_read_elsewhere"), e.shapes)
                       for e in applied],
            **strict_steps(new_ep.module(), model, xs)}
        # the same program without the rule: oproj takes the same sites, the latent all-reduce stays native
        base_ep, base_log = k3fuse.apply(ep, ctx.with_(enabled_rules=DEFAULTS))
        out[("export", dtype)]["defaults_summary"] = base_log.summary()
        out[("export", dtype)]["native_all_reduces_without"] = sum(
            n.target is torch.ops._c10d_functional.all_reduce.default for n in base_ep.graph.nodes)
        out[("export", dtype)]["native_all_reduces_with"] = sum(
            n.target is torch.ops._c10d_functional.all_reduce.default for n in new_ep.graph.nodes)
        # off unless named
        _, off_log = k3fuse.apply(ep, k3fuse.DecodeContext.from_process_group())
        out[("export", dtype)]["off"] = [(e.decision, e.guard, e.reason) for e in off_log.events if e.rule == RULE]
    # a graph without the site: the near-miss names where it left the pattern
    mod = AllReduceAdd(group)
    _, miss_log = k3fuse.apply(torch.export.export(mod, (torch.randn(2, 16),)), ctx)
    out["miss"] = [(e.decision, e.guard, e.reason, e.values) for e in miss_log.events if e.rule == RULE]
    return out


def _tp2_worker(rank: int, world: int) -> dict:
    return {"op": _op_checks(rank, world), "stack": _stack(rank, world)}


@pytest.fixture(scope="module")
def tp2():
    return launch(_tp2_worker, 2, backend="gloo", timeout_s=600)


def test_op_reference_vs_float64_at_tp2(tp2):
    for rank, res in enumerate(tp2):
        for (dtype, T), r in res["op"].items():
            assert r["stats"] == {OP: {"reference": 1}}, (rank, dtype, T, r["stats"])
            assert r["shape_ok"] and r["dtype_ok"], (rank, dtype, T)
            ulp = 2 ** -7 if dtype == "torch.bfloat16" else 2 ** -23
            # one rounding of the fp32 sum (plus fp32 summation of two terms), then one of the norm
            assert r["s_err"] <= ulp, (rank, dtype, T, r["s_err"])
            assert r["n_err"] <= 2 * ulp + 1e-6, (rank, dtype, T, r["n_err"])
            assert r["stock_is_model"], (rank, dtype, T)
            # stock rounds the sum to the trunk dtype before normalising; the op normalises the fp32 sum
            assert r["vs_stock"] <= (0.05 if dtype == "torch.bfloat16" else 1e-5), (rank, dtype, T, r["vs_stock"])
    a, b = (res["op"] for res in tp2)
    for key in a:
        assert torch.equal(a[key]["s"], b[key]["s"]) and torch.equal(a[key]["n"], b[key]["n"]), key


def test_rule_fires_on_the_k3_stack_at_tp2_both_doors(tp2):
    for rank, res in enumerate(tp2):
        stack = res["stack"]
        for (door, dtype), r in ((k, v) for k, v in stack.items() if isinstance(k, tuple)):
            s = r["summary"]
            assert RULE in s, (rank, door, dtype, list(s), r.get("error"))
            assert s[RULE]["applied"] == N_LAYERS, (rank, door, dtype, s.get(RULE))
            assert r["fallbacks"] == {}, (rank, door, dtype, r["fallbacks"])
            assert r["stats"][OP] == {"reference": N_LAYERS * STEPS}, (rank, door, dtype, r["stats"])
            assert r["err"] < (TOL if dtype == "float32" else BF16_TOL), (rank, door, dtype, r["err"])
            if door != "export":
                continue
            assert r["ops"] == N_LAYERS and r["strict_arg"] == [True] * N_LAYERS
            assert [e[:3] for e in r["events"]] == [("norm" if dtype == "float32" else "norm[bfloat16]", EPS, False)] \
                * N_LAYERS, r["events"]
            # oproj_allreduce_residual does not take the latent all-reduce: same count with or without the rule
            assert s["oproj_allreduce_residual"]["applied"] == r["defaults_summary"]["oproj_allreduce_residual"][
                "applied"]
            assert r["native_all_reduces_without"] - r["native_all_reduces_with"] == N_LAYERS
            assert [d for d, _, _ in r["off"]] == ["rejected"] and r["off"][0][1] == "rule_disabled"
            assert "no H200 measurement yet" in r["off"][0][2]


def test_near_miss_without_the_site_names_the_diverging_node(tp2):
    (decision, guard, reason, values), = tp2[0]["stack"]["miss"]
    assert decision == "not_matched" and guard is None, (decision, guard, reason)
    assert reason.startswith("norm: the all-reduced wait_tensor (from all_reduce) feeds aten.add"), reason
    assert "not an RMSNorm" in reason and values["readers"] == ["aten.add"], values


def test_rule_does_not_fire_at_tp1():
    model = K3DecodeStack(get_config("tiny", n_layers=1), tp_size=1, rank=0, seed=5)
    x = torch.randn(BATCH, model.config.hidden)
    _, log = k3fuse.apply(torch.export.export(model, (x, model.init_state(BATCH))), _named())
    (e,) = log.rejected(RULE)
    assert (e.guard, e.values) == ("tp_size", {"tp_size": 1, "minimum": 2}), e
    assert log.applied(RULE) == 0


def test_rule_runs_when_named_in_the_environment(monkeypatch):
    monkeypatch.setenv("K3FUSE_RULES", "+" + RULE)
    model = K3DecodeStack(get_config("tiny", n_layers=1), tp_size=1, rank=0, seed=5)
    x = torch.randn(BATCH, model.config.hidden)
    _, log = k3fuse.apply(torch.export.export(model, (x, model.init_state(BATCH))), k3fuse.DecodeContext())
    (e,) = log.rejected(RULE)
    assert e.guard == "tp_size"   # enabled by the environment, then refused by its contract at TP 1


def test_cuda_impl_registers_and_covers_k3_latent():
    """Both protocol Impls are registered, and their one predicate accepts K3's latent at every
    decode token count (the rule's compile-time Spec) and names the limit it refuses."""
    import dataclasses

    from k3fuse.kernels import dispatch
    from k3fuse.kernels.lib.cute import compat
    from k3fuse.kernels.ops.allreduce_rmsnorm import AllReduceNormSpec

    spec = AllReduceNormSpec(L=L, dtype=torch.bfloat16, w_dtype=torch.bfloat16, world_size=2, max_tokens=64)
    kernels = {i.name: i for i in dispatch.cuda_kernels(OP)}  # the CuTe DSL and triton installed
    if compat.HAVE_CUTE:
        assert dispatch.coverage(spec, range(1, 65)) == {}
        lamport = kernels["cute.allreduce_rmsnorm"]
        assert "L=3583" in lamport.accepts(dataclasses.replace(spec, L=3583))
        assert "dtype" in lamport.accepts(dataclasses.replace(spec, dtype=torch.float32))
        assert "M=65" in lamport.accepts(spec.with_tokens(65))
        assert "torch.distributed" in lamport.accepts(dataclasses.replace(spec, dist_ready=False))
    if compat.HAVE_CUTE:
        names = {i.name for i in dispatch.implementations(OP)}
        assert {"cute.allreduce_rmsnorm", "cute.allreduce_rmsnorm.flags", "reference"} <= names
