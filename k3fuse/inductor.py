"""Door (b): k3fuse as an Inductor post-grad custom pass, for any Inductor user (vLLM, plain torch.compile).

    torch._inductor.config.post_grad_custom_post_pass = k3fuse.inductor_pass(ctx)

The pass chains whatever post_grad_custom_post_pass was installed when it was created (that one
runs first), and its `uuid()` hashes the rules' source, the context and the chained pass, so
Inductor's FX graph cache recompiles when any of them changes. Static placeholders come from the
AOT metadata (`static_input_indices`, minus mutated inputs) when a TracingContext is active;
otherwise nothing is static and the site guards that need static weights reject (logged).
On an Inductor cache hit the pass does not run and logs nothing: the cached code already holds
the rewrite it made when the entry was written (same uuid).
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from . import runtime, settings
from .context import DecodeContext
from .ir import mark_static
from .log import RewriteLog
from .pipeline import RuleRegistry, run_pipeline
from .rule import Rule
from .plugins import install_plugins


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


class K3FusePass(CustomGraphPass):
    """The k3fuse pipeline as an Inductor post-grad pass."""

    def __init__(self, ctx: DecodeContext, *, rules: RuleRegistry | list[Rule] | None = None,
                 log: RewriteLog | str | os.PathLike[str] | None = None, chain: Any = None):
        self.ctx = ctx
        install_plugins()
        self.rules = RuleRegistry.coerce(rules)
        self.log = RewriteLog.coerce(log, rank=ctx.rank)
        self.chain = chain

    def __call__(self, graph: fx.Graph) -> None:
        if self.chain is not None:
            self.chain(graph)
        mark_static_by_index(graph, static_input_indices_from_tracing_context())
        run_pipeline(graph, self.ctx, rules=self.rules, door="inductor", log=self.log)

    def uuid(self) -> bytes:
        h = hashlib.sha256()
        h.update(self.rules.fingerprint().encode())
        h.update(json.dumps(self.ctx.describe(), sort_keys=True).encode())
        h.update(str(self.ctx.multicast_status()).encode())
        h.update(torch.__version__.encode())
        # which rules run and whether any does: K3FUSE_RULES and the kill switch change the rewrite
        h.update(f"{settings.get('K3FUSE_RULES')}|{runtime.is_disabled()}".encode())
        if self.chain is not None:
            chained = self.chain.uuid() if hasattr(self.chain, "uuid") else repr(self.chain)
            h.update(chained if isinstance(chained, bytes) else str(chained).encode())
        return h.digest()


def inductor_pass(ctx: DecodeContext | dict[str, Any] | None = None, *,
                  rules: RuleRegistry | list[Rule] | None = None,
                  log: RewriteLog | str | os.PathLike[str] | None = None) -> K3FusePass:
    """A CustomGraphPass for `torch._inductor.config.post_grad_custom_post_pass`.

    Chains the pass currently installed there (unless it is already a K3FusePass).
    """
    from torch._inductor import config as inductor_config

    existing = inductor_config.post_grad_custom_post_pass
    if isinstance(existing, K3FusePass):
        existing = existing.chain
    return K3FusePass(DecodeContext.coerce(ctx), rules=rules, log=log, chain=existing)


__all__ = ["inductor_pass", "K3FusePass", "mark_static_by_index", "mutated_input_indices",
           "static_input_indices_from_tracing_context"]
