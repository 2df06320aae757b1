"""The fused ops torch.ops.k3fuse.*: reference numerics against float64, collectives on 2 and 4 gloo
ranks, fake impls, opcheck, dispatch (kill switch, call guard, strict, registry), l2_prefetch
surviving DCE / Inductor / export, and the shared-expert fork/join on CPU."""
from __future__ import annotations

import dataclasses

import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import k3fuse.kernels  # noqa: F401  registers torch.ops.k3fuse.*
from k3fuse import runtime
from k3fuse.dist import launch
from k3fuse.kernels import dispatch, streams
from k3fuse.kernels.dispatch import Impl
from k3fuse.kernels.lib.reference import stock

ops = torch.ops.k3fuse
BF16 = torch.bfloat16
HALF_ULP_BF16 = 2.0 ** -8  # one round-to-nearest into bf16: relative error at most 2^-8


@pytest.fixture(autouse=True)
def _clean_state():
    runtime.reset_stats()
    streams.clear()
    yield
    runtime.reset_stats()
    streams.clear()


def rand(*shape, seed: int, dtype=BF16, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def assert_one_rounding(out: torch.Tensor, ref64: torch.Tensor) -> None:
    """`out` is the float64 truth rounded once to out.dtype (plus fp32-accumulation noise)."""
    assert out.shape == ref64.shape
    err = (out.double() - ref64).abs()
    bound = HALF_ULP_BF16 * ref64.abs() + 1e-5 * ref64.abs().max()
    worst = (err - bound).max().item()
    assert worst <= 0, f"error exceeds one bf16 rounding by {worst:.3g}"


def situ64(g: torch.Tensor, u: torch.Tensor, beta=4.0, linear_beta=25.0) -> torch.Tensor:
    return beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))


def rmsnorm64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


# --- reference numerics, one rank -----------------------------------------------------------------
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_decode_gemm_reference_vs_float64(with_bias, out_dtype):
    x, w = rand(3, 64, seed=1), rand(40, 64, seed=2)
    b = rand(40, seed=3) if with_bias else None
    out = ops.decode_gemm(x, w, b, out_dtype)
    ref = x.double() @ w.double().T + (b.double() if b is not None else 0)
    assert out.dtype == (out_dtype or BF16)
    if out_dtype is None:
        assert_one_rounding(out, ref)
    else:
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert runtime.stats() == {"decode_gemm": {"reference": 1}}


@pytest.mark.parametrize("with_addend", [False, True])
def test_gemm_ar_residual_reference_vs_float64(with_addend):
    x, w, r = rand(4, 96, seed=1), rand(32, 96, seed=2, scale=0.2), rand(4, 32, seed=3)
    addend = rand(4, 32, seed=4) if with_addend else None
    out = ops.gemm_ar_residual(x, w, r, addend, "", 1)
    ref = r.double() + x.double() @ w.double().T + (addend.double() if with_addend else 0)
    assert out.dtype == BF16
    assert_one_rounding(out, ref)
    assert runtime.stats() == {"gemm_ar_residual": {"reference": 1}}


def test_gemm_ar_residual_rmsnorm_reference_vs_float64():
    x, w, r, a = rand(4, 96, seed=1), rand(32, 96, seed=2, scale=0.2), rand(4, 32, seed=3), rand(4, 32, seed=4)
    nw = rand(32, seed=5, dtype=torch.float32).abs() + 0.5
    out, normed = ops.gemm_ar_residual_rmsnorm(x, w, r, a, nw, 1e-5, "", 1)
    total = r.double() + x.double() @ w.double().T + a.double()
    assert_one_rounding(out, total)
    assert_one_rounding(normed, rmsnorm64(total, nw, 1e-5))


def test_moe_front_sharded_reference_vs_float64():
    x, wr, wd = rand(3, 64, seed=1), rand(16, 64, seed=2), rand(24, 64, seed=3)
    logits, latent = ops.moe_front_sharded(x, wr, wd, "", 1)
    assert logits.dtype == torch.float32 and latent.dtype == BF16
    torch.testing.assert_close(logits.double(), x.double() @ wr.double().T, rtol=1e-5, atol=1e-5)
    assert_one_rounding(latent, x.double() @ wd.double().T)


# --- multi-rank: the collectives inside the ops --------------------------------------------------
def _tp_inputs(world_size: int, T: int = 3) -> dict[str, torch.Tensor]:
    H, P, E, L = 32, 16 * world_size, 8 * world_size, 12 * world_size
    return {
        "x_attn": rand(T, P, seed=11), "w_o": rand(H, P, seed=12, scale=0.3),
        "residual": rand(T, H, seed=13), "addend": rand(T, H, seed=14),
        "norm_w": rand(H, seed=15, dtype=torch.float32).abs() + 0.5,
        "x": rand(T, H, seed=16), "w_r": rand(E, H, seed=17), "w_down": rand(L, H, seed=18),
    }


def _tp_worker(rank: int, world_size: int, inp: dict[str, torch.Tensor]) -> dict:
    """Each rank runs the ops on its shards; returns outputs, the kill-switch outputs and stats."""
    import k3fuse.kernels  # noqa: F401
    from k3fuse import compat, runtime
    from torch.distributed import _functional_collectives as funcol

    group_name = compat.group_name_of(None)
    cols = lambda t: t.chunk(world_size, dim=-1)[rank].contiguous()  # noqa: E731
    x_attn, w_o = cols(inp["x_attn"]), cols(inp["w_o"])
    res, add, nw = inp["residual"], inp["addend"], inp["norm_w"]
    w_r, w_down = inp["w_r"], inp["w_down"]  # full replicated weights: the op slices its rows
    out: dict = {}
    out["ar"] = ops.gemm_ar_residual(x_attn, w_o, res, add, group_name, world_size)
    out["ar_norm"] = ops.gemm_ar_residual_rmsnorm(x_attn, w_o, res, None, nw, 1e-5, group_name, world_size)
    out["front"] = ops.moe_front_sharded(inp["x"], w_r, w_down, group_name, world_size)
    out["stats"] = runtime.stats()
    runtime.reset_stats()
    from k3fuse.kernels.collective_guard import reagree

    with runtime.disable():   # on every rank, applied to the group (a per-rank toggle is refused)
        reagree(group_name)
        out["ar_disabled"] = ops.gemm_ar_residual(x_attn, w_o, res, add, group_name, world_size)
        out["front_disabled"] = ops.moe_front_sharded(inp["x"], w_r, w_down, group_name, world_size)
    reagree(group_name)
    # what the unfused model computes: F.linear -> funcol all_reduce -> y_routed + y -> r + moe
    y = funcol.all_reduce(F.linear(x_attn, w_o), "sum", group_name)
    out["ar_unfused"] = res + (add + y)
    out["stats_disabled"] = runtime.stats()
    if world_size == 2:
        out["prefetch"] = _prefetch_between_all_reduce_and_wait(group_name)
    return out


def _prefetch_between_all_reduce_and_wait(group_name: str) -> dict:
    """torch.compile(inductor) of all_reduce -> l2_prefetch -> wait_tensor: the call must survive."""
    from torch._inductor.utils import run_and_get_code

    c10d = torch.ops._c10d_functional

    def step(x, w):
        y = c10d.all_reduce(x, "sum", group_name)
        ops.l2_prefetch(y, [w], 1 << 20)
        y = c10d.wait_tensor(y)
        return y @ w

    x, w = torch.ones(2, 8), torch.eye(8)
    runtime.reset_stats()
    compiled = torch.compile(step, backend="inductor", fullgraph=True)
    result, (code, *_) = run_and_get_code(compiled, x, w)
    compiled(x, w)
    lines = code.splitlines()
    where = lambda key: next(i for i, ln in enumerate(lines) if key in ln)  # noqa: E731
    return {"calls": runtime.stats().get("l2_prefetch", {}), "result": result,
            "order": (where("torch.ops._c10d_functional.all_reduce"),
                      where("torch.ops.k3fuse.l2_prefetch.default("),
                      where("torch.ops._c10d_functional.wait_tensor"))}


def _check_tp_results(results: list[dict], world_size: int) -> None:
    inp = _tp_inputs(world_size)
    d = {k: v.double() for k, v in inp.items()}
    total_ar = d["residual"] + d["x_attn"] @ d["w_o"].T
    for rank, out in enumerate(results):
        assert_one_rounding(out["ar"], total_ar + d["addend"])
        assert_one_rounding(out["ar_norm"][0], total_ar)
        assert_one_rounding(out["ar_norm"][1], rmsnorm64(total_ar, inp["norm_w"], 1e-5))
        logits, latent = out["front"]
        assert logits.shape == (3, inp["w_r"].shape[0]) and logits.dtype == torch.float32
        torch.testing.assert_close(logits.double(), d["x"] @ d["w_r"].T, rtol=1e-5, atol=1e-5)
        assert_one_rounding(latent, d["x"] @ d["w_down"].T)
        assert out["stats"] == {"gemm_ar_residual": {"reference": 1},
                                "gemm_ar_residual_rmsnorm": {"reference": 1},
                                "moe_front_sharded": {"reference": 1}}, f"rank {rank}"
        # kill switch: exactly the unfused sequence (bitwise), counted as a fallback
        assert torch.equal(out["ar_disabled"], out["ar_unfused"])
        torch.testing.assert_close(out["front_disabled"][0], logits)
        torch.testing.assert_close(out["front_disabled"][1], latent)
        assert out["stats_disabled"] == {"gemm_ar_residual": {"fallback:disabled": 1},
                                         "moe_front_sharded": {"fallback:disabled": 1}}


@pytest.mark.slow
def test_collective_ops_on_2_gloo_ranks_and_prefetch_survives_inductor():
    results = launch(_tp_worker, 2, backend="gloo", args=(_tp_inputs(2),), timeout_s=240)
    _check_tp_results(results, 2)
    for out in results:
        pf = out["prefetch"]
        assert pf["calls"] == {"reference": 2}, "Inductor dropped l2_prefetch"
        ar, prefetch, wait = pf["order"]
        assert ar < prefetch < wait, f"prefetch not between all_reduce and wait: {pf['order']}"
        torch.testing.assert_close(pf["result"], torch.full((2, 8), 2.0))


@pytest.mark.slow
def test_collective_ops_on_4_gloo_ranks():
    _check_tp_results(launch(_tp_worker, 4, backend="gloo", args=(_tp_inputs(4),), timeout_s=240), 4)


def test_world_size_mismatch_without_group_is_a_clear_error():
    x, w, r = rand(2, 8, seed=1), rand(4, 8, seed=2), rand(2, 4, seed=3)
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        ops.gemm_ar_residual(x, w, r, None, "tp", 2)


# --- fake impls and opcheck ------------------------------------------------------------------------
def _example_calls() -> list[tuple]:
    x, w, r = rand(2, 16, seed=1), rand(8, 16, seed=2), rand(2, 8, seed=3)
    nw = torch.ones(8)
    return [
        (ops.gemm_ar_residual, (x, w, r, None, "", 1), [((2, 8), BF16)]),
        (ops.gemm_ar_residual, (x, w, r, r, "", 1, 32, False), [((2, 8), BF16)]),
        (ops.gemm_ar_residual_rmsnorm, (x, w, r, r, nw, 1e-5, "", 1), [((2, 8), BF16)] * 2),
        (ops.moe_front_sharded, (x, w, w[:6], "", 1), [((2, 8), torch.float32), ((2, 6), BF16)]),
        (ops.moe_front_sharded, (x, w, w[:4], "tp", 4), [((2, 8), torch.float32), ((2, 4), BF16)]),
        (ops.shared_expert_fork, (x, 7), [((2, 16), BF16)]),
        (ops.shared_expert_end, (r, 7), []),
        (ops.shared_expert_join, (r, x, [x], 7), [((2, 8), BF16)]),
        (ops.l2_prefetch, (x, [w, r], 1 << 20), []),
        (ops.decode_gemm, (x, w, None), [((2, 8), BF16)]),
        (ops.decode_gemm, (x, w, rand(8, seed=5), torch.float32), [((2, 8), torch.float32)]),
    ]


@pytest.mark.parametrize("index", range(len(_example_calls())))
def test_fake_impl_shapes_under_fake_tensor_mode(index):
    op, args, expected = _example_calls()[index]
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else
                     [mode.from_tensor(t) for t in a] if isinstance(a, list) else a for a in args]
        out = op(*fake_args)
    outs = [] if out is None else [out] if isinstance(out, torch.Tensor) else list(out)
    assert [(tuple(o.shape), o.dtype) for o in outs] == expected
    assert runtime.stats() == {}, "a fake impl ran an implementation"


def test_fake_impl_rejects_mismatched_reduction_dim():
    with FakeTensorMode() as mode:
        x, w = mode.from_tensor(rand(2, 16, seed=1)), mode.from_tensor(rand(8, 12, seed=2))
        with pytest.raises(RuntimeError, match="disagree on the reduction dim"):
            ops.decode_gemm(x, w, None)


# every example except the world_size-4 one, whose real impl needs a 4-rank group
@pytest.mark.parametrize("index", [i for i, c in enumerate(_example_calls()) if "tp" not in c[1]])
def test_opcheck(index):
    op, args, expected = _example_calls()[index]
    if op is ops.shared_expert_join:  # a join needs its site's fork to have run
        ops.shared_expert_fork(rand(2, 16, seed=1), 7)
    result = torch.library.opcheck(op, args)
    assert set(result.values()) == {"SUCCESS"}, result


def test_ops_are_inference_only_even_with_weights_that_require_grad():
    x = rand(2, 16, seed=1, dtype=torch.float32).requires_grad_()
    w = torch.nn.Parameter(rand(8, 16, seed=2, dtype=torch.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "autograd kernel was not registered" warning
        outs = [ops.decode_gemm(x, w, None), ops.gemm_ar_residual(x, w, rand(2, 8, seed=3), None, "", 1),
                ops.shared_expert_fork(x, 2), ops.shared_expert_join(x, x, [x], 2)]
    assert not any(o.requires_grad for o in outs)


# --- dispatch: kill switch, call guard, strict, stats ---------------------------------------------
def test_kill_switch_runs_stock_sequence_and_counts_fallback(monkeypatch):
    x, w, r, a = rand(2, 16, seed=1), rand(8, 16, seed=2), rand(2, 8, seed=3), rand(2, 8, seed=4)
    nw = rand(8, seed=5, dtype=torch.float32)
    with runtime.disable():
        out = ops.gemm_ar_residual(x, w, r, a, "", 1)
        out2, normed = ops.gemm_ar_residual_rmsnorm(x, w, r, None, nw, 1e-5, "", 1)
        logits = ops.decode_gemm(x, w, None, torch.float32)
    assert torch.equal(out, r + (a + F.linear(x, w)))
    from k3fuse.model.layers import rms_norm
    assert torch.equal(out2, r + F.linear(x, w)) and torch.equal(normed, rms_norm(out2, nw, 1e-5))
    assert torch.equal(logits, F.linear(x.float(), w.float()))
    assert runtime.stats() == {op: {"fallback:disabled": 1} for op in
                               ("gemm_ar_residual", "gemm_ar_residual_rmsnorm", "decode_gemm")}
    monkeypatch.setenv("K3FUSE_DISABLE", "1")
    ops.decode_gemm(x, w, None)
    assert runtime.stats()["decode_gemm"]["fallback:disabled"] == 2
    with runtime.strict():  # the kill switch wins: stock was asked for, so strict mode does not raise
        assert torch.equal(ops.decode_gemm(x, w, None, torch.float32), F.linear(x.float(), w.float()))
    assert runtime.stats()["decode_gemm"]["fallback:disabled"] == 3


def test_token_call_guard_falls_back_and_strict_raises():
    x, w, r = rand(65, 16, seed=1), rand(8, 16, seed=2), rand(65, 8, seed=3)
    out = ops.gemm_ar_residual(x, w, r, None, "", 1)
    assert torch.equal(out, stock.gemm_ar_residual(x, w, r, None, "", 1))
    assert runtime.stats() == {"gemm_ar_residual": {"fallback:tokens 65 outside [1, 64]": 1}}
    assert runtime.fallbacks() == runtime.stats()
    ops.gemm_ar_residual(x, w, r, None, "", 1, 128)  # a larger max_tokens admits 65
    assert runtime.stats()["gemm_ar_residual"]["reference"] == 1
    with pytest.raises(runtime.K3FuseFallbackError,
                       match=r"gemm_ar_residual fell back in strict mode: tokens 65 outside \[1, 64\]"):
        ops.gemm_ar_residual(x, w, r, None, "", 1, 64, True)
    with runtime.strict(), pytest.raises(runtime.K3FuseFallbackError, match="moe_front_sharded"):
        ops.moe_front_sharded(x, w, w, "", 1)
    assert runtime.stats()["gemm_ar_residual"] == {"fallback:tokens 65 outside [1, 64]": 1, "reference": 1}


def test_stats_and_reset():
    x, w = rand(2, 16, seed=1), rand(8, 16, seed=2)
    ops.decode_gemm(x, w, None)
    ops.decode_gemm(x, w, None)
    ops.l2_prefetch(x, [w], 0)
    assert runtime.stats() == {"decode_gemm": {"reference": 2}, "l2_prefetch": {"reference": 1}}
    assert runtime.fallbacks() == {}
    runtime.reset_stats()
    assert runtime.stats() == {}


@pytest.fixture
def registered_impls(monkeypatch):
    """A registry holding only the reference impls, for tests that register their own.

    Kernel modules imported earlier in the session (test_cute_compile imports them where the CuTe
    DSL and Triton are installed) register real impls; they are hidden for the test and restored.
    """
    for entry in list(dispatch._ops.values()):
        monkeypatch.setattr(entry, "impls", [i for i in entry.impls if i.name == dispatch.REFERENCE])
    names: list[tuple[str, str]] = []
    yield names
    for op, name in names:
        dispatch.unregister_impl(op, name)


def test_registry_priority_supports_and_failure(registered_impls):
    x, w = rand(2, 16, seed=1), rand(8, 16, seed=2)
    seen = []

    def fast_run(x, weight, bias, out_dtype):
        seen.append((x.shape, weight.shape, bias, out_dtype))
        return torch.zeros(2, 8, dtype=BF16)

    def picky(spec):
        return None if spec.tokens <= 2 else f"M={spec.tokens} > 2"

    registered_impls += [("decode_gemm", "test.fast"), ("decode_gemm", "test.broken")]
    dispatch.register_impl("decode_gemm", Impl("test.fast", picky, fast_run, 10, ("cpu",)))
    assert torch.equal(ops.decode_gemm(x, w, None), torch.zeros(2, 8, dtype=BF16))
    assert seen == [((2, 16), (8, 16), None, None)]
    ops.decode_gemm(rand(3, 16, seed=3), w, None)  # declined -> reference (expected on CPU)
    assert runtime.stats() == {"decode_gemm": {"test.fast": 1, "reference": 1}}

    def broken_run(*args):
        raise ValueError("launch failed")

    dispatch.register_impl("decode_gemm", Impl("test.broken", lambda *a: None, broken_run, 20, ("cpu",)))
    with runtime.strict(), pytest.raises(runtime.K3FuseFallbackError, match="test.broken failed"):
        ops.decode_gemm(x, w, None)
    with pytest.warns(RuntimeWarning, match="test.broken failed: ValueError: launch failed"):
        ops.decode_gemm(x, w, None)
    ops.decode_gemm(x, w, None)  # disabled after its failure: no second warning, test.fast runs
    assert runtime.stats()["decode_gemm"]["test.fast"] == 3
    assert "test.broken" not in runtime.stats()["decode_gemm"]
    assert [i.name for i in dispatch.implementations("decode_gemm")][:2] == ["test.broken", "test.fast"]


def test_reference_on_cuda_is_a_fallback_listing_why_kernels_declined(monkeypatch, registered_impls):
    """Simulated: the device decision says cuda, one kernel declines and one module failed to import."""
    monkeypatch.setattr(dispatch, "_device_type", lambda args: "cuda")
    monkeypatch.setattr(dispatch, "load_gpu_impls", lambda: None)
    monkeypatch.setattr(dispatch, "_loaded", set())  # no library module: only the test kernel can run
    monkeypatch.setitem(dispatch._import_errors, "k3fuse.kernels.lib.triton.splitk_gemm",
                        "ModuleNotFoundError: No module named 'triton'")
    registered_impls.append(("decode_gemm", "cute.test_gemv"))
    dispatch.register_impl("decode_gemm", Impl("cute.test_gemv", lambda *a: "K=16 not a multiple of 64",
                                               lambda *a: None, 100))
    x, w = rand(2, 16, seed=1), rand(8, 16, seed=2)
    ops.decode_gemm(x, w, None)
    (reason,) = runtime.stats()["decode_gemm"]
    assert reason == ("fallback:cute.test_gemv: K=16 not a multiple of 64; import failed: "
                      "k3fuse.kernels.lib.triton.splitk_gemm (ModuleNotFoundError: No module named 'triton')")
    with runtime.strict(), pytest.raises(runtime.K3FuseFallbackError, match="decode_gemm.*cute.test_gemv"):
        ops.decode_gemm(x, w, None)


def test_declined_on_cuda_runs_the_stock_sequence_not_the_fp32_reference(monkeypatch, registered_impls):
    """On a GPU a declined op must cost what the unfused model costs: the stock (bf16) sequence."""
    monkeypatch.setattr(dispatch, "_device_type", lambda args: "cuda")
    monkeypatch.setattr(dispatch, "load_gpu_impls", lambda: None)
    entry = dispatch._entry("decode_gemm")
    ran: list[str] = []
    monkeypatch.setattr(entry, "stock", lambda *a, **k: ran.append("stock") or stock.decode_gemm(*a, **k))
    reference = next(i for i in entry.impls if i.name == dispatch.REFERENCE)
    monkeypatch.setattr(entry, "impls", [dataclasses.replace(
        reference, run=lambda *a, **k: ran.append("reference"))])
    x, w = rand(2, 16, seed=1), rand(8, 16, seed=2)
    torch.testing.assert_close(ops.decode_gemm(x, w, None), x @ w.T)
    assert ran == ["stock"]
    assert list(runtime.stats()["decode_gemm"]) == ["fallback:no kernel registered"]


def test_lazy_library_import_enables_kernels_whose_modules_import(tmp_path, monkeypatch, registered_impls):
    """A kernel runs only once the library modules it needs imported on a usable toolchain; a module
    that fails to import, or a toolchain that reports itself unavailable, is recorded instead."""
    lib = tmp_path / "k3fuse_fake_lib"
    for toolchain, missing in (("good_chain", "None"), ("gone_chain", "'no such compiler'")):
        (lib / toolchain).mkdir(parents=True)
        (lib / toolchain / "__init__.py").write_text(f"def unavailable():\n    return {missing}\n")
    (lib / "__init__.py").write_text("")
    (lib / "good_chain" / "good.py").write_text("IMPORTED = True\n")
    (lib / "good_chain" / "bad.py").write_text("import not_a_real_module_k3fuse\n")
    (lib / "gone_chain" / "any.py").write_text("raise RuntimeError('never imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(dispatch, "LIBRARY", "k3fuse_fake_lib")
    warmed: list = []
    for name, needs in (("fake.good", ("good_chain.good",)), ("fake.bad", ("good_chain.bad",)),
                        ("fake.gone", ("gone_chain.any",))):
        registered_impls.append(("decode_gemm", name))
        dispatch.register_impl("decode_gemm", Impl(name, lambda spec: "never", lambda *a: None, 5, needs=needs,
                                                   warmup=warmed.extend))
    dispatch._reset_for_tests()
    try:
        dispatch.load_gpu_impls()
        dispatch.load_gpu_impls()  # once only
        assert "fake.good" in [i.name for i in dispatch.cuda_kernels("decode_gemm")]
        assert not {"fake.bad", "fake.gone"} & {i.name for i in dispatch.cuda_kernels("decode_gemm")}
        errors = dispatch.import_errors()
        assert errors["k3fuse_fake_lib.good_chain.bad"] == ("ModuleNotFoundError: No module named "
                                                            "'not_a_real_module_k3fuse'")
        assert errors["k3fuse_fake_lib.gone_chain"] == "no such compiler"
        shapes = [{"M": 1, "N": 7168, "K": 6144, "dtype": BF16}]
        status = dispatch.warmup("decode_gemm", shapes)
        assert status["fake.good"] is None and "fake.bad" not in status and warmed == shapes
    finally:
        dispatch._reset_for_tests()
        for m in [m for m in sys.modules if m.startswith("k3fuse_fake_lib")]:
            sys.modules.pop(m)


def test_import_of_kernels_stays_light():
    code = ("import sys, k3fuse.kernels; bad = [m for m in sys.modules if m.startswith("
            "('k3fuse.kernels.lib.cute', 'k3fuse.kernels.lib.triton'))]; print(bad)")
    import subprocess
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --- l2_prefetch survives DCE and export (Inductor: in the 2-rank test) ---------------------------
def _prefetching_step(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = x * 2
    _unused = y + 1  # noqa: F841  dead code, so the DCE test can see DCE doing something
    ops.l2_prefetch(y, [w], 1 << 20)
    return ops.decode_gemm(y, w, None, torch.float32)


def test_l2_prefetch_survives_fx_dead_code_elimination():
    from torch.fx.experimental.proxy_tensor import make_fx
    gm = make_fx(_prefetching_step)(rand(2, 8, seed=1), rand(4, 8, seed=2))
    assert torch.ops.aten.add.Tensor in [n.target for n in gm.graph.nodes]
    assert gm.graph.eliminate_dead_code()  # it removed the dead add ...
    targets = [n.target for n in gm.graph.nodes]
    assert torch.ops.aten.add.Tensor not in targets
    assert ops.l2_prefetch.default in targets  # ... and kept the prefetch, which has no users
    gm.recompile()
    runtime.reset_stats()
    gm(rand(2, 8, seed=1), rand(4, 8, seed=2))
    assert runtime.stats()["l2_prefetch"] == {"reference": 1}


class _PrefetchModule(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(rand(4, 8, seed=2), requires_grad=False)

    def forward(self, x):
        return _prefetching_step(x, self.w)


def test_l2_prefetch_survives_export_save_and_load(tmp_path):
    x = rand(2, 8, seed=1)
    ep = torch.export.export(_PrefetchModule(), (x,)).run_decompositions()
    assert ops.l2_prefetch.default in [n.target for n in ep.graph.nodes]
    path = tmp_path / "prefetch.pt2"
    torch.export.save(ep, str(path))
    loaded = torch.export.load(str(path))
    assert ops.l2_prefetch.default in [n.target for n in loaded.graph.nodes]
    runtime.reset_stats()
    out = loaded.module()(x)
    assert runtime.stats() == {"l2_prefetch": {"reference": 1}, "decode_gemm": {"reference": 1}}
    torch.testing.assert_close(out, ops.decode_gemm(x * 2, _PrefetchModule().w, None, torch.float32))


# --- shared-expert fork/end/join on CPU -----------------------------------------------------------
def test_markers_copy_their_value_and_count_under_the_forks_implementation():
    """On CPU nothing switches: the fork hands the region a copy of x, the join a copy of the region's
    output; the join counts under the implementation that ran its site's fork."""
    x, y, anchor = rand(3, 32, seed=1), rand(3, 16, seed=2), rand(3, 32, seed=3)
    x_side = ops.shared_expert_fork(x, 0)
    assert torch.equal(x_side, x) and x_side.data_ptr() != x.data_ptr()
    assert ops.shared_expert_end(y, 0) is None
    out = ops.shared_expert_join(y, anchor, [x], 0)
    assert torch.equal(out, y) and out.data_ptr() != y.data_ptr()
    assert torch.equal(ops.shared_expert_join(y, anchor, [x], 0), y)  # a join may run again
    assert runtime.stats() == {"shared_expert_fork": {"reference": 1}, "shared_expert_join": {"reference": 2}}
    runtime.reset_stats()
    with runtime.disable():
        ops.shared_expert_fork(x, 1)
        ops.shared_expert_end(y, 1)
        ops.shared_expert_join(y, anchor, [x], 1)
    assert runtime.stats() == {"shared_expert_fork": {"fallback:disabled": 1}, "shared_expert_join": {"stock": 1}}


def test_a_join_without_its_fork_is_an_error():
    x = rand(2, 16, seed=1)
    with pytest.raises(RuntimeError, match=r"shared_expert_join\(site=9\).*no fork"):
        ops.shared_expert_join(x, x, [x], 9)


def test_markers_under_torch_compile_are_lowered_away():
    """Inductor launches a graph's kernels on one stream: it lowers the markers to nothing (the region
    is compiled on the main stream), so no marker runs and the numbers are the graph's."""
    from torch._inductor.utils import run_and_get_code

    f32 = torch.float32  # Inductor fuses the activation in fp32: compare without bf16 roundings
    x, wg, wu = rand(2, 16, seed=1, dtype=f32), rand(8, 16, seed=2, dtype=f32), rand(8, 16, seed=3, dtype=f32)
    w_routed = rand(16, 16, seed=5, dtype=f32)

    def moe(x):
        x_side = ops.shared_expert_fork(x, 4)
        h = F.silu(F.linear(x_side, wg)) * F.linear(x_side, wu)
        ops.shared_expert_end(h, 4)
        routed = x @ w_routed
        return routed[:, :8] + ops.shared_expert_join(h, routed, [x], 4)

    expected = moe(x)
    runtime.reset_stats()
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got, (code, *_) = run_and_get_code(torch.compile(moe, backend="inductor", fullgraph=True), x)
    torch.testing.assert_close(got, expected)
    assert "shared_expert" not in code
    assert runtime.stats() == {}


@pytest.mark.parametrize("impl", ["reference", "stock"])
def test_gemm_ar_residual_keeps_an_hf_style_3d_residual_shape(impl):
    """HF decode code holds the residual as [B, 1, H] while the projection runs on [B, K] rows: the
    op adds row by row and returns the residual's shape (broadcasting [B, H] against [B, 1, H] would
    silently give [B, B, H])."""
    x, w = rand(3, 16, seed=1), rand(8, 16, seed=2)
    residual, addend, norm_w = rand(3, 1, 8, seed=3), rand(3, 1, 8, seed=4), rand(8, seed=5)
    y = (x.float() @ w.float().T).view(3, 1, 8)
    want = (residual.float() + y + addend.float()).to(BF16)  # the reference rounds once
    if impl == "stock":  # the model's rounding points: y, then addend + y, then residual + that
        want = residual + (addend + y.to(BF16))
        got = stock.gemm_ar_residual(x, w, residual, addend, "unused", 1)
        got_n, _ = stock.gemm_ar_residual_rmsnorm(x, w, residual, addend, norm_w, 1e-5, "unused", 1)
    else:
        got = ops.gemm_ar_residual(x, w, residual, addend, "unused", 1)
        got_n, _ = ops.gemm_ar_residual_rmsnorm(x, w, residual, addend, norm_w, 1e-5, "unused", 1)
    assert got.shape == got_n.shape == (3, 1, 8)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_n, want)


def test_implementations_register_only_against_declared_ops():
    """An op is declared once (its module under kernels/ops/, OpDecl); a kernel for an op nobody declared is a
    mistake (a typo would otherwise register an Impl that never runs)."""
    from k3fuse.kernels import dispatch, ops

    assert set(ops.OPS) == {d.name for d in ops.DECLARATIONS}
    with pytest.raises(KeyError, match="'decode_gem' is not declared: declare it once in its module under kernels/ops/"):
        dispatch.register_impl("decode_gem", dispatch.Impl("typo", lambda *a: None, lambda *a: None))
    with pytest.raises(KeyError, match="not declared"):
        dispatch.register_stock("decode_gem", lambda *a: None)


def test_from_call_reads_cuda_operands_past_the_device_check():
    """Each op's from_call on fake CUDA tensors of K3's decode shapes (no GPU needed): the checks after
    operands_misfit run and accept them (the W4A16 op's: tests/test_routed_experts_w4a16.py)."""
    from k3fuse.kernels.ops.kda_delta import KDADeltaSpec
    from k3fuse.kernels.ops.route_topk import RouteTopkSpec
    from k3fuse.kernels.ops.routed_experts import RoutedExpertsSpec

    T, E, I, L, k, H, dk = 3, 896, 64, 3584, 16, 4, 128
    with FakeTensorMode():
        cuda = {"device": "cuda"}
        experts = RoutedExpertsSpec.from_call(
            torch.empty(T, L, dtype=torch.bfloat16, **cuda), torch.empty(T * k, dtype=torch.int64, **cuda),
            torch.empty(E, I, L, dtype=torch.bfloat16, **cuda), torch.empty(E, I, L, dtype=torch.bfloat16, **cuda),
            torch.empty(E, L, I, dtype=torch.bfloat16, **cuda), k, 1.0, 1.0)
        route = RouteTopkSpec.from_call(torch.empty(T, E, **cuda), torch.empty(E, **cuda), k, 2.5)
        kda = KDADeltaSpec.from_call(torch.empty(T, H, dk, dk, **cuda), torch.empty(T, H, dk, **cuda),
                                     torch.empty(T, H, **cuda), torch.empty(T, H, dk, **cuda),
                                     torch.empty(T, H, dk, **cuda), torch.empty(T, H, dk, **cuda))
    assert (experts.fits, experts.tokens, experts.E, experts.I, experts.L) == (None, T, E, I, L)
    assert (route.fits, route.tokens, route.E) == (None, T, E)
    assert (kda.fits, kda.tokens, kda.heads, kda.dk, kda.dv) == (None, T, H, dk, dk)
