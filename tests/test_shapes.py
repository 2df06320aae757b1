"""k3fuse/model/shapes.py: the one K3 GEMM shape table (benches and GPU tests), derived from the
`k3` preset, reproduces the per-rank shapes they used to type by hand."""
from __future__ import annotations

import pytest
import torch

from k3fuse.model import K3DecodeStack, get_config
from k3fuse.model.shapes import DECODE_GEMM_BENCH_SITES, GemmSite, gemm_site, gemm_sites, k3_gemm_sites

BF16, F32 = torch.bfloat16, torch.float32

#: the numbers bench/bench_decode_gemm.py, tests/gpu/test_decode_gemm_gpu.py, bench/bench_fused_ar.py,
#: tests/gpu/test_shared_expert_gpu.py and tests/test_kernel_coverage.py wrote out before the table
BEFORE = {
    "oproj_tp1": (7168, 12288, BF16), "oproj_tp2": (7168, 6144, BF16), "oproj_tp8": (7168, 1536, BF16),
    "oproj_tp16": (7168, 768, BF16), "router": (896, 7168, F32), "w_down": (3584, 7168, BF16),
    "w_up": (7168, 3584, BF16), "qkvg_tp2": (6144, 7168, BF16), "w_fa": (128, 7168, BF16),
    "w_fb_tp2": (6144, 128, BF16), "w_b_tp2": (48, 7168, BF16), "shared_gate_tp2": (3072, 7168, BF16),
    "shared_up_tp2": (3072, 7168, BF16), "shared_down_tp2": (7168, 3072, BF16),
}


@pytest.mark.parametrize("name", sorted(BEFORE))
def test_table_reproduces_the_hand_typed_shapes(name):
    site = gemm_site(name)
    assert site == GemmSite(name, *BEFORE[name])
    name_, n, k, dtype = site  # unpacks like the tuples it replaces
    assert (name_, n, k, dtype) == (name, *BEFORE[name])


def test_bench_sites_in_order():
    assert [s.name for s in gemm_sites(*DECODE_GEMM_BENCH_SITES)] == [
        "oproj_tp1", "oproj_tp2", "oproj_tp8", "oproj_tp16", "router", "w_down", "w_up"]


def test_sites_are_the_models_weights():
    """The table is the model's sharding: a small config's weight shapes (TP 1), and 1/tp of the
    sharded dim at TP 2 and 4."""
    cfg = get_config("tiny", dtype="bfloat16")
    layer = K3DecodeStack(cfg, seed=0, device="meta").layers[0]
    weights = {"oproj": layer.kda.w_o, "qkvg": layer.kda.w_q, "w_fa": layer.kda.w_fa, "w_fb": layer.kda.w_fb,
               "w_b": layer.kda.w_b, "router": layer.moe.routed.router.w_r, "w_down": layer.moe.routed.w_down,
               "w_up": layer.moe.routed.w_up, "shared_gate": layer.moe.shared.w_gate,
               "shared_up": layer.moe.shared.w_up, "shared_down": layer.moe.shared.w_down}
    row_parallel = {"oproj", "shared_down"}
    for tp in (1, 2, 4):
        sites = {s.name.removesuffix(f"_tp{tp}"): s for s in k3_gemm_sites(tp, cfg)}
        assert sorted(sites) == sorted(weights)
        for name, w in weights.items():
            n, k = w.shape
            if name.startswith(("oproj", "qkvg", "w_fb", "w_b", "shared")):  # sharded
                n, k = (n, k // tp) if name in row_parallel else (n // tp, k)
            assert (sites[name].n, sites[name].k) == (n, k), (tp, name)
            assert sites[name].dtype == (F32 if name == "router" else BF16)


def test_unknown_site_and_bad_tp():
    with pytest.raises(ValueError, match="unknown K3 GEMM site 'nope'"):
        gemm_site("nope")
    with pytest.raises(ValueError, match="does not divide"):
        k3_gemm_sites(3)
