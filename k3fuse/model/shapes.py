"""The decode GEMM sites of one K3 layer on one rank: the shape table benches and tests share.

Every number comes from the `k3` preset (k3fuse/model/config.py) and the sharding of
k3fuse/model/layers.py, never typed by hand: a site is `y = x @ W.T` with W [n, k] as the rank
holds it, and `dtype` is the output's (the trunk dtype, fp32 for the router's logits).

    k3_gemm_sites(2)          every site at TP 2, in layer order
    gemm_site("oproj_tp2")    one site by name ("router", "w_down", "w_up", "w_fa" are replicated:
                              no "_tpN" suffix)
"""
from __future__ import annotations

import re
from typing import NamedTuple

import torch

from .config import K3Config, get_config


class GemmSite(NamedTuple):
    """One decode GEMM: the weight is [n, k] (output features x input features) on one rank,
    `dtype` the output dtype. A tuple, so `name, n, k, dtype = site` unpacks it."""

    name: str
    n: int
    k: int
    dtype: torch.dtype


def k3_gemm_sites(tp: int, cfg: K3Config | None = None) -> list[GemmSite]:
    """The decode GEMMs of one KDA + LatentMoE layer on one rank at tensor parallelism `tp`.

    Column-parallel weights (q/k/v/g, W_fb, W_b, shared gate/up) hold 1/tp of their rows,
    row-parallel ones (the out-projection W_o, shared down) 1/tp of their columns; the router,
    W_down, W_up and W_fa are replicated. Routed experts (grouped GEMMs) are not decode GEMM sites.
    """
    cfg = cfg or get_config("k3")
    cfg.validate_for_tp(tp)
    trunk = cfg.torch_dtype
    H, P, R, h, L, S, E = (cfg.hidden, cfg.kda_dim, cfg.gate_rank, cfg.kda_heads, cfg.latent,
                           cfg.shared_inter, cfg.n_experts)
    return [
        GemmSite(f"qkvg_tp{tp}", P // tp, H, trunk),  # each of W_q, W_k, W_v, W_g
        GemmSite("w_fa", R, H, trunk),
        GemmSite(f"w_fb_tp{tp}", P // tp, R, trunk),
        GemmSite(f"w_b_tp{tp}", h // tp, H, trunk),
        GemmSite(f"oproj_tp{tp}", H, P // tp, trunk),
        GemmSite("router", E, H, torch.float32),  # F.linear(x.float(), W_r.float()): fp32 logits
        GemmSite("w_down", L, H, trunk),
        GemmSite("w_up", H, L, trunk),
        GemmSite(f"shared_gate_tp{tp}", S // tp, H, trunk),
        GemmSite(f"shared_up_tp{tp}", S // tp, H, trunk),
        GemmSite(f"shared_down_tp{tp}", H, S // tp, trunk),
    ]


def gemm_site(name: str, cfg: K3Config | None = None) -> GemmSite:
    """One site by name: "oproj_tp2", "qkvg_tp2", "shared_down_tp2", "router", "w_up" ..."""
    m = re.fullmatch(r"(.+)_tp(\d+)", name)
    tp = int(m.group(2)) if m else 1
    for site in k3_gemm_sites(tp, cfg):
        if site.name == name:
            return site
    known = [s.name for s in k3_gemm_sites(1, cfg)]
    raise ValueError(f"unknown K3 GEMM site {name!r}; sites (with _tpN for the sharded ones): {known}")


def gemm_sites(*names: str, cfg: K3Config | None = None) -> list[GemmSite]:
    return [gemm_site(name, cfg) for name in names]


#: the shapes bench/bench_decode_gemm.py and bench/sweep_decode_gemm.py time: the out-projection
#: at TP 1, 2, 8, 16 and the replicated MoE front and tail
DECODE_GEMM_BENCH_SITES = ("oproj_tp1", "oproj_tp2", "oproj_tp8", "oproj_tp16", "router", "w_down", "w_up")

__all__ = ["GemmSite", "k3_gemm_sites", "gemm_site", "gemm_sites", "DECODE_GEMM_BENCH_SITES"]
