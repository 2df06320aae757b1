"""How the serving engines host k3fuse: their supported versions and where their TP group lives.

Each engine module (`vllm`, `sglang`) states its facts (the versions k3fuse was written against,
its graph ops as "namespace::name" strings, how its group names map to torch process groups)
without importing the engine: an engine is imported only when a graph holds one of its ops or
a pass asks for its TP group; importing them registers their spellings with k3fuse.engine_ops.
`vllm_pass` (the class that subclasses vLLM's InductorPass) imports vLLM; `sglang_hook` installs
the pass for SGLang.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch.distributed as dist

from . import sglang, vllm
from .base import Engine, EngineError

#: where a pass looks for its tensor-parallel group: "auto" tries vLLM's, then SGLang's, then
#: torch's default group (else a single-rank context)
GroupSource = Literal["auto", "vllm", "sglang", "torch"]
GROUP_SOURCES: tuple[str, ...] = ("auto", "vllm", "sglang", "torch")


@dataclass(frozen=True)
class TPGroup:
    """A tensor-parallel group found at run time, and who owns it (for messages)."""

    group: dist.ProcessGroup | None  # None: no torch.distributed, a single rank
    owner: str


def find_tp_group(source: GroupSource = "auto") -> TPGroup:
    """The TP group a pass running now should rewrite for.

    "vllm" / "sglang": that engine's TP group, or EngineError when the engine is not imported or its
    parallel state is not initialised here. "torch": the default group (None when torch.distributed
    is not initialised). "auto": the first engine that is imported and initialised, else "torch".
    """
    finders: dict[str, Callable[[], dist.ProcessGroup | None]] = {"vllm": vllm.tp_group, "sglang": sglang.tp_group}
    if source not in GROUP_SOURCES:
        raise EngineError(f"unknown TP group source {source!r}", f"use one of {', '.join(GROUP_SOURCES)}")
    if source in finders:
        group = finders[source]()
        if group is None:
            engine = vllm.ENGINE if source == "vllm" else sglang.ENGINE
            raise EngineError(f"no {engine.name} TP group in this process ({engine.module} is "
                              f"{'imported' if engine.imported() else 'not imported'}; its model parallel state "
                              "is not initialised)",
                              f"run the pass inside a {engine.name} worker, or build it with group='torch' or a "
                              "DecodeContext")
        return TPGroup(group, source)
    if source == "auto":
        for owner, finder in finders.items():
            group = finder()
            if group is not None:
                return TPGroup(group, owner)
    if dist.is_available() and dist.is_initialized():
        return TPGroup(dist.group.WORLD, "torch")
    return TPGroup(None, "torch")


__all__ = ["Engine", "EngineError", "GroupSource", "GROUP_SOURCES", "TPGroup", "find_tp_group"]
