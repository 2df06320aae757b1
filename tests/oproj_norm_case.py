"""The engine tests' case: a row-parallel out-projection, its all-reduce, the residual add and RMSNorm,
on seeded inputs, with the float64 reference of the whole (unsharded) computation; and what every engine's
ranks must report when their rule selections differ."""
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


def compile_refusal(exc: BaseException, seconds: float) -> dict:
    """What a rank reports when its compile raised: the ContextError in `exc`'s cause chain (else the last
    cause), as "Type: message", and how long the compile took."""
    cause = exc
    while cause.__cause__ is not None and type(cause).__name__ != "ContextError":
        cause = cause.__cause__
    return {"error": f"{type(cause).__name__}: {cause}", "seconds": seconds}


def check_rules_differ_refused(results: list[dict]) -> None:
    """Issue 48.2: with K3FUSE_RULES=-oproj_allreduce_residual on rank 1 alone, every rank raised one
    ContextError naming the setting and both ranks' values, within seconds (no rank waits in a collective)."""
    for r in results:
        assert r["error"] is not None and "ContextError: the ranks of TP group" in r["error"], r
        assert "K3FUSE_RULES: rank 0='', rank 1='-oproj_allreduce_residual'" in r["error"], r
        assert r["seconds"] < 120, r
