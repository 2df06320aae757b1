"""Side-stream fork/join for the shared expert, safe under CUDA-graph capture.

`launch(site, ...)` runs a computation on a per-device side stream: an event recorded on the
current (main) stream orders it after everything already queued there, a second event marks its
end. `join(site)` makes the current stream wait on that end event and hands back the output.
Only events are used, never host synchronisation, so a capture records the fork/join edges as graph
dependencies. Cross-stream lifetimes use `record_stream`: inputs (allocated on main, read on the
side) are recorded on the side stream, the output (allocated on the side, used on main) on main.
In a compiled graph the join also takes what the fork read (shared_expert_join's `reads`), so the
graph's own buffer planning (Inductor's reuse) keeps them alive until the join as well.

Slots are keyed by (device, site): one in-flight shared-expert computation per site. A fork
replaces its site's slot; a join reads it (and may read it again until the next fork). On CPU
`launch` runs synchronously. Collectives never go on the side stream (see docs/architecture.md).
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass
class _Slot:
    output: torch.Tensor
    producer: str                                # implementation name, for the join's count
    done: "torch.cuda.Event | None" = None       # None: computed synchronously


_lock = threading.Lock()
_side_streams: dict[int, "torch.cuda.Stream"] = {}
_fork_events: dict[tuple[int, int], "torch.cuda.Event"] = {}
_done_events: dict[tuple[int, int], "torch.cuda.Event"] = {}
_slots: dict[tuple[str, int], _Slot] = {}


def _device_key(device: torch.device) -> str:
    return str(device)


def side_stream(device: torch.device | int | None = None) -> "torch.cuda.Stream":
    """The side stream of a CUDA device, created on first use (call `prepare` before capture)."""
    index = torch.cuda._utils._get_device_index(device, optional=True)
    with _lock:
        stream = _side_streams.get(index)
        if stream is None:
            stream = torch.cuda.Stream(device=index)
            _side_streams[index] = stream
        return stream


def prepare(device: torch.device | int | None = None, sites: Sequence[int] = ()) -> None:
    """Create the side stream and the sites' events now, outside any CUDA-graph capture."""
    index = torch.cuda._utils._get_device_index(device, optional=True)
    side_stream(index)
    for site in sites:
        _events(index, site)


def _events(index: int, site: int) -> tuple["torch.cuda.Event", "torch.cuda.Event"]:
    key = (index, site)
    with _lock:
        if key not in _fork_events:
            _fork_events[key] = torch.cuda.Event()
            _done_events[key] = torch.cuda.Event()
        return _fork_events[key], _done_events[key]


def launch(site: int, inputs: Sequence[torch.Tensor | None], compute: Callable[[], torch.Tensor],
           producer: str) -> None:
    """Run `compute()` for `site` off the current stream (CUDA) or right now (CPU).

    `inputs` are the tensors `compute` reads (activation and weights); on CUDA they are recorded
    on the side stream so the caching allocator does not hand their memory out early.
    """
    tensors = [t for t in inputs if t is not None]
    device = tensors[0].device
    if device.type != "cuda":
        store(site, device, compute(), producer)
        return
    main = torch.cuda.current_stream(device)
    side = side_stream(device)
    fork_event, done_event = _events(device.index, site)
    fork_event.record(main)
    side.wait_event(fork_event)
    with torch.cuda.stream(side):
        output = compute()
        done_event.record(side)
    for t in tensors:
        t.record_stream(side)
    with _lock:
        _slots[(_device_key(device), site)] = _Slot(output, producer, done_event)


def store(site: int, device: torch.device, output: torch.Tensor, producer: str) -> None:
    """Publish an output computed synchronously on the current stream (CPU, or the stock path)."""
    with _lock:
        _slots[(_device_key(device), site)] = _Slot(output, producer, None)


def join(site: int, device: torch.device) -> tuple[torch.Tensor, str]:
    """Order the current stream after `site`'s side work; return (output, producer)."""
    with _lock:
        slot = _slots.get((_device_key(device), site))
    if slot is None:
        raise RuntimeError(f"k3fuse shared_expert_join(site={site}) on {device}: no fork for this "
                           "site ran before the join")
    if slot.done is not None:
        main = torch.cuda.current_stream(device)
        main.wait_event(slot.done)
        slot.output.record_stream(main)
    return slot.output, slot.producer


def clear() -> None:
    """Drop every slot (tests; frees the last outputs)."""
    with _lock:
        _slots.clear()
