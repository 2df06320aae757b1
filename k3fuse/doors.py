"""What the three doors share: the TP group a pass rewrites for, its context, and which graph
inputs are static.

The doors (backend.py: torch.compile; inductor.py: the Inductor pass the engines host; offline.py:
torch.export programs) sit on this module; the serving engines' adapters (k3fuse/engines) sit on the
doors and register here how their TP group is found (`register_engine_group`), so nothing here
knows an engine. Contexts from a live group are built by `DecodeContext.from_process_group` only,
which has the group's ranks agree their rewrite settings (k3fuse/context.py).
"""
from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch.distributed as dist
import torch.fx as fx

from .context import ContextError, DecodeContext, context_fields
from .graph_facts import mark_static
from .usage_error import UsageError

#: where a pass looks for its tensor-parallel group: "auto" tries the engines' (vLLM's, then
#: SGLang's), then torch's default group (else a single-rank context)
GroupSource = Literal["auto", "vllm", "sglang", "torch"]


class EngineError(UsageError, RuntimeError):
    """An engine k3fuse cannot work with as found: a version outside the supported range, a TP
    group that cannot be found, k3fuse's pass added twice."""


@dataclass(frozen=True)
class EngineGroup:
    """How to find a serving engine's TP group in this process (registered by k3fuse.engines)."""

    source: str                                      # its GroupSource name, e.g. "vllm"
    name: str                                        # as users know the engine, e.g. "vLLM"
    module: str                                      # its import name
    find: Callable[[], dist.ProcessGroup | None]     # None: not imported or not initialised here


_engines: dict[str, EngineGroup] = {}


def register_engine_group(engine: EngineGroup) -> None:
    """Called by each engine's facts module on import; "auto" tries engines in registration order."""
    _engines[engine.source] = engine


def group_sources() -> tuple[str, ...]:
    return ("auto", *_engines, "torch")


def check_group_source(source: str) -> None:
    if source not in group_sources():
        raise EngineError(f"unknown TP group source {source!r}", f"use one of {', '.join(group_sources())}")


@dataclass(frozen=True)
class TPGroup:
    """A tensor-parallel group found at run time, and who owns it (for messages)."""

    group: dist.ProcessGroup | None  # None: no torch.distributed, a single rank
    owner: str


def find_tp_group(source: str = "auto") -> TPGroup:
    """The TP group a pass running now should rewrite for.

    An engine's name: that engine's TP group, or EngineError when the engine is not imported or its
    parallel state is not initialised here. "torch": the default group (None when torch.distributed
    is not initialised). "auto": the first engine that is imported and initialised, else "torch".
    """
    check_group_source(source)
    engine = _engines.get(source)
    if engine is not None:
        group = engine.find()
        if group is None:
            state = "imported" if engine.module in sys.modules else "not imported"
            raise EngineError(f"no {engine.name} TP group in this process ({engine.module} is {state}; its model "
                              "parallel state is not initialised)",
                              f"run the pass inside a {engine.name} worker, or build it with group='torch' or a "
                              "DecodeContext")
        return TPGroup(group, source)
    if source == "auto":
        for owner, candidate in _engines.items():
            group = candidate.find()
            if group is not None:
                return TPGroup(group, owner)
    if dist.is_available() and dist.is_initialized():
        return TPGroup(dist.group.WORLD, "torch")
    return TPGroup(None, "torch")


_built_lock = threading.Lock()
_built: dict[tuple, tuple[dist.ProcessGroup, DecodeContext]] = {}


def context_for(given: DecodeContext | dict[str, Any] | None, source: str = "auto", *,
                once: bool = False) -> DecodeContext:
    """The context a door rewrites for: `given` when it is a DecodeContext, else one built for the
    TP group `source` finds, with the fields in `given` (DecodeContext.from_process_group: the
    group's ranks agree their rewrite settings).

    once: built once per (group, fields) in this process (the Inductor pass: vLLM deep-copies it
    and an Inductor cache hit skips its run, but each rank builds, and agrees, the same contexts).
    """
    if isinstance(given, DecodeContext):
        return given
    fields = context_fields(given)
    found = find_tp_group(source)
    if found.group is None:
        return DecodeContext(**fields)
    size = dist.get_world_size(found.group)
    if fields.get("tp_size", size) != size:
        raise ContextError(f"tp_size={fields['tp_size']} does not match the {found.owner} TP group of size {size}")
    if not once or size == 1:
        return DecodeContext.from_process_group(found.group, **fields)
    key = (found.group.group_name, repr(sorted(fields.items(), key=lambda kv: kv[0])))
    with _built_lock:
        group, ctx = _built.get(key, (None, None))
        if ctx is None or group is not found.group:   # (a re-initialised group: built afresh)
            ctx = DecodeContext.from_process_group(found.group, **fields)
            _built[key] = (found.group, ctx)
    return ctx


# --- static graph inputs ---------------------------------------------------------------------------
def _aot_metadata() -> Any:
    """The active TracingContext's AOT forward metadata, or None outside AOT compilation."""
    from torch._guards import TracingContext

    tc = TracingContext.try_get()
    return getattr(tc, "fw_metadata", None) if tc is not None else None


def mutated_input_indices() -> set[int]:
    """Indices of AOT graph inputs the graph mutates (data or metadata); empty outside AOT."""
    meta = _aot_metadata()
    if meta is None:
        return set()
    return {i for i, info in enumerate(meta.input_info) if getattr(info, "mutates_data", False)
            or getattr(info, "mutates_metadata", False)}


def static_input_indices_from_tracing_context() -> set[int] | None:
    """Indices of AOT graph inputs that are parameters/buffers never mutated, if AOT says so."""
    meta = _aot_metadata()
    if meta is None or getattr(meta, "static_input_indices", None) is None:
        return None
    return set(meta.static_input_indices) - mutated_input_indices()


def mark_static_by_index(graph: fx.Graph, indices: set[int] | None) -> int:
    """Mark placeholders by position; returns how many are static."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    count = 0
    for i, node in enumerate(placeholders):
        static = indices is not None and i in indices
        mark_static(node, static)
        count += static
    return count


__all__ = ["EngineError", "EngineGroup", "GroupSource", "TPGroup", "register_engine_group", "group_sources",
           "check_group_source", "find_tp_group", "context_for", "mark_static_by_index", "mutated_input_indices",
           "static_input_indices_from_tracing_context"]
