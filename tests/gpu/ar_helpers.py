"""What the GPU tests of the fused collective ops share: multicast kept off, ranks started with
k3fuse.dist.launch (one GPU each), the token sweep and NaN-poisoned allocations."""
from __future__ import annotations

import os

import pytest
import torch

from k3fuse.dist import MULTICAST_OFF, RankFailedError, launch


def token_sweep(max_tokens: int) -> list[int]:
    """The token counts a fused all-reduce test sweeps: K3FUSE_TEST_AR_TOKENS (e.g. 1,2,64) if set,
    else every count 1..max_tokens."""
    return [int(t) for t in os.environ.get("K3FUSE_TEST_AR_TOKENS", "").split(",") if t.strip()] \
        or list(range(1, max_tokens + 1))


def poison(shape, dtype, device) -> None:
    """Fill a block with NaN and free it: the caching allocator hands it to the next same-size
    allocation, so an output element the kernel does not write stays NaN."""
    t = torch.empty(shape, dtype=dtype, device=device)
    t.fill_(float("nan"))
    del t


def spawn(fn, world: int, args: tuple = (), **env: str) -> None:
    """fn(rank, world, *args) on `world` GPUs (k3fuse.dist.launch, NCCL), with `env` and multicast
    off in the ranks' environment (K3FUSE_AR_PROTOCOL defaults to lamport). World 1 runs on one GPU:
    the push lands in the rank's own buffer, which exercises the kernels and the protocol words
    without a peer. Skips when fewer GPUs are visible; a failing rank fails the test with its
    traceback."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs")
    with pytest.MonkeyPatch.context() as mp:
        for key, value in {**MULTICAST_OFF, "K3FUSE_AR_PROTOCOL": "lamport", **env}.items():
            mp.setenv(key, value)
        try:
            launch(fn, world, backend="nccl", args=args, timeout_s=900)
        except RankFailedError as exc:
            pytest.fail(f"worker failed:\n{exc}")


def captured_rmsnorm_tail(rank: int, world: int, H: int, eps: float, max_tokens: int):
    """allreduce_rmsnorm over 2 tokens of width H on the WORLD group, warmed up and captured in a CUDA
    graph, ranks met after each; returns (graph, summed output). At world 1 the push is left out of
    the graph, so its epilogue waits for a push that never comes (a missing peer with one GPU)."""
    import torch.distributed as dist

    from k3fuse.kernels.lib.triton import lamport_push

    dev = torch.device("cuda", rank)
    group = dist.group.WORLD.group_name
    nw = torch.ones(H, device=dev, dtype=torch.bfloat16)
    x = torch.randn(2, H, device=dev, dtype=torch.bfloat16)
    torch.ops.k3fuse.allreduce_rmsnorm(x, nw, eps, group, world, max_tokens)   # warm-up before capture
    torch.cuda.synchronize()
    dist.barrier()
    if world == 1:
        lamport_push.run = lambda *a, **k: None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        summed, _ = torch.ops.k3fuse.allreduce_rmsnorm(x, nw, eps, group, world, max_tokens)
    torch.cuda.synchronize()
    dist.barrier()
    return graph, summed


def check_stopped_rank_learns(world: int, stopped: bool, check) -> None:
    """After a rank stopped stepping (world 2): the ranks meet, and the stopped one's next post-step
    `check` raises K3FuseCollectiveError naming rank 0, whose collective timed out without it."""
    import torch.distributed as dist

    from k3fuse.kernels import dispatch

    if world > 1:
        dist.barrier()
        if stopped:
            with pytest.raises(dispatch.K3FuseCollectiveError, match="rank 0"):
                check()
