"""Door (b): k3fuse as an Inductor post-grad custom pass (plain torch.compile, SGLang's decode compile).

    torch._inductor.config.post_grad_custom_post_pass = k3fuse.inductor_pass(ctx)

vLLM ignores that global hook (it installs its own pass manager) and takes an instance of its
own InductorPass: `k3fuse.vllm_pass` (k3fuse/engines/vllm_pass.py) subclasses this pass for it.

The pass chains whatever post_grad_custom_post_pass was installed when it was created (that one
runs first), and its `uuid()` hashes the rules' source, the context (the rewrite settings its TP
group agreed included) and the chained pass, so Inductor's FX graph cache recompiles when any of
them changes. Static placeholders come from the AOT metadata (`static_input_indices`, minus mutated
inputs) when a TracingContext is active; otherwise nothing is static and the site guards that need
static weights reject (logged). On an Inductor cache hit the pass does not run and logs nothing:
the cached code already holds the rewrite it made when the entry was written (same uuid).
"""
from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
from typing import Any

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from .context import ContextError, DecodeContext, rewrite_settings
from .doors import (EngineError, GroupSource, check_group_source, context_for, mark_static_by_index,
                    static_input_indices_from_tracing_context)
from .log import RewriteLog
from .pipeline import RuleRegistry, run_pipeline
from .plugins import install_plugins
from .rule import Rule

logger = logging.getLogger("k3fuse")

#: attribute a K3FusePass sets on each fx.Graph it rewrote: a second k3fuse pass on the same graph
#: (added twice, or chained behind itself) is an error, not a second rewrite
_RAN_ATTR = "_k3fuse_pass_ran"


class K3FusePass(CustomGraphPass):
    """The k3fuse pipeline as an Inductor post-grad pass.

    `ctx`: a DecodeContext (used as given), or a dict of its fields / None: the context is then
    built when the pass is first asked for it (its `uuid()`, which every compile computes, hit or
    miss), in the process that compiles (a serving engine's worker), for the TP group `group`
    names ("auto": vLLM's, else SGLang's, else torch's default group; see k3fuse.doors). Every rank
    builds it, once per process (`doors.context_for(..., once=True)`), and the ranks agree their
    rewrite settings through the group's store, never a collective: ranks that would rewrite
    differently raise one ContextError each, at compile time, instead of hanging in different
    collectives (k3fuse/context.py). Copies (`copy.deepcopy`, pickling to a worker) drop the built
    context and find the process's own; they share the rules and the log.
    """

    def __init__(self, ctx: DecodeContext | dict[str, Any] | None = None, *,
                 rules: RuleRegistry | list[Rule] | None = None,
                 log: RewriteLog | str | os.PathLike[str] | None = None, chain: Any = None,
                 group: GroupSource = "auto"):
        install_plugins()   # the engines register their TP groups
        check_group_source(group)
        if not (ctx is None or isinstance(ctx, (DecodeContext, dict))):
            raise ContextError(f"ctx must be a DecodeContext, a dict of its fields or None, got {type(ctx).__name__}")
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
            self._ctx = context_for(self._given, self.group, once=True)
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
        context, every setting that decides a rewrite (the agreed ones, or the live ones on a
        single rank: K3FUSE_RULES, the kill switch, the toolchain switches, K3FUSE_AR_PROTOCOL,
        K3FUSE_GEMV_MAX_M, ...), torch and the chained pass."""
        ctx = self.ctx
        h = hashlib.sha256()
        h.update(self.rules.fingerprint().encode())
        h.update(json.dumps(ctx.describe(), sort_keys=True, default=repr).encode())
        if ctx.agreed_settings is None:
            h.update(json.dumps(rewrite_settings(), sort_keys=True, default=repr).encode())
        h.update(torch.__version__.encode())
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


__all__ = ["inductor_pass", "K3FusePass", "contains_k3fuse_pass"]
