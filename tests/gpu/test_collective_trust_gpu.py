"""Issue 48 on GPUs, the device paths of items 3 and 4, at world 1 on one GPU and at world 2 on two
(skipped, saying so, with fewer GPUs):

- test_a_device_timeout_under_graph_replay_stops_the_engine_step: a captured graph whose fused
  all-reduce times out on the device (world 1: its push left out of the capture; world 2: the peer
  stops replaying), replayed step after step as an engine does, with only the engines' adapters'
  post-step check after each step (k3fuse.engines.step_check.after_step, what vLLM's and SGLang's
  adapters run), never a check_collectives() of the user: a step raises within two steps, naming
  the op and the peer, and the NaN outputs are never taken as a result.
- test_a_failed_compile_raises_on_every_rank_naming_it: the last rank's compile of a new variant
  fails (injected in the CuTe compile); that rank raises, every peer raises at the start barrier
  within seconds (not the process group's timeout), naming that rank and its reason, and every
  later call of every rank raises.
- test_a_failed_allocation_raises_on_every_rank_naming_it: the same for the symmetric allocation of
  a new workspace (another token budget; injected out-of-memory): the peers raise at the
  allocation barrier.

Run (one H100/H200: the world-1 cases; two: all):
  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
      python -m pytest -m gpu -o addopts= -rA tests/gpu/test_collective_trust_gpu.py
"""
from __future__ import annotations

import time

import pytest
import torch

from ar_helpers import captured_rmsnorm_tail, check_stopped_rank_learns, spawn

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

H, K, MAX_T, EPS = 4096, 2048, 64, 1e-5
WORLDS = [pytest.param(1, id="world1"), pytest.param(2, id="world2")]


def _op(x, w, res, nw, group, world, max_tokens=MAX_T):
    return torch.ops.k3fuse.gemm_ar_residual_rmsnorm(x, w, res, None, nw, EPS, group, world, max_tokens)


def _weights(dev, rank, dist):
    g = torch.Generator(device=dev).manual_seed(5 + rank)
    w = torch.randn(H, K, device=dev, dtype=torch.bfloat16, generator=g) / K ** 0.5
    nw = torch.randn(H, device=dev, dtype=torch.bfloat16)
    dist.broadcast(nw, 0)
    return w, nw


# --- item 3: a device timeout under graph replay, surfaced by the engines' step check ----------------
def _replay_steps(rank, world):
    import torch.distributed as dist

    import k3fuse.kernels  # noqa: F401
    from k3fuse import runtime
    from k3fuse.engines import step_check
    from k3fuse.kernels import dispatch

    graph, summed = captured_rmsnorm_tail(rank, world, H, EPS, MAX_T)
    runtime.reset_stats()
    def engine_step() -> None:
        """What an engine's worker does per step: replay, read the step's result back (the sampled
        tokens), then the adapters' post-step check."""
        graph.replay()
        summed[0, 0].item()
        step_check.after_step()

    if world > 1:    # healthy steps first
        for _ in range(10):
            engine_step()
        assert torch.isfinite(summed.float()).all()
        dist.barrier()
    stopped = world > 1 and rank == world - 1   # world 2: this rank stops stepping
    raised, steps = None, 0
    t0 = time.perf_counter()
    if not stopped:
        for steps in range(1, 4):
            try:
                engine_step()
            except dispatch.K3FuseCollectiveError as exc:
                raised = str(exc)
                break
        assert raised is not None and steps <= 2, f"rank {rank}: no step raised ({steps} steps)"
        assert "allreduce_rmsnorm" in raised and "timed out" in raised and "peer rank" in raised, raised
        assert torch.isnan(summed.float()).all()
        assert runtime.collective_errors(), runtime.stats()
        assert time.perf_counter() - t0 < 30
    check_stopped_rank_learns(world, stopped, step_check.after_step)


@pytest.mark.parametrize("world", WORLDS)
def test_a_device_timeout_under_graph_replay_stops_the_engine_step(world):
    spawn(_replay_steps, world, K3FUSE_AR_TIMEOUT_S="0.5")


# --- item 4: a failed compile or allocation on one rank ----------------------------------------------
def _start_up_failure(rank, world, what):
    import torch.distributed as dist

    import k3fuse.kernels  # noqa: F401
    from k3fuse.kernels import dispatch
    from k3fuse.kernels.lib.cute import compat

    dev = torch.device("cuda", rank)
    group = dist.group.WORLD.group_name
    w, nw = _weights(dev, rank, dist)
    x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
    res = torch.randn(1, H, device=dev, dtype=torch.bfloat16)
    _op(x, w, res, nw, group, world)          # healthy: the group's state, its board, a workspace
    torch.cuda.synchronize()
    dist.barrier()
    failing = rank == world - 1
    max_tokens = MAX_T
    if what == "compile":   # a new variant (2 tokens, the GEMV push): its kernels compile on first use
        x = torch.randn(2, K, device=dev, dtype=torch.bfloat16)
        res = torch.randn(2, H, device=dev, dtype=torch.bfloat16)
        if failing:
            built = compat.compiled

            def compiled(key, build, *a, **k):
                if key not in compat._cache:
                    raise RuntimeError("injected compile failure")
                return built(key, build, *a, **k)
            compat.compiled = compiled
    else:                    # a new workspace (another token budget): its symmetric allocation
        max_tokens = MAX_T // 2
        if failing:
            from torch.distributed import _symmetric_memory as symm_mem

            def empty(*a, **k):
                raise torch.cuda.OutOfMemoryError("injected allocation failure")
            symm_mem.empty = empty
    injected = f"injected {what} failure"
    t0 = time.perf_counter()
    with pytest.raises(dispatch.K3FuseCollectiveError) as first:
        _op(x, w, res, nw, group, world, max_tokens)
        torch.cuda.synchronize()
    took = time.perf_counter() - t0
    assert injected in str(first.value), str(first.value)
    if not failing:
        assert f"peer rank {world - 1}" in str(first.value), str(first.value)
        assert took < 30, f"rank {rank}: {took:.1f} s (the process group's timeout?)"
    for _ in range(2):       # the group stays failed on every rank
        with pytest.raises(dispatch.K3FuseCollectiveError, match=injected):
            _op(x, w, res, nw, group, world, max_tokens)
    print(f"rank {rank}: {what} failure on rank {world - 1} raised here after {took:.2f} s", flush=True)


@pytest.mark.parametrize("world", WORLDS)
def test_a_failed_compile_raises_on_every_rank_naming_it(world):
    spawn(_start_up_failure, world, ("compile",), K3FUSE_AR_TIMEOUT_S="2")


@pytest.mark.parametrize("world", WORLDS)
def test_a_failed_allocation_raises_on_every_rank_naming_it(world):
    spawn(_start_up_failure, world, ("allocation",), K3FUSE_AR_TIMEOUT_S="2")
