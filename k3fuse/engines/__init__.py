"""How the serving engines host k3fuse: their supported versions and where their TP group lives.

Each engine module (`vllm`, `sglang`) states its facts (the versions k3fuse was written against,
its graph ops as "namespace::name" strings, how its group names map to torch process groups)
without importing the engine: an engine is imported only when a graph holds one of its ops or
a pass asks for its TP group. `vllm_pass` is the exception: it defines the class that subclasses
vLLM's InductorPass, so importing it imports vLLM.
"""
from __future__ import annotations

import importlib.metadata
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch.distributed as dist

from ..usage import UsageError

#: where a pass looks for its tensor-parallel group: "auto" tries vLLM's, then SGLang's, then
#: torch's default group (else a single-rank context)
GroupSource = Literal["auto", "vllm", "sglang", "torch"]
GROUP_SOURCES: tuple[str, ...] = ("auto", "vllm", "sglang", "torch")


class EngineError(UsageError, RuntimeError):
    """An engine k3fuse cannot work with as found: a version outside the supported range, a TP
    group that cannot be found, k3fuse's pass added twice."""


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


@dataclass(frozen=True)
class Engine:
    """A serving engine: its import name, the distributions it ships as, the versions supported."""

    name: str  # as users know it, e.g. "vLLM"
    module: str  # import name
    distributions: tuple[str, ...]  # pip names carrying `module`
    min_version: tuple[int, int, int]  # inclusive
    max_version: tuple[int, int, int]  # exclusive

    def supported(self) -> str:
        return f"{_dotted(self.min_version)} up to (not including) {_dotted(self.max_version)}"

    def imported(self) -> bool:
        return self.module in sys.modules

    def installed_version(self) -> str | None:
        for dist_name in self.distributions:
            try:
                return importlib.metadata.version(dist_name)
            except importlib.metadata.PackageNotFoundError:
                continue
        return None

    def check_version(self, version: str | None = None) -> str:
        """The engine's version, raising EngineError when it is not installed or not supported."""
        version = self.installed_version() if version is None else version
        if version is None:
            raise EngineError(f"{self.name} is not installed (no distribution {' or '.join(self.distributions)})",
                              f"install {self.name} {self.supported()}")
        m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
        found = (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)) if m else None
        if found is None or not self.min_version <= found < self.max_version:
            raise EngineError(f"{self.name} {version} is not supported by k3fuse",
                              f"k3fuse supports {self.name} {self.supported()}")
        return version


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

from . import sglang, vllm  # noqa: E402  (registers their spellings with k3fuse.normalize)
