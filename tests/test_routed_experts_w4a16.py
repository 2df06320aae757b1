"""routed_experts_w4a16 on CPU: the op, its fake impl, the routed_experts rule on the quantized
spellings, and the Triton kernel in Triton's interpreter.

* the op's reference is `routed_experts_quantized_gathered` bit for bit and its stock is the model's
  spelling; the fake impl names bad formats, shapes and tables;
* the rule matches `routed_experts_quantized_grouped` (bf16: this CPU torch exports and runs
  torch._grouped_mm) and `routed_experts_quantized_gathered` (fp32, bf16) for MXFP4 and int4 through
  the export door, strict mode and the counters: the rewritten program computes what the original
  did, the log names the format; wrong layouts and group sizes are refused with the reason; a GPU
  context refuses what no kernel covers;
* the K3 reference stack with MXFP4 and int4 experts through both doors: the rule fires per layer;
* the kernel (both modes, both formats, both dot orientations) through TRITON_INTERPRET=1 against
  float64 on the dequantized weights, NaN-poisoned outputs; its sm_90 compile (no spills, cp.async).
"""
from __future__ import annotations

import dataclasses
import re
import textwrap

import pytest
import torch
from torch import nn

import k3fuse
from k3fuse import quant, runtime, spelling
from stack_helpers import assert_one_graph_serves_dynamic_tokens
from triton_interpreter import run_in_interpreter

RULE = "routed_experts"
OP = "routed_experts_w4a16"
H100 = (9, 0)
BETA, LINEAR_BETA = spelling.K3_SITU_BETA, spelling.K3_SITU_LINEAR_BETA
FORMATS = ("mxfp4", "int4")


def _quantized(fmt: str, E: int = 8, I: int = 64, L: int = 96, seed: int = 0):
    """(w1, w3, w2) as QuantizedWeight in `fmt` (int4 scales in bf16, as the model stores them)."""
    g = torch.Generator().manual_seed(seed)
    w1, w3 = (torch.randn(E, I, L, generator=g) * L ** -0.5 for _ in range(2))
    w2 = torch.randn(E, L, I, generator=g) * I ** -0.5
    return [quant.quantize(w, fmt, torch.bfloat16) for w in (w1, w3, w2)]


def _op_args(fmt: str, T: int = 3, E: int = 8, I: int = 64, L: int = 96, k: int = 4, dtype=torch.float32,
             seed: int = 0):
    g = torch.Generator().manual_seed(seed + 1)
    a = torch.randn(T, L, generator=g).to(dtype)
    experts = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).reshape(-1)
    weights = []
    for q in _quantized(fmt, E, I, L, seed):
        weights += [q.packed, q.scale]
    table = quant.e2m1_table() if fmt == "mxfp4" else None
    return (a, experts, *weights, k, BETA, LINEAR_BETA, fmt, table)


# --- the op ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_op_on_cpu_is_the_quantized_reference_and_disable_runs_stock(fmt, dtype):
    args = _op_args(fmt, dtype=dtype)
    runtime.reset_stats()
    with runtime.strict():
        z = torch.ops.k3fuse.routed_experts_w4a16(*args)
    assert runtime.stats() == {OP: {"reference": 1}}
    assert z.shape == (12, 96) and z.dtype == dtype
    assert torch.equal(z, spelling.routed_experts_quantized_gathered(*args))
    runtime.reset_stats()
    with k3fuse.disable():
        z0 = torch.ops.k3fuse.routed_experts_w4a16(*args)
    assert runtime.stats() == {OP: {"fallback:disabled": 1}}
    assert torch.equal(z0, spelling.routed_experts_quantized(*args))


def _blocked(args: tuple) -> tuple:
    """_op_args's call with its tables in block order and the layout said."""
    tables = [t for w, s in zip(args[2:8:2], args[3:8:2]) for t in quant.block_order(w, s)]
    return (*args[:2], *tables, *args[8:], "blocks")


@pytest.mark.parametrize("fmt", FORMATS)
def test_op_over_block_ordered_tables_computes_what_it_does_over_rows(fmt):
    """Layout "blocks": the reference and stock un-block the step's experts, so the op over block-ordered
    tables is the row-major call bit for bit; a layout the op does not know is refused by name. (The kernels
    read block order in place: the interpreter and GPU tests.)"""
    args = _op_args(fmt, T=5, I=128, L=256, dtype=torch.bfloat16)
    rows = spelling.routed_experts_quantized_gathered(*args)
    runtime.reset_stats()
    with runtime.strict():
        z = torch.ops.k3fuse.routed_experts_w4a16(*_blocked(args))
    assert runtime.stats() == {OP: {"reference": 1}}
    assert torch.equal(z, rows)
    with k3fuse.disable():
        stock = torch.ops.k3fuse.routed_experts_w4a16(*_blocked(args))
    assert torch.equal(stock, spelling.routed_experts_quantized(*args))
    assert not torch.equal(spelling.routed_experts_quantized_gathered(*_blocked(args)[:-1]), rows)  # the control
    with pytest.raises(Exception, match="layout 'columns' is not one of"):
        torch.ops.k3fuse.routed_experts_w4a16(*args, "columns")


def test_fake_impl_shapes_and_messages():
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = torch.ops.k3fuse.routed_experts_w4a16
    real = {fmt: _op_args(fmt, T=5) for fmt in FORMATS}
    mode = FakeTensorMode()
    fake = {fmt: tuple(mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in args)
            for fmt, args in real.items()}
    with mode:
        a, experts, w1, s1, w3, s3, w2, s2, k, b, lb, fmt, table = fake["mxfp4"]
        assert op(a, experts, w1, s1, w3, s3, w2, s2, k, b, lb, fmt, table).shape == (20, 96)
        bad = (((a, experts, w1, s1, w3, s3, w2, s2, k, b, lb, "nvfp4", None), "format 'nvfp4' is not one of"),
               ((a, experts[:-1], w1, s1, w3, s3, w2, s2, k, b, lb, fmt, table), "19 expert ids for 5 tokens"),
               ((a, experts, w1[:, :, :8], s1, w3, s3, w2, s2, k, b, lb, fmt, table), r"w1/w3 must be \[E, I, L/2\]"),
               ((a, experts, w1, s1, w3, s3, w2[:, :-1], s2, k, b, lb, fmt, table), r"w2 must be \[E, L, I/2\]"),
               ((a, experts, w1, s1[:, :, :2], w3, s3, w2, s2, k, b, lb, fmt, table),
                "w1_scale must be .*group size 32"),
               ((a, experts, w1, s1, w3, s3, w2, s2, k, b, lb, fmt, table[:8]), "16 E2M1 values"))
        for args, message in bad:
            with pytest.raises(Exception, match=message):
                op(*args)
        a, experts, w1, s1, w3, s3, w2, s2, k, b, lb, fmt, _ = fake["int4"]
        assert op(a, experts, w1, s1, w3, s3, w2, s2, k, b, lb, fmt, None).shape == (20, 96)
        with pytest.raises(Exception, match=r"w1/w3 must be \[E, I, L/8\]"):
            op(a, experts, w1[:, :, :4], s1, w3, s3, w2, s2, k, b, lb, fmt, None)


# --- the rule on standalone modules ------------------------------------------------------------------
class QuantizedExperts(nn.Module):
    """The routed experts over quantized weights, in one of the model's spellings (static buffers), held in
    `layout` (blocks: quant.block_order's; `repack=False` keeps the bytes as drawn, for widths that cannot be)."""

    def __init__(self, fmt: str, spelled=spelling.routed_experts_quantized_gathered, E: int = 8, I: int = 64,
                 L: int = 96, k: int = 4, dtype=torch.float32, layout: str = "rows", repack: bool = True):
        super().__init__()
        for name, q in zip(("w1", "w3", "w2"), _quantized(fmt, E, I, L, seed=7)):
            packed, scale = quant.to_layout(q.packed, q.scale, layout) if repack else (q.packed, q.scale)
            self.register_buffer(f"{name}_packed", packed)
            self.register_buffer(f"{name}_scale", scale)
        self.register_buffer("table", quant.e2m1_table() if fmt == "mxfp4" else None)
        self.fmt, self.spelled, self.k, self.dtype, self.layout = fmt, spelled, k, dtype, layout

    def forward(self, a, idx):
        return self.spelled(a, idx.reshape(-1), self.w1_packed, self.w1_scale, self.w3_packed, self.w3_scale,
                            self.w2_packed, self.w2_scale, self.k, BETA, LINEAR_BETA, self.fmt, self.table,
                            self.layout)


def _inputs(module: QuantizedExperts, T: int = 3, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    L, E = module.w2_packed.shape[1], module.w1_packed.shape[0]
    a = torch.randn(T, L, generator=g).to(module.dtype)
    return a, torch.stack([torch.randperm(E, generator=g)[:module.k] for _ in range(T)])


SPELLINGS = [(spelling.routed_experts_quantized_gathered, torch.float32, "gathered"),
             (spelling.routed_experts_quantized_gathered, torch.bfloat16, "gathered"),
             (spelling.routed_experts_quantized_grouped, torch.bfloat16, "grouped")]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("spelled,dtype,form", SPELLINGS)
def test_rule_rewrites_each_quantized_spelling_and_computes_what_it_did(fmt, spelled, dtype, form):
    module = QuantizedExperts(fmt, spelled, dtype=dtype)
    args = _inputs(module)
    ep = torch.export.export(module, args)
    new_ep, log = k3fuse.apply(ep, k3fuse.DecodeContext(strict=True))
    (e,) = [e for e in log.events if e.rule == RULE and e.decision == "applied"]
    suffix = "" if dtype == torch.float32 else "[bfloat16]"
    assert e.variant == f"{form}_{fmt}{suffix}", e.variant
    assert (e.values["format"], e.values["top_k"], e.values["E"], e.values["I"], e.values["group_size"]) == \
        (fmt, 4, 8, 64, 32)
    left = {n.target for n in new_ep.graph.nodes}
    assert torch.ops.k3fuse.routed_experts_w4a16.default in left
    assert not left & {torch.ops.aten._grouped_mm.default, torch.ops.aten.bmm.default,
                       torch.ops.k3fuse.routed_experts.default}
    runtime.reset_stats()
    with runtime.strict():
        z = new_ep.module()(*args)
    assert runtime.stats() == {OP: {"reference": 1}} and runtime.fallbacks() == {}
    z0 = module(*args)
    if form == "gathered":
        assert torch.equal(z, z0)  # the reference is this very spelling
    else:  # grouped GEMMs accumulate in another order than the bmm; both round to bf16 per projection
        torch.testing.assert_close(z.float(), z0.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("spelled,dtype,form", SPELLINGS)
def test_rule_rewrites_the_spellings_over_block_ordered_tables(fmt, spelled, dtype, form):
    """A model holding block-ordered tables un-blocks the step's experts (one k3fuse.from_block_order node
    a table): the rule's blocks variant takes the whole spelling, tells the op the layout, and the log says
    it; the program computes what the row-major module does. The row-major patterns leave it alone."""
    module = QuantizedExperts(fmt, spelled, I=256, L=256, dtype=dtype, layout="blocks")
    rows = QuantizedExperts(fmt, spelled, I=256, L=256, dtype=dtype)
    args = _inputs(module)
    ep = torch.export.export(module, args)
    assert sum(n.target == torch.ops.k3fuse.from_block_order.default for n in ep.graph.nodes) == 3
    new_ep, log = k3fuse.apply(ep, k3fuse.DecodeContext(strict=True))
    (e,) = [e for e in log.events if e.rule == RULE and e.decision == "applied"]
    suffix = "" if dtype == torch.float32 else "[bfloat16]"
    assert e.variant == f"{form}_{fmt}_blocks{suffix}", e.variant
    assert (e.values["format"], e.values["layout"], e.values["I"]) == (fmt, "blocks", 256)
    (op,) = [n for n in new_ep.graph.nodes if n.target == torch.ops.k3fuse.routed_experts_w4a16.default]
    assert "blocks" in op.args
    assert not [n for n in new_ep.graph.nodes if n.target == torch.ops.k3fuse.from_block_order.default]
    runtime.reset_stats()
    with runtime.strict():
        z = new_ep.module()(*args)
    assert runtime.stats() == {OP: {"reference": 1}} and runtime.fallbacks() == {}
    if form == "gathered":
        assert torch.equal(z, rows(*args)) and torch.equal(z, module(*args))
    else:
        torch.testing.assert_close(z.float(), rows(*args).float(), rtol=2e-2, atol=2e-2)


def test_rule_refuses_block_order_off_whole_steps():
    """Tables said to be in block order whose widths are not whole steps of 128 (I = 64, L = 96): the guard
    names the layout, and the spelling is left as it was."""
    module = QuantizedExperts("mxfp4", layout="blocks", repack=False)
    args = _inputs(module)
    _, log = k3fuse.apply(torch.export.export(module, args), k3fuse.DecodeContext())
    (e,) = log.rejected(RULE)
    assert e.guard == "layout" and e.values["layout"] == "blocks" and (e.values["I"], e.values["L"]) == (64, 96)
    assert "whole steps of 128" in e.reason


@pytest.mark.parametrize("fmt", FORMATS)
def test_rule_captures_other_sizes_and_top_k(fmt):
    module = QuantizedExperts(fmt, E=16, I=32, L=160, k=2)
    args = _inputs(module, T=7)
    new_ep, log = k3fuse.apply(torch.export.export(module, args), k3fuse.DecodeContext())
    (e,) = [e for e in log.events if e.rule == RULE and e.decision == "applied"]
    assert (e.values["format"], e.values["top_k"], e.values["E"], e.values["I"]) == (fmt, 2, 16, 32)
    assert torch.equal(new_ep.module()(*args), module(*args))


@pytest.mark.parametrize("fmt,spelled,dtype", [("mxfp4", spelling.routed_experts_quantized_gathered, torch.float32),
                                              ("int4", spelling.routed_experts_quantized_grouped, torch.bfloat16)])
def test_rule_matches_a_dynamic_token_count(fmt, spelled, dtype):
    """torch.compile with the token dim dynamic (as a recompile for a second batch size makes it): one
    rewritten graph, the slot count min(T*k, E) a symbolic size, serves every token count."""
    experts = QuantizedExperts(fmt, spelled, dtype=dtype)
    router = torch.randn(experts.w1_packed.shape[0], experts.w2_packed.shape[1])
    assert_one_graph_serves_dynamic_tokens(experts, router, _inputs, RULE, OP)


def test_rule_refuses_a_table_that_is_not_a_static_buffer():
    class TableInput(QuantizedExperts):
        def forward(self, a, idx, table):
            return self.spelled(a, idx.reshape(-1), self.w1_packed, self.w1_scale, self.w3_packed, self.w3_scale,
                                self.w2_packed, self.w2_scale, self.k, BETA, LINEAR_BETA, self.fmt, table)

    module = TableInput("mxfp4")
    args = (*_inputs(module), quant.e2m1_table())
    _, log = k3fuse.apply(torch.export.export(module, args), k3fuse.DecodeContext())
    (e,) = log.rejected(RULE)
    assert log.applied(RULE) == 0 and e.guard == "static_weight" and e.values["table"] == "table"


@pytest.fixture
def fake_kernel(monkeypatch):
    """A stand-in CUDA kernel of routed_experts_w4a16 covering mxfp4 only, E <= 64."""
    from k3fuse.kernels import dispatch

    dispatch.load_gpu_impls()

    def accepts(s):
        return f"format {s.format}" if s.format != "mxfp4" else (None if s.E <= 64 else f"E={s.E} > 64")

    impl = dispatch.Impl("test.routed_experts_w4a16", accepts=accepts, run=lambda *a, **k: None)
    others = [i for i in dispatch.implementations(OP) if "cuda" not in i.device_types]
    monkeypatch.setattr(dispatch._entry(OP), "impls", [impl, *others])
    return impl


def test_gpu_context_refuses_what_no_kernel_covers_and_names_the_format(fake_kernel):
    gpu = k3fuse.DecodeContext(device_capability=H100)
    for fmt, n_experts, limit in (("mxfp4", 64, None), ("mxfp4", 128, "E=128 > 64"), ("int4", 64, "format int4")):
        module = QuantizedExperts(fmt, E=n_experts)
        _, log = k3fuse.apply(torch.export.export(module, _inputs(module, T=4)), gpu)
        assert log.applied(RULE) == (limit is None), (fmt, n_experts)
        if limit is not None:
            (e,) = log.rejected(RULE)
            assert e.guard == "kernel_shape" and e.values["format"] == fmt and e.values["tokens"] == "4"
            assert e.values["limits"] == [f"test.routed_experts_w4a16: {limit}"]


def test_spec_from_call_reads_cuda_operands_and_names_each_misfit():
    """from_call past its device check, on fake CUDA tensors (no GPU needed): a call the kernel reads is
    accepted, and a wrong shape, packed dtype, scale dtype or expert ids each come back named."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from k3fuse.kernels.lib.triton import routed_experts_w4a16 as K
    from k3fuse.kernels.ops.routed_experts_w4a16 import RoutedExpertsW4A16Spec, accepts

    T, E, I, L, k = 2, 16, 64, 96, 4
    with FakeTensorMode():
        a = torch.empty(T, L, device="cuda", dtype=torch.bfloat16)
        experts = torch.empty(T * k, device="cuda", dtype=torch.int64)
        packed = {n: torch.empty(shape, device="cuda", dtype=torch.uint8)
                  for n, shape in K.packed_shapes("mxfp4", E, I, L).items()}

        def spec(**over):
            t = {**packed, **over}
            return RoutedExpertsW4A16Spec.from_call(over.get("a", a), over.get("experts", experts), t["w1"], t["s1"],
                                                    t["w3"], t["s3"], t["w2"], t["s2"], k, 1.0, 1.0, "mxfp4")

        good = spec()
        assert (good.tokens, good.E, good.I, good.L, good.fits) == (T, E, I, L, None) and accepts(good) is None
        assert "shapes" in spec(w2=torch.empty(E, L, I, device="cuda", dtype=torch.uint8)).fits
        assert spec(w1=packed["w1"].view(torch.int8)).fits == "w1 is torch.int8, mxfp4 packs torch.uint8"
        assert spec(s3=packed["s3"].view(torch.int8)).fits.startswith("s3 is torch.int8")
        assert "experts" in spec(experts=torch.empty(T * k - 1, device="cuda", dtype=torch.int64)).fits


def test_cute_copies_ask_the_scales_aligned_to_a_step_of_their_format():
    """The CuTe kernel copies a row's 4 group scales a step in one cp.async: 4 E8M0 bytes, or 8 bytes of
    int4's bf16 scales, so a scale table must start on that many bytes (the packed weights on 16); a
    view off them is named, for the Triton kernel to take."""
    from k3fuse.kernels.ops.routed_experts_w4a16 import _unaligned, scale_alignment

    assert scale_alignment(torch.uint8) == 4 and scale_alignment(torch.bfloat16) == 8
    table = torch.empty(64, dtype=torch.bfloat16)  # (CPU storage: the test reads only its addresses)
    start = (-table.data_ptr() % 16) // 2  # the first 16-byte aligned element
    assert _unaligned(8, w1_scale=table[start:], w2_scale=table[start + 4:]) is None
    assert _unaligned(8, w1_scale=table[start + 2:]) == "w1_scale not 16-byte (weights) / 8-byte (scales) aligned"
    assert _unaligned(4, w1_scale=table[start + 2:]) is None
    words = torch.empty(64, dtype=torch.int32)
    at = (-words.data_ptr() % 16) // 4
    assert _unaligned(8, w3_packed=words[at + 2:]) == "w3_packed not 16-byte (weights) / 8-byte (scales) aligned"


def test_kernel_covers_k3_shapes_and_names_its_limits():
    pytest.importorskip("triton")
    from k3fuse.kernels import dispatch

    from k3fuse.kernels.ops.routed_experts_w4a16 import RoutedExpertsW4A16Spec

    dispatch.load_gpu_impls()
    for fmt in FORMATS:
        for I in (3072, 1536, 384):
            spec = RoutedExpertsW4A16Spec(E=896, I=I, L=3584, top_k=16, dtype=torch.bfloat16, format=fmt,
                                          scale_dtype=torch.uint8 if fmt == "mxfp4" else torch.bfloat16)
            assert dispatch.coverage(spec, range(1, 65)) == {}, (fmt, I)
    odd = RoutedExpertsW4A16Spec(E=896, I=100, L=3584, top_k=16, dtype=torch.bfloat16, format="mxfp4",
                                 scale_dtype=torch.uint8)
    limits = dispatch.coverage(odd, [1])
    assert any("whole groups of 32" in str(v) for v in limits.values()), limits


def test_cute_kernel_takes_mxfp4_and_int4_bf16_at_k3_widths_and_names_what_it_leaves_to_triton(monkeypatch):
    """The CuTe expert GEMMs (priority over Triton) cover bf16 activations with MXFP4, or int4 with bf16
    scales, at K3's widths at every token count; int4 with K3FUSE_W4A16_CUTE_INT4=0, int4 with fp16 or
    fp32 scales, fp16 activations and widths off 128-element steps are left to Triton, each named."""
    pytest.importorskip("triton")
    from k3fuse.kernels import dispatch
    from k3fuse.kernels.lib.cute import compat
    from k3fuse.kernels.lib.cute import routed_experts_w4a16 as C
    from k3fuse.kernels.lib.composite.routed_experts_w4a16 import W4A16Launch
    from k3fuse.kernels.ops.routed_experts_w4a16 import RoutedExpertsW4A16Spec, cute_accepts

    if not compat.HAVE_CUTE:
        pytest.skip(f"nvidia-cutlass-dsl not importable: {compat.IMPORT_ERROR}")
    dispatch.load_gpu_impls()
    names = [i.name for i in dispatch.cuda_kernels(OP)]
    assert names.index("cute.routed_experts_w4a16") < names.index("triton.routed_experts_w4a16")

    def spec(T, I=1536, fmt="mxfp4", dtype=torch.bfloat16, scale_dtype=None):
        scale_dtype = scale_dtype or (torch.uint8 if fmt == "mxfp4" else torch.bfloat16)
        return RoutedExpertsW4A16Spec(tokens=T, E=896, I=I, L=3584, top_k=16, dtype=dtype, format=fmt,
                                      scale_dtype=scale_dtype)

    monkeypatch.setenv("K3FUSE_W4A16_CUTE_INT4", "0")
    assert cute_accepts(spec(8, fmt="int4")) == "int4 on the CuTe kernel is turned off (K3FUSE_W4A16_CUTE_INT4=0)"
    monkeypatch.delenv("K3FUSE_W4A16_CUTE_INT4")
    for I in (3072, 1536, 384):
        for T in range(1, 65):
            assert cute_accepts(spec(T, I)) is None, (I, T)
            assert cute_accepts(spec(T, I, fmt="int4")) is None, (I, T)
            launch = W4A16Launch.for_call("mxfp4", T, 896, I, 3584, 16)  # (a width it does not take raises)
            steps = 3584 // C.STEP
            assert steps % launch.split == 0 and (3584 // C.BLOCK_ROWS) % launch.n_tiles == 0, (I, T, launch)
            assert 2 <= launch.gate_up().stages <= steps // launch.split + 1, (I, T, launch)
            assert launch.pairwise == (T <= 2)
    for I in (2048, 256):  # Kimi K2.x's int4 experts at TP 1 and 8: 384 of them, top-8, hidden 7168
        k2 = RoutedExpertsW4A16Spec(E=384, I=I, L=7168, top_k=8, dtype=torch.bfloat16, format="int4",
                                    scale_dtype=torch.bfloat16)
        assert all(cute_accepts(k2.with_tokens(T)) is None for T in range(1, 65)), I
    assert W4A16Launch.for_call("int4", 1, 896, 384, 3584, 16).split > 1  # 16 pairs x 12 row blocks: the split fills
    assert W4A16Launch.for_call("mxfp4", 64, 896, 3072, 3584, 16).split == 1  # the SMs
    assert "int4 with bf16 scales" in cute_accepts(spec(8, fmt="int4", scale_dtype=torch.float16))
    assert "int4 with bf16 scales" in cute_accepts(spec(8, fmt="int4", scale_dtype=torch.float32))
    assert "bf16 activations" in cute_accepts(spec(8, dtype=torch.float16))
    assert "bf16 activations" in cute_accepts(spec(8, fmt="int4", dtype=torch.float16))
    assert cute_accepts(spec(8, I=96)) == "I=96, L=3584 (the CuTe kernel needs multiples of 128)"
    # block-ordered tables: both kernels read them at every K3 width and token count; off whole steps, named
    from k3fuse.kernels.ops.routed_experts_w4a16 import accepts

    for I in (3072, 1536, 384):
        for T in (1, 2, 5, 64):
            blocked = dataclasses.replace(spec(T, I), layout="blocks")
            assert cute_accepts(blocked) is None
            assert W4A16Launch.for_call("mxfp4", T, 896, I, 3584, 16, "blocks").blocked
            assert accepts(blocked) is None
    assert accepts(dataclasses.replace(spec(1, 192), layout="blocks")) == \
        "layout 'blocks' at I=192, L=3584 (block order needs whole steps of 128)"


# --- the K3 stack with quantized experts ------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_k3_stack_with_block_ordered_experts_both_doors(fmt):
    """The K3 stack holding its experts in block order (tiny at two steps of 128 a row): the blocks variant fires
    per layer through export and torch.compile, strict, and the steps are the model's."""
    from stack_helpers import compiled_door, strict_steps

    from k3fuse.model import K3DecodeStack, get_config

    ctx = k3fuse.DecodeContext(strict=True)
    model = K3DecodeStack(get_config("tiny", n_layers=2, latent=256, moe_inter=256, expert_format=fmt,
                                     expert_layout="blocks"), seed=5)
    gen = torch.Generator().manual_seed(11)
    xs = [torch.randn(3, model.config.hidden, generator=gen) for _ in range(3)]
    new_ep, log = k3fuse.apply(torch.export.export(model, (xs[0], model.init_state(3))), ctx)
    res = strict_steps(new_ep.module(), model, xs)
    form = f"gathered_{fmt}_blocks"
    assert log.summary()[RULE]["variants"] == {form: 2}, log.summary()[RULE]
    assert res["fallbacks"] == {} and res["stats"][OP] == {"reference": 6} and res["err"] < 2e-5, res
    out = compiled_door(model, xs, ctx)
    assert out["summary"][RULE]["variants"] == {form: 2} and out["fallbacks"] == {}, out


@pytest.mark.parametrize("fmt", FORMATS)
def test_k3_stack_with_quantized_experts_both_doors(fmt):
    from stack_helpers import compiled_door, strict_steps

    from k3fuse.model import K3DecodeStack, get_config

    ctx = k3fuse.DecodeContext(strict=True)
    for dtype in ("float32", "bfloat16"):
        model = K3DecodeStack(get_config("tiny", n_layers=2, dtype=dtype, expert_format=fmt), seed=5)
        gen = torch.Generator().manual_seed(11)
        xs = [torch.randn(3, model.config.hidden, generator=gen).to(getattr(torch, dtype)) for _ in range(3)]
        new_ep, log = k3fuse.apply(torch.export.export(model, (xs[0], model.init_state(3))), ctx)
        res = strict_steps(new_ep.module(), model, xs)
        s = log.summary()
        form = "gathered_" + fmt + ("" if dtype == "float32" else "[bfloat16]")
        assert s[RULE]["applied"] == 2 and s[RULE]["variants"] == {form: 2}, s[RULE]
        assert res["fallbacks"] == {} and res["stats"][OP] == {"reference": 6}, res
        assert res["err"] < (2e-5 if dtype == "float32" else 0.25), res["err"]
        if dtype == "float32":
            out = compiled_door(model, xs, ctx)
            assert out["summary"][RULE]["variants"] == {form: 2} and out["fallbacks"] == {}, out


# --- the Triton kernel through Triton's interpreter (a subprocess: TRITON_INTERPRET must be set
# before triton is imported). fp16 trunk: the interpreter (Triton 3.6, numpy) mis-reads bf16 loads;
# the GPU test covers bf16. Every case runs pairwise and grouped, both formats; "blocked" on tables in
# quant.block_order's layout (and, the control, the same tables read as rows) -----------------------
CASES = ["one_token", "k3_like", "crowded", "bad_ids", "blocked"]
INTERPRETER_SCRIPT = textwrap.dedent("""
    import json, os
    assert os.environ["TRITON_INTERPRET"] == "1"
    import torch
    from k3fuse import quant
    from k3fuse.kernels.lib.triton import routed_experts_w4a16 as K
    from k3fuse.spelling import K3_SITU_BETA as B, K3_SITU_LINEAR_BETA as LB, routed_experts_gathered
    assert K.HAVE_TRITON and K.bf16_kernel.INTERPRET
    out = []
    for fmt in ("mxfp4", "int4"):
        for name, T, E, I, L, k in (("one_token", 1, 8, 64, 96, 2), ("k3_like", 3, 24, 32, 64, 4),
                                    ("crowded", 20, 8, 32, 64, 4), ("bad_ids", 3, 8, 32, 64, 2),
                                    ("blocked", 3, 8, 128, 256, 4)):
            g = torch.Generator().manual_seed(T)
            a = torch.randn(T, L, generator=g).half()
            w = [torch.randn(E, I, L, generator=g) * L ** -0.5, torch.randn(E, I, L, generator=g) * L ** -0.5,
                 torch.randn(E, L, I, generator=g) * I ** -0.5]
            q = [quant.quantize(x, fmt, torch.float16) for x in w]
            deq = [x.dequantize(torch.float64) for x in q]
            if name == "crowded":  # every token picks experts 0..k-1: groups of T > 16 rows (two row blocks)
                experts = torch.arange(k).repeat(T)
            else:
                experts = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).reshape(-1)
            ref = routed_experts_gathered(a.double(), experts, *deq, k, B, LB)
            half = routed_experts_gathered(a, experts, *[x.dequantize(torch.float16) for x in q], k, B, LB)
            kept = torch.ones(T * k, dtype=torch.bool)
            if name == "bad_ids":
                kept[[1, 4]] = False
                experts = experts.clone()
                experts[1], experts[4] = -1, E
            args = [t for x in q for t in (x.packed, x.scale)]
            layouts = ["rows"]
            if name == "blocked":  # I = 128 rows of w1 (L = 256: two steps a row), 256 rows of w2
                args = [t for x in q for t in quant.block_order(x.packed, x.scale)]
                layouts = ["blocks", "rows"]
            table = quant.e2m1_table() if fmt == "mxfp4" else None
            # both modes; the k3_like case also with the other dot orientation (mma.sync / wgmma), the
            # one_token case (L = 96) with both down tiles in one program (the second one partly past L)
            wgmma = K.GATE_UP["WGMMA"]
            launches = [{"gate_up": {"WGMMA": wgmma}, "down": {"WGMMA": wgmma}}]
            if name == "k3_like":
                launches.append({"gate_up": {"WGMMA": not wgmma}, "down": {"WGMMA": not wgmma}})
                launches.append({"gate_up": {"WORD_ORDER": True}, "down": {"WORD_ORDER": True}})
            if name == "one_token":
                launches.append({"down": {"N_TILES": 2, "BLOCK_N": 64}})
            for pairwise in (True, False):
                for launch in launches:
                    for layout in layouts:
                        z = torch.full((T * k, L), float("nan"), dtype=torch.float16)
                        K.run(a, experts, *args, k, B, LB, fmt, table, layout, out=z,
                              config={"pairwise": pairwise, **launch})
                        err = lambda x: float((x[kept].double() - ref[kept]).norm() / ref[kept].norm())
                        out.append({"fmt": fmt, "case": name, "pairwise": pairwise, "launch": launch,
                                    "layout": layout, "written": not bool(torch.isnan(z[kept]).any()),
                                    "rel": err(z), "rel_fp16": err(half)})
    print("RESULT " + json.dumps(out))
""")


def test_triton_kernel_in_the_interpreter_against_float64():
    results = run_in_interpreter(INTERPRETER_SCRIPT)
    assert sorted({(r["fmt"], r["case"], r["pairwise"]) for r in results}) == \
        sorted((f, c, p) for f in FORMATS for c in CASES for p in (True, False))
    assert {r["launch"]["down"].get("WGMMA") for r in results if r["case"] == "k3_like"} >= {True, False}
    assert any(r["launch"]["down"].get("N_TILES") == 2 for r in results if r["case"] == "one_token")
    assert any(r["launch"]["down"].get("WORD_ORDER") for r in results if r["case"] == "k3_like")
    control = [r for r in results if r["layout"] == "rows" and r["case"] == "blocked"]
    assert len(control) == 4 and all(r["rel"] > 0.5 for r in control), control  # block order read as rows
    for r in results:
        if r in control:
            continue
        assert r["written"], r  # every (kept) row of the NaN-poisoned output was written
        assert r["rel"] < 3e-3 and r["rel"] < 2 * r["rel_fp16"] + 1e-4, r  # fp16 rounding, as the spelling's


def test_word_order_and_quad_order_put_each_element_where_the_cute_kernel_reads_it():
    """word_order: position 8w + 2j + h holds element 8w + j + 4h; quads also moves word 4t + i of each
    128-element step to 4i + t (a thread quad's loads of word i contiguous); the SiTU-GLU kernel in the
    interpreter stores its columns in both orders as word_order puts them."""
    from k3fuse.kernels.lib.triton.routed_experts_w4a16 import word_order

    x = torch.arange(2 * 256).reshape(2, 256)
    words, quads = word_order(x), word_order(x, quads=True)
    for pos in range(256):
        w, j, h = pos // 8, (pos % 8) // 2, pos % 2
        assert words[1, pos] == 256 + 8 * w + j + 4 * h
        step, i, t = pos // 128, (pos % 128) // 32, (pos % 32) // 8
        assert quads[1, pos] == 256 + 128 * step + 8 * (4 * t + i) + j + 4 * h
    results = run_in_interpreter(textwrap.dedent("""
        import json, torch
        from k3fuse.kernels.lib.triton import routed_experts_w4a16 as K
        gu = torch.randn(2, 3, 2 * 256, generator=torch.Generator().manual_seed(0))
        natural = K.act(gu, torch.float16, 1.5, 2.5, word_ordered=False)
        out = {}
        for quads in (False, True):
            got = K.act(gu, torch.float16, 1.5, 2.5, word_ordered=True, quads=quads)
            out[str(quads)] = bool(torch.equal(got, K.word_order(natural, quads)))
        print("RESULT " + json.dumps(out))
    """), timeout=300)
    assert results == {"False": True, "True": True}


def test_grouping_and_word_order_in_one_launch_are_the_two_launches():
    """group_in_word_order (grouped mode's preparations in one launch) in the interpreter: the same
    groups and rows as `group`, and a copy of a equal to word_order(a, quads), both orders; an expert id
    outside [0, E) left out; the sizes it refuses, by name."""
    from k3fuse.kernels.lib.triton.routed_experts_w4a16 import group_in_word_order

    results = run_in_interpreter(textwrap.dedent("""
        import json, torch
        from k3fuse.kernels.lib.triton import routed_experts_w4a16 as K
        out = []
        for T, L, E, k in ((3, 256, 40, 16), (16, 3584, 896, 16), (1, 128, 8, 4)):
            gen = torch.Generator().manual_seed(T)
            a = torch.randn(T, L, generator=gen).to(torch.bfloat16)
            experts = torch.randint(0, E, (T * k,), generator=gen)
            experts[0] = E + 3  # left out of every group
            rows0, groups0 = K.group(experts, E, False)
            P, n = T * k, int(groups0[0])
            kept = int(groups0[1 + 2 * P:1 + 2 * P + n].sum())
            for quads in (False, True):
                rows, groups, x = K.group_in_word_order(a, experts, E, quads)
                out.append({"T": T, "quads": quads, "kept": kept, "x": bool(torch.equal(x, K.word_order(a, quads))),
                            "groups": int(groups[0]) == n and all(
                                bool(torch.equal(groups[1 + c * P:1 + c * P + n], groups0[1 + c * P:1 + c * P + n]))
                                for c in range(3)),
                            "rows": bool(torch.equal(rows[:kept], rows0[:kept]))})
        print("RESULT " + json.dumps(out))
    """), timeout=300)
    assert len(results) == 6 and all(r["x"] and r["groups"] and r["rows"] for r in results), results
    assert [r["kept"] for r in results] == [47, 47, 255, 255, 3, 3]  # every pair but the one left out
    a = torch.zeros(2, 200, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"K a multiple of 128, got \(2, 200\)"):
        group_in_word_order(a, torch.zeros(32, dtype=torch.int64), 8, quads=True)


def test_situ_glu_launch_lets_its_dependent_start_where_asked_sm90():
    """The SiTU-GLU launch before a down launched as its programmatic dependent (act_pdl) triggers that launch
    first thing; otherwise it has no griddepcontrol (sm_90 PTX)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    from k3fuse.kernels.lib.triton import routed_experts_w4a16 as K

    fn = K._act_kernel
    for trigger in (False, True):
        constexprs = {"I": 384, "SPLIT_K": 1, "BLOCK": K.ACT_BLOCK, "WORD_ORDER": True, "QUADS": True,
                      "LAUNCH_DEPENDENTS": trigger}
        types = {"gu_ptr": "*fp32", "act_ptr": "*bf16", "P": "i32", "beta": "fp32", "linear_beta": "fp32"}
        sig = {n: "constexpr" if n in constexprs else types[n] for n in fn.arg_names}
        src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=constexprs)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
        assert ptx.count("griddepcontrol.launch_dependents") == trigger and "griddepcontrol.wait" not in ptx
        if trigger:  # before the first load of the partials
            assert ptx.index("griddepcontrol.launch_dependents") < ptx.index("ld.global")


SM90_TYPES = {"a_ptr": "*bf16", "act_ptr": "*bf16", "w1_ptr": "*i32", "w3_ptr": "*i32", "w2_ptr": "*i32",
              "s1_ptr": "*u8", "s3_ptr": "*u8", "s2_ptr": "*u8", "gu_ptr": "*fp32", "z_ptr": "*bf16",
              "experts_ptr": "*i64", "rows_ptr": "*i32", "groups_ptr": "*i32", "P": "i32", "E": "i32"}


@pytest.mark.parametrize("fmt", FORMATS)
def test_triton_kernels_compile_for_sm90(fmt):
    """Gate/up and down compile for sm_90 at K3's shapes in both modes and both layouts: no spills, no atomics,
    the packed loads software-pipelined (cp.async), the bf16x2 dequantization; block order's loads as wide as
    the row-major ones (as many 16-byte copies)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    from k3fuse.kernels.lib.triton import routed_experts_w4a16 as K

    types = dict(SM90_TYPES)
    if fmt == "int4":
        types.update({n: "*bf16" for n in ("s1_ptr", "s3_ptr", "s2_ptr")})

    def compile_kernel(fn, constexprs: dict, launch: dict):
        sig = {n: "constexpr" if n in constexprs else types[n] for n in fn.arg_names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if sig[n].startswith("*")}
        src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=launch)

    wide: dict[tuple, int] = {}  # 16-byte cp.async copies per kernel and launch, by layout
    for T, I, pairwise, blocked in ((1, 1536, True, False), (8, 384, False, False), (64, 3072, False, False),
                                    (1, 1536, True, True), (64, 3072, False, True)):
        cfg = K.pick_config(T, 896, I, 3584, 16, {"pairwise": pairwise})
        gu, dn = cfg["gate_up"], cfg["down"]
        mode = {"PAIRWISE": pairwise, **({"rows_ptr": None, "groups_ptr": None} if pairwise else {})}
        packed = K.packs(torch.bfloat16, fmt, torch.uint8 if fmt == "mxfp4" else torch.bfloat16)
        shape = {"I": I, "L": 3584, "BLOCK_M": K.BLOCK_M, "MXFP4": fmt == "mxfp4", "PACKED": packed, **mode}
        for name, fn, constexprs, launch in (
                ("gate_up", K._gate_up_kernel, {**shape, "TOP_K": 16, "BLOCK_N": gu["BLOCK_N"],
                                                "BLOCK_K": gu["BLOCK_K"], "SPLIT_K": gu["SPLIT_K"],
                                                "STAGES": gu["STAGES"], "WGMMA": gu["WGMMA"],
                                                "WORD_ORDER": gu["WORD_ORDER"], "BLOCKED": blocked}, gu),
                ("down", K._down_kernel, {**shape, "N_TILES": dn["N_TILES"], "BLOCK_N": dn["BLOCK_N"],
                                          "BLOCK_K": dn["BLOCK_K"], "STAGES": dn["STAGES"], "WGMMA": dn["WGMMA"],
                                          "WORD_ORDER": dn["WORD_ORDER"], "BLOCKED": blocked}, dn)):
            ck = compile_kernel(fn, constexprs, {"num_warps": launch["num_warps"]})
            ptx, where = ck.asm["ptx"], (name, T, I, pairwise, blocked)
            assert ".entry" in ptx and "atom." not in ptx and "cp.async" in ptx, where
            assert ".local" not in ptx, where  # no spills to local memory
            assert packed and "mul.rn.bf16x2" in ptx, where  # the bf16x2 dequantization
            wide[where] = len(re.findall(r"cp\.async\.cg\.shared\.global [^\n]*, 0x10,", ptx))
    for (name, T, I, pairwise, blocked), copies in wide.items():
        if blocked:
            assert copies and copies == wide[(name, T, I, pairwise, False)], (name, T, I, copies)


def test_pick_config_splits_k_when_the_grid_is_small():
    from k3fuse.kernels.lib.triton import routed_experts_w4a16 as K

    one = K.pick_config(1, 896, 384, 3584, 16)
    assert one["pairwise"] and one["gate_up"]["SPLIT_K"] > 1
    assert 3584 % (one["gate_up"]["SPLIT_K"] * K.GROUP) == 0
    many = K.pick_config(64, 896, 3072, 3584, 16)
    assert not many["pairwise"] and many["gate_up"]["SPLIT_K"] == 1
    forced = K.pick_config(1, 896, 384, 3584, 16, {"pairwise": False, "gate_up": {"SPLIT_K": 1}})
    assert not forced["pairwise"] and forced["gate_up"]["SPLIT_K"] == 1


def test_the_cute_launch_covers_the_sms_and_takes_imposed_choices():
    """W4A16Launch.for_call at K3's widths: a K split for few pairs, row tiles for many, the ring's depth
    following the span; an arm imposes a split or tile count (dataclasses.replace), and one that does not
    divide the steps or row blocks, or a layout that is not one, is refused by name."""
    from k3fuse.kernels.lib.composite.routed_experts_w4a16 import STAGES, TARGET_CTAS, W4A16Launch
    from k3fuse.kernels.lib.cute import routed_experts_w4a16 as w4

    E, L, k = 896, 3584, 16
    few = W4A16Launch.for_call("int4", 1, E, 384, L, k)  # 16 pairs x 12 row blocks: split until ~8 CTAs an SM
    assert few.pairwise and few.split > 1 and (L // w4.STEP) % few.split == 0
    assert 16 * 12 * few.split >= TARGET_CTAS and few.n_tiles == 1
    many = W4A16Launch.for_call("mxfp4", 64, E, 3072, L, k)
    assert not many.pairwise and many.split == 1 and many.n_tiles > 1
    assert many.gate_up().stages == many.down(4.0, 25.0).stages == STAGES
    imposed = dataclasses.replace(W4A16Launch.for_call("mxfp4", 1, E, 3072, L, k), split=14, n_tiles=2)
    assert imposed.gate_up().L // imposed.gate_up().split == 256 and imposed.down(4.0, 25.0).n_tiles == 2
    assert imposed.gate_up().stages == 3  # 2 steps a span: a ring of 3 at most
    assert dataclasses.replace(few, split=4).gate_up().stages == STAGES
    with pytest.raises(ValueError, match="split 3"):
        dataclasses.replace(few, split=3)  # 28 steps
    with pytest.raises(ValueError, match="n_tiles 3"):
        dataclasses.replace(many, n_tiles=3)  # 56 row blocks
    with pytest.raises(ValueError, match="expert layout 'columns'"):
        W4A16Launch.for_call("mxfp4", 1, E, 3072, L, k, "columns")
    with pytest.raises(ValueError, match="I=96"):
        W4A16Launch.for_call("mxfp4", 1, E, 96, L, k)  # off whole row blocks (the op's predicate says so first)


def test_pairwise_launches_stage_their_rows_and_grouped_downs_follow_the_situ_glu_grid():
    """Pairwise (1-2 tokens at top-16): the gate/up stages a's row, the down computes h from the gate/up's
    partials (SiTU's betas and the split's slots in its type); grouped: the down reads the Triton SiTU-GLU's
    h after that grid (PDL). A mode imposed on a token count gets that mode's split and tiles; each launch
    its own compile key."""
    from k3fuse.kernels.lib.composite.routed_experts_w4a16 import W4A16Launch
    from k3fuse.kernels.lib.cute import routed_experts_w4a16 as w4

    E, L, k = 896, 3584, 16
    staged, grouped = W4A16Launch.for_call("mxfp4", 1, E, 384, L, k), W4A16Launch.for_call("mxfp4", 16, E, 384, L, k)
    assert staged.pairwise and staged.gate_up().pairwise
    assert staged.down(4.0, 25.0).situ == w4.Situ(beta=4.0, linear_beta=25.0, splits=staged.split)
    assert not grouped.pairwise and not grouped.gate_up().pairwise and grouped.down(4.0, 25.0).situ is None
    forced = W4A16Launch.for_call("mxfp4", 2, E, 384, L, k, pairwise=False)  # ~32 groups: the rule's split
    assert not forced.pairwise and forced.split == 4 and W4A16Launch.for_call("mxfp4", 2, E, 384, L, k).split == 1
    assert W4A16Launch.for_call("mxfp4", 64, E, 384, L, k, pairwise=True).pairwise
    keys = {w4.builder(kernel)[0] for launch in (staged, grouped, forced)
            for kernel in (launch.gate_up(), launch.down(4.0, 25.0), launch.down(2.0, 25.0))}
    assert len(keys) == 7  # the grouped downs take no betas
    if w4.compat.HAVE_CUTE:
        up, down, after = (w4.W4A16RowsDot(kernel) for kernel in (staged.gate_up(), staged.down(4.0, 25.0),
                                                                   grouped.down(4.0, 25.0)))
        assert up.x_stage_bytes() == 2 * 3584 // staged.split and down.x_stage_bytes() == 2 * 384
        assert not up.after_grid and not down.after_grid and after.after_grid and after.x_stage_bytes() == 0


def test_blocked_is_the_tables_layout_with_its_own_launch_keys():
    """The tables' layout says `blocked` (the caller's fact, not a choice): the launch the call takes, over
    block-ordered tables, in both modes and both projections, each its own compile key."""
    from k3fuse.kernels.lib.composite.routed_experts_w4a16 import W4A16Launch
    from k3fuse.kernels.lib.cute import routed_experts_w4a16 as w4

    for fmt in FORMATS:
        for T in (1, 2, 64):
            rows = W4A16Launch.for_call(fmt, T, 896, 1536, 3584, 16)
            blocked = W4A16Launch.for_call(fmt, T, 896, 1536, 3584, 16, "blocks")
            assert not rows.blocked and blocked == dataclasses.replace(rows, blocked=True)
            for made in (lambda launch: launch.gate_up(), lambda launch: launch.down(4.0, 25.0)):
                assert made(blocked).blocked and w4.builder(made(blocked))[0] != w4.builder(made(rows))[0]


def test_the_launch_types_refuse_what_the_kernel_cannot_stream():
    """GateUp / Down (the CuTe kernel's one constructor argument) name a split, tile count or ring depth that
    does not fit the widths; a launch runs only on the call it was made for."""
    from k3fuse.kernels.lib.composite import routed_experts_w4a16 as composite
    from k3fuse.kernels.lib.cute import routed_experts_w4a16 as w4

    with pytest.raises(ValueError, match="gate/up at I=1536, L=3584: split 5"):
        w4.GateUp(fmt="mxfp4", I=1536, L=3584, top_k=16, split=5, pairwise=True, stages=3)
    with pytest.raises(ValueError, match="ring 6"):
        w4.GateUp(fmt="mxfp4", I=1536, L=3584, top_k=16, split=7, pairwise=True, stages=6)  # 4 steps a span
    with pytest.raises(ValueError, match="ring 1"):
        w4.Down(fmt="int4", I=1536, L=3584, n_tiles=1, situ=None, stages=1)
    with pytest.raises(ValueError, match="n_tiles 16"):
        w4.Down(fmt="int4", I=1536, L=3584, n_tiles=16, situ=None, stages=3)  # 56 row blocks
    args = list(_op_args("mxfp4", T=2, E=8, I=128, L=256, k=4))
    launch = composite.W4A16Launch.for_call("mxfp4", 2, 8, 128, 256, 4)
    composite_args = (*args[:13], "rows")
    for wrong in (dataclasses.replace(launch, blocked=True), dataclasses.replace(launch, format="int4"),
                  composite.W4A16Launch.for_call("mxfp4", 2, 8, 128, 256, 2)):
        with pytest.raises(ValueError, match=r"a launch for \(format, I, L, top_k, blocked\)"):
            composite.run(*composite_args, launch=wrong)  # refused before anything runs (CPU tensors)
