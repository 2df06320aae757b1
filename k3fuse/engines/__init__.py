"""The serving engines that host k3fuse: their facts and their adapters, above the doors.

Each engine's facts module (`vllm`, `sglang`) states the versions k3fuse was written against, its
graph ops as "namespace::name" strings and how its group names map to torch process groups, and
registers its spellings (k3fuse.engine_ops) and how its TP group is found (k3fuse.doors), without
importing the engine: an engine is imported only when a graph holds one of its ops or a pass asks
for its TP group. The adapters put k3fuse into the engine: `vllm_pass` (the class that subclasses
vLLM's InductorPass; importing it imports vLLM), `sglang_hook` (the pass as SGLang's global hook),
and `step_check` (the collectives' post-step check after each engine step).
"""
from __future__ import annotations

from ..doors import EngineError, GroupSource, TPGroup, find_tp_group, group_sources
from . import vllm, sglang  # noqa: I001  (registration order: "auto" tries vLLM first)
from .base import Engine

#: the TP group sources a pass accepts ("auto", the engines', "torch")
GROUP_SOURCES: tuple[str, ...] = group_sources()

__all__ = ["Engine", "EngineError", "GroupSource", "GROUP_SOURCES", "TPGroup", "find_tp_group"]
