"""GPU correctness of routed_experts: the Triton kernels against a float64 reference.

K3's routed experts (E = 896, top-16, latent L = 3584) at the widths the layer benchmark uses
(moe_inter 128 at TP 1, 64 per rank at TP 2) and at the published width (3072, 1536 per rank at
TP 2): every token count 1..64 against the gathered spelling in float64 and against the model's
stock grouped GEMMs, with a NaN-poisoned output (an unwritten row fails); crowded experts (every
token picks the same 16, so a group spans several 16-row blocks); both checks in each mode forced
(pairwise: no grouping launch, one pair per program; grouped), whatever pick_config would choose;
the op through the dispatcher in strict mode with runtime.stats() checked; 1000 CUDA-graph replays
on changing tokens and experts (the mode pick_config chooses: pairwise at 1 token).

    python -m pytest -m gpu tests/gpu/test_routed_experts_gpu.py -q
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
from k3fuse.kernels.lib.triton import routed_experts as kernel  # noqa: E402
from k3fuse.kernels.ops import routed_experts as experts_op  # noqa: E402
from k3fuse.spelling import routed_experts_gathered, routed_experts_grouped, situ  # noqa: E402

from experts_helpers import BF16, DEV, E, K, L, SITU, rel, tokens  # noqa: E402

#: kernel.run's config forcing each mode
MODES = pytest.mark.parametrize("mode", [{"pairwise": True}, {"pairwise": False}], ids=["pairwise", "grouped"])


def _weights(I: int, seed: int = 0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    w1 = torch.randn(E, I, L, device=DEV, dtype=BF16, generator=gen) * L ** -0.5
    w3 = torch.randn(E, I, L, device=DEV, dtype=BF16, generator=gen) * L ** -0.5
    w2 = torch.randn(E, L, I, device=DEV, dtype=BF16, generator=gen) * I ** -0.5
    return w1, w3, w2




def _ref64(a, experts, w):
    """The routed experts in float64, one expert at a time (the gathered spelling would copy
    T*k weight slices: 45 GB at the published width and 64 tokens)."""
    w1, w3, w2 = w
    z = torch.empty(experts.shape[0], L, device=DEV, dtype=torch.float64)
    for e in experts.unique().tolist():
        pairs = (experts == e).nonzero().squeeze(1)
        x = a.double()[pairs // K]
        act = situ(x @ w1[e].double().T, x @ w3[e].double().T, *SITU)
        z[pairs] = act @ w2[e].double().T
    return z


@pytest.fixture(scope="module", params=[128, 64, 1536], ids=["I128_tp1", "I64_tp2", "I1536_k3_tp2"])
def weights(request):
    w = _weights(request.param)
    yield w
    del w
    torch.cuda.empty_cache()


@MODES
def test_every_token_count_against_float64_and_the_stock_grouped_gemms(weights, mode):
    I = weights[0].shape[1]
    counts = range(1, 65) if I <= 128 else (1, 2, 3, 8, 17, 33, 64)  # the published width is 30 GB of weights
    for T in counts:
        a, experts = tokens(T, seed=T)
        assert experts_op.accepts(experts_op.RoutedExpertsSpec.from_call(a, experts, *weights, K, *SITU)) is None
        out = torch.full((T * K, L), float("nan"), device=DEV, dtype=BF16)
        z = kernel.run(a, experts, *weights, K, *SITU, out=out, config=mode)
        assert z.data_ptr() == out.data_ptr() and not torch.isnan(z).any(), T
        ref = _ref64(a, experts, weights)
        stock = routed_experts_grouped(a, experts, *weights, K, *SITU)
        assert rel(z, ref) < 1e-2, (T, rel(z, ref))
        # as close to float64 as the stock bf16 path is (same rounding points, another summation order)
        assert rel(z, ref) < 1.5 * rel(stock, ref) + 1e-3, (T, rel(z, ref), rel(stock, ref))
        if T <= 8:  # the gathered spelling (the op's reference impl) agrees too
            gathered = routed_experts_gathered(a, experts, *weights, K, *SITU)
            assert rel(gathered, ref) < 1e-2, T


@MODES
@pytest.mark.parametrize("T", [1, 16, 17, 64])
def test_crowded_experts_span_several_row_blocks(weights, T, mode):
    a, experts = tokens(T, seed=100 + T, crowded=True)
    out = torch.full((T * K, L), float("nan"), device=DEV, dtype=BF16)
    z = kernel.run(a, experts, *weights, K, *SITU, out=out, config=mode)
    assert not torch.isnan(z).any()
    assert rel(z, _ref64(a, experts, weights)) < 1e-2


def test_op_strict_counts_the_kernel(weights):
    dispatch.load_gpu_impls()
    a, experts = tokens(8, seed=7)
    runtime.reset_stats()
    with runtime.strict():
        z = torch.ops.k3fuse.routed_experts(a, experts, *weights, K, *SITU)
    assert runtime.stats()["routed_experts"] == {"triton.routed_experts": 1}
    assert runtime.fallbacks() == {}
    assert rel(z, _ref64(a, experts, weights)) < 1e-2


@pytest.mark.parametrize("T", [1, 8, 64])
def test_cuda_graph_1000_replays_on_changing_inputs(weights, T):
    if weights[0].shape[1] > 128 and T != 8:
        pytest.skip("the published width runs one token count here (30 GB of weights, 1000 replays)")
    a_static, e_static = tokens(T, seed=0)
    z_static = torch.empty(T * K, L, device=DEV, dtype=BF16)
    kernel.run(a_static, e_static, *weights, K, *SITU, out=z_static)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernel.run(a_static, e_static, *weights, K, *SITU, out=z_static)
    checked = 0
    for i in range(1000):
        a, experts = tokens(T, seed=1000 + i, crowded=(i % 97 == 0))
        a_static.copy_(a)
        e_static.copy_(experts)
        z_static.fill_(float("nan"))
        graph.replay()
        if i % 50 == 0 or i % 97 == 0:  # the float64 reference is slow: check a sample, every crowded one
            torch.cuda.synchronize()
            assert not torch.isnan(z_static).any(), i
            assert rel(z_static, _ref64(a, experts, weights)) < 1e-2, i
            checked += 1
    torch.cuda.synchronize()
    assert not torch.isnan(z_static).any()
    assert checked >= 20
