"""Multi-rank launcher: run a function on N local ranks with a process group, get results back.

Gloo on CPU, NCCL when there is a GPU per rank. Children are spawned (never forked, so CUDA and
threads are safe), join a process group on 127.0.0.1 and send back a pickled result or their
traceback. A failing rank raises `RankFailedError` naming the rank; a run past `timeout_s` kills
every child and raises `LaunchTimeout`, so a deadlocked collective never hangs a test.
"""
from __future__ import annotations

import multiprocessing as mp
import multiprocessing.util as mp_util
import os
import pickle
import queue as queue_module
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

#: NVLink multicast off in NCCL, torch symmetric memory and NVSHMEM (it can take a host's shared GPUs
#: down): set by the people running the GPUs, exported by the benches and GPU tests, never unset
MULTICAST_OFF = {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1"}
# children inherit these from the parent's environment
_PRESERVED_ENV = tuple(MULTICAST_OFF)
_HOST = "127.0.0.1"


class ProcessGroupMissing(RuntimeError):
    """A tensor-parallel path was asked for but torch.distributed has no process group."""


class RankFailedError(RuntimeError):
    """A rank raised; carries the rank and the traceback text from the child."""

    def __init__(self, rank: int, exc_type: str, message: str, remote_traceback: str):
        self.rank = rank
        self.exc_type = exc_type
        self.remote_traceback = remote_traceback
        super().__init__(f"rank {rank} failed with {exc_type}: {message}\n"
                         f"--- traceback on rank {rank} ---\n{remote_traceback}")


class LaunchTimeout(TimeoutError):
    """The ranks did not all finish within timeout_s; they were killed."""


def require_group(group: dist.ProcessGroup | None = None) -> dist.ProcessGroup:
    """The process group to use (`group`, else WORLD); a clear error when there is none."""
    if not dist.is_available():
        raise ProcessGroupMissing("torch.distributed is not available in this torch build")
    if not dist.is_initialized():
        raise ProcessGroupMissing(
            "tensor parallelism needs an initialised process group: call "
            "torch.distributed.init_process_group(...) first or run under k3fuse.dist.launch")
    return dist.group.WORLD if group is None else group


def disagreements(group: dist.ProcessGroup | None, mine: dict[str, object]) -> list[str]:
    """What the ranks of `group` disagree on, as "key: rank 0=a, rank 1=b" lines ([] when all agree).

    Collective (all_gather_object): every rank must call it, and every rank gets the same answer, so
    every rank can raise the same error instead of one rank hanging in a later collective."""
    world = dist.get_world_size(group)
    if world == 1:
        return []
    items = sorted((k, repr(v)) for k, v in mine.items())
    got: list = [None] * world
    dist.all_gather_object(got, items, group=group)
    if all(g == got[0] for g in got):
        return []
    diffs = []
    for key in sorted({k for g in got for k, _ in g}):
        vals = {r: dict(g).get(key) for r, g in enumerate(got)}
        if len(set(vals.values())) > 1:
            diffs.append(f"{key}: " + ", ".join(f"rank {r}={v}" for r, v in vals.items()))
    return diffs


def shared_values(group: dist.ProcessGroup | None, mine: object) -> list[str]:
    """The values several ranks of `group` hold, as "value: ranks 0, 1" lines ([] when all differ).

    Collective like `disagreements`: every rank gets the same answer and can raise the same error
    (e.g. two ranks of a TP group on one GPU, which symmetric memory cannot serve)."""
    world = dist.get_world_size(group)
    if world == 1:
        return []
    got: list = [None] * world
    dist.all_gather_object(got, repr(mine), group=group)
    ranks: dict[str, list[int]] = {}
    for r, v in enumerate(got):
        ranks.setdefault(v, []).append(r)
    return [f"{v}: ranks {', '.join(map(str, rs))}" for v, rs in ranks.items() if len(rs) > 1]


def pick_backend(world_size: int, backend: str | None = None) -> str:
    """nccl when CUDA has a GPU per rank, else gloo; validates an explicit choice."""
    if backend is None:
        if torch.cuda.is_available() and torch.cuda.device_count() >= world_size and dist.is_nccl_available():
            return "nccl"
        backend = "gloo"
    if backend == "gloo":
        if not dist.is_gloo_available():
            raise RuntimeError("backend 'gloo' is not available in this torch build")
    elif backend == "nccl":
        if not dist.is_nccl_available():
            raise RuntimeError("backend 'nccl' is not available in this torch build")
        n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if world_size > n_gpu:
            raise ValueError(f"backend 'nccl' needs one GPU per rank: world_size={world_size} "
                             f"but {n_gpu} CUDA device(s) are visible")
    else:
        raise ValueError(f"unknown backend {backend!r}; use 'gloo', 'nccl' or None (auto)")
    return backend


def _child(fn: Callable, rank: int, world_size: int, backend: str, port: int, args: tuple,
           timeout_s: float, env: dict[str, str], results: Any) -> None:
    for key, value in env.items():
        os.environ.setdefault(key, value)
    os.environ.update(MASTER_ADDR=_HOST, MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        elif "OMP_NUM_THREADS" not in os.environ:
            # CPU ranks share the cores: oversubscribed OpenMP spin-waits make them crawl
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(_HOST, port, world_size, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
        result = fn(rank, world_size, *args)
        payload = ("ok", pickle.dumps(result))
        # after a success only: destroy_process_group flushes pending work and can block on a peer
        # that is stuck in a collective, so a failed rank reports at once (the parent kills the rest)
        dist.destroy_process_group()
    except BaseException as exc:  # report everything, including SystemExit from the fn
        payload = ("err", (type(exc).__name__, str(exc), traceback.format_exc()))
    results.put((rank,) + payload)
    # Hand the result over, then skip the interpreter teardown (seconds with torch loaded).
    results.close()
    results.join_thread()
    # os._exit skips multiprocessing's exit hook: run its finalizers here, or the semaphores this rank
    # made (tqdm's lock inside torch.fx's Interpreter) outlive it and the parent warns of leaks
    mp_util._run_finalizers(0)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch(fn: Callable[..., Any], world_size: int, *, backend: str | None = None,
           args: tuple = (), timeout_s: float = 300) -> list[Any]:
    """Run fn(rank, world_size, *args) on `world_size` spawned ranks; results in rank order.

    `fn` and `args` must be picklable (a module-level function; a calling script needs the usual
    `if __name__ == "__main__":` guard). Each rank's return value is pickled with the standard
    pickler (tensors travel by value, not shared memory, so a rank may exit before the parent
    reads it). After reporting, a rank leaves with os._exit (its atexit handlers do not run) to
    skip seconds of interpreter teardown. CPU ranks get cpu_count // world_size threads unless
    OMP_NUM_THREADS is set.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {fn!r}")
    backend = pick_backend(world_size, backend)
    try:
        pickle.dumps((fn, args))
    except Exception as exc:
        raise TypeError(f"launch needs a picklable fn and args (a module-level function, plain "
                        f"values): {exc}") from exc
    env = {k: os.environ[k] for k in _PRESERVED_ENV if k in os.environ}
    # The parent hosts the rendezvous store on a port the OS picks, so concurrent launches
    # never race for a port and the store outlives any rank.
    store = dist.TCPStore(_HOST, 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_child, name=f"k3fuse-rank{rank}", daemon=True,
                         args=(fn, rank, world_size, backend, store.port, args, timeout_s, env,
                               results))
             for rank in range(world_size)]
    deadline = time.monotonic() + timeout_s
    done: dict[int, Any] = {}
    try:
        for p in procs:
            p.start()
        while len(done) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(done))
                raise LaunchTimeout(f"ranks {missing} of {world_size} did not finish within "
                                    f"{timeout_s}s (backend {backend}); all ranks were killed")
            try:
                rank, status, payload = results.get(timeout=min(0.2, remaining))
            except queue_module.Empty:
                for rank, p in enumerate(procs):
                    # a rank that died without reporting (segfault, os._exit, OOM kill)
                    if rank not in done and p.exitcode is not None and results.empty():
                        time.sleep(0.5)  # its report may still be in the pipe
                        if results.empty():
                            raise RankFailedError(rank, "ProcessDied",
                                                  f"exit code {p.exitcode} without a result",
                                                  "(no traceback: the process died)")
                continue
            if status == "err":
                exc_type, message, tb = payload
                raise RankFailedError(rank, exc_type, message, tb)
            done[rank] = pickle.loads(payload)
    finally:
        for p in procs:
            if p.pid is None:  # never started
                continue
            p.join(timeout=5 if len(done) == world_size else 0)
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
        del store
    return [done[r] for r in range(world_size)]
