"""GPU correctness of routed_experts_w4a16: the Triton W4A16 kernels and the CuTe expert GEMMs (MXFP4, and
int4 with bf16 scales) against a float64 reference on the dequantized weights.

K3's routed experts (E = 896, top-16, latent L = 3584) at I = 3072, 1536 and 384 per rank (TP 1, 2
and 8), in MXFP4 and int4 (k3fuse/quant.py layouts, random packed bytes and scales drawn directly):
every token count 1..64, both modes forced (pairwise, grouped), with a NaN-poisoned output (an
unwritten row fails), each compared with float64 on the dequantized weights and with the model's
rounding points emulated in fp32 (g, u, act in bf16: what the stock grouped GEMMs compute); crowded
experts (a group over several 16-row blocks); the op through the dispatcher in strict mode with the
counters; 1000 CUDA-graph replays on changing tokens and experts; the CuTe launches with imposed
splits and row tiles (the benchmark's arms) and over block-ordered tables; expert ids outside the table.

The references run one expert at a time, each on its weights dequantized when it is met (bf16: exact
for MXFP4; int4's q * s rounded once, as the model's dequantization does): a whole dequantized table
(59 GB at I = 3072) beside the packed one does not fit an 80 GB H100.

    python -m pytest -m gpu tests/gpu/test_routed_experts_w4a16_gpu.py -q
"""
from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # collected on CPU CI only with -m gpu; skip cleanly there
    pytest.skip("needs CUDA", allow_module_level=True)

import k3fuse.kernels  # noqa: F401,E402  (registers torch.ops.k3fuse.*)
from k3fuse import quant, runtime  # noqa: E402
from k3fuse.kernels import dispatch  # noqa: E402
from k3fuse.kernels.lib.triton import routed_experts_w4a16 as kernel  # noqa: E402
from k3fuse.kernels.lib.composite.routed_experts_w4a16 import W4A16Launch  # noqa: E402
from k3fuse.kernels.ops.routed_experts_w4a16 import (  # noqa: E402
    RoutedExpertsW4A16Spec,
    accepts,
    cute_accepts,
    cute_run,
)
from k3fuse.spelling import situ  # noqa: E402

from experts_helpers import BF16, DEV, E, K, L, SITU, rel, tokens  # noqa: E402

#: K3FUSE_TEST_W4A16_CONFIG: a GATE_UP/DOWN override (JSON) the device run passes when it checks a
#: configuration its sweep picked before that configuration becomes the default
LAUNCH = json.loads(os.environ.get("K3FUSE_TEST_W4A16_CONFIG") or "{}")
CONFIG = {"gate_up": dict(LAUNCH), "down": dict(LAUNCH)} if LAUNCH else {}
MODES = pytest.mark.parametrize("mode", [{"pairwise": True, **CONFIG}, {"pairwise": False, **CONFIG}],
                                ids=["pairwise", "grouped"])


class Experts:
    """One width and format: the packed tensors the kernel reads, dequantized an expert at a time."""

    def __init__(self, fmt: str, I: int, seed: int = 0):
        gen = torch.Generator(device=DEV).manual_seed(seed)
        self.fmt, self.I = fmt, I
        self.packed = []
        for rows, cols in ((I, L), (I, L), (L, I)):
            self.packed += list(quant.random_experts(fmt, E, rows, cols, gen, DEV))
        self.table = quant.e2m1_table(DEV) if fmt == "mxfp4" else None

    def dequantized(self, e: int) -> list[torch.Tensor]:
        """Expert e's w1, w3, w2 in bf16, as the model dequantizes them."""
        return [quant.dequantize(p[e:e + 1], s[e:e + 1], self.fmt, BF16)[0]
                for p, s in zip(self.packed[0::2], self.packed[1::2])]

    def args(self, a: torch.Tensor, experts: torch.Tensor) -> tuple:
        return (a, experts, *self.packed, K, *SITU, self.fmt, self.table)

    def reference(self, a: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(float64 with no rounding, fp32 with the model's rounding points), one expert at a time."""
        z64 = torch.empty(experts.shape[0], L, device=DEV, dtype=torch.float64)
        zbf = torch.empty(experts.shape[0], L, device=DEV, dtype=torch.float32)
        for e in experts.unique().tolist():
            w1, w3, w2 = self.dequantized(e)
            pairs = (experts == e).nonzero().squeeze(1)
            x = a[pairs // K]
            x64 = x.double()
            z64[pairs] = situ(x64 @ w1.double().T, x64 @ w3.double().T, *SITU) @ w2.double().T
            xf = x.float()
            g = (xf @ w1.float().T).to(BF16).float()
            u = (xf @ w3.float().T).to(BF16).float()
            act = situ(g, u, *SITU).to(BF16).float()
            zbf[pairs] = (act @ w2.float().T).to(BF16).float()
        return z64, zbf




@pytest.fixture(scope="module", autouse=True)
def cute_int4():
    """int4 on the CuTe kernel (its default) whatever the environment says."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("K3FUSE_W4A16_CUTE_INT4", "1")
        yield


def _cute_missing(experts) -> str | None:
    """Why the CuTe kernel does not run these experts, or None."""
    return cute_accepts(RoutedExpertsW4A16Spec(tokens=1, E=E, I=experts.I, L=L, top_k=K, dtype=BF16,
                                               format=experts.fmt, scale_dtype=experts.packed[1].dtype))


def _launch(experts, T: int, pairwise: bool | None = None, layout: str = "rows", **choices) -> W4A16Launch:
    """The op's CuTe launch for T tokens at these experts' format and width, in the mode imposed (`pairwise`,
    its split and tiles recomputed) or the call's, over `layout` tables, with `choices` imposed."""
    launch = W4A16Launch.for_call(experts.fmt, T, E, experts.I, L, K, layout, pairwise=pairwise)
    return dataclasses.replace(launch, **choices)


def _cute_run(experts, a, ids, out, pairwise):
    return cute_run(*experts.args(a, ids), out=out, launch=_launch(experts, a.shape[0], pairwise))


def _check(z: torch.Tensor, ref: tuple[torch.Tensor, torch.Tensor], where) -> None:
    z64, zbf = ref
    assert not torch.isnan(z).any(), where
    err, err_model = rel(z, z64), rel(zbf, z64)
    assert err < 1e-2, (where, err)
    # as close to float64 as the model's bf16 rounding points are (the kernel's summation order differs)
    assert err < 1.5 * err_model + 1e-3, (where, err, err_model)


@pytest.fixture(scope="module", params=[(f, i) for f in ("mxfp4", "int4") for i in (384, 1536, 3072)],
                ids=lambda p: f"{p[0]}_I{p[1]}")
def experts(request):
    ex = Experts(*request.param)
    yield ex
    del ex
    torch.cuda.empty_cache()


import triton  # noqa: E402
import triton.language as tl  # noqa: E402

_dequant = kernel._dequant


@triton.jit
def _dequant_probe(w_ptr, s_ptr, o_ptr, W: tl.constexpr, MXFP4: tl.constexpr, PACKED: tl.constexpr,
                   DTYPE: tl.constexpr):
    """The kernels' dequantization alone: 16 rows of W words and W / 4 scales a program -> [16, 8W]."""
    r = tl.program_id(0) * 16 + tl.arange(0, 16)
    ww, gg, kk = tl.arange(0, W), tl.arange(0, W // 4), tl.arange(0, 8 * W)
    words = tl.load(w_ptr + r[:, None] * W + ww[None, :])
    scales = tl.load(s_ptr + r[:, None] * (W // 4) + gg[None, :])
    tl.store(o_ptr + r[:, None] * (8 * W) + kk[None, :], _dequant(words, scales, MXFP4, PACKED, DTYPE, False))


@pytest.mark.parametrize("fmt", ["mxfp4", "int4"])
@pytest.mark.parametrize("packed,dtype", [(True, BF16), (False, BF16), (False, torch.float16)],
                         ids=["bf16x2", "fp32_bf16", "fp32_fp16"])
def test_dequantization_is_the_models_bit_for_bit(fmt, packed, dtype):
    """Every code under every scale: mxfp4 all 256 E8M0 bytes (0: the subnormal 2^-127, 254: overflow
    to inf, 255: NaN's inf) and int4 bf16 scales from 2^-133 to 2^127, each against quant.dequantize."""
    gen = torch.Generator(device=DEV).manual_seed(5)
    rows, W = 256, 16  # 128 elements (4 groups) a row
    if fmt == "mxfp4":
        w = torch.randint(0, 256, (rows, 4 * W), device=DEV, dtype=torch.uint8, generator=gen)
        w[:, :16] = torch.tensor([i | (15 - i) << 4 for i in range(16)], device=DEV, dtype=torch.uint8)  # every code
        s = torch.arange(256, device=DEV, dtype=torch.int32).to(torch.uint8)[:, None].repeat(1, W // 4)
        words = w.view(torch.int32)
    else:
        words = torch.randint(-2 ** 31, 2 ** 31 - 1, (rows, W), device=DEV, dtype=torch.int32, generator=gen)
        exps = torch.linspace(-133, 127, rows * (W // 4), device=DEV).round()
        mantissas = 1 + 0.99 * torch.rand(exps.shape, device=DEV, generator=gen)
        s = (torch.exp2(exps) * mantissas).to(BF16).view(rows, W // 4)
    out = torch.empty((rows, 8 * W), device=DEV, dtype=dtype)
    tl_dtype = tl.bfloat16 if dtype == BF16 else tl.float16
    _dequant_probe[(rows // 16,)](words.contiguous(), s.contiguous(), out, W=W, MXFP4=fmt == "mxfp4", PACKED=packed,
                                  DTYPE=tl_dtype)
    want = quant.dequantize(w if fmt == "mxfp4" else words, s, fmt, dtype)
    assert torch.equal(out.isnan(), want.isnan()), "NaN where the model has none, or the reverse"
    same = (out == want) | (out.isnan() & want.isnan())
    bad = (~same).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} weights differ, first at {bad[:4].tolist()}: " \
                             f"{out[tuple(bad[0])].item()} vs {want[tuple(bad[0])].item()}"
    if fmt == "mxfp4":  # the extremes really occur: subnormal products, inf and NaN
        tiny = torch.finfo(dtype).tiny
        assert want.isinf().any() and want.isnan().any() and ((want.abs() < tiny) & (want != 0)).any()


def test_every_token_count_against_float64_in_both_modes(experts):
    for T in range(1, 65):
        a, ids = tokens(T, seed=T)
        assert accepts(RoutedExpertsW4A16Spec.from_call(*experts.args(a, ids))) is None
        ref = experts.reference(a, ids)
        for mode in ({"pairwise": True, **CONFIG}, {"pairwise": False, **CONFIG}):
            out = torch.full((T * K, L), float("nan"), device=DEV, dtype=BF16)
            z = kernel.run(*experts.args(a, ids), out=out, config=mode)
            assert z.data_ptr() == out.data_ptr()
            _check(z, ref, (experts.fmt, experts.I, T, mode))
            if _cute_missing(experts) is None:
                out = torch.full((T * K, L), float("nan"), device=DEV, dtype=BF16)
                z = _cute_run(experts, a, ids, out, mode["pairwise"])
                assert z.data_ptr() == out.data_ptr()
                _check(z, ref, (experts.fmt, experts.I, T, mode, "cute"))


@MODES
@pytest.mark.parametrize("T", [1, 17, 64])
def test_crowded_experts_span_several_row_blocks(experts, T, mode):
    a, ids = tokens(T, seed=100 + T, crowded=True)
    out = torch.full((T * K, L), float("nan"), device=DEV, dtype=BF16)
    z = kernel.run(*experts.args(a, ids), out=out, config=mode)
    ref = experts.reference(a, ids)
    _check(z, ref, (experts.fmt, experts.I, T, mode, "crowded"))
    if _cute_missing(experts) is None:
        out = torch.full((T * K, L), float("nan"), device=DEV, dtype=BF16)
        _check(_cute_run(experts, a, ids, out, mode["pairwise"]), ref, (experts.fmt, experts.I, T, mode, "cute"))


@MODES
@pytest.mark.parametrize("T", [1, 5, 64])
def test_cute_wide_scales_against_float64(experts, T, mode):
    """E8M0 scales of 2^1 and more (bytes 128-130) in row blocks of experts 0-2, every token on experts
    0..K-1: the CTAs over those rows take the two-multiply loop, the rest the one-multiply loop (at
    64 tokens, 8 chunks of pairs a span); both against float64."""
    if experts.fmt != "mxfp4" or (why := _cute_missing(experts)) is not None:
        pytest.skip("E8M0 scales are MXFP4's (int4's bf16 scale is one multiply at any value)"
                    if experts.fmt != "mxfp4" else why)
    wide = range(3)
    scales = (experts.packed[1], experts.packed[5])  # w1's and w2's (the reference dequantizes what they hold)
    saved = [s[:len(wide)].clone() for s in scales]
    try:
        for e in wide:
            scales[0][e, 16 * e:16 * e + 16] = 128 + e
            scales[1][e, 64:80] = 129
        a, ids = tokens(T, seed=300 + T, crowded=True)
        out = torch.full((T * K, L), float("nan"), device=DEV, dtype=BF16)
        _check(_cute_run(experts, a, ids, out, mode["pairwise"]), experts.reference(a, ids),
               (experts.I, T, mode, "wide scales"))
    finally:
        for s, kept in zip(scales, saved):
            s[:len(wide)] = kept


#: CuTe launches besides the op's own (imposed splits and row tiles, which the benchmark's --cute-choices
#: arms time): no split, 2 steps a span (a ring as deep as the span allows), two row tiles a down CTA
CUTE_CHOICES = {"split1": {"split": 1}, "split14": {"split": 14}, "split2_tiles2": {"split": 2, "n_tiles": 2}}


@pytest.mark.parametrize("choice", list(CUTE_CHOICES))
@pytest.mark.parametrize("T", [1, 2, 5, 17, 64])
def test_cute_launch_choices_against_float64(experts, T, choice):
    """Each choice in both modes, NaN-poisoned, crowded experts at 17 tokens (several chunks a span)."""
    if (why := _cute_missing(experts)) is not None:
        pytest.skip(why)
    a, ids = tokens(T, seed=500 + T, crowded=T == 17)
    ref = experts.reference(a, ids)
    for pairwise in (True, False):
        launch = _launch(experts, T, pairwise, **CUTE_CHOICES[choice])
        out = torch.full((T * K, L), float("nan"), device=DEV, dtype=BF16)
        _check(cute_run(*experts.args(a, ids), out=out, launch=launch), ref, (experts.I, T, choice, launch))


def _ids_outside_the_table(experts, launch, seed: int, bad: list[int]) -> torch.Tensor:
    """2 tokens' pairs `bad` given expert ids outside [0, E); the others checked against float64 after a run
    of `launch` into a NaN-poisoned output; the bad pairs' rows, as the run left them."""
    a, ids = tokens(2, seed=seed)
    bad_at = torch.tensor(bad, device=DEV)
    outside = ids.clone()
    outside[bad_at] = torch.tensor([-1, E, -7, E + 3], device=DEV)
    out = torch.full((2 * K, L), float("nan"), device=DEV, dtype=BF16)
    cute_run(*experts.args(a, outside), out=out, launch=launch)
    keep = torch.ones(2 * K, dtype=torch.bool, device=DEV)
    keep[bad_at] = False
    z64, zbf = experts.reference(a, ids)
    _check(out[keep], (z64[keep], zbf[keep]), (experts.I, launch, "ids outside the table"))
    return out[bad_at]


@pytest.mark.parametrize("T", [1, 2])
def test_pairwise_graph_replays_against_float64(experts, T):
    """The pairwise MLP in two launches whose CTAs stage a's rows and h (the SiTU-GLU of the gate/up's
    partials) themselves, under 1000 CUDA-graph replays on changing tokens and experts."""
    if (why := _cute_missing(experts)) is not None:
        pytest.skip(why)
    launch = _launch(experts, T)
    assert launch.pairwise, launch
    _replays_against_float64(experts, T, lambda a, ids, z: cute_run(*experts.args(a, ids), out=z, launch=launch),
                             launch)


#: launches over quant.block_order's tables (`blocked`), each against float64
BLOCKED_CHOICES = {"op": {}, "split1": {"split": 1}, "split2_tiles2": {"split": 2, "n_tiles": 2}}


def _blocked_args(experts, a, ids) -> tuple:
    """experts.args with the tables in block order (made once a width and format)."""
    if not hasattr(experts, "blocked"):
        experts.blocked = [t for w, s in zip(experts.packed[0::2], experts.packed[1::2])
                           for t in quant.block_order(w, s)]
    return (a, ids, *experts.blocked, K, *SITU, experts.fmt, experts.table, "blocks")


@pytest.mark.parametrize("choice", list(BLOCKED_CHOICES))
@pytest.mark.parametrize("T", [1, 2, 5, 17, 64])
def test_blocked_tables_against_float64(experts, T, choice):
    """The launches over quant.block_order's tables (a block's step one contiguous piece), both modes,
    NaN-poisoned, crowded experts at 17 tokens."""
    if (why := _cute_missing(experts)) is not None:
        pytest.skip(why)
    a, ids = tokens(T, seed=700 + T, crowded=T == 17)
    ref = experts.reference(a, ids)
    for pairwise in (True, False):
        launch = _launch(experts, T, pairwise, "blocks", **BLOCKED_CHOICES[choice])
        assert launch.blocked, launch
        out = torch.full((T * K, L), float("nan"), device=DEV, dtype=BF16)
        _check(cute_run(*_blocked_args(experts, a, ids), out=out, launch=launch), ref,
               (experts.I, T, choice, launch))


@pytest.mark.parametrize("T", [1, 2, 64])
def test_blocked_graph_replays_against_float64(experts, T):
    """The op's launch over quant.block_order's tables under 1000 CUDA-graph replays on changing inputs."""
    if (why := _cute_missing(experts)) is not None:
        pytest.skip(why)
    launch = _launch(experts, T, layout="blocks")
    _replays_against_float64(experts, T, lambda a, ids, z: cute_run(*_blocked_args(experts, a, ids), out=z,
                                                                     launch=launch), launch)


def test_pairwise_leaves_out_expert_ids_outside_the_table(experts):
    """Pairs whose expert id is outside [0, E) are left out by both staged launches (the down never
    reads their unwritten partials into a stored row); the others are right."""
    if (why := _cute_missing(experts)) is not None:
        pytest.skip(why)
    left = _ids_outside_the_table(experts, _launch(experts, 2, pairwise=True), 12, [1, 6, 18, 30])
    assert torch.isnan(left).all()  # nothing stored for them


def test_grouped_leaves_out_expert_ids_outside_the_table(experts):
    """Grouped mode (the grouping drops the pairs, the down reads the SiTU-GLU's h after its grid): pairs whose
    expert id is outside [0, E) are left out; the others are right."""
    if (why := _cute_missing(experts)) is not None:
        pytest.skip(why)
    left = _ids_outside_the_table(experts, _launch(experts, 2, pairwise=False), 13, [2, 7, 19, 29])
    assert torch.isnan(left).all()  # nothing stored for them


def test_unsplit_launches_graph_replays_against_float64(experts):
    """The launches measured faster without the rule's K split (MXFP4 at I = 1536 / 1 token and I = 384 /
    2 tokens: UNSPLIT_MXFP4), as the op takes them, under 1000 CUDA-graph replays."""
    from k3fuse.kernels.lib.composite.routed_experts_w4a16 import UNSPLIT_MXFP4

    if (why := _cute_missing(experts)) is not None:
        pytest.skip(why)
    counts = [key[-1] for key in UNSPLIT_MXFP4 if experts.fmt == "mxfp4" and key[:-1] == (E, experts.I, L, K)]
    if not counts:
        pytest.skip(f"no unsplit launch for {experts.fmt} at I={experts.I}")
    for T in counts:
        launch = _launch(experts, T)
        assert launch.split == 1, launch
        _replays_against_float64(experts, T, lambda a, ids, z: cute_run(*experts.args(a, ids), out=z),
                                 f"unsplit {launch}")


def test_op_strict_counts_the_kernel(experts):
    dispatch.load_gpu_impls()
    a, ids = tokens(8, seed=7)
    runtime.reset_stats()
    with runtime.strict():
        z = torch.ops.k3fuse.routed_experts_w4a16(*experts.args(a, ids))
    impl = "cute.routed_experts_w4a16" if _cute_missing(experts) is None else "triton.routed_experts_w4a16"
    assert runtime.stats()["routed_experts_w4a16"] == {impl: 1}
    assert runtime.fallbacks() == {}
    _check(z, experts.reference(a, ids), (experts.fmt, experts.I, "op"))


@pytest.mark.parametrize("T", [1, 2, 8, 64])
def test_op_over_block_ordered_tables_strict_and_under_replays(experts, T):
    """The op as a block-ordered model calls it (layout "blocks", its own launch with `blocked`): strict, on
    the CuTe kernel, against float64; then 1000 CUDA-graph replays of that launch."""
    if (why := _cute_missing(experts)) is not None:
        pytest.skip(why)
    a, ids = tokens(T, seed=7)
    runtime.reset_stats()
    with runtime.strict():
        z = torch.ops.k3fuse.routed_experts_w4a16(*_blocked_args(experts, a, ids))
    assert runtime.stats()["routed_experts_w4a16"] == {"cute.routed_experts_w4a16": 1} and runtime.fallbacks() == {}
    _check(z, experts.reference(a, ids), (experts.fmt, experts.I, T, "op, blocks"))
    launch = _launch(experts, T, layout="blocks")
    assert launch == dataclasses.replace(_launch(experts, T), blocked=True)
    _replays_against_float64(experts, T, lambda a, ids, z: cute_run(*_blocked_args(experts, a, ids), out=z),
                             f"op, blocks {launch}")


@pytest.mark.parametrize("T", [1, 8, 64])
def test_triton_over_block_ordered_tables_under_replays(experts, T):
    """The Triton kernels reading block-ordered tables in place (a blocked model's path where CuTe does not
    run): 1000 CUDA-graph replays against float64, NaN-poisoned."""
    _replays_against_float64(experts, T, lambda a, ids, z: kernel.run(*_blocked_args(experts, a, ids), out=z,
                                                                      config=CONFIG or None), "triton, blocks")


def test_a_wrong_table_is_refused(experts):
    if experts.fmt != "mxfp4":
        pytest.skip("int4 has no table")
    a, ids = tokens(2, seed=3)
    args = list(experts.args(a, ids))
    args[-1] = experts.table.flip(0).contiguous()
    assert accepts(RoutedExpertsW4A16Spec.from_call(*args)) == "the table is not the E2M1 values the kernel decodes"


@pytest.mark.parametrize("impl", ["triton", "cute"])
@pytest.mark.parametrize("T", [1, 8, 64])
def test_cuda_graph_1000_replays_on_changing_inputs(experts, T, impl):
    if impl == "cute" and (why := _cute_missing(experts)) is not None:
        pytest.skip(why)
    if impl == "cute":
        _replays_against_float64(experts, T, lambda a, ids, z: cute_run(*experts.args(a, ids), out=z), impl)
    else:
        _replays_against_float64(experts, T, lambda a, ids, z: kernel.run(*experts.args(a, ids), out=z,
                                                                          config=CONFIG or None), impl)


def _replays_against_float64(experts, T: int, run, what: str) -> None:
    """A CUDA graph of run(a, ids, z) replayed 1000 times on changing tokens and experts (NaN-poisoned
    z, every 97th crowded), a sample of the replays and every crowded one against float64. Warmed up
    (compiled) on the capture's own stream."""
    a_static, e_static = tokens(T, seed=0)
    z_static = torch.empty(T * K, L, device=DEV, dtype=BF16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run(a_static, e_static, z_static)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        run(a_static, e_static, z_static)
    checked = 0
    for i in range(1000):
        a, ids = tokens(T, seed=1000 + i, crowded=(i % 97 == 0))
        a_static.copy_(a)
        e_static.copy_(ids)
        z_static.fill_(float("nan"))
        graph.replay()
        if i % 100 == 0 or i % 97 == 0:  # the references are slow: check a sample, every crowded one
            torch.cuda.synchronize()
            _check(z_static, experts.reference(a, ids), (experts.fmt, experts.I, T, what, "replay", i))
            checked += 1
    torch.cuda.synchronize()
    assert not torch.isnan(z_static).any()
    assert checked >= 10
