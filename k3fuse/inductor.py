"""Door (b): k3fuse as an Inductor post-grad custom pass (plain torch.compile, SGLang's decode compile).

    torch._inductor.config.post_grad_custom_post_pass = k3fuse.inductor_pass(ctx)

vLLM ignores that global hook (it installs its own pass manager) and takes an instance of its
own InductorPass: `k3fuse.vllm_pass` (k3fuse/engines/vllm_pass.py) subclasses this pass for it.

The pass chains whatever post_grad_custom_post_pass was installed when it was created (that one
runs first), and its `uuid()` hashes the rules' source, the context and the chained pass, so
Inductor's FX graph cache recompiles when any of them changes. Static placeholders come from the
AOT metadata (`static_input_indices`, minus mutated inputs) when a TracingContext is active;
otherwise nothing is static and the site guards that need static weights reject (logged).
On an Inductor cache hit the pass does not run and logs nothing: the cached code already holds
the rewrite it made when the entry was written (same uuid).
"""
from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from . import runtime, settings
from .context import ContextError, DecodeContext
from .engines import GROUP_SOURCES, EngineError, GroupSource, find_tp_group
from .graph_facts import mark_static
from .log import RewriteLog
from .pipeline import RuleRegistry, run_pipeline
from .rule import Rule
from .plugins import install_plugins

logger = logging.getLogger("k3fuse")


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


#: attribute a K3FusePass sets on each fx.Graph it rewrote: a second k3fuse pass on the same graph
#: (added twice, or chained behind itself) is an error, not a second rewrite
_RAN_ATTR = "_k3fuse_pass_ran"


class K3FusePass(CustomGraphPass):
    """The k3fuse pipeline as an Inductor post-grad pass.

    `ctx`: a DecodeContext (used as given), or a dict of its fields / None: the context is then
    built when the pass first runs, in the process that compiles (a serving engine's worker), from
    the TP group `group` names ("auto": vLLM's, else SGLang's, else torch's default group; see
    k3fuse.engines.find_tp_group). That build is local (no collective): a pass may run on one rank
    and not another (a cache hit), so nothing in it may wait for the other ranks.
    Copies (`copy.deepcopy`, pickling to a worker) drop the built context, so each process builds
    its own, and share the rules and the log.
    """

    def __init__(self, ctx: DecodeContext | dict[str, Any] | None = None, *,
                 rules: RuleRegistry | list[Rule] | None = None,
                 log: RewriteLog | str | os.PathLike[str] | None = None, chain: Any = None,
                 group: GroupSource = "auto"):
        if group not in GROUP_SOURCES:
            raise EngineError(f"unknown TP group source {group!r}", f"use one of {', '.join(GROUP_SOURCES)}")
        if not (ctx is None or isinstance(ctx, (DecodeContext, dict))):
            raise ContextError(f"ctx must be a DecodeContext, a dict of its fields or None, got {type(ctx).__name__}")
        install_plugins()
        self._given = ctx
        self._ctx = ctx if isinstance(ctx, DecodeContext) else None
        self.group = group
        self.rules = RuleRegistry.coerce(rules)
        self.log = RewriteLog.coerce(log, rank=self._ctx.rank if self._ctx is not None else 0)
        self.chain = chain

    @property
    def ctx(self) -> DecodeContext:
        """The context the pass rewrites for (built from the TP group on first use unless given)."""
        if self._ctx is None:
            self._ctx = context_for_group(self._given, self.group)
            if self.log.rank == 0 and self._ctx.rank:
                self.log.rank = self._ctx.rank
        return self._ctx

    def __call__(self, graph: fx.Graph) -> None:
        if self.chain is not None:
            self.chain(graph)
        if getattr(graph, _RAN_ATTR, False):
            raise EngineError("k3fuse's pass ran twice on one graph: it was added twice (e.g. as "
                              "post_grad_custom_post_pass and through inductor_passes, or installed twice)",
                              "add k3fuse's pass once")
        setattr(graph, _RAN_ATTR, True)
        mark_static_by_index(graph, static_input_indices_from_tracing_context())
        run_pipeline(graph, self.ctx, rules=self.rules, door="inductor", log=self.log)

    def is_applicable_for_range(self, compile_range: Any) -> bool:
        """vLLM's per-pass range hook: run only on graphs compiled for token counts inside the
        context's decode range (a graph for 1..8192 tokens would reach the fused ops with batches
        they are not built for; vLLM's `compile_ranges_endpoints: [64]` gives decode its own graph)."""
        lo, hi = self.ctx.tokens
        start, end = int(compile_range.start), int(compile_range.end)
        applicable = lo <= start and end <= hi
        if not applicable:
            logger.info("k3fuse: not run on the graph for compile range %s: outside the decode token range %d-%d",
                        compile_range, lo, hi)
        return applicable

    def uuid(self) -> str:
        """Inductor's (and vLLM's, JSON-hashed) cache key: a hex string over the rules' source, the
        context, torch, the switches and the chained pass."""
        ctx = self.ctx
        h = hashlib.sha256()
        h.update(self.rules.fingerprint().encode())
        h.update(json.dumps(ctx.describe(), sort_keys=True).encode())
        h.update(str(ctx.multicast_status()).encode())
        h.update(torch.__version__.encode())
        # which rules run and whether any does: K3FUSE_RULES and the kill switch change the rewrite
        h.update(f"{settings.get('K3FUSE_RULES')}|{runtime.is_disabled()}".encode())
        if self.chain is not None:
            chained = self.chain.uuid() if hasattr(self.chain, "uuid") else repr(self.chain)
            h.update(chained if isinstance(chained, bytes) else str(chained).encode())
        return h.hexdigest()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        if not isinstance(self._given, DecodeContext):
            state["_ctx"] = None  # built from the TP group of the process the copy runs in
        return state

    def __deepcopy__(self, memo: dict[int, Any]) -> K3FusePass:
        """vLLM deep-copies its compile config: the copy shares the rules and the log (so events
        reach the caller's log) and builds its own context."""
        clone = copy.copy(self)
        clone.__dict__.update(self.__getstate__())
        clone.chain = copy.deepcopy(self.chain, memo)
        return clone


def contains_k3fuse_pass(hook: Any) -> bool:
    """True if `hook` is a K3FusePass or chains one."""
    seen = 0
    while hook is not None and seen < 64:
        if isinstance(hook, K3FusePass):
            return True
        hook, seen = getattr(hook, "chain", None), seen + 1
    return False


def context_for_group(given: dict[str, Any] | None, source: GroupSource = "auto") -> DecodeContext:
    """A DecodeContext for the TP group `source` finds now, with the fields in `given` (no
    collective: the multicast status is this rank's own)."""
    from .context import probe_multicast
    from .compat import group_name_of

    fields = dict(given or {})
    found = find_tp_group(source)
    if found.group is None:
        return DecodeContext(**fields)
    group = found.group
    size = dist.get_world_size(group)
    if fields.get("tp_size", size) != size:
        raise ContextError(f"tp_size={fields['tp_size']} does not match the {found.owner} TP group of size {size}")
    fields.pop("tp_size", None)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    fields.setdefault("device_capability", torch.cuda.get_device_capability(device) if device is not None else None)
    fields.setdefault("multicast_info", probe_multicast(fields.get("multicast", "auto"), device=device))
    return DecodeContext(tp_size=size, rank=dist.get_rank(group), group_name=group_name_of(group), **fields)


def inductor_pass(ctx: DecodeContext | dict[str, Any] | None = None, *,
                  rules: RuleRegistry | list[Rule] | None = None,
                  log: RewriteLog | str | os.PathLike[str] | None = None,
                  group: GroupSource = "auto") -> K3FusePass:
    """A CustomGraphPass for `torch._inductor.config.post_grad_custom_post_pass`.

    Chains the pass currently installed there; raises EngineError when that already holds a
    k3fuse pass (the graph would be rewritten twice). Without a DecodeContext the context is built
    when the pass first runs (see K3FusePass).
    """
    from torch._inductor import config as inductor_config

    existing = inductor_config.post_grad_custom_post_pass
    if contains_k3fuse_pass(existing):
        raise EngineError("post_grad_custom_post_pass already holds k3fuse's pass",
                          "install it once, or reset torch._inductor.config.post_grad_custom_post_pass first")
    return K3FusePass(ctx, rules=rules, log=log, chain=existing, group=group)


__all__ = ["inductor_pass", "K3FusePass", "contains_k3fuse_pass", "context_for_group", "mark_static_by_index", "mutated_input_indices",
           "static_input_indices_from_tracing_context"]
