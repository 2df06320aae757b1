"""GPU correctness of decode_gemm: CuTe GEMV and Triton split-K against a float64 reference.

Every token count 1..64 on the K3 per-rank shapes, fresh random inputs per case, NaN-poisoned
outputs (an unwritten element fails), the op through the dispatcher in strict mode with
runtime.stats() checked, determinism, and CUDA-graph capture with 1000 replays on changing inputs.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # collected on CPU CI only with -m gpu; skip cleanly there
    pytest.skip("needs CUDA", allow_module_level=True)

import k3fuse.kernels  # noqa: F401,E402  (registers torch.ops.k3fuse.*)
from k3fuse import runtime  # noqa: E402
from k3fuse.kernels import dispatch  # noqa: E402
from k3fuse.kernels.lib.cute import compat  # noqa: E402
from k3fuse.kernels.lib.cute import gemv as decode_gemv  # noqa: E402
from k3fuse.kernels.ops import decode_gemm  # noqa: E402
from k3fuse.kernels.lib.triton import splitk_gemm  # noqa: E402
from k3fuse.model.shapes import DECODE_GEMM_BENCH_SITES, gemm_site, gemm_sites  # noqa: E402

# (name, N, K, out dtype): K3 per-rank shapes at TP 1, 2, 8, 16 plus the replicated MoE front/tail,
# then the rest of the K3 layer at TP 2: q/k/v/g, the gate's low-rank pair, and W_b's 48 rows
# (a skinny N the split-K kernel serves with masked 16-column tiles); k3fuse/model/shapes.py
SHAPES = gemm_sites(*DECODE_GEMM_BENCH_SITES, "qkvg_tp2", "w_fa", "w_fb_tp2", "w_b_tp2")
ROUTER, OPROJ_TP2 = gemm_site("router"), gemm_site("oproj_tp2")
DEV = "cuda"
_weights: dict = {}


def _weight(N, K):
    if (N, K) not in _weights:
        _weights[(N, K)] = torch.randn(N, K, device=DEV, dtype=torch.bfloat16) / K ** 0.5
    return _weights[(N, K)]


def _ref(x, w, out_dtype):
    return (x.double() @ w.double().T)


def _check(y, ref, out_dtype, what):
    assert not torch.isnan(y).any(), f"{what}: NaN (unwritten output)"
    rel = ((y.double() - ref).norm() / ref.norm()).item()
    tol = 1e-2 if out_dtype == torch.bfloat16 else 1e-5
    assert rel < tol, f"{what}: rel err {rel:.2e} >= {tol}"


@pytest.mark.parametrize("name,N,K,out_dtype", SHAPES, ids=[s[0] for s in SHAPES])
def test_kernels_all_token_counts(name, N, K, out_dtype):
    w = _weight(N, K)
    for M in range(1, 65):
        x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
        ref = _ref(x, w, out_dtype)
        spec = decode_gemm.DecodeGemmSpec.from_call(x, w, None, out_dtype)
        if decode_gemm.gemv_accepts(spec, crossover=False) is None:
            y = torch.full((M, N), float("nan"), device=DEV, dtype=out_dtype)
            decode_gemv.run(x, w, None, out_dtype, out=y)
            _check(y, ref, out_dtype, f"gemv {name} M={M}")
        assert decode_gemm.splitk_accepts(spec) is None, f"split-K must support {name} M={M}"
        y = torch.full((M, N), float("nan"), device=DEV, dtype=out_dtype)
        splitk_gemm.run(x, w, None, out_dtype, out=y)
        _check(y, ref, out_dtype, f"splitk {name} M={M}")
        y2 = torch.full((M, N), float("nan"), device=DEV, dtype=out_dtype)
        splitk_gemm.run(x, w, None, out_dtype, out=y2)
        assert torch.equal(y, y2), f"splitk {name} M={M} not deterministic"


@pytest.mark.parametrize("name,N,K,out_dtype", SHAPES, ids=[s[0] for s in SHAPES])
def test_op_strict_no_fallback(name, N, K, out_dtype):
    w = _weight(N, K)
    runtime.reset_stats()
    with runtime.strict():
        for M in range(1, 65):
            x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
            y = torch.ops.k3fuse.decode_gemm(x, w, None, out_dtype)
            assert y.dtype == out_dtype and y.shape == (M, N)
            _check(y, _ref(x, w, out_dtype), out_dtype, f"op {name} M={M}")
    st = runtime.stats()["decode_gemm"]
    assert not any(k.startswith("fallback") or k == "reference" for k in st), st
    assert sum(st.values()) == 64, st


def test_bias_and_batch_dims():
    w = _weight(ROUTER.n, ROUTER.k)
    b = torch.randn(ROUTER.n, device=DEV, dtype=torch.bfloat16)
    for M in (1, 2, 5, 33):
        x = torch.randn(1, M, ROUTER.k, device=DEV, dtype=torch.bfloat16)
        with runtime.strict():
            y = torch.ops.k3fuse.decode_gemm(x, w, b, torch.float32)
        ref = x.double().reshape(M, -1) @ w.double().T + b.double()
        _check(y.reshape(M, -1), ref, torch.float32, f"bias M={M}")


@pytest.mark.parametrize("M", [1, 2, 16, 64])
def test_cuda_graph_1000_replays(M):
    N, K = OPROJ_TP2.n, OPROJ_TP2.k
    w = _weight(N, K)
    x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
    dispatch.warmup("decode_gemm", [{"M": M, "N": N, "K": K, "dtype": torch.bfloat16}])
    with runtime.strict():
        torch.ops.k3fuse.decode_gemm(x, w, None, None)  # warm-up before capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = torch.ops.k3fuse.decode_gemm(x, w, None, None)
    gen = torch.Generator(device=DEV).manual_seed(M)
    for i in range(1000):
        x.copy_(torch.randn(M, K, device=DEV, dtype=torch.bfloat16, generator=gen))
        y.fill_(float("nan"))
        g.replay()
        if i % 97 == 0 or i == 999:
            _check(y, _ref(x, w, torch.bfloat16), torch.bfloat16, f"graph M={M} replay {i}")
    torch.cuda.synchronize()


def test_refuses_compile_while_capturing():
    if not compat.available():
        pytest.skip("CuTe DSL not installed")
    key, build = decode_gemv.builder(3, 4096, 1, 128)
    x = torch.randn(8, device=DEV)
    g = torch.cuda.CUDAGraph()
    with pytest.raises(compat.CompileWhileCapturing):
        with torch.cuda.graph(g):
            x.add_(1)
            compat.compiled(("never-compiled",) + key, build)
