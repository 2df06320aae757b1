"""Compile-time kernel coverage: on a GPU a rule inserts an op only where a kernel serves the site.

Each decode GEMM kernel states its limits once, as its predicate over the op's Spec
(`Impl.accepts`); `kernel_covers` asks it for every token count the site can see, and the rule
refuses a site no kernel serves, naming the shape
and each kernel's limit, instead of inserting an op that would fall back on every call.
"""
import pytest
import torch

import k3fuse
from k3fuse.guards import kernel_covers
from k3fuse.kernels import dispatch
from k3fuse.kernels.ops.decode_gemm import DecodeGemmSpec
from k3fuse.model import K3DecodeStack, get_config
from k3fuse.model.shapes import k3_gemm_sites

pytest.importorskip("triton")  # CI installs Triton: the split-K kernel's limits are what is tested

H100 = (9, 0)
BF16 = torch.bfloat16


def _gemm(N: int, K: int, dtype: torch.dtype = BF16, out_dtype: torch.dtype = BF16) -> DecodeGemmSpec:
    return DecodeGemmSpec(N=N, K=K, dtype=dtype, out_dtype=out_dtype, bias=False)


TP2_SITES = k3_gemm_sites(2)


@pytest.mark.parametrize("name,N,K,out", TP2_SITES, ids=[s.name for s in TP2_SITES])
def test_k3_tp2_decode_shapes_are_covered_at_every_token_count(name, N, K, out):
    """Every decode GEMM of the K3 layer at TP 2 (k3fuse/model/shapes.py: the projections decode_gemm
    takes, the shared expert's on the side stream, the out-projection's GEMM inside the fused
    all-reduce), W_b's 48 rows included (masked tiles); the router's logits are fp32."""
    assert dispatch.coverage(_gemm(N, K, out_dtype=out), range(1, 65)) == {}


def test_uncovered_shape_names_the_tokens_and_every_kernels_limit():
    ctx = k3fuse.DecodeContext(device_capability=H100)
    failure = kernel_covers(ctx, _gemm(64, 100), tokens=None)
    assert failure is not None and (failure.level, failure.guard) == ("site", "kernel_shape")
    assert failure.values["tokens"] == "1-64" and failure.values["N"] == 64 and failure.values["K"] == 100
    assert any(limit.startswith("triton.splitk: ") and "K % 128 == 0" in limit
               for limit in failure.values["limits"])
    assert "N=64 K=100" in failure.message
    # the graph's own token count, when static, is the only one asked about
    assert kernel_covers(ctx, _gemm(64, 100), tokens=3).values["tokens"] == "3"


def test_cpu_context_never_asks_the_kernels():
    assert kernel_covers(k3fuse.DecodeContext(), _gemm(64, 100), tokens=None) is None


def test_rule_refuses_only_the_site_no_kernel_serves():
    """tiny in bf16: W_fb [128, 16], W_up [128, 64] and the shared expert's down [128, 64] have K < 128 and no
    GEMV config; the rest is served."""
    model = K3DecodeStack(get_config("tiny", n_layers=1, dtype="bfloat16"), seed=0)
    x = torch.randn(2, model.config.hidden, dtype=BF16)
    ep = torch.export.export(model, (x, model.init_state(2)))
    _, log = k3fuse.apply(ep, k3fuse.DecodeContext(device_capability=H100))
    refused = log.rejected("decode_gemm")
    assert {(e.level, e.guard) for e in refused} == {("site", "kernel_shape")}
    assert sorted((e.values["N"], e.values["K"], e.values["tokens"]) for e in refused) == [(128, 16, "2"),
                                                                                           (128, 64, "2"),
                                                                                           (128, 64, "2")]
    assert log.applied("decode_gemm") == 11  # the 14 CPU sites less W_fb, W_up and the shared down

    _, log_fp32 = k3fuse.apply(torch.export.export(
        K3DecodeStack(get_config("tiny", n_layers=1), seed=0), (x.float(), model.init_state(2))),
        k3fuse.DecodeContext(device_capability=H100))
    assert log_fp32.applied("decode_gemm") == 0  # no kernel takes an fp32 trunk
    assert {e.guard for e in log_fp32.rejected("decode_gemm")} == {"kernel_shape"}
