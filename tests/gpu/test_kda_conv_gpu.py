"""GPU correctness of kda_short_conv: the Triton kernel against a float64 reference.

K3 widths ([q; k; v] of 3 * 12288 / tp channels at TP 1, 2 and 8; K = 4 taps; bf16 trunk, fp32
taps), every token count 1..64, a small odd width (one masked block), fp16 and fp32 trunks, a
token stride wider than the row (q, k, v as slices of one buffer), NaN-poisoned outputs (an
unwritten element fails); the new state equals the window's last K-1 taps bit for bit; the op
through the dispatcher in strict mode with runtime.stats() checked, determinism, the stock
sequence for comparison, a fallback outside the kernel's limits, and CUDA-graph capture replayed
on changing inputs.

    python -m pytest -m gpu tests/gpu/test_kda_conv_gpu.py -q
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
from k3fuse.kernels.lib.reference import stock  # noqa: E402
from k3fuse.kernels.lib.triton import kda_conv  # noqa: E402
from k3fuse.kernels.ops import kda_conv as conv_op  # noqa: E402
from op_helpers import graph_replays, strict_deterministic_run  # noqa: E402

DEV = "cuda"
OP = "kda_short_conv"
K = 4
WIDTHS = (12288, 6144, 1536)  # K3's q (= k = v) width per rank at TP 1, 2, 8
RTOL, ATOL = 1e-5, 1e-6


def _operands(T: int, width: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0, taps: int = K,
              row_stride: int | None = None):
    """conv_state [T, 3W, K-1], q/k/v [T, W] (slices of one [3, T, row_stride] buffer when asked), fp32
    taps [3W, K] at the model's scale."""
    gen = torch.Generator(device=DEV).manual_seed(seed)

    def rn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=DEV) * scale).to(dtype)

    state = rn(T, 3 * width, taps - 1)
    qkv = rn(3, T, row_stride or width)
    q, k, v = (qkv[i, :, :width] for i in range(3))
    return state, q, k, v, torch.randn(3 * width, taps, generator=gen, device=DEV) * 0.5


def _ref64(state, q, k, v, weight):
    window = torch.cat([state.double(), torch.cat([q, k, v], -1).double().unsqueeze(-1)], -1)
    acc = (window * weight.double()).sum(-1)
    return acc / (1 + torch.exp(-acc)), window[..., 1:]


def _poisoned_run(args):
    """The kernel writing into outputs pre-filled with NaN (fresh memory may hold stale values that
    happen to be right): any element the kernel does not write stays NaN."""
    state = args[0]
    T, C, km1 = state.shape
    conv = torch.full((T, C), float("nan"), device=DEV)
    new_state = torch.full((T, C, km1), float("nan"), device=DEV).to(state.dtype)
    out = kda_conv.run(*args, out=(conv, new_state))
    assert out[0] is conv and out[1] is new_state
    return out


def _check(args, conv, new_state):
    assert not torch.isnan(conv).any() and not torch.isnan(new_state.float()).any()
    conv64, state64 = _ref64(*args)
    torch.testing.assert_close(conv.double(), conv64, rtol=RTOL, atol=ATOL)
    assert torch.equal(new_state.double(), state64)  # a copy of the window's last K-1 taps: exact


@pytest.mark.parametrize("width", WIDTHS)
def test_kernel_matches_float64_at_every_token_count_with_poisoned_outputs(width):
    for T in range(1, 65):
        args = _operands(T, width, seed=T * 100 + width)
        assert conv_op.accepts(conv_op.KDAConvSpec.from_call(*args)) is None
        _check(args, *_poisoned_run(args))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("width,taps,row_stride", [(7, 4, None), (40, 4, 48), (300, 2, None), (1000, 8, None)])
def test_odd_widths_other_taps_strided_rows_and_trunks(dtype, width, taps, row_stride):
    for T in (1, 3, 17, 64):
        args = _operands(T, width, dtype, seed=width + T, taps=taps, row_stride=row_stride)
        assert conv_op.accepts(conv_op.KDAConvSpec.from_call(*args)) is None
        _check(args, *_poisoned_run(args))


def test_op_strict_counts_the_kernel_and_is_deterministic():
    args = _operands(33, 6144, seed=7)
    first = strict_deterministic_run(torch.ops.k3fuse.kda_short_conv, args, {OP: {"triton.kda_conv": 2}})
    _check(args, *first)
    # and close to what the model computes (stock: the window, a sum over it, silu)
    conv_st, state_st = stock.kda_short_conv(*args)
    torch.testing.assert_close(first[0], conv_st, rtol=1e-5, atol=1e-6)
    assert torch.equal(first[1], state_st)


def test_outside_the_kernels_limits_falls_back_to_stock_and_strict_raises():
    args = _operands(3, 64, seed=1, taps=10)  # K = 10: more taps than the kernel unrolls
    runtime.reset_stats()
    conv, new_state = torch.ops.k3fuse.kda_short_conv(*args)
    (reason,) = runtime.fallbacks()[OP]
    assert "K=10" in reason
    conv64, state64 = _ref64(*args)
    torch.testing.assert_close(conv.double(), conv64, rtol=1e-4, atol=1e-5)
    with pytest.raises(runtime.K3FuseFallbackError), runtime.strict():
        torch.ops.k3fuse.kda_short_conv(*args)


def test_coverage_for_k3_shapes():
    for width in WIDTHS:
        assert dispatch.coverage(conv_op.KDAConvSpec(channels=3 * width, taps=K, dtype=torch.bfloat16),
                                 range(1, 65)) == {}


@pytest.mark.parametrize("T,width", [(1, 12288), (8, 6144), (64, 12288)])
def test_cuda_graph_replay_on_changing_inputs(T, width):
    dispatch.warmup(OP, [{"M": T, "channels": 3 * width, "taps": K, "dtype": torch.bfloat16}])
    replays = graph_replays(torch.ops.k3fuse.kda_short_conv, lambda seed: _operands(T, width, seed=seed))
    for fresh, (conv_out, state_out) in replays:
        conv64, state64 = _ref64(*fresh)
        torch.testing.assert_close(conv_out.double(), conv64, rtol=RTOL, atol=ATOL)
        assert torch.equal(state_out.double(), state64)
