"""The side stream of a bracketed graph region (the shared expert), safe under CUDA-graph capture.

The graph's own nodes run on the side stream between the fork and the end markers
(kernels/ops/shared_expert.py); the join orders the main stream after them:

* `fork(site, x)`: an event recorded on the current (main) stream, waited on by the side stream; the
  side stream becomes current, so every kernel the region's nodes launch goes there; x, allocated
  on the main stream and read on the side, is recorded on the side stream (the caching allocator
  keeps its memory until the side stream's work on it is done).
* `end(site)`: an event recorded on the side stream marks the region's end; the stream the fork
  found becomes current again (a capture stream under CUDA-graph capture, not the default one).
* `join(site, y)`: the current stream waits on that event; y, allocated on the side stream and read
  on the main one, is recorded on it.
Only events, never host synchronisation, so a capture records the fork and join edges as graph
dependencies. A site's events are its own (one per layer), and created by `prepare` before a
capture. On CPU, and on the stock path, nothing switches: `end` and `join` then do nothing but
report who ran the fork. Collectives never run on the side stream (the region ends before them).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

_lock = threading.Lock()
_side_streams: dict[int, "torch.cuda.Stream"] = {}
_events: dict[tuple[int, int], tuple["torch.cuda.Event", "torch.cuda.Event"]] = {}


@dataclass
class _Window:
    producer: str  # which implementation ran the fork, for the join's count
    caller: "torch.cuda.Stream | None" = None  # the stream the fork switched away from (None: no switch)
    done: "torch.cuda.Event | None" = None  # recorded by `end` on the side stream


_windows: dict[tuple[str, int], _Window] = {}


def side_stream(device: torch.device | int | None = None) -> "torch.cuda.Stream":
    """The side stream of a CUDA device, created on first use (call `prepare` before capture)."""
    index = torch.cuda._utils._get_device_index(device, optional=True)
    with _lock:
        stream = _side_streams.get(index)
        if stream is None:
            stream = torch.cuda.Stream(device=index)
            _side_streams[index] = stream
        return stream


def _site_events(index: int, site: int) -> tuple["torch.cuda.Event", "torch.cuda.Event"]:
    key = (index, site)
    with _lock:
        if key not in _events:
            _events[key] = (torch.cuda.Event(), torch.cuda.Event())
        return _events[key]


def prepare(device: torch.device | int | None = None, sites: tuple[int, ...] = ()) -> None:
    """Create the side stream and the sites' events now, outside any CUDA-graph capture."""
    index = torch.cuda._utils._get_device_index(device, optional=True)
    side_stream(index)
    for site in sites:
        _site_events(index, site)


def fork(site: int, x: torch.Tensor, producer: str) -> None:
    """Open `site`'s window on x's CUDA device: the side stream waits for the main stream's work so
    far and becomes current."""
    device = x.device
    side = side_stream(device)
    caller = _stranded_caller(device) or torch.cuda.current_stream(device)
    forked, _ = _site_events(device.index, site)
    forked.record(caller)
    side.wait_event(forked)
    torch.cuda.set_stream(side)
    x.record_stream(side)
    with _lock:
        _windows[(str(device), site)] = _Window(producer, caller)


def _stranded_caller(device: torch.device) -> "torch.cuda.Stream | None":
    """The caller of a window an error left open on `device` (its end never ran, so the side stream
    is still current), forgotten here: a new fork starts from that caller."""
    with _lock:
        for key, window in list(_windows.items()):
            if key[0] == str(device) and window.caller is not None and window.done is None:
                del _windows[key]
                return window.caller
    return None


def fork_inline(site: int, device: torch.device, producer: str) -> None:
    """A fork that switches nothing (CPU, stock): the region runs where the graph runs."""
    with _lock:
        _windows[(str(device), site)] = _Window(producer)


def end(site: int, device: torch.device) -> None:
    """Close `site`'s window: mark the side stream's progress and make the fork's caller current."""
    with _lock:
        window = _windows.get((str(device), site))
    if window is None or window.caller is None or window.done is not None:
        return
    _, done = _site_events(device.index, site)
    done.record(side_stream(device))
    torch.cuda.set_stream(window.caller)
    window.done = done


def join(site: int, y: torch.Tensor) -> str:
    """Order the current stream after `site`'s window (y is its region's output); returns who ran
    the fork. Raises when no fork of this site ran on y's device."""
    with _lock:
        window = _windows.get((str(y.device), site))
    if window is None:
        raise RuntimeError(f"k3fuse shared_expert_join(site={site}) on {y.device}: no fork for this site ran "
                           "before the join")
    if window.done is not None:
        main = torch.cuda.current_stream(y.device)
        main.wait_event(window.done)
        y.record_stream(main)
    return window.producer


def clear() -> None:
    """Forget every window (tests). A window still open (a fork without its end) stays on the side stream."""
    with _lock:
        _windows.clear()


__all__ = ["side_stream", "prepare", "fork", "fork_inline", "end", "join", "clear"]
