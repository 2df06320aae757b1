"""k3fuse.dist.launch: results come back in rank order, failures name their rank, nothing hangs."""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from k3fuse.dist import (LaunchTimeout, ProcessGroupMissing, RankFailedError, launch, pick_backend,
                         require_group, shared_values)


def _collective_worker(rank: int, world_size: int, scale: float) -> dict:
    t = torch.full((3,), float(rank + 1)) * scale
    dist.all_reduce(t)
    return {"rank": rank, "world": world_size, "sum": t, "backend": dist.get_backend(),
            "nvls": os.environ.get("NCCL_NVLS_ENABLE"),
            "multicast": os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST")}


def _sharing_worker(rank: int, world_size: int) -> tuple[list[str], list[str]]:
    """Ranks 0 and 2 hold "gpu0", rank 1 "gpu1": one shared value; then every value distinct."""
    return shared_values(None, ("host", "gpu0" if rank != 1 else "gpu1")), shared_values(None, rank)


def _failing_worker(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError(f"boom on rank {rank}")
    return rank


def _dying_worker(rank: int, world_size: int) -> None:
    os._exit(3)


def _sleeping_worker(rank: int, world_size: int) -> None:
    time.sleep(120)


@pytest.mark.slow
def test_launch_returns_results_in_rank_order(monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    results = launch(_collective_worker, 2, args=(2.0,), timeout_s=120)
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert r["world"] == 2 and r["backend"] == "gloo"
        assert torch.equal(r["sum"], torch.full((3,), 6.0))  # (1 + 2) * 2
        assert (r["nvls"], r["multicast"]) == ("0", "1")


@pytest.mark.slow
def test_shared_values_names_the_ranks_that_share_one():
    results = launch(_sharing_worker, 3, backend="gloo", timeout_s=120)
    assert results == [(["('host', 'gpu0'): ranks 0, 2"], [])] * 3   # the same answer on every rank


@pytest.mark.slow
def test_launch_propagates_a_rank_exception_with_traceback():
    with pytest.raises(RankFailedError) as info:
        launch(_failing_worker, 2, timeout_s=120)
    err = info.value
    assert err.rank == 1 and err.exc_type == "ValueError"
    assert "boom on rank 1" in str(err) and "_failing_worker" in err.remote_traceback


@pytest.mark.slow
def test_launch_reports_a_rank_that_dies_without_result():
    with pytest.raises(RankFailedError, match="exit code 3"):
        launch(_dying_worker, 1, timeout_s=120)


@pytest.mark.slow
def test_launch_times_out_instead_of_hanging():
    start = time.monotonic()
    with pytest.raises(LaunchTimeout, match="did not finish within 5"):
        launch(_sleeping_worker, 1, timeout_s=5)
    assert time.monotonic() - start < 30


@pytest.mark.parametrize("world_size", [0, -1, 1.5, True])
def test_launch_rejects_bad_world_size(world_size):
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        launch(_failing_worker, world_size)


def test_launch_rejects_bad_backend_and_timeout():
    with pytest.raises(ValueError, match="unknown backend 'mpi-ish'"):
        launch(_failing_worker, 1, backend="mpi-ish")
    with pytest.raises(ValueError, match="timeout_s must be positive"):
        launch(_failing_worker, 1, timeout_s=0)


def test_nccl_needs_a_gpu_per_rank():
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises((RuntimeError, ValueError), match="nccl"):
        pick_backend(n_gpu + 1, "nccl")


def test_auto_backend_is_gloo_without_enough_gpus():
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert pick_backend(n_gpu + 1) == "gloo"


def test_require_group_without_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this test process")
    with pytest.raises(ProcessGroupMissing, match="init_process_group"):
        require_group()


def test_launch_rejects_unpicklable_fn_before_spawning():
    with pytest.raises(TypeError, match="picklable"):
        launch(lambda rank, world_size: rank, 1)
