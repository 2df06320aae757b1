"""Timing decode steps the way METHOD.md asks: CUDA events over CUDA-graph replays, medians.

One graph holds several decode steps (rank start skew would otherwise pollute the collectives'
timings), inputs are refilled with fresh random values between replays (outside the timed
window), ranks meet at a barrier before each replay, and the caller reports the slower rank.
On CPU the same steps are timed with the host clock (a smoke test, not a measurement).
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def warm_up(steps: Callable[[], object], warmup: int = 2) -> None:
    """Run `steps` `warmup` times on a side stream (compiles, workspaces, side streams), as CUDA-graph
    capture asks, and wait for it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            steps()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def record(steps: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """`steps` captured in a CUDA graph (warmed up before: `warm_up`)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        steps()
    torch.cuda.synchronize()
    return graph


def capture(steps: Callable[[], object], warmup: int = 2) -> torch.cuda.CUDAGraph:
    """Warm `steps` up on a side stream, then capture it."""
    warm_up(steps, warmup)
    return record(steps)


def _check_collectives() -> None:
    """The post-step check of the fused collectives (k3fuse.check_collectives), when loaded."""
    import sys

    guard = sys.modules.get("k3fuse.kernels.collective_guard")
    if guard is not None:
        guard.check_collectives()


def time_graph(graph: torch.cuda.CUDAGraph, n_steps: int, replays: int,
               refill: Callable[[], None] | None = None) -> list[float]:
    """Microseconds per decode step of each timed replay (after 3 untimed ones)."""
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    per_step: list[float] = []
    for _ in range(replays):
        if refill is not None:
            refill()
        _barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        _check_collectives()   # a fused collective that failed in the replay raises (after the timing)
        per_step.append(start.elapsed_time(end) * 1e3 / n_steps)
    return per_step


def graph_replay_us(fn: Callable[[int], object], n_steps: int, replays: int = 30, warmup: int = 1,
                    refill: Callable[[], None] | None = None) -> float:
    """Median microseconds per step of one CUDA graph running fn(0), ..., fn(n_steps - 1).

    The steps are one pass over rotated weight copies (a GEMM benchmark: together they exceed the
    L2) or several decode steps (a collective: rank start skew amortised); `warmup` untimed passes
    on a side stream come first (compiles, workspaces), then `capture` and `time_graph` (ranks meet
    at a barrier before each replay when a process group of several ranks is initialised; the
    caller takes `slowest_rank`)."""
    def steps() -> None:
        for i in range(n_steps):
            fn(i)  # each output dropped at once, so the graph's pool reuses its memory

    graph = capture(steps, warmup=warmup)
    return median(time_graph(graph, n_steps, replays, refill))


def time_host(steps: Callable[[], object], n_steps: int, replays: int,
              refill: Callable[[], None] | None = None) -> list[float]:
    """Host-clock microseconds per step (CPU smoke runs)."""
    steps()
    per_step: list[float] = []
    for _ in range(replays):
        if refill is not None:
            refill()
        _barrier()
        t0 = time.perf_counter()
        steps()
        per_step.append((time.perf_counter() - t0) * 1e6 / n_steps)
    return per_step


def slowest_rank(value: float, device: torch.device) -> float:
    """The largest `value` over the ranks (the slower rank decides a collective step)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def _device_seconds(work: Callable[[], object], reps: int) -> float:
    """Median seconds of `work()` on the current stream (CUDA events, after one warm-up call)."""
    work()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        work()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def copy_seconds(src: torch.Tensor, dst: torch.Tensor, reps: int = 10) -> float:
    """Median seconds of `dst.copy_(src)` on the device (CUDA events, after one warm-up copy)."""
    return _device_seconds(lambda: dst.copy_(src), reps)


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write): a copy counts its bytes once, so a
    read-only kernel beats it; the floor is the nominal bandwidth (report.NOMINAL_HBM_BPS), not this."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device).random_()
    return 2 * src.numel() / copy_seconds(src, torch.empty_like(src), reps)


def read_bandwidth(device: torch.device, nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Bytes/s a read-only kernel streams (a sum over `nbytes` of fp32, median of `reps` after a warm-up):
    what the card gives a step that only reads, printed beside the floor."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    out = torch.empty((), dtype=torch.float32, device=device)
    return src.numel() * src.element_size() / _device_seconds(lambda: torch.sum(src, dim=0, out=out), reps)


__all__ = ["warm_up", "record", "capture", "time_graph", "graph_replay_us", "time_host", "slowest_rank", "median",
           "copy_seconds", "copy_bandwidth", "read_bandwidth"]
