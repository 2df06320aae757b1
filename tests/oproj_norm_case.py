"""The engine tests' case: a row-parallel out-projection, its all-reduce, the residual add and RMSNorm,
on seeded inputs, with the float64 reference of the whole (unsharded) computation."""
from __future__ import annotations

import torch

T, K_LOCAL, H = 4, 16, 32  # tokens, each rank's share of the reduction dim, hidden
EPS = 1e-6


def inputs(world: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w [H, K_LOCAL * world], norm weight [H], x [T, K_LOCAL * world], residual [T, H]), the same on every rank."""
    gen = torch.Generator().manual_seed(0)
    w_full = (torch.randn(H, K_LOCAL * world, generator=gen) / K_LOCAL).to(dtype)
    norm_w = (torch.rand(H, generator=gen) + 0.5).to(dtype)
    x_full = torch.randn(T, K_LOCAL * world, generator=gen).to(dtype)
    residual = torch.randn(T, H, generator=gen).to(dtype)
    return w_full, norm_w, x_full, residual


def shard(rank: int) -> slice:
    """Rank `rank`'s columns of w and x (the reduction dimension)."""
    return slice(rank * K_LOCAL, (rank + 1) * K_LOCAL)


def reference(w_full: torch.Tensor, norm_w: torch.Tensor, x_full: torch.Tensor,
              residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + x @ w.T, its RMSNorm) in float64."""
    total = residual.double() + x_full.double() @ w_full.double().T
    return total, total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + EPS) * norm_w.double()
