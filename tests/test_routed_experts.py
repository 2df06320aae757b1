"""routed_experts on CPU: the op, its fake impl, and the routed_experts rule on both spellings and
on the K3 stack.

* the op's reference is the gathered spelling bit for bit and its stock is the model's spelling; the
  fake impl names bad shapes and dtypes;
* the rule matches `routed_experts_gathered` (fp32, bf16) and `routed_experts_grouped` (bf16: this
  CPU torch exports and runs torch._grouped_mm, so the grouped spelling is matched in a real
  exported graph and its rewrite run, not only structurally) through the export door; the rewritten
  program computes what the original did; K3FUSE_RULES turns it off; a GPU context refuses a shape
  no kernel covers, with the kernel's limit in the log;
* the K3 reference stack (tiny) at TP1 and TP2 (gloo ranks), through torch.compile(backend="k3fuse")
  and the export door, strict mode: the rule fires once per layer, the reference ran, and the
  outputs match stock eager; shared_expert_stream still finds its join after it.
"""
from __future__ import annotations

import textwrap

import pytest
import torch
from torch import nn

import k3fuse
from k3fuse import runtime, spelling
from k3fuse.dist import launch
from stack_helpers import assert_one_graph_serves_dynamic_tokens, compiled_door, strict_steps, tiny_stack
from triton_interpreter import run_in_interpreter

RULE = OP = "routed_experts"
N_LAYERS = 2
STEPS = 3
BATCH = 3
TOL = 2e-5
H100 = (9, 0)
BETA, LINEAR_BETA = spelling.K3_SITU_BETA, spelling.K3_SITU_LINEAR_BETA


def _operands(T: int = 3, E: int = 8, I: int = 32, L: int = 16, k: int = 4, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(T, L, generator=g).to(dtype)
    experts = torch.randint(0, E, (T * k,), generator=g)
    w1, w3 = ((torch.randn(E, I, L, generator=g) * L ** -0.5).to(dtype) for _ in range(2))
    w2 = (torch.randn(E, L, I, generator=g) * I ** -0.5).to(dtype)
    return a, experts, w1, w3, w2, k


# --- the op ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_op_strict_on_cpu_is_the_gathered_reference_and_disable_runs_stock(dtype):
    a, experts, w1, w3, w2, k = _operands(dtype=dtype)
    runtime.reset_stats()
    with runtime.strict():
        z = torch.ops.k3fuse.routed_experts(a, experts, w1, w3, w2, k, BETA, LINEAR_BETA)
    assert runtime.stats() == {OP: {"reference": 1}}
    assert z.shape == (a.shape[0] * k, a.shape[1]) and z.dtype == dtype
    assert torch.equal(z, spelling.routed_experts_gathered(a, experts, w1, w3, w2, k, BETA, LINEAR_BETA))
    runtime.reset_stats()
    with k3fuse.disable():
        z0 = torch.ops.k3fuse.routed_experts(a, experts, w1, w3, w2, k, BETA, LINEAR_BETA)
    assert runtime.stats() == {OP: {"fallback:disabled": 1}}
    assert torch.equal(z0, spelling.routed_experts(a, experts, w1, w3, w2, k, BETA, LINEAR_BETA))


def test_fake_impl_shapes_and_messages():
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = torch.ops.k3fuse.routed_experts
    with FakeTensorMode():
        a, experts, w1, w3, w2, k = _operands(T=5, E=8, I=32, L=16, k=4)
        z = op(a, experts, w1, w3, w2, k, BETA, LINEAR_BETA)
        assert z.shape == (20, 16) and z.dtype == torch.float32
        bad = (((a[0], experts, w1, w3, w2, k), r"a must be the latent \[T, L\]"),
               ((a, experts.int(), w1, w3, w2, k), "experts must be int64"),
               ((a, experts[:-1], w1, w3, w2, k), "19 expert ids for 5 tokens x top_k=4"),
               ((a, experts, w1[:, :, :8], w3, w2, k), r"w1/w3 must be \[E, I, L=16\]"),
               ((a, experts, w1, w3, w2[:, :, :8], k), r"w2 must be \[E, L, I\] = \(8, 16, 32\)"),
               ((a, experts, w1, w3, w2.bfloat16(), k), "must share a dtype"))
        for args, message in bad:
            with pytest.raises(Exception, match=message):
                op(*args, BETA, LINEAR_BETA)


# --- the rule on standalone modules ------------------------------------------------------------------
class Experts(nn.Module):
    """The routed experts alone, in one of the model's spellings (static weights)."""

    def __init__(self, spelled=spelling.routed_experts_gathered, E: int = 8, I: int = 32, L: int = 16, k: int = 4,
                 dtype=torch.float32):
        super().__init__()
        _, _, w1, w3, w2, _ = _operands(E=E, I=I, L=L, k=k, dtype=dtype, seed=7)
        self.w1, self.w3, self.w2 = (nn.Parameter(w, requires_grad=False) for w in (w1, w3, w2))
        self.spelled, self.k = spelled, k

    def forward(self, a, idx):
        return self.spelled(a, idx.reshape(-1), self.w1, self.w3, self.w2, self.k, BETA, LINEAR_BETA)


def _inputs(module: Experts, T: int = 3, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    L, E = module.w1.shape[2], module.w1.shape[0]
    return torch.randn(T, L, generator=g).to(module.w1.dtype), torch.randint(0, E, (T, module.k), generator=g)


@pytest.mark.parametrize("spelled,dtype,variant", [
    (spelling.routed_experts_gathered, torch.float32, "gathered"),
    (spelling.routed_experts_gathered, torch.bfloat16, "gathered[bfloat16]"),
    (spelling.routed_experts_grouped, torch.bfloat16, "grouped[bfloat16]"),
])
def test_rule_rewrites_each_spelling_and_computes_what_it_did(spelled, dtype, variant):
    module = Experts(spelled, dtype=dtype)
    args = _inputs(module)
    ep = torch.export.export(module, args)
    targets = {n.target for n in ep.graph.nodes}
    assert (torch.ops.aten._grouped_mm.default in targets) == (variant.startswith("grouped"))
    new_ep, log = k3fuse.apply(ep, k3fuse.DecodeContext(strict=True))
    (e,) = [e for e in log.events if e.rule == RULE and e.decision == "applied"]
    assert e.variant == variant and (e.values["top_k"], e.values["E"], e.values["I"]) == (4, 8, 32)
    left = {n.target for n in new_ep.graph.nodes}
    assert torch.ops.k3fuse.routed_experts.default in left
    assert not left & {torch.ops.aten._grouped_mm.default, torch.ops.aten.bmm.default}
    runtime.reset_stats()
    with runtime.strict():
        z = new_ep.module()(*args)
    assert runtime.stats() == {OP: {"reference": 1}} and runtime.fallbacks() == {}
    z0 = module(*args)
    if spelled is spelling.routed_experts_gathered:
        assert torch.equal(z, z0)  # the reference is this very spelling
    else:  # grouped GEMMs accumulate in another order than the bmm; both round to bf16 per projection
        torch.testing.assert_close(z.float(), z0.float(), rtol=2e-2, atol=2e-2)


def test_rule_captures_other_sizes_and_top_k():
    module = Experts(E=16, I=24, L=40, k=2)
    args = _inputs(module, T=7)
    new_ep, log = k3fuse.apply(torch.export.export(module, args), k3fuse.DecodeContext())
    (e,) = [e for e in log.events if e.rule == RULE and e.decision == "applied"]
    assert (e.values["top_k"], e.values["E"], e.values["I"]) == (2, 16, 24)
    assert torch.equal(new_ep.module()(*args), module(*args))


@pytest.mark.parametrize("spelled,dtype", [(spelling.routed_experts_gathered, torch.float32),
                                            (spelling.routed_experts_grouped, torch.bfloat16)])
def test_rule_matches_a_dynamic_token_count(spelled, dtype):
    """torch.compile with a symbolic token count (the token dim marked dynamic, as a recompile after a
    second batch size makes it): the sizes the trace baked in (the expand's [T, k, L], the scatter
    buffer's [T*k, L]) are SymInt nodes in the graph, and the free sizes bind them."""
    experts = Experts(spelled, dtype=dtype)
    router = torch.randn(experts.w1.shape[0], experts.w1.shape[2])
    assert_one_graph_serves_dynamic_tokens(experts, router, _inputs, RULE, OP)


def test_rule_runs_by_default_and_the_environment_turns_it_off(monkeypatch):
    module = Experts()
    _, log = k3fuse.apply(torch.export.export(module, _inputs(module)), k3fuse.DecodeContext())
    assert log.applied(RULE) == 1
    monkeypatch.setenv("K3FUSE_RULES", "-routed_experts")
    _, log = k3fuse.apply(torch.export.export(module, _inputs(module)), k3fuse.DecodeContext())
    (e,) = log.rejected(RULE)
    assert log.applied(RULE) == 0 and e.guard == "rule_disabled"


def test_a_graph_without_experts_is_not_matched_with_the_reason():
    lin = nn.Linear(16, 16)
    _, log = k3fuse.apply(torch.export.export(lin, (torch.randn(3, 16),)), k3fuse.DecodeContext())
    (e,) = [e for e in log.events if e.rule == RULE]
    assert e.decision == "not_matched" and "no aten._grouped_mm or aten.bmm" in e.reason, e.reason


@pytest.fixture
def fake_kernel(monkeypatch):
    """A stand-in CUDA kernel of routed_experts that covers E <= 64 (and nothing else registered), so
    the GPU-context test does not depend on which kernels this build has."""
    from k3fuse.kernels import dispatch

    dispatch.load_gpu_impls()
    impl = dispatch.Impl("test.routed_experts", accepts=lambda s: None if s.E <= 64 else f"E={s.E} > 64 experts",
                         run=lambda *a, **k: None)
    others = [i for i in dispatch.implementations(OP) if "cuda" not in i.device_types]
    monkeypatch.setattr(dispatch._entry(OP), "impls", [impl, *others])
    return impl


def test_gpu_context_refuses_experts_no_kernel_covers(fake_kernel):
    gpu = k3fuse.DecodeContext(device_capability=H100)
    for n_experts, applied in ((64, 1), (128, 0)):
        module = Experts(E=n_experts)
        _, log = k3fuse.apply(torch.export.export(module, _inputs(module, T=4)), gpu)
        assert log.applied(RULE) == applied
        if not applied:
            (e,) = log.rejected(RULE)
            assert (e.guard, e.values["E"], e.values["tokens"]) == ("kernel_shape", 128, "4")
            assert e.values["limits"] == ["test.routed_experts: E=128 > 64 experts"]


# --- the Triton kernel through Triton's interpreter (a subprocess: TRITON_INTERPRET must be set
# before triton is imported). fp16: the interpreter (Triton 3.6, numpy) mis-reads bf16 loads; the
# GPU test (tests/gpu/test_routed_experts_gpu.py) covers bf16. Every case runs pairwise and grouped,
# whatever pick_config's threshold would choose; "bad_ids" has expert ids -1 and E, whose rows are
# unspecified: the other rows are checked ---------------------------------------------------------
CASES = ["one_token", "k3_like", "many_tokens", "crowded", "wide_inter", "bad_ids"]
INTERPRETER_SCRIPT = textwrap.dedent("""
    import json, os
    assert os.environ["TRITON_INTERPRET"] == "1"
    import torch
    from k3fuse.kernels.lib.triton import routed_experts as K
    from k3fuse.spelling import K3_SITU_BETA as B, K3_SITU_LINEAR_BETA as LB, routed_experts_gathered
    assert K.INTERPRET and K.HAVE_TRITON
    out = []
    for name, T, E, I, L, k in (("one_token", 1, 8, 16, 32, 2), ("k3_like", 3, 24, 32, 48, 4),
                                ("many_tokens", 17, 40, 16, 32, 8), ("crowded", 20, 8, 16, 32, 4),
                                ("wide_inter", 2, 8, 160, 32, 2), ("bad_ids", 3, 8, 16, 32, 2)):
        g = torch.Generator().manual_seed(T)
        a = torch.randn(T, L, generator=g).half()
        w1, w3 = ((torch.randn(E, I, L, generator=g) * L ** -0.5).half() for _ in range(2))
        w2 = (torch.randn(E, L, I, generator=g) * I ** -0.5).half()
        if name == "crowded":  # every token picks experts 0..k-1: groups of T > 16 rows (two row blocks)
            experts = torch.arange(k).repeat(T)
        else:
            experts = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).reshape(-1)
        ref = routed_experts_gathered(a.double(), experts, w1.double(), w3.double(), w2.double(), k, B, LB)
        half = routed_experts_gathered(a, experts, w1, w3, w2, k, B, LB)  # the fp16 spelling's own error
        kept = torch.ones(T * k, dtype=torch.bool)
        if name == "bad_ids":
            kept[[1, 4]] = False
            experts = experts.clone()
            experts[1], experts[4] = -1, E
        for pairwise in (True, False):
            z = torch.full((T * k, L), float("nan"), dtype=torch.float16)
            K.run(a, experts, w1, w3, w2, k, B, LB, out=z, config={"pairwise": pairwise})
            err = lambda x: float((x[kept].double() - ref[kept]).norm() / ref[kept].norm())
            out.append({"case": name, "pairwise": pairwise, "written": not bool(torch.isnan(z[kept]).any()),
                        "rel": err(z), "rel_fp16": err(half)})
    print("RESULT " + json.dumps(out))
""")


def test_triton_kernel_in_the_interpreter_against_float64():
    results = run_in_interpreter(INTERPRETER_SCRIPT)
    assert [(r["case"], r["pairwise"]) for r in results] == [(c, p) for c in CASES for p in (True, False)]
    for r in results:
        assert r["written"], r  # every (kept) row of the NaN-poisoned output was written
        assert r["rel"] < 3e-3 and r["rel"] < 2 * r["rel_fp16"] + 1e-4, r  # fp16 rounding, as the spelling's


#: the kernels' runtime arguments; pointers 16-byte aligned, as a launch specializes them
SM90_TYPES = {"a_ptr": "*bf16", "w1_ptr": "*bf16", "w3_ptr": "*bf16", "gu_ptr": "*bf16", "w2_ptr": "*bf16",
              "z_ptr": "*bf16", "experts_ptr": "*i64", "rows_ptr": "*i32", "groups_ptr": "*i32", "scratch_ptr": "*i32",
              "P": "i32", "E": "i32", "beta": "fp32", "linear_beta": "fp32"}


def test_triton_kernels_compile_for_sm90():
    """The kernels compile to PTX for sm_90 at K3's shapes (E 896, top-16, L 3584, I 64/128/1536), grouped
    and pairwise (no rows or groups: None), without atomics; gate/up's loads are software-pipelined
    (cp.async) in both modes, the reason pairwise keeps tl.dot on one live row."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    from k3fuse.kernels.lib.triton import routed_experts as K

    def compile_ptx(fn, constexprs: dict, launch: dict) -> str:
        sig = {n: "constexpr" if n in constexprs else SM90_TYPES[n] for n in fn.arg_names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if sig[n].startswith("*")}
        src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=launch).asm["ptx"]

    for T, I, pairwise in ((1, 64, True), (1, 64, False), (2, 128, True), (64, 128, False), (64, 128, True),
                           (8, 1536, False)):
        cfg = K.pick_config(T, 896, I, 3584, 16, {"pairwise": pairwise})
        gu, dn = cfg["gate_up"], cfg["down"]
        mode = {"PAIRWISE": pairwise, **({"rows_ptr": None, "groups_ptr": None} if pairwise else {})}
        shape = {"I": I, "L": 3584, "ROW_BLOCKS": cfg["row_blocks"], "BLOCK_M": K.BLOCK_M, **mode}
        kernels = {
            "gate_up": (K._gate_up_kernel, {**shape, "TOP_K": 16, "BLOCK_N": gu["BLOCK_N"], "BLOCK_K": gu["BLOCK_K"]},
                        gu),
            "down": (K._down_kernel, {**shape, "N_TILES": dn["N_TILES"], "BLOCK_N": dn["BLOCK_N"],
                                      "BLOCK_K": dn["BLOCK_K"]}, dn),
        }
        if not pairwise:
            kernels["group"] = (K._group_kernel, {"BLOCK_P": cfg["BLOCK_P"]}, {"num_warps": 4})
        for name, (fn, constexprs, launch) in kernels.items():
            ptx = compile_ptx(fn, constexprs, {k: launch[k] for k in ("num_warps", "num_stages") if k in launch})
            where = (name, T, I, pairwise)
            assert ".entry" in ptx and "atom." not in ptx, where  # no atomics: deterministic
            assert name != "gate_up" or "cp.async" in ptx, where


def test_pick_config_goes_pairwise_at_one_or_two_tokens_of_top16_and_overrides_win():
    from k3fuse.kernels.lib.triton import routed_experts as K

    assert K.PAIRWISE_MAX_PAIRS == 32  # a first guess: bench/bench_routed_experts.py times both modes
    for T in (1, 2, 3, 4, 8, 64):
        cfg = K.pick_config(T, 896, 64, 3584, 16)
        assert cfg["pairwise"] == (T <= 2), T
        assert (cfg["groups"], cfg["row_blocks"] == 1) == ((16 * T, True) if T <= 2 else (min(896, 16 * T), False)), T
    forced = K.pick_config(64, 896, 64, 3584, 16, {"pairwise": True, "gate_up": {"BLOCK_N": 32}})
    assert forced["pairwise"] and (forced["groups"], forced["row_blocks"], forced["gate_up"]["BLOCK_N"]) == (1024, 1, 32)
    assert not K.pick_config(1, 896, 64, 3584, 16, {"pairwise": False})["pairwise"]
    # down's N_TILES follows the group count: T*k pairs pairwise, the expected distinct experts grouped
    tiles = [K.pick_config(4, 16, 64, 3584, 16, {"pairwise": p})["down"]["N_TILES"] for p in (True, False)]
    assert tiles == [2, 1]


def test_kernel_covers_k3_shapes_and_names_its_limits():
    pytest.importorskip("triton")
    from k3fuse.kernels import dispatch

    from k3fuse.kernels.ops.routed_experts import RoutedExpertsSpec

    for I in (64, 128, 1536):
        spec = RoutedExpertsSpec(E=896, I=I, L=3584, top_k=16, dtype=torch.bfloat16)
        assert dispatch.coverage(spec, range(1, 65)) == {}, I
    limits = dispatch.coverage(RoutedExpertsSpec(E=896, I=128, L=3584, top_k=16, dtype=torch.float32), [1])
    assert any("triton.routed_experts: dtype torch.float32" in str(v) for v in limits.values()), limits


# --- the K3 stack: both doors, TP1 and TP2 -----------------------------------------------------------
def _stack(tp_size: int, rank: int) -> dict:
    ctx = (k3fuse.DecodeContext.from_process_group(strict=True) if tp_size > 1
           else k3fuse.DecodeContext(strict=True))
    out = {}
    for dtype in ("float32", "bfloat16"):
        model, xs = tiny_stack(dtype, tp_size, rank, N_LAYERS, BATCH, STEPS)
        new_ep, log = k3fuse.apply(torch.export.export(model, (xs[0], model.init_state(BATCH))), ctx)
        out[("export", dtype)] = {"summary": log.summary(), **strict_steps(new_ep.module(), model, xs)}
        if dtype == "float32":
            out[("compile", dtype)] = compiled_door(model, xs, ctx)
    return out


def _tp_worker(rank: int, world_size: int) -> dict:
    return _stack(world_size, rank)


def _check_stack(out: dict) -> None:
    for (door, dtype), res in out.items():
        s = res["summary"]
        form = "gathered" if dtype == "float32" else "gathered[bfloat16]"
        assert s[RULE]["applied"] == N_LAYERS and s[RULE]["variants"] == {form: N_LAYERS}, (door, dtype, s[RULE])
        assert s["fused_routing"]["applied"] == N_LAYERS, (door, dtype)  # the expert ids are route_topk's
        assert s["shared_expert_stream"]["applied"] == N_LAYERS, (door, dtype)  # its join still finds its anchor
        assert res["fallbacks"] == {} and res["stats"][OP] == {"reference": N_LAYERS * STEPS}, (door, dtype, res)
        # fp32: the other rules' references differ from eager by accumulation order only; bf16: their
        # roundings differ from the model's (test_route_topk.py has the same bound)
        assert res["err"] < (TOL if dtype == "float32" else 0.25), (door, dtype, res["err"])


def test_k3_stack_tp1_both_doors():
    _check_stack(_stack(1, 0))


@pytest.mark.slow
def test_k3_stack_tp2_both_doors_on_every_rank():
    for out in launch(_tp_worker, 2, backend="gloo", timeout_s=600):
        _check_stack(out)
