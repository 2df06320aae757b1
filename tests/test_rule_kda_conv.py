"""kda_short_conv on CPU: the op, its reference and stock sequence, the Triton kernel through Triton's
interpreter, and the rule through all three doors.

* the fp32 reference against a float64 oracle, fp32 and bf16 operands, K = 4 (K3) and other K;
  the stock sequence is the model's `short_conv`; the fake impl and the Spec name a bad shape or
  dtype; strict mode counts the reference on CPU, the kill switch runs the stock sequence;
* the Triton kernel runs on CPU through TRITON_INTERPRET=1 in a subprocess (tests/triton_interpreter.py)
  at T in {1, 3, 8, 17, 64}, K3's C = 3 * 12288 / tp (TP 1 and 2) and a small odd C, a row stride
  wider than W, with outputs pre-filled with NaN (an element it does not write stays NaN): the new
  state equals the reference's bit for bit, the conv is within 1e-5 of the float64 oracle; it
  compiles for sm_90 with no spills, no atomics, the taps in 16-byte rows and the state read and
  written in vectors (no strided tap access);
* the rule fires once per KDA layer through k3fuse.apply on torch.export, torch.compile(backend=
  "k3fuse", compiler="eager") and k3fuse.inductor_pass, at TP 1 and TP 2 (2 gloo ranks), fp32 and
  bf16 trunks, and the rewritten program matches the model (output and state, 4 decode steps) in
  strict mode with runtime.stats() showing only the reference; the model's `.contiguous()` copy of
  the state goes with the site; kda_delta_rule and decode_gemm find the same sites whether they run
  before or after it; a broadcast operand, a non-fp32 or non-static tap, another trunk dtype than the
  context's, 65 tokens and, on a GPU context, a K no kernel serves are refused with the values logged.
"""
from __future__ import annotations

import re
import textwrap
from collections import Counter

import pytest
import torch
from torch import nn

import k3fuse
from k3fuse import runtime
from k3fuse.dist import launch
from k3fuse.kernels.lib.reference import kda_conv as ref_conv
from k3fuse.kernels.lib.reference import stock
from k3fuse.model.layers import short_conv
from stack_helpers import compiled_door, reference_then_stock, strict_steps, tiny_stack
from triton_interpreter import run_in_interpreter

RULE = OP = "kda_short_conv"
N_LAYERS = 2
STEPS = 4
BATCH = 3
TOL = 2e-5
H100 = (9, 0)
BF16 = torch.bfloat16


def _operands(T: int, width: int, K: int = 4, dtype: torch.dtype = torch.float32, seed: int = 0):
    """conv_state [T, 3W, K-1], q/k/v [T, W] in `dtype`, fp32 taps [3W, K] of the model's scale."""
    gen = torch.Generator().manual_seed(seed)

    def rn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    state, q, k, v = rn(T, 3 * width, K - 1), rn(T, width), rn(T, width), rn(T, width)
    return state, q, k, v, torch.randn(3 * width, K, generator=gen) * 0.5


def _oracle(state, q, k, v, weight):
    """float64: silu of the window against the taps, and the window less its oldest tap."""
    window = torch.cat([state.double(), torch.cat([q, k, v], -1).double().unsqueeze(-1)], -1)
    acc = (window * weight.double()).sum(-1)
    return acc / (1 + torch.exp(-acc)), window[..., 1:]


# --- op, reference, stock ---------------------------------------------------------------------------
@pytest.mark.parametrize("T,width,K,dtype", [(1, 5, 4, torch.float32), (3, 16, 4, torch.float32), (8, 7, 2, BF16),
                                             (17, 32, 4, BF16), (64, 9, 6, torch.float32)])
def test_reference_matches_float64_oracle(T, width, K, dtype):
    args = _operands(T, width, K, dtype, seed=T * 10 + K)
    conv, state = ref_conv.kda_short_conv(*args)
    conv64, state64 = _oracle(*args)
    assert conv.dtype == torch.float32 and conv.shape == (T, 3 * width)
    assert state.dtype == dtype and state.shape == (T, 3 * width, K - 1) and state.is_contiguous()
    torch.testing.assert_close(conv.double(), conv64, rtol=1e-5, atol=1e-6)
    assert torch.equal(state.double(), state64)  # a copy: exact


def test_stock_is_the_models_short_conv_and_the_reference_agrees():
    for dtype in (torch.float32, BF16):
        args = _operands(5, 16, dtype=dtype, seed=3)
        conv_s, state_s = stock.kda_short_conv(*args)
        conv_m, state_m = short_conv(*args)
        assert torch.equal(conv_s, conv_m) and torch.equal(state_s, state_m)
        conv_r, state_r = ref_conv.kda_short_conv(*args)
        assert torch.equal(state_r, state_m) and state_m.is_contiguous()
        torch.testing.assert_close(conv_r, conv_m, rtol=1e-5, atol=1e-6)  # the taps' sum order only


def test_op_strict_on_cpu_counts_the_reference_and_disable_runs_stock():
    (_, state), (_, state0) = reference_then_stock(torch.ops.k3fuse.kda_short_conv, _operands(3, 8, dtype=BF16),
                                                   short_conv)
    assert torch.equal(state, state0)  # a copy of the window: the same bits


def test_fake_impl_shapes_and_bad_inputs_name_the_shape_or_dtype():
    from torch._subclasses.fake_tensor import FakeTensorMode

    e = torch.empty
    with FakeTensorMode():
        conv, state = torch.ops.k3fuse.kda_short_conv(e(5, 24, 3, dtype=BF16), e(5, 8, dtype=BF16),
                                                      e(5, 8, dtype=BF16), e(5, 8, dtype=BF16), e(24, 4))
        assert conv.shape == (5, 24) and conv.dtype == torch.float32
        assert state.shape == (5, 24, 3) and state.dtype == BF16 and state.is_contiguous()
        good = (e(5, 24, 3), e(5, 8), e(5, 8), e(5, 8), e(24, 4))
        for i, bad, message in ((0, e(5, 24), r"conv_state must be \[T, C, K-1\]"),
                                (2, e(5, 9), r"k is \(5, 9\), expected \[T, C/3\]"),
                                (3, e(5, 8, dtype=BF16), "v dtype torch.bfloat16 differs"),
                                (4, e(24, 3), r"weight is \(24, 3\), expected \[C, K\] = \(24, 4\)"),
                                (4, e(24, 4, dtype=BF16), "weight must be float32")):
            args = list(good)
            args[i] = bad
            with pytest.raises(Exception, match=message):
                torch.ops.k3fuse.kda_short_conv(*args)


def test_spec_from_cuda_operands_and_the_kernels_reasons():
    """from_call on fake CUDA tensors (no GPU needed): K3's shapes fit; a bad shape, dtype or layout
    is the `fits` reason, which is what the fallback counter and the log print."""
    pytest.importorskip("triton")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from k3fuse.kernels.ops.kda_conv import KDAConvSpec, accepts

    def spec(T=3, C=36864, K=4, dtype=BF16, w_dtype=torch.float32, q_width=None, state=None):
        cuda = {"device": "cuda"}
        W = q_width or C // 3
        return KDAConvSpec.from_call(state if state is not None else torch.empty(T, C, K - 1, dtype=dtype, **cuda),
                                     *(torch.empty(T, W, dtype=dtype, **cuda) for _ in range(3)),
                                     torch.empty(C, K, dtype=w_dtype, **cuda))

    with FakeTensorMode():
        k3 = spec()
        assert (k3.fits, k3.tokens, k3.channels, k3.taps, k3.dtype) == (None, 3, 36864, 4, BF16)
        assert accepts(k3) is None
        assert spec(q_width=100).fits == "q is (3, 100), expected [T, C/3] = (3, 12288) for conv_state (3, 36864, 3)"
        assert spec(w_dtype=BF16).fits == "weight dtype torch.bfloat16 (fp32 only)"
        strided = torch.empty(3, 3, 36864, device="cuda", dtype=BF16).transpose(1, 2)
        assert "not contiguous" in spec(state=strided).fits
        assert accepts(spec(K=10)) == "K=10 (needs 2 <= K <= 8)"
        assert accepts(spec(dtype=torch.float64, w_dtype=torch.float32)).startswith("dtype torch.float64")
    assert KDAConvSpec.from_call(*_operands(3, 8)).fits == ("conv_state, q, k, v, weight are not CUDA tensors "
                                                            "on one device")


# --- the rule on a small module ----------------------------------------------------------------------
class Conv(nn.Module):
    """The model's short conv on graph inputs (static fp32 taps unless `tap_input`), a consumer of each output."""

    def __init__(self, width: int, K: int = 4, tap_dtype: torch.dtype = torch.float32, shared_taps: bool = False):
        super().__init__()
        shape = (K,) if shared_taps else (3 * width, K)  # shared: one set of taps broadcast over the channels
        self.w = nn.Parameter((torch.randn(*shape) * 0.5).to(tap_dtype), requires_grad=False)

    def forward(self, state, q, k, v):
        conv, new_state = short_conv(state, q, k, v, self.w)
        return conv + 1.0, new_state


class ConvTapInput(nn.Module):
    def forward(self, state, q, k, v, w):
        return short_conv(state, q, k, v, w)


def _graph_ops(ep) -> Counter:
    return Counter(str(n.target) for n in ep.graph.nodes if n.op == "call_function")


@pytest.mark.parametrize("dtype,variant", [(torch.float32, "window"), (BF16, "window[bfloat16]")])
def test_rule_rewrites_the_site_and_drops_the_state_copy(dtype, variant):
    module = Conv(8)
    args = _operands(3, 8, dtype=dtype)[:4]
    new_ep, log = k3fuse.apply(torch.export.export(module, args), k3fuse.DecodeContext(strict=True))
    assert log.applied(RULE) == 1 and log.summary()[RULE]["variants"] == {variant: 1}
    (e,) = log.select(RULE, "applied")
    assert e.values == {"channels": 24, "taps": 4}
    ops = _graph_ops(new_ep)
    assert ops["k3fuse.kda_short_conv.default"] == 1
    assert not any(name.startswith(("aten.cat", "aten.clone", "aten.slice")) for name in ops), ops
    runtime.reset_stats()
    with runtime.strict():
        conv, state = new_ep.module()(*args)
    assert runtime.stats() == {OP: {"reference": 1}}
    conv0, state0 = module(*args)
    torch.testing.assert_close(conv, conv0, rtol=1e-5, atol=1e-6)
    assert torch.equal(state, state0) and state.is_contiguous()


def _rejected(module, args, ctx=None):
    _, log = k3fuse.apply(torch.export.export(module, args), ctx or k3fuse.DecodeContext())
    assert log.applied(RULE) == 0
    (e,) = log.rejected(RULE)
    return e


def test_broadcast_non_fp32_and_non_static_taps_and_another_trunk_are_refused_with_values():
    """(The cats broadcast nothing: only the taps can be a broadcast operand.)"""
    state, q, k, v, w = _operands(3, 8)
    e = _rejected(Conv(8, shared_taps=True), (state, q, k, v))  # taps [K], broadcast over the channels
    assert (e.level, e.guard) == ("site", "shape") and e.values["conv_weight"] == ["4"]
    e = _rejected(Conv(8, tap_dtype=torch.float64), (state, q, k, v))
    assert (e.guard, e.values["conv_weight"]) == ("dtype", "torch.float64")
    e = _rejected(ConvTapInput(), (state, q, k, v, w))
    assert (e.guard, e.values["conv_weight"]) == ("static_weight", "w")
    e = _rejected(Conv(8), (state, q, k, v), k3fuse.DecodeContext(dtype=BF16))
    assert (e.guard, e.values["conv_state"], e.values["expected"]) == ("dtype", "torch.float32", "torch.bfloat16")


def test_more_than_64_tokens_is_rejected():
    e = _rejected(Conv(8), _operands(65, 8)[:4])
    assert (e.level, e.guard, e.values["tokens"]) == ("site", "token_range", 65)


def test_gpu_context_refuses_a_k_no_kernel_serves_and_covers_k3():
    pytest.importorskip("triton")
    from k3fuse.kernels import dispatch
    from k3fuse.kernels.ops.kda_conv import KDAConvSpec

    for tp in (1, 2, 8):  # K3's [q; k; v] width per rank, 1-64 tokens
        assert dispatch.coverage(KDAConvSpec(channels=3 * 12288 // tp, taps=4, dtype=BF16), range(1, 65)) == {}
    gpu = k3fuse.DecodeContext(device_capability=H100)
    _, log = k3fuse.apply(torch.export.export(Conv(8), _operands(3, 8)[:4]), gpu)
    assert log.applied(RULE) == 1
    e = _rejected(Conv(8, K=10), _operands(3, 8, K=10)[:4], gpu)
    assert (e.guard, e.values["taps"], e.values["tokens"]) == ("kernel_shape", 10, "3")
    assert e.values["limits"] == ["triton.kda_conv: K=10 (needs 2 <= K <= 8)"]


# --- the K3 stack: three doors, both trunks, other rules in either order ----------------------------
def _three_doors(tp_size: int, rank: int) -> dict:
    """k3fuse.apply on torch.export (fp32 and bf16), torch.compile(backend="k3fuse") with the eager
    compiler and k3fuse.inductor_pass under Inductor: per door the rule's applied count, variants,
    the largest difference to the model over STEPS strict steps and the op's stats; and the counts
    of kda_short_conv, kda_delta_rule and decode_gemm with the three in either order."""
    from k3fuse.patterns import DecodeGemm, KDADeltaRule, KDAShortConv

    ctx = k3fuse.DecodeContext.from_process_group() if tp_size > 1 else k3fuse.DecodeContext()
    out = {}
    for dtype in ("float32", "bfloat16"):
        model, xs = tiny_stack(dtype, tp_size, rank, N_LAYERS, BATCH, STEPS)
        ep = torch.export.export(model, (xs[0], model.init_state(BATCH)))
        # bf16: this rule alone (the fused collectives round a bf16 trunk once where the model rounds
        # often, tests/test_rules_k3.py; here only the conv's difference is measured)
        new_ep, log = k3fuse.apply(ep, ctx if dtype == "float32" else ctx.with_(enabled_rules=frozenset({RULE})))
        out[("export", dtype)] = {"summary": log.summary()[RULE], **strict_steps(new_ep.module(), model, xs)}
        if dtype == "float32":
            orders = {}
            for name, rules in (("conv_first", (KDAShortConv, KDADeltaRule, DecodeGemm)),
                                ("conv_last", (KDADeltaRule, DecodeGemm, KDAShortConv)),
                                ("no_conv", (KDADeltaRule, DecodeGemm))):
                _, olog = k3fuse.apply(ep, ctx, rules=[cls() for cls in rules])
                orders[name] = {r: s["applied"] for r, s in olog.summary().items()}
            out["orders"] = orders
    model, xs = tiny_stack("float32", tp_size, rank, N_LAYERS, BATCH, STEPS)
    res = compiled_door(model, xs, ctx)
    out[("compile", "float32")] = {**res, "summary": res["summary"][RULE]}
    ilog = k3fuse.RewriteLog()
    torch._dynamo.reset()
    with torch._inductor.config.patch(post_grad_custom_post_pass=k3fuse.inductor_pass(ctx, log=ilog),
                                      force_disable_caches=True), torch.no_grad():
        res = strict_steps(torch.compile(model, fullgraph=True), model, xs)
    out[("inductor_pass", "float32")] = {"summary": ilog.summary()[RULE], **res}
    return out


def _tp_worker(rank: int, world_size: int) -> dict:
    return _three_doors(world_size, rank)


def _check(out: dict) -> None:
    for (door, dtype), variant in ((("export", "float32"), "window"), (("export", "bfloat16"), "window[bfloat16]"),
                                   (("compile", "float32"), "window"), (("inductor_pass", "float32"), "window")):
        res = out[(door, dtype)]
        assert res["summary"]["applied"] == N_LAYERS and res["summary"]["variants"] == {variant: N_LAYERS}, (door, res)
        assert res["err"] < (TOL if dtype == "float32" else 1e-2), (door, dtype, res["err"])
        assert res["fallbacks"] == {} and res["stats"][OP] == {"reference": N_LAYERS * STEPS}, (door, res)
    orders = out["orders"]
    assert orders["conv_first"] == orders["conv_last"] == {**orders["no_conv"], RULE: N_LAYERS}
    assert orders["no_conv"]["kda_delta_rule"] == N_LAYERS


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_three_doors(tp):
    outs = [_three_doors(1, 0)] if tp == 1 else launch(_tp_worker, tp, backend="gloo", timeout_s=900)
    for out in outs:
        _check(out)


# --- the Triton kernel on CPU: Triton's interpreter (a subprocess), compile for sm_90 -----------------
INTERPRETER_SCRIPT = textwrap.dedent("""
    import json, os
    assert os.environ["TRITON_INTERPRET"] == "1"
    import torch
    from k3fuse.kernels.lib.triton import kda_conv as K
    from k3fuse.kernels.lib.reference import kda_conv as R

    def case(T, W, dtype, q_row_stride=None, block=None):
        g = torch.Generator().manual_seed(T * 7 + W)
        state = torch.randn(T, 3 * W, 3, generator=g).to(dtype)
        wide = torch.randn(3, T, q_row_stride or W, generator=g).to(dtype)
        q, k, v = (wide[i, :, :W] for i in range(3))  # a row stride > W when asked
        w = torch.randn(3 * W, 4, generator=g) * 0.5
        conv = torch.full((T, 3 * W), float("nan"))
        new_state = torch.full((T, 3 * W, 3), float("nan")).to(dtype)
        K.run(state, q, k, v, w, config={"BLOCK": block, "num_warps": 4} if block else None, out=(conv, new_state))
        conv_r, state_r = R.kda_short_conv(state, q, k, v, w)
        window = torch.cat([state.double(), torch.cat([q, k, v], -1).double().unsqueeze(-1)], -1)
        acc = (window * w.double()).sum(-1)
        conv64 = acc / (1 + torch.exp(-acc))
        return {"T": T, "W": W, "dtype": str(dtype), "strided": q_row_stride is not None, "block": block,
                "written": not bool(torch.isnan(conv).any() or torch.isnan(new_state.float()).any()),
                "state_equal": bool(torch.equal(new_state, state_r)),
                "err64": float(((conv.double() - conv64).abs() / (1 + conv64.abs())).max()),
                "err_ref": float((conv - conv_r).abs().max())}

    out = []
    for T in (1, 3, 8, 17, 64):
        for W in (12288, 6144):  # K3 at TP 1 and 2: C = 36864, 18432
            # the GPU's 128-channel blocks up to 8 tokens; above, 1024-channel blocks (the same code, 8x
            # fewer programs for the interpreter: 64 tokens at TP 1 take 2 minutes in 128-channel blocks)
            out.append(case(T, W, torch.bfloat16, block=None if T <= 8 else 1024))
        out.append(case(T, 7, torch.float32))  # a small odd width: C = 21, one masked block
        out.append(case(T, 7, torch.bfloat16))
    out.append(case(5, 40, torch.bfloat16, q_row_stride=48))
    print("RESULT " + json.dumps(out))
""")


@pytest.fixture(scope="module")
def interpreter_results() -> list[dict]:
    return run_in_interpreter(INTERPRETER_SCRIPT, timeout=900)


def test_interpreter_kernel_writes_every_output_and_matches_the_reference(interpreter_results):
    assert sorted({r["T"] for r in interpreter_results}) == [1, 3, 5, 8, 17, 64]
    assert {r["W"] for r in interpreter_results} == {12288, 6144, 7, 40}
    assert {r["block"] for r in interpreter_results} == {None, 1024}  # the default blocks, and wide ones
    for r in interpreter_results:
        assert r["written"] and r["state_equal"], r
        assert r["err64"] < 1e-5 and r["err_ref"] < 1e-5, r


def test_triton_kernel_compiles_for_sm90_with_only_contiguous_vector_accesses():
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    from k3fuse.kernels.lib.triton import kda_conv

    ints = ("W", "s_st", "q_st", "k_st", "v_st")
    for T, width, dtype in ((64, 12288, "bf16"), (8, 6144, "fp16"), (1, 12288, "bf16"), (3, 1536, "fp32")):
        sig = {**{p: f"*{dtype}" for p in ("s_ptr", "q_ptr", "k_ptr", "v_ptr")}, "w_ptr": "*fp32",
               "conv_ptr": "*fp32", "ns_ptr": f"*{dtype}", **{i: "i32" for i in ints},
               **{c: "constexpr" for c in ("K", "KP", "SP", "BLOCK")}}
        # what Triton sees for K3: 16-byte aligned pointers, W and every token stride divisible by 16
        attrs = {(i,): [["tt.divisibility", 16]] for i in range(12)}
        cfg = kda_conv.pick_config(T, width)
        src = triton.compiler.ASTSource(fn=kda_conv._kda_conv_kernel, signature=sig, attrs=attrs,
                                        constexprs={"K": 4, "KP": 4, "SP": 4, "BLOCK": cfg["BLOCK"]})
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg["num_warps"]}).asm["ptx"]
        assert ".local" not in ptx and "atom." not in ptx  # no spills; no atomics: a fixed tap order
        assert "ld.global.v4.b32" in ptx  # the taps: one 16-byte row a channel
        if dtype != "fp32":  # the state in and out as a thread's 4 consecutive 16-bit values, never a strided tap
            assert "ld.global.v2.b32" in ptx and "st.global.v2.b32" in ptx
            scalar = re.findall(r"(ld|st)\.global(?:\.L[12]::[a-z_]+)*\.b16\s", ptx)
            assert scalar == ["ld"], (T, width, dtype, scalar)  # only q/k/v: one channel a thread, coalesced
