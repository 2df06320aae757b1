"""GPU correctness of route_topk: the Triton kernel against the reference, on the same device.

K3's router tail (E = 896 experts, top-16, routed_scaling 2.5) at every token count 1..64:
idx bit for bit and weights bit for bit (the kernel spells sigmoid as torch's CUDA kernel does,
1 / (1 + expf(-x)) with IEEE division, and adds the weights in selection order as the reference
does); adversarial ties (few distinct logits: lowest index wins); NaN-poisoned outputs (an
unwritten element fails); the op through the dispatcher in strict mode with runtime.stats()
checked; and 1000 CUDA-graph replays on changing inputs, each checked against the reference.

    python -m pytest -m gpu tests/gpu/test_route_topk_gpu.py -q
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
from k3fuse.kernels.lib.reference import routing, stock  # noqa: E402
from k3fuse.kernels.lib.triton import route_topk  # noqa: E402
from k3fuse.kernels.ops import route_topk as route_op  # noqa: E402

DEV = "cuda"
E, K, SCALE = 896, 16, 2.5


def _inputs(T: int, seed: int = 0, ties: bool = False):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    if ties:  # three logit values, two bias values: hundreds of equal biased scores per token
        levels = torch.tensor([-1.0, 0.0, 0.5], device=DEV)
        logits = levels[torch.randint(0, 3, (T, E), generator=gen, device=DEV)]
        b = torch.tensor([0.0, 0.125], device=DEV)[torch.randint(0, 2, (E,), generator=gen, device=DEV)]
        return logits, b
    return torch.randn(T, E, generator=gen, device=DEV) * 2, torch.randn(E, generator=gen, device=DEV) * 0.05


def _poisoned(T: int):
    return (torch.full((T, K), float("nan"), device=DEV), torch.full((T, K), -7, dtype=torch.int64, device=DEV))


@pytest.mark.parametrize("ties", [False, True])
def test_every_token_count_matches_the_reference_bit_for_bit(ties):
    for T in range(1, 65):
        logits, b = _inputs(T, seed=T, ties=ties)
        assert route_op.accepts(route_op.RouteTopkSpec.from_call(logits, b, K, SCALE)) is None
        w, idx = route_topk.run(logits, b, K, SCALE, out=_poisoned(T))
        w_ref, idx_ref = routing.route_topk(logits, b, K, SCALE)
        assert torch.equal(idx, idx_ref), (T, ties)
        assert torch.equal(w, w_ref), (T, ties, float((w - w_ref).abs().max()))
        # the model's own sequence (torch.topk, torch.sum) picks the same experts off ties
        if not ties:
            w_st, idx_st = stock.route_topk(logits, b, K, SCALE)
            assert torch.equal(idx, idx_st)
            torch.testing.assert_close(w, w_st, rtol=1e-6, atol=0)


def test_ties_go_to_the_lowest_index():
    logits, b = torch.zeros(3, E, device=DEV), torch.zeros(E, device=DEV)
    _, idx = route_topk.run(logits, b, K, SCALE, out=_poisoned(3))
    assert (idx == torch.arange(K, device=DEV)).all()


def test_op_strict_counts_the_kernel():
    logits, b = _inputs(7)
    runtime.reset_stats()
    with runtime.strict():
        w, idx = torch.ops.k3fuse.route_topk(logits, b, K, SCALE)
    assert runtime.stats()["route_topk"] == {"triton.route_topk": 1}
    w_ref, idx_ref = routing.route_topk(logits, b, K, SCALE)
    assert torch.equal(idx, idx_ref) and torch.equal(w, w_ref)
    assert dispatch.coverage("route_topk", {"E": E, "top_k": K, "dtype": torch.float32}, range(1, 65)) == {}


@pytest.mark.parametrize("T", [1, 16, 64])
def test_cuda_graph_replays(T):
    logits, b = _inputs(T, seed=100 + T)
    out = _poisoned(T)
    route_topk.run(logits, b, K, SCALE, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        route_topk.run(logits, b, K, SCALE, out=out)
    gen = torch.Generator(device=DEV).manual_seed(T)
    for i in range(1000):
        logits.copy_(torch.randn(T, E, generator=gen, device=DEV) * 2)
        out[0].fill_(float("nan"))
        out[1].fill_(-7)
        graph.replay()
        if i % 50 == 0 or i == 999:
            w_ref, idx_ref = routing.route_topk(logits, b, K, SCALE)
            assert torch.equal(out[1], idx_ref) and torch.equal(out[0], w_ref), i
    torch.cuda.synchronize()
