"""moe_combine on CPU: the op, its reference and stock sequence, the Triton kernel through Triton's
interpreter, and the moe_combine rule on the K3 stack.

* the reference against a float64 loop over tokens and slots; the stock sequence is the model's
  spelling and cast bit for bit, and the model computes with the spelling (LatentMoE.forward);
* the op in strict mode counts the reference on CPU, the kill switch runs stock; the fake impl
  names bad shapes and dtypes; the Spec names each misfit of a call (wrong weights dtype, wrong
  shapes, a strided z, CPU tensors) and `accepts` each limit (dtype, tokens, top_k);
* the Triton kernel runs on CPU through TRITON_INTERPRET=1 in a subprocess (the variable must be
  set before triton is imported) at K3's L = 3584 and an odd L, T in {1, 3, 8, 17, 64}, k = 16, into
  NaN-poisoned outputs: fp16 and fp32 equal the reference bit for bit (the kernel adds the slots in
  the reference's order, without FMA); bf16's loads and fp32 sum are the reference's too (the
  interpreter casts fp32 -> bf16 by truncation, a compiled kernel rounds to nearest: the GPU test
  checks those bits); strided weights and z rows, and a column block that does not divide L; the
  kernel compiles for sm_90 with 16-byte loads and no FMA, atomics or spills;
* the rule fires once per layer on the reference stack, BF16 and MXFP4 experts, fp32 and bf16 trunks,
  through k3fuse.apply, torch.compile(backend="k3fuse") and k3fuse.inductor_pass, at TP 1 here and
  TP 2 on gloo ranks (also with moe_tail_allreduce_norm on, whose op then reads the combine's), in
  strict mode against the eager model; shared_expert_stream still finds its join, with the rules in
  either order; outside its guards (65 tokens, bf16 weights, broadcast weights, top_k no kernel
  covers on a GPU context) it is refused with the values logged.
"""
from __future__ import annotations

import textwrap

import pytest
import torch
from torch import nn

import k3fuse
from k3fuse import runtime, spelling
from k3fuse.dist import launch
from k3fuse.graph_facts import op_qualname
from k3fuse.kernels.lib.reference import moe_combine as ref_combine
from k3fuse.kernels.lib.reference import stock
from stack_helpers import strict_steps
from triton_interpreter import run_in_interpreter

RULE = OP = "moe_combine"
N_LAYERS = 2
STEPS = 3
BATCH = 3
TOL = 2e-5
H100 = (9, 0)


def _operands(T: int, L: int, k: int = 16, dtype=torch.bfloat16, seed: int = 0):
    """Expert outputs z [T*k, L] and renormalised routing weights [T, k] (as route_topk gives them)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(T * k, L, generator=g).to(dtype)
    w = torch.rand(T, k, generator=g) + 0.01
    return z, w / w.sum(-1, keepdim=True) * 2.5


def _f64(z: torch.Tensor, w: torch.Tensor, k: int) -> torch.Tensor:
    """out[t] = sum_j w[t, j] * z[t*k + j], a loop in float64."""
    T = w.shape[0]
    out = torch.zeros(T, z.shape[1], dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            out[t] += w[t, j].double() * z[t * k + j].double()
    return out


# --- reference, stock, the model's spelling -------------------------------------------------------------
@pytest.mark.parametrize("T,L,k", [(1, 3584, 16), (3, 3584, 16), (17, 64, 16), (5, 1001, 4), (2, 7, 1)])
def test_reference_matches_a_float64_loop(T, L, k):
    z, w = _operands(T, L, k, dtype=torch.float32, seed=T + L)
    out = ref_combine.moe_combine(z, w, k)
    assert out.dtype == torch.float32 and out.shape == (T, L) and out.is_contiguous()
    torch.testing.assert_close(out.double(), _f64(z, w, k), rtol=1e-5, atol=1e-5)
    # a 16-bit z: its fp32 sum is the same, then one rounding to z's dtype
    for dtype in (torch.bfloat16, torch.float16):
        zh = z.to(dtype)
        assert torch.equal(ref_combine.moe_combine(zh, w, k), ref_combine.moe_combine(zh.float(), w, k).to(dtype))


def test_stock_is_the_models_spelling_and_cast_bit_for_bit():
    from k3fuse.model import layers

    assert layers.moe_combine is spelling.moe_combine  # LatentMoE.forward computes with the spelling
    for dtype in (torch.float32, torch.bfloat16):
        z, w = _operands(3, 96, 16, dtype=dtype)
        model_spelled = (z.float().view(3, 16, 96) * w.unsqueeze(-1)).sum(1).to(dtype)  # LatentMoE's, before
        assert torch.equal(spelling.moe_combine(z, w, 16).to(dtype), model_spelled)
        assert torch.equal(stock.moe_combine(z, w, 16), model_spelled)
        # the reference adds in slot order; torch's sum in its own: an ulp or so apart in fp32
        torch.testing.assert_close(ref_combine.moe_combine(z, w, 16).float(), model_spelled.float(),
                                   rtol=1e-6 if dtype == torch.float32 else 1e-2, atol=1e-6)


def test_op_strict_on_cpu_counts_the_reference_and_disable_runs_stock():
    z, w = _operands(3, 40, 4)
    runtime.reset_stats()
    with runtime.strict():
        out = torch.ops.k3fuse.moe_combine(z, w, 4)
    assert runtime.stats() == {OP: {"reference": 1}}
    assert out.dtype == z.dtype and out.shape == (3, 40) and torch.equal(out, ref_combine.moe_combine(z, w, 4))
    runtime.reset_stats()
    with k3fuse.disable():
        out0 = torch.ops.k3fuse.moe_combine(z, w, 4)
    assert runtime.stats() == {OP: {"fallback:disabled": 1}}
    assert torch.equal(out0, stock.moe_combine(z, w, 4))


def test_fake_impl_shapes_and_messages():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = torch.ops.k3fuse.moe_combine(torch.empty(12, 8, dtype=torch.bfloat16), torch.empty(3, 4), 4)
        assert out.shape == (3, 8) and out.dtype == torch.bfloat16
        for z, w, k, message in ((torch.empty(12, 8), torch.empty(3, 4), 3, r"weights must be \[T, top_k=3\]"),
                                 (torch.empty(10, 8), torch.empty(3, 4), 4, "10 rows of z for 3 tokens x top_k=4"),
                                 (torch.empty(12, 8), torch.empty(3, 4, dtype=torch.bfloat16), 4,
                                  "weights must be float32"),
                                 (torch.empty(3, 4, 8), torch.empty(3, 4), 4, r"z must be the expert outputs")):
            with pytest.raises(Exception, match=message):
                torch.ops.k3fuse.moe_combine(z, w, k)


# --- the Spec and the kernel's one predicate -----------------------------------------------------------
def test_spec_from_call_names_each_misfit_and_accepts_each_limit():
    """from_call on fake CUDA tensors (no GPU needed): K3's call is accepted; a wrong weights dtype, wrong
    shapes, a strided z and CPU tensors each come back named; accepts names the dtype, token and top_k
    limits."""
    pytest.importorskip("triton")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from k3fuse.kernels.ops.moe_combine import MoECombineSpec, accepts

    T, k, L = 8, 16, 3584
    with FakeTensorMode():
        z = torch.empty(T * k, L, device="cuda", dtype=torch.bfloat16)
        w = torch.empty(T, k, device="cuda")
        good = MoECombineSpec.from_call(z, w, k)
        assert (good.tokens, good.L, good.top_k, good.dtype, good.fits) == (T, L, k, torch.bfloat16, None)
        assert accepts(good) is None
        assert accepts(MoECombineSpec.from_call(z, w.bfloat16(), k)) == "weights dtype torch.bfloat16 (fp32 only)"
        short = torch.empty(T * k - 1, L, device="cuda", dtype=torch.bfloat16)
        assert accepts(MoECombineSpec.from_call(short, w, k)) == (
            f"z ({T * k - 1}, {L}) / weights ({T}, {k}) are not [T*top_k, L] / [T, top_k={k}]")
        assert accepts(MoECombineSpec.from_call(z, w, k - 1)).endswith(f"[T, top_k={k - 1}]")
        strided = torch.empty_strided((T * k, L), (2 * L, 2), device="cuda", dtype=torch.bfloat16)
        assert accepts(MoECombineSpec.from_call(strided, w, k)).startswith("z needs a unit inner stride")
        assert accepts(MoECombineSpec.from_call(z.double(), w, k)) == "dtype torch.float64 (bf16/fp16/fp32 z only)"
    cpu = MoECombineSpec.from_call(torch.empty(T * k, L), torch.empty(T, k), k)
    assert accepts(cpu) == "z, weights are not CUDA tensors on one device"
    assert accepts(MoECombineSpec(tokens=65, L=L, top_k=k, dtype=torch.bfloat16)) == "T=65 (needs 1 <= T <= 64)"
    assert accepts(MoECombineSpec(tokens=1, L=L, top_k=65, dtype=torch.bfloat16)) == (
        "top_k=65 (needs 1 <= top_k <= 64)")


def test_kernel_covers_k3_shapes_and_names_its_limits():
    pytest.importorskip("triton")
    from k3fuse.guards import kernel_covers
    from k3fuse.kernels import dispatch
    from k3fuse.kernels.ops.moe_combine import MoECombineSpec

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert dispatch.coverage(MoECombineSpec(L=3584, top_k=16, dtype=dtype), range(1, 65)) == {}, dtype
    f = kernel_covers(k3fuse.DecodeContext(device_capability=H100),
                      MoECombineSpec(L=3584, top_k=80, dtype=torch.bfloat16), tokens=None)
    assert f is not None and (f.level, f.guard, f.values["tokens"]) == ("site", "kernel_shape", "1-64")
    assert f.values["limits"] == ["triton.moe_combine: top_k=80 (needs 1 <= top_k <= 64)"]


def test_pick_config_fills_the_gpu_and_loads_16_bytes_a_thread():
    from k3fuse.kernels.lib.triton import moe_combine as K

    assert K.pick_config(64, 3584, torch.bfloat16) == {"BLOCK_L": 512, "num_warps": 2}  # 64 x 7 = 448 programs
    assert K.pick_config(1, 3584, torch.bfloat16) == {"BLOCK_L": 128, "num_warps": 1}  # 28: as many as it gets
    assert K.pick_config(64, 3584, torch.float32) == {"BLOCK_L": 512, "num_warps": 4}  # 4 fp32 per 16 bytes
    for T in range(1, 65):
        cfg = K.pick_config(T, 3584, torch.bfloat16)
        assert T * -(-3584 // cfg["BLOCK_L"]) >= K.MIN_PROGRAMS or cfg["BLOCK_L"] == K.BLOCKS[-1], T


# --- the Triton kernel through Triton's interpreter ------------------------------------------------------
TOKENS = (1, 3, 8, 17, 64)
INTERPRETER_SCRIPT = textwrap.dedent("""
    import json, os
    assert os.environ["TRITON_INTERPRET"] == "1"
    import torch
    from k3fuse.kernels.lib.triton import moe_combine as K
    from k3fuse.kernels.lib.reference import moe_combine as R
    assert K.HAVE_TRITON
    k = 16

    def operands(T, L, dtype, seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(T * k, L, generator=g).to(dtype), torch.rand(T, k, generator=g) * 0.3

    def truncated(x):  # fp32 -> bf16 as the interpreter's numpy casts it (round toward zero)
        return (x.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)

    def case(name, z, w, config=None):
        T, L = w.shape[0], z.shape[1]
        out = torch.full((T, L), float("nan"), dtype=z.dtype)
        K.run(z, w, k, out=out, config=config)
        acc = R.moe_combine(z.float(), w, k)  # the reference's fp32 sum, before its cast
        ref = R.moe_combine(z, w, k)
        terms = z.double().view(T, k, L) * w.double().unsqueeze(-1)
        f64, scale = terms.sum(1), terms.abs().sum(1).clamp_min(1e-30)  # the error scale: sum of |terms|
        bits = truncated(acc) if z.dtype == torch.bfloat16 else ref
        return {"case": name, "dtype": str(z.dtype), "T": T, "L": L, "written": not bool(torch.isnan(out).any()),
                "bitwise": bool(torch.equal(out, bits)),
                "rel64": float(((out.double() - f64).abs() / scale).max())}

    out = []
    for T in (1, 3, 8, 17, 64):
        for L in (3584, 1001):
            out.append(case("k3" if L == 3584 else "odd_L", *operands(T, L, torch.float16, T + L)))
    for dtype in (torch.float32, torch.bfloat16):
        for T, L in ((1, 3584), (17, 3584), (64, 3584), (3, 1001)):
            out.append(case("k3" if L == 3584 else "odd_L", *operands(T, L, dtype, T + L)))
    z, w = operands(5, 640, torch.float16, 7)
    wide = torch.zeros(5 * k, 704, dtype=torch.float16); wide[:, :640] = z     # rows 704 apart
    wt = torch.zeros(k, 5); wt.copy_(w.t())                                    # weights transposed in memory
    out.append(case("strided", wide[:, :640], wt.t()))
    out.append(case("block_128", z, w, {"BLOCK_L": 128, "num_warps": 1}))      # 640 = 5 whole blocks
    out.append(case("ragged", z, w, {"BLOCK_L": 256}))                         # 640 = 2.5 blocks: masked
    print("RESULT " + json.dumps(out))
""")


@pytest.fixture(scope="module")
def interpreter_results() -> list[dict]:
    return run_in_interpreter(INTERPRETER_SCRIPT, timeout=600)


def test_interpreter_every_token_count_at_k3_and_odd_l(interpreter_results):
    fp16 = [(r["T"], r["L"]) for r in interpreter_results
            if r["dtype"] == "torch.float16" and r["case"] in ("k3", "odd_L")]
    assert fp16 == [(T, L) for T in TOKENS for L in (3584, 1001)]
    for r in interpreter_results:
        assert r["written"], r  # every element of the NaN-poisoned output was written
        assert r["bitwise"], r  # the reference's bits (bf16: the interpreter's truncating cast of its fp32 sum)
        # against float64, relative to the sum of |terms|: the fp32 sum's roundings, then one rounding to the
        # output dtype (bf16: truncated, under one ulp)
        assert r["rel64"] < {"torch.float32": 1e-5, "torch.float16": 2 ** -10, "torch.bfloat16": 2 ** -7}[r["dtype"]], r


def test_interpreter_strided_operands_and_other_blocks(interpreter_results):
    cases = {r["case"]: r for r in interpreter_results}
    for name in ("strided", "block_128", "ragged"):
        assert cases[name]["written"] and cases[name]["bitwise"], cases[name]


def test_triton_kernel_compiles_for_sm90():
    """16-byte loads of z at K3's L (bf16 and fp32), no FMA (the reference's roundings), no atomics, no
    spills; a ragged block compiles too."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    from k3fuse.kernels.lib.triton import moe_combine as K

    names = K._moe_combine_kernel.arg_names
    for dtype, ty, T, L in ((torch.bfloat16, "bf16", 64, 3584), (torch.bfloat16, "bf16", 1, 3584),
                            (torch.float32, "fp32", 8, 3584), (torch.bfloat16, "bf16", 3, 1001)):
        cfg = K.pick_config(T, L, dtype)
        constexprs = {"TOP_K": 16, "BLOCK_L": cfg["BLOCK_L"], "EVEN_L": L % cfg["BLOCK_L"] == 0}
        types = {"z_ptr": f"*{ty}", "w_ptr": "*fp32", "out_ptr": f"*{ty}", "L": "i32", "z_st": "i32", "w_st": "i32",
                 "w_sk": "i32"}
        sig = {n: "constexpr" if n in constexprs else types[n] for n in names}
        # what a launch specialises: 16-byte aligned pointers, and L and z's row stride when 16-divisible
        divisible = ("z_ptr", "w_ptr", "out_ptr") + (("L", "z_st") if L % 16 == 0 else ())
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
        src = triton.compiler.ASTSource(fn=K._moe_combine_kernel, signature=sig, attrs=attrs, constexprs=constexprs)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                             options={"num_warps": cfg["num_warps"], "enable_fp_fusion": False}).asm["ptx"]
        where = (dtype, T, L)
        assert "fma.rn.f32" not in ptx and "atom." not in ptx and ".local" not in ptx, where
        if L % 16 == 0 and cfg["num_warps"] * 32 * 16 // (2 if ty == "bf16" else 4) <= cfg["BLOCK_L"]:
            assert "ld.global.L1::evict_first.L2::cache_hint.v4.b32" in ptx, where


# --- the rule on small modules -------------------------------------------------------------------------
class Combine(nn.Module):
    """A routed-experts output and routing weights in, the model's combine (spelling + cast) out,
    followed by a consumer."""

    def __init__(self, k: int):
        super().__init__()
        self.k = k

    def forward(self, z, weights):
        return spelling.moe_combine(z, weights, self.k).to(z.dtype) * 2.0


def _apply(module, args, ctx=None, **ctx_kw):
    return k3fuse.apply(torch.export.export(module, args), ctx or k3fuse.DecodeContext(**ctx_kw))


@pytest.mark.parametrize("dtype,variant", [(torch.float32, "combine"), (torch.bfloat16, "combine[bfloat16]")])
def test_rule_rewrites_the_spelling_and_computes_what_it_did(dtype, variant):
    z, w = _operands(5, 48, 4, dtype=dtype)
    new_ep, log = _apply(Combine(4), (z, w), strict=True)
    assert log.applied(RULE) == 1
    (e,) = [e for e in log.events if e.rule == RULE and e.decision == "applied"]
    assert e.variant == variant and e.values == {"top_k": 4, "L": 48}
    ops = [op_qualname(n) for n in new_ep.graph.nodes if op_qualname(n)]
    assert "k3fuse::moe_combine" in ops and not any(q.startswith("aten::sum") for q in ops), ops
    runtime.reset_stats()
    with runtime.strict():
        out = new_ep.module()(z, w)
    assert runtime.stats() == {OP: {"reference": 1}} and runtime.fallbacks() == {}
    assert out.dtype == dtype
    torch.testing.assert_close(out, Combine(4)(z, w), rtol=1e-6 if dtype == torch.float32 else 8e-3, atol=1e-6)


def test_rule_runs_by_default_and_the_environment_turns_it_off(monkeypatch):
    args = _operands(3, 16, 4, dtype=torch.float32)
    _, log = _apply(Combine(4), args)
    assert log.applied(RULE) == 1
    monkeypatch.setenv("K3FUSE_RULES", "-moe_combine")
    _, log = _apply(Combine(4), args)
    (e,) = log.rejected(RULE)
    assert log.applied(RULE) == 0 and e.guard == "rule_disabled"


def test_outside_the_guards_is_refused_with_values():
    # 65 tokens: the decode range
    _, log = _apply(Combine(4), _operands(65, 16, 4, dtype=torch.float32))
    (e,) = log.rejected(RULE)
    assert (e.level, e.guard, e.values["tokens"], list(e.values["range"])) == ("site", "token_range", 65, [1, 64])
    # bf16 weights: the op takes the router's fp32 weights only
    z, w = _operands(3, 16, 4)
    _, log = _apply(Combine(4), (z, w.bfloat16()))
    (e,) = log.rejected(RULE)
    assert (e.guard, e.values) == ("dtype", {"z": "torch.bfloat16", "weights": "torch.bfloat16",
                                             "out": "torch.bfloat16"})
    # the context's trunk dtype
    _, log = _apply(Combine(4), (z, w), dtype=torch.float32)
    (e,) = log.rejected(RULE)
    assert (e.guard, e.values) == ("dtype", {"z": "torch.bfloat16", "expected": "torch.float32"})
    # one weight row broadcast over the tokens: not the per-token routing weights the op reads
    class Broadcast(nn.Module):
        def forward(self, z, weights):
            return (z.float().view(-1, 4, z.shape[1]) * weights.unsqueeze(-1)).sum(1).to(z.dtype) * 2.0

    z, w = _operands(3, 16, 4, dtype=torch.float32)
    _, log = _apply(Broadcast(), (z, w[:1]))
    (e,) = log.rejected(RULE)
    assert e.guard == "shape" and e.values["weights"] == ["1", "4"] and e.values["z"] == ["12", "16"]


def test_a_graph_without_the_combine_is_not_matched_with_the_reason():
    class SumOverTokens(nn.Module):
        def forward(self, z, weights):  # a weighted sum over dim 0: not the combine over the slots
            return (z.view(3, 4, 16) * weights.unsqueeze(-1)).sum(0)

    _, log = _apply(SumOverTokens(), _operands(3, 16, 4, dtype=torch.float32))
    (e,) = [e for e in log.events if e.rule == RULE]
    assert e.decision == "not_matched" and log.applied(RULE) == 0, e


def test_gpu_context_refuses_a_top_k_no_kernel_covers():
    pytest.importorskip("triton")
    gpu = k3fuse.DecodeContext(device_capability=H100, enabled_rules=frozenset({RULE}))
    for k, applied in ((16, 1), (65, 0)):
        _, log = _apply(Combine(k), _operands(2, 32, k, dtype=torch.float32), gpu)
        assert log.applied(RULE) == applied
        if not applied:
            (e,) = log.rejected(RULE)
            assert (e.guard, e.values["top_k"], e.values["L"], e.values["tokens"]) == ("kernel_shape", 65, 32, "2")
            assert e.values["limits"] == ["triton.moe_combine: top_k=65 (needs 1 <= top_k <= 64)"]


# --- the K3 stack: BF16 and MXFP4 experts, three doors, TP 1 and TP 2 -----------------------------------------
def _default_rules() -> frozenset[str]:
    from k3fuse.patterns import RULE_CLASSES

    return frozenset(c.name for c in RULE_CLASSES if c.default_on)


def _stack_model(dtype: str, fmt: str | None, tp_size: int, rank: int):
    from k3fuse.model import K3DecodeStack, get_config

    extra = {"expert_format": fmt, "moe_inter": 64} if fmt else {}  # whole groups of 32 per rank at TP 2
    model = K3DecodeStack(get_config("tiny", n_layers=N_LAYERS, dtype=dtype, **extra), tp_size=tp_size, rank=rank,
                          seed=5)
    gen = torch.Generator().manual_seed(11)
    xs = [torch.randn(BATCH, model.config.hidden, generator=gen).to(getattr(torch, dtype)) for _ in range(STEPS)]
    return model, xs


def _graph_facts(graph) -> dict:
    """What reads the combine: the latent all-reduce (TP > 1), the fused MoE tail, or the latent norm;
    and that each shared-expert join's anchor is computed from a combine."""
    from k3fuse.vocabulary import is_metadata_check, value_root

    combines = [n for n in graph.nodes if op_qualname(n) == "k3fuse::moe_combine"]
    readers = sorted({op_qualname(u) or str(u.target) for n in combines for u in n.users if not is_metadata_check(u)})
    joins = [n for n in graph.nodes if op_qualname(n) == "k3fuse::shared_expert_join"]

    def upstream(node, targets) -> bool:
        seen, todo = set(), [node]
        while todo:
            v = todo.pop()
            if v in targets:
                return True
            if v not in seen:
                seen.add(v)
                todo.extend(v.all_input_nodes)
        return False

    sources = [op_qualname(value_root(n.args[0])) for n in combines]
    return {"combines": len(combines), "readers": readers, "z_from": sorted(set(sources)),
            "anchors_after_combine": all(upstream(j.args[1], set(combines)) for j in joins), "joins": len(joins)}


def _door_result(log, fn, model, xs, graph=None) -> dict:
    res = strict_steps(fn, model, xs)
    s = log.summary()
    out = {"applied": s[RULE]["applied"], "variants": s[RULE]["variants"], "why": s[RULE]["why"],
           "shared": s["shared_expert_stream"]["applied"],
           "tail": s.get("moe_tail_allreduce_norm", {}).get("applied", 0),
           "err": res["err"], "stats": res["stats"].get(OP, {}), "fallbacks": res["fallbacks"]}
    if graph is not None:
        out["graph"] = _graph_facts(graph)
    return out


def _stack(tp_size: int, rank: int, doors: tuple[str, ...] = ("export", "compile", "inductor_pass")) -> dict:
    """Every (expert format, trunk dtype) through the doors; at TP 2 also the MoE tail rule on and the
    rules in the other order (shared_expert_stream before moe_combine)."""
    ctx = (k3fuse.DecodeContext.from_process_group(strict=True) if tp_size > 1 else k3fuse.DecodeContext(strict=True))
    out = {}
    for fmt in (None, "mxfp4"):
        for dtype in ("float32", "bfloat16"):
            model, xs = _stack_model(dtype, fmt, tp_size, rank)
            ep = torch.export.export(model, (xs[0], model.init_state(BATCH)))
            new_ep, log = k3fuse.apply(ep, ctx)
            out[(fmt, dtype, "export")] = _door_result(log, new_ep.module(), model, xs, new_ep.graph)
            if dtype == "bfloat16" and "tail" in doors:
                tail = ctx.with_(enabled_rules=_default_rules() | {"moe_tail_allreduce_norm"})
                new_ep, log = k3fuse.apply(ep, tail)
                out[(fmt, dtype, "tail")] = _door_result(log, new_ep.module(), model, xs, new_ep.graph)
            if dtype == "float32" and "reordered" in doors:
                from k3fuse.patterns import all_rules

                rules = [r for r in all_rules() if r.default_on]
                names = [r.name for r in rules]
                i, j = names.index(RULE), names.index("shared_expert_stream")
                rules[i], rules[j] = rules[j], rules[i]
                new_ep, log = k3fuse.apply(ep, ctx, rules=rules)
                out[(fmt, dtype, "reordered")] = _door_result(log, new_ep.module(), model, xs, new_ep.graph)
            if dtype == "float32" and "compile" in doors:
                rlog = k3fuse.RewriteLog()
                torch._dynamo.reset()
                compiled = torch.compile(model, backend="k3fuse", fullgraph=True,
                                         options={"compiler": "eager", "context": ctx, "log": rlog})
                out[(fmt, dtype, "compile")] = _door_result(rlog, compiled, model, xs)
            if dtype == "bfloat16" and fmt is None and "inductor_pass" in doors:
                ilog = k3fuse.RewriteLog()
                torch._dynamo.reset()
                with torch._inductor.config.patch(post_grad_custom_post_pass=k3fuse.inductor_pass(ctx, log=ilog),
                                                  force_disable_caches=True), torch.no_grad():
                    out[(fmt, dtype, "inductor_pass")] = _door_result(ilog, torch.compile(model, fullgraph=True),
                                                                      model, xs)
    return out


def _tp_worker(rank: int, world_size: int) -> dict:
    return _stack(world_size, rank, ("export", "compile", "tail", "reordered"))


def _check_stack(out: dict, tp: int) -> None:
    assert out, "no door ran"
    for (fmt, dtype, door), res in out.items():
        where = (fmt, dtype, door)
        variant = "combine" if dtype == "float32" else "combine[bfloat16]"
        assert res["applied"] == N_LAYERS and res["variants"] == {variant: N_LAYERS}, (where, res)
        assert res["shared"] == N_LAYERS, (where, res)  # shared_expert_stream still finds its join
        assert res["fallbacks"] == {} and res["stats"] == {"reference": N_LAYERS * STEPS}, (where, res)
        # fp32: the other rules' references differ from eager by accumulation order only; bf16: their
        # roundings differ from the model's (test_routed_experts.py has the same bounds)
        assert res["err"] < (TOL if dtype == "float32" else 0.25), (where, res["err"])
        g = res.get("graph")
        if g is None:
            continue
        assert g["combines"] == N_LAYERS and g["joins"] == N_LAYERS and g["anchors_after_combine"], (where, g)
        assert g["z_from"] == ["k3fuse::routed_experts" if fmt is None else "k3fuse::routed_experts_w4a16"], g
        if door == "tail":  # the fused MoE tail reads the combine's output (TP 2)
            assert res["tail"] == N_LAYERS and g["readers"] == ["k3fuse::allreduce_rmsnorm"], (where, res)
        elif tp > 1:  # the latent all-reduce reads it
            assert g["readers"] == ["_c10d_functional::all_reduce"], (where, g)
        else:  # TP 1: the latent norm's cast
            assert all(not r.startswith("k3fuse::") for r in g["readers"]), (where, g)


def test_k3_stack_tp1_both_expert_formats_and_doors():
    _check_stack(_stack(1, 0, ("export", "compile", "inductor_pass", "reordered")), 1)


@pytest.mark.slow
def test_k3_stack_tp2_both_expert_formats_moe_tail_and_rule_order():
    for out in launch(_tp_worker, 2, backend="gloo", timeout_s=900):
        _check_stack(out, 2)
        assert {door for *_, door in out} == {"export", "compile", "tail", "reordered"}
