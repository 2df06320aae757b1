"""GPU correctness of kda_delta_rule: the Triton kernel against a float64 reference.

K3 widths (96 heads at TP1, 48 at TP2, 12 at TP8; d = 128), token counts 1..64 with odd counts,
decode-like operands (unit-norm k, q scaled by d^-1/2, beta in (0, 1), g in (-5, 0)), a strided v
(the model's unbind view of the conv output), NaN-poisoned outputs (an unwritten element fails),
the op through the dispatcher in strict mode with runtime.stats() checked, determinism, the stock
sequence for comparison, and CUDA-graph capture replayed on changing inputs.

    python -m pytest -m gpu tests/gpu/test_kda_delta_gpu.py -q
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
from k3fuse.kernels.lib.triton import kda_delta  # noqa: E402
from k3fuse.kernels.ops import kda_delta as kda_op  # noqa: E402
from op_helpers import graph_replays, strict_deterministic_run  # noqa: E402

DEV = "cuda"
D = 128
HEADS = (96, 48, 12)
TOKENS = (1, 2, 3, 5, 7, 8, 13, 16, 31, 33, 47, 63, 64)
RTOL, ATOL = 1e-4, 1e-5


def _operands(T: int, h: int, dk: int = D, dv: int = D, seed: int = 0, strided_v: bool = True):
    gen = torch.Generator(device=DEV).manual_seed(seed)

    def rn(*shape):
        return torch.randn(*shape, generator=gen, device=DEV)

    S = rn(T, h, dk, dv) * 0.5
    g = -5.0 * torch.sigmoid(rn(T, h, dk))
    beta = torch.sigmoid(rn(T, h))
    k = torch.nn.functional.normalize(rn(T, h, dk), dim=-1)
    q = torch.nn.functional.normalize(rn(T, h, dk), dim=-1) * dk ** -0.5
    if strided_v:  # as the model passes it: one of three [T, h, d] views of the conv output
        v = rn(T, 3, h, dv).unbind(1)[2]
        assert v.stride(1) == dv and (T == 1 or not v.is_contiguous())  # one token: strides do not matter
    else:
        v = rn(T, h, dv)
    return S, g, beta, k, v, q


def _ref64(S, g, beta, k, v, q):
    S, g, beta, k, v, q = (t.double() for t in (S, g, beta, k, v, q))
    S = S * torch.exp(g).unsqueeze(-1)
    e = beta.unsqueeze(-1) * (v - torch.einsum("thkv,thk->thv", S, k))
    S = S + k.unsqueeze(-1) * e.unsqueeze(-2)
    return S, torch.einsum("thkv,thk->thv", S, q)


def _poisoned_run(args):
    """The kernel writing into outputs pre-filled with NaN (fresh memory may hold stale values that
    happen to be right): any element the kernel does not write stays NaN."""
    T, h, dk, dv = args[0].shape
    S_new = torch.full((T, h, dk, dv), float("nan"), device=DEV)
    o = torch.full((T, h, dv), float("nan"), device=DEV)
    out = kda_delta.run(*args, out=(S_new, o))
    assert out[0] is S_new and out[1] is o
    return out


@pytest.mark.parametrize("h", HEADS)
@pytest.mark.parametrize("T", TOKENS)
def test_kernel_matches_float64_with_poisoned_outputs(T, h):
    args = _operands(T, h, seed=T * 1000 + h)
    assert kda_op.accepts(kda_op.KDADeltaSpec.from_call(*args)) is None
    S_new, o = _poisoned_run(args)
    assert not torch.isnan(S_new).any() and not torch.isnan(o).any()
    S_ref, o_ref = _ref64(*args)
    torch.testing.assert_close(S_new.double(), S_ref, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(o.double(), o_ref, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("dk,dv", [(16, 16), (32, 32), (64, 48), (128, 80)])
def test_small_widths_and_ragged_value_blocks(dk, dv):
    for T in (1, 3, 64):
        args = _operands(T, 4, dk, dv, seed=dk + dv + T, strided_v=False)
        S_new, o = _poisoned_run(args)
        S_ref, o_ref = _ref64(*args)
        torch.testing.assert_close(S_new.double(), S_ref, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(o.double(), o_ref, rtol=RTOL, atol=ATOL)


def test_op_strict_counts_the_kernel_and_is_deterministic():
    args = _operands(33, 48, seed=7)
    first = strict_deterministic_run(torch.ops.k3fuse.kda_delta_rule, args, {"kda_delta_rule": {"triton.kda_delta": 2}})
    S_ref, o_ref = _ref64(*args)
    torch.testing.assert_close(first[0].double(), S_ref, rtol=RTOL, atol=ATOL)
    # and close to what the model computes (stock: einsum/bmm in fp32)
    for a, b in zip(first, stock.kda_delta_rule(*args)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_outside_the_kernels_limits_falls_back_to_stock_and_strict_raises():
    args = _operands(65, 4, seed=1)
    runtime.reset_stats()
    S, o = torch.ops.k3fuse.kda_delta_rule(*args)
    (reason,) = runtime.fallbacks()["kda_delta_rule"]
    assert "T=65" in reason
    with pytest.raises(runtime.K3FuseFallbackError), runtime.strict():
        torch.ops.k3fuse.kda_delta_rule(*args)


def test_coverage_for_k3_shapes():
    for h in HEADS:
        assert dispatch.coverage(kda_op.KDADeltaSpec(heads=h, dk=D, dv=D, dtype=torch.float32),
                                 range(1, 65)) == {}


@pytest.mark.parametrize("T,h", [(1, 96), (8, 48), (64, 96)])
def test_cuda_graph_replay_on_changing_inputs(T, h):
    dispatch.warmup("kda_delta_rule", [{"M": T, "heads": h, "dk": D, "dv": D}])
    replays = graph_replays(torch.ops.k3fuse.kda_delta_rule, lambda seed: _operands(T, h, seed=seed))
    for fresh, (S_out, o_out) in replays:
        S_ref, o_ref = _ref64(*fresh)
        torch.testing.assert_close(S_out.double(), S_ref, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(o_out.double(), o_ref, rtol=RTOL, atol=ATOL)
