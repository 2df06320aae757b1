"""The engine tests' case: a row-parallel out-projection, its all-reduce, the residual add and RMSNorm,
on seeded inputs, with the float64 reference of the whole (unsharded) computation; and what every engine's
ranks must report when their rule selections differ; and a device timeout injected into the fused op."""
from __future__ import annotations

from typing import Callable

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
    """With K3FUSE_RULES=-oproj_allreduce_residual on rank 1 alone, every rank raised one
    ContextError naming the setting and both ranks' values, within seconds (no rank waits in a collective)."""
    for r in results:
        assert r["error"] is not None and "ContextError: the ranks of TP group" in r["error"], r
        assert "K3FUSE_RULES: rank 0='', rank 1='-oproj_allreduce_residual'" in r["error"], r
        assert r["seconds"] < 120, r


def inject_device_timeout(rank: int, fails: Callable[[torch.Tensor], bool], reason: str) -> None:
    """Register a CPU implementation of k3fuse.gemm_ar_residual_rmsnorm that, in a call where `fails(weight)`
    (asked on every rank alike), pairs the sum and then fails on rank 1 as a timed-out kernel does under a
    replayed graph: recorded for the group with `reason`, NaN outputs, no exception."""
    from k3fuse.kernels import collective_guard, dispatch
    from k3fuse.kernels.lib.reference import allreduce

    def run(x, weight, residual, addend, norm_weight, eps, group_name, world_size, max_tokens=64, **_):
        out, normed = allreduce.gemm_ar_residual_rmsnorm(x, weight, residual, addend, norm_weight, eps, group_name,
                                                         world_size)
        if not fails(weight):
            return out, normed
        if rank == 1:   # recorded once the sum paired, so only the post-step checks can see it in this step
            collective_guard.fail(group_name, "gemm_ar_residual_rmsnorm",
                                  f"k3fuse.gemm_ar_residual_rmsnorm: rank 1 of group {group_name!r}: {reason}",
                                  "timeout")
        # both ranks wait here until it is recorded: a device's error words are set before any later check
        # reads them, and without this rank 0's check could run first (a race, not the behaviour under test)
        torch.distributed.barrier()
        if rank == 1:
            return torch.full_like(out, float("nan")), torch.full_like(normed, float("nan"))
        return out, normed

    dispatch.register_impl("gemm_ar_residual_rmsnorm", dispatch.Impl("test.device_timeout", lambda spec: None, run,
                                                                      priority=10_000, device_types=("cpu",)))
