"""GPU correctness of moe_combine: the Triton kernel against a float64 reference and the reference's bits.

K3's combine (L = 3584, top-16, bf16 expert outputs, fp32 routing weights) at every token count
1..64 into NaN-poisoned outputs (an unwritten element fails): within the bf16 rounding of the
float64 sum, and the same bits as the plain-torch reference on the same device (the kernel adds the
slots in the reference's order without FMA); fp16 / fp32 and an odd L; the op through the
dispatcher in strict mode with k3fuse.stats() showing the Triton kernel; determinism; 65 tokens
falling back to stock (strict raises); and CUDA-graph capture replayed on changing inputs.

    python -m pytest -m gpu tests/gpu/test_moe_combine_gpu.py -q
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # collected on CPU CI only with -m gpu; skip cleanly there
    pytest.skip("needs CUDA", allow_module_level=True)

import k3fuse  # noqa: E402
from k3fuse import runtime  # noqa: E402
from k3fuse.kernels import dispatch  # noqa: E402
from k3fuse.kernels.lib.reference import moe_combine as reference  # noqa: E402
from k3fuse.kernels.lib.reference import stock  # noqa: E402
from k3fuse.kernels.lib.triton import moe_combine  # noqa: E402
from k3fuse.kernels.ops import moe_combine as combine_op  # noqa: E402

DEV = "cuda"
L, K = 3584, 16
OP = "moe_combine"


def _operands(T: int, L: int = L, dtype=torch.bfloat16, seed: int = 0):
    """Expert outputs z [T*K, L] and route_topk-like weights [T, K] (positive, scaled to sum 2.5)."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    z = torch.randn(T * K, L, generator=gen, device=DEV).to(dtype)
    w = torch.rand(T, K, generator=gen, device=DEV) + 0.01
    return z, w / w.sum(-1, keepdim=True) * 2.5


def _f64(z: torch.Tensor, w: torch.Tensor):
    """(sum over the slots in float64, the sum of |terms|: the scale of any fp32 rounding)."""
    T = w.shape[0]
    terms = z.double().view(T, K, -1) * w.double().unsqueeze(-1)
    return terms.sum(1), terms.abs().sum(1)


def _poisoned_run(z: torch.Tensor, w: torch.Tensor, **kw) -> torch.Tensor:
    """The kernel writing into an output pre-filled with NaN (fresh memory may hold stale values that
    happen to be right): any element it does not write stays NaN."""
    out = torch.full((w.shape[0], z.shape[1]), float("nan"), dtype=z.dtype, device=DEV)
    assert moe_combine.run(z, w, K, out=out, **kw) is out
    return out


#: half an ulp of the output dtype, relative: the one rounding of the fp32 sum at the end
HALF_ULP = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11, torch.float32: 2 ** -24}


def _check(out: torch.Tensor, z: torch.Tensor, w: torch.Tensor, where) -> None:
    """Every element written; within the fp32 sum's roundings (K adds, each within 2^-24 of the sum of
    |terms|) and one rounding to the output dtype of the float64 sum; the reference's bits."""
    assert not torch.isnan(out).any(), where
    ref64, scale = _f64(z, w)
    bound = HALF_ULP[z.dtype] * ref64.abs() * 1.01 + 2 * K * 2 ** -24 * scale + 1e-7  # 1e-7: fp16 subnormals
    excess = float(((out.double() - ref64).abs() - bound).max())
    assert excess <= 0, (where, excess)
    assert torch.equal(out, reference.moe_combine(z, w, K)), where  # the reference's bits on this device


def test_every_token_count_at_k3_width_bf16():
    for T in range(1, 65):
        z, w = _operands(T, seed=T)
        assert combine_op.accepts(combine_op.MoECombineSpec.from_call(z, w, K)) is None
        _check(_poisoned_run(z, w), z, w, T)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("width", [L, 1001])
def test_other_dtypes_and_an_odd_width(dtype, width):
    for T in (1, 3, 8, 17, 64):
        z, w = _operands(T, width, dtype, seed=T + width)
        _check(_poisoned_run(z, w), z, w, (dtype, width, T))


def test_strided_operands_and_every_column_block():
    T = 9
    z, w = _operands(T, 640, seed=4)
    wide = torch.zeros(T * K, 704, dtype=z.dtype, device=DEV)
    wide[:, :640] = z
    wt = w.t().contiguous().t()  # the weights transposed in memory
    _check(_poisoned_run(wide[:, :640], wt), z, w, "strided")
    for block in moe_combine.BLOCKS:
        for warps in (1, 2, 4):
            _check(_poisoned_run(z, w, config={"BLOCK_L": block, "num_warps": warps}), z, w, (block, warps))


def test_op_strict_counts_the_kernel_and_is_deterministic():
    z, w = _operands(33, seed=7)
    k3fuse.reset_stats()
    with k3fuse.strict():
        first = torch.ops.k3fuse.moe_combine(z, w, K)
        again = torch.ops.k3fuse.moe_combine(z, w, K)
    assert k3fuse.stats() == {OP: {"triton.moe_combine": 2}}
    assert torch.equal(first, again)  # fixed order
    _check(first, z, w, "op")
    # and close to what the model computes (stock: the spelling, Inductor-free, torch's sum order)
    torch.testing.assert_close(first.float(), stock.moe_combine(z, w, K).float(), rtol=2 ** -7, atol=1e-3)
    assert dispatch.coverage(combine_op.MoECombineSpec(L=L, top_k=K, dtype=torch.bfloat16), range(1, 65)) == {}


def test_outside_the_kernels_limits_falls_back_to_stock_and_strict_raises():
    z, w = _operands(65, seed=1)
    runtime.reset_stats()
    out = torch.ops.k3fuse.moe_combine(z, w, K)
    (reason,) = runtime.fallbacks()[OP]
    assert "T=65" in reason
    assert torch.equal(out, stock.moe_combine(z, w, K))
    with pytest.raises(runtime.K3FuseFallbackError), runtime.strict():
        torch.ops.k3fuse.moe_combine(z, w, K)


@pytest.mark.parametrize("T", [1, 8, 64])
def test_cuda_graph_replay_on_changing_inputs(T):
    z, w = _operands(T, seed=3)
    assert dispatch.warmup(OP, [{"M": T, "L": L, "top_k": K, "dtype": torch.bfloat16}]) == {"triton.moe_combine": None}
    with runtime.strict():
        torch.ops.k3fuse.moe_combine(z, w, K)  # compiled for these strides before capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = torch.ops.k3fuse.moe_combine(z, w, K)
    for step in range(20):
        fz, fw = _operands(T, seed=100 + step)
        z.copy_(fz)
        w.copy_(fw)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(out, fz, fw, (T, step))
