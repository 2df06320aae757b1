"""Reference out-projection + all-reduce + residual (+ RMSNorm), and the MoE tail's all-reduce +
RMSNorm.

One fp32 pipeline: partial = x @ W.T (fp32), all-reduce the fp32 partial (sum), add the residual
(and the addend) in fp32, round once. The RMSNorm variant normalises the fp32 sum (before that
rounding), as a fused kernel holding the sum in registers does. `allreduce_rmsnorm` is the same
without the GEMM and the residual: the fp32 sum of the partials, rounded once to x's dtype, and
RMSNorm of the fp32 sum in the K3 spelling's order (variance in fp32, times rsqrt, times the weight
in fp32, one cast back to x's dtype).
"""
from __future__ import annotations

import torch

from .collectives import accumulation_dtype, all_reduce_sum


def _residual_sum(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                  addend: torch.Tensor | None, group_name: str, world_size: int) -> torch.Tensor:
    acc = accumulation_dtype(x, weight, residual, addend)
    # the op's output has the residual's shape ([T, H] or an HF-style [B, 1, H]); x's rows are its rows
    partial = (x.to(acc) @ weight.to(acc).T).reshape(residual.shape)
    total = all_reduce_sum(partial, group_name, world_size)
    total = total + residual.to(acc)
    if addend is not None:
        total = total + addend.to(acc)
    return total


def rms_norm_acc(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in x's (accumulation) dtype, times the weight; no rounding."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.to(x.dtype)


def gemm_ar_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                     addend: torch.Tensor | None, group_name: str, world_size: int,
                     max_tokens: int = 64) -> torch.Tensor:
    total = _residual_sum(x, weight, residual, addend, group_name, world_size)
    return total.to(residual.dtype)


def gemm_ar_residual_rmsnorm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                             addend: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                             group_name: str, world_size: int, max_tokens: int = 64
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    total = _residual_sum(x, weight, residual, addend, group_name, world_size)
    normed = rms_norm_acc(total, norm_weight, eps)
    return total.to(residual.dtype), normed.to(residual.dtype)


def allreduce_rmsnorm(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, group_name: str,
                      world_size: int, max_tokens: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum over ranks of x, RMSNorm(sum) * norm_weight), both in x's dtype, summed in fp32."""
    acc = accumulation_dtype(x, norm_weight)
    total = all_reduce_sum(x.to(acc, copy=True).contiguous(), group_name, world_size)  # never x itself
    normed = rms_norm_acc(total, norm_weight, eps)
    return total.to(x.dtype), normed.to(x.dtype)
