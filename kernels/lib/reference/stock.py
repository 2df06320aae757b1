"""The stock sequences: what the unfused model runs, op by op, with its rounding points.

The kill switch and the call guard run these instead of a fused implementation, so "disabled"
reproduces the unfused model: projections with F.linear in the model dtype, the functional
all-reduce / all-gather on the group named in the graph, adds in the model dtype, RMSNorm with the
variance in fp32 and the result cast back (the spelling of k3fuse/model/layers.py: the math is
k3fuse.spelling's, the model's own functions).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from k3fuse import compat
from k3fuse import spelling
from k3fuse.spelling import ROUTE_EPS, delta_rule, rms_norm, route, short_conv


def all_reduce(t: torch.Tensor, group_name: str, world_size: int) -> torch.Tensor:
    if world_size == 1:
        return t
    return compat.WAIT_TENSOR(compat.ALL_REDUCE(t, "sum", group_name))


def all_gather_last_dim(t: torch.Tensor, group_name: str, world_size: int) -> torch.Tensor:
    if world_size == 1:
        return t
    gathered = compat.WAIT_TENSOR(compat.ALL_GATHER(t.contiguous(), world_size, group_name))
    return torch.cat(gathered.chunk(world_size, dim=0), dim=-1)  # [ws*T, n] -> [T, ws*n]


def gemm_ar_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                     addend: torch.Tensor | None, group_name: str, world_size: int,
                     max_tokens: int = 64) -> torch.Tensor:
    y = all_reduce(F.linear(x, weight), group_name, world_size).reshape(residual.shape)
    if addend is not None:
        y = addend + y  # MoE: moe = y_routed + y_shared, then r = r + moe
    return residual + y


def gemm_ar_residual_rmsnorm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                             addend: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                             group_name: str, world_size: int, max_tokens: int = 64
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    out = gemm_ar_residual(x, weight, residual, addend, group_name, world_size)
    return out, rms_norm(out, norm_weight, eps)


def allreduce_rmsnorm(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, group_name: str,
                      world_size: int, max_tokens: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Stock: the MoE tail as the model runs it, the functional all-reduce in x's dtype, then the
    model's rms_norm of the rounded sum."""
    r = all_reduce(x, group_name, world_size)
    return r, rms_norm(r, norm_weight, eps)


def moe_front_sharded(x: torch.Tensor, router_w: torch.Tensor, down_w: torch.Tensor | None,
                      group_name: str, world_size: int, max_tokens: int = 64
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Stock: the replicated router and latent projections every rank computed before the rewrite
    (router-only form: no latent projection, an empty [T, 0] latent)."""
    latent = F.linear(x, down_w) if down_w is not None else x.new_empty((*x.shape[:-1], 0))
    return F.linear(x.float(), router_w.float()), latent


def decode_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    if out_dtype is not None and out_dtype != x.dtype:
        # the router spelling: F.linear(x.float(), W_r.float())
        return F.linear(x.to(out_dtype), weight.to(out_dtype),
                        bias.to(out_dtype) if bias is not None else None)
    return F.linear(x, weight, bias)


def l2_prefetch(anchor: torch.Tensor, weights: list[torch.Tensor], budget_bytes: int) -> None:
    return None


def kda_delta_rule(recurrent: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stock: the model's delta-rule step (k3fuse.spelling `delta_rule`, the model's), op for op."""
    return delta_rule(recurrent, g, beta, k, v, q)


def kda_short_conv(conv_state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stock: the model's short conv (k3fuse.spelling `short_conv`), op for op."""
    return short_conv(conv_state, q, k, v, weight)


def route_topk(logits: torch.Tensor, b_corr: torch.Tensor, top_k: int, routed_scaling: float,
               eps: float = ROUTE_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """Stock: the model's `route` (k3fuse.spelling), op for op; ties go to torch.topk's order."""
    return route(logits, b_corr, top_k, routed_scaling, eps)


def moe_combine(z: torch.Tensor, weights: torch.Tensor, top_k: int) -> torch.Tensor:
    """Stock: the model's weighted combine (k3fuse.spelling `moe_combine`), then its cast to the trunk
    dtype (z's)."""
    return spelling.moe_combine(z, weights, top_k).to(z.dtype)
