"""Which kernels one decode step launches, how long each runs, and on which stream.

The profiler watches one replay of the multi-step CUDA graph (CUPTI reports the graph's kernels
one by one), so the numbers are those of the timed path. Kernels per step = kernels seen / steps;
the timeline keeps one step (the middle one) with start offsets, for the layer figure.
"""
from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

_NOT_KERNELS = re.compile(r"^(Memcpy|Memset|cudaMemcpy|cudaMemset)", re.I)

#: kernel-name families for the timeline's colours and the per-kind totals
KINDS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("collective", re.compile(r"nccl|oneshot|lamport|allreduce|all_reduce", re.I)),
    ("gemm", re.compile(r"gemv|splitk|gemm|xmma|cutlass|cublas|nvjet|sm90|grouped|mm_", re.I)),
    ("routing", re.compile(r"topk|sort|gatherTopK|radix", re.I)),
    ("prefetch", re.compile(r"prefetch", re.I)),
    ("pointwise", re.compile(r"triton|elementwise|reduce|vectorized|copy|cat|index", re.I)),
)


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return "other"


@dataclass(frozen=True)
class KernelEvent:
    name: str
    stream: int
    start_us: float
    dur_us: float

    @property
    def kind(self) -> str:
        return kind_of(self.name)


def kernel_events(prof: torch.profiler.profile) -> list[KernelEvent]:
    out: list[KernelEvent] = []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA or _NOT_KERNELS.match(e.name):
            continue
        stream = getattr(e, "device_resource_id", None)  # the CUDA stream of a kernel event
        out.append(KernelEvent(e.name, int(stream if stream is not None else e.thread), float(e.time_range.start),
                               float(e.time_range.end - e.time_range.start)))
    return sorted(out, key=lambda k: k.start_us)


def side_stream_overlap(kernels: list[KernelEvent]) -> dict[str, float]:
    """How much side-stream kernel time ran while the main stream (the busiest one) was busy too.

    Evidence for the shared-expert offload: overlapped µs and the share of side-stream time."""
    busiest: dict[int, float] = defaultdict(float)
    for k in kernels:
        busiest[k.stream] += k.dur_us
    if len(busiest) < 2:
        return {"side_us": 0.0, "overlapped_us": 0.0, "share": 0.0}
    main = max(busiest, key=busiest.__getitem__)
    spans: list[list[float]] = []
    for k in sorted((k for k in kernels if k.stream == main), key=lambda k: k.start_us):
        if spans and k.start_us <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], k.start_us + k.dur_us)
        else:
            spans.append([k.start_us, k.start_us + k.dur_us])
    side = overlapped = 0.0
    for k in kernels:
        if k.stream == main:
            continue
        side += k.dur_us
        end = k.start_us + k.dur_us
        overlapped += sum(max(0.0, min(end, b) - max(k.start_us, a)) for a, b in spans)
    return {"side_us": side, "overlapped_us": overlapped, "share": overlapped / side if side else 0.0}


def concurrency(kernels: list[KernelEvent]) -> dict[str, float]:
    """Kernel time that ran alongside other kernels, whatever streams the profiler names.

    busy = the summed kernel durations, wall = the time at least one kernel ran (union of the
    intervals), concurrent = busy - wall. Stream ids of kernels replayed from a CUDA graph are the
    graph executor's own (one per step and branch, changing between steps), so "the busiest stream
    is the main one" can misread a replay; this measure needs no stream ids. Without a fork it is 0."""
    busy = sum(k.dur_us for k in kernels)
    wall = 0.0
    end = float("-inf")
    for k in sorted(kernels, key=lambda k: k.start_us):
        stop = k.start_us + k.dur_us
        if stop > end:
            wall += stop - max(k.start_us, end)
            end = stop
    return {"busy_us": busy, "wall_us": wall, "concurrent_us": busy - wall}


def profile_steps(run: Callable[[], object], n_steps: int) -> dict[str, Any]:
    """Profile one call of `run` (a graph replay of `n_steps` decode steps, or the eager steps).

    Returns kernels per step, device µs per step by kernel name and by kind, and the middle
    step's timeline [{name, kind, stream, start_us, dur_us}] with start relative to that step.
    """
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    kernels = kernel_events(prof)
    per_step = len(kernels) / n_steps if n_steps else 0.0
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    by_kind: dict[str, float] = defaultdict(float)
    for k in kernels:
        by_name[k.name][0] += 1
        by_name[k.name][1] += k.dur_us
        by_kind[k.kind] += k.dur_us
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])
    timeline: list[dict[str, Any]] = []
    if kernels and per_step >= 1:
        n = round(per_step)
        mid = kernels[(n_steps // 2) * n:(n_steps // 2 + 1) * n]
        t0 = mid[0].start_us if mid else 0.0
        timeline = [dict(asdict(k), start_us=k.start_us - t0, kind=k.kind) for k in mid]
    return {
        "kernels_per_step": per_step,
        "device_us_per_step": sum(k.dur_us for k in kernels) / max(n_steps, 1),
        "by_kind_us_per_step": {k: v / max(n_steps, 1) for k, v in sorted(by_kind.items())},
        "top_kernels": [{"name": name, "calls_per_step": c / max(n_steps, 1), "us_per_step": us / max(n_steps, 1)}
                        for name, (c, us) in top[:25]],
        "timeline": timeline,
        "side_stream": {k: v / max(n_steps, 1) if k != "share" else v
                        for k, v in side_stream_overlap(kernels).items()},
        "concurrency": {k: v / max(n_steps, 1) for k, v in concurrency(kernels).items()},
    }


__all__ = ["profile_steps", "kind_of", "kernel_events", "concurrency", "side_stream_overlap", "KernelEvent", "KINDS"]
