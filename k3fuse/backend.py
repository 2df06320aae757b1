"""Door (a): the torch.compile backend "k3fuse".

    torch.compile(model, backend="k3fuse")                 # registered by the package entry point
    torch.compile(model, backend="k3fuse", options={"compiler": "eager", "context": {...}, "log": "rw.jsonl"})

Dynamo hands over the model's FX graph; AOT autograd functionalises it and decomposes it with
Inductor's table (both compilers, so rules see one IR); the pipeline rewrites the inference
graph; then Inductor compiles it ("inductor", default) or it runs as is ("eager"). Static
placeholders are the AOT inputs that are parameters/buffers (static_input_idxs) minus any the
graph mutates. Without a DecodeContext in the "context" option the context is built
(k3fuse.doors.context_for) for a serving engine's TP group when one is set up in this process
(vLLM's stock compile mode, which calls `model.compile(backend="k3fuse")`), else for the default
process group, else is tp=1; the group's ranks agree their rewrite settings as it is built.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from .context import DecodeContext
from .doors import context_for, mark_static_by_index, mutated_input_indices, static_input_indices_from_tracing_context
from .log import RewriteLog
from .matcher import decomposition_table
from .pipeline import RuleRegistry, run_pipeline
from .rule import Rule
from .plugins import install_plugins

COMPILERS = ("inductor", "eager")
_OPTION_KEYS = {"compiler", "context", "log", "rules"}


class BackendOptionError(ValueError):
    """Unknown or malformed torch.compile options for the k3fuse backend."""


def _parse_options(options: dict[str, Any] | None) -> tuple[str, DecodeContext, RewriteLog, RuleRegistry]:
    opts = dict(options or {})
    unknown = sorted(set(opts) - _OPTION_KEYS)
    if unknown:
        raise BackendOptionError(f"unknown k3fuse backend option(s) {unknown}; known: {sorted(_OPTION_KEYS)}")
    compiler = opts.get("compiler", "inductor")
    if compiler not in COMPILERS:
        raise BackendOptionError(f"compiler must be one of {COMPILERS}, got {compiler!r}")
    install_plugins()   # the engines register their TP groups
    ctx = context_for(opts.get("context"), "auto")
    rlog = RewriteLog.coerce(opts.get("log"), rank=ctx.rank)
    rules: Sequence[Rule] | RuleRegistry | None = opts.get("rules")
    if isinstance(rules, str) or (rules is not None and not isinstance(rules, RuleRegistry) and not (
            isinstance(rules, (list, tuple)) and all(isinstance(r, Rule) for r in rules))):
        raise BackendOptionError(f"option rules={rules!r} must be a list of Rule objects or a RuleRegistry; to pick "
                                 f"the K3 rules by name use K3FUSE_RULES or the context's enabled_rules / "
                                 f"disabled_rules")
    registry = RuleRegistry.coerce(rules)
    return compiler, ctx, rlog, registry


def _rewrite(gm: fx.GraphModule, static: set[int] | None, ctx: DecodeContext, rlog: RewriteLog,
             registry: RuleRegistry, door: str) -> None:
    mark_static_by_index(gm.graph, static)
    run_pipeline(gm, ctx, rules=registry, door=door, log=rlog)


def k3fuse_backend(gm: fx.GraphModule, example_inputs: Sequence[Any],
                   options: dict[str, Any] | None = None) -> Callable[..., Any]:
    """torch.compile backend: AOT (Inductor decompositions) -> k3fuse pipeline -> Inductor or eager.

    options: compiler "inductor" | "eager"; context: DecodeContext or dict of its fields;
    log: JSONL path or a RewriteLog to append to; rules: rules to run instead of the K3 rules.
    """
    compiler, ctx, rlog, registry = _parse_options(options)
    compiled = _compile(gm, example_inputs, compiler, ctx, rlog, registry)
    return _with_collective_check(compiled) if ctx.tp_size > 1 else compiled


def _with_collective_check(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """After every call of a compiled graph, the collectives' post-step check (no device sync):
    a fused collective that failed inside a replayed CUDA graph, here or on a peer, raises here
    instead of its NaN outputs flowing on (kernels/collective_guard.py)."""
    from .kernels.collective_guard import check_collectives

    def run(*args: Any) -> Any:
        out = compiled(*args)
        check_collectives()
        return out

    run.__wrapped__ = compiled  # type: ignore[attr-defined]
    if getattr(compiled, "_boxed_call", False):   # the same calling convention as what it wraps
        run._boxed_call = True  # type: ignore[attr-defined]
    return run


def _compile(gm: fx.GraphModule, example_inputs: Sequence[Any], compiler: str, ctx: DecodeContext,
             rlog: RewriteLog, registry: RuleRegistry) -> Callable[..., Any]:
    if compiler == "inductor":
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        from .kernels.ops.shared_expert import outline_regions

        def inner_compile(aot_gm: fx.GraphModule, aot_inputs: Sequence[Any], **kwargs: Any) -> Any:
            static = set(kwargs.get("static_input_idxs") or ())
            mutated = mutated_input_indices()
            _rewrite(aot_gm, static - mutated, ctx, rlog, registry, door="backend.inductor")
            outline_regions(aot_gm)   # the shared expert's side stream, which Inductor's own code cannot switch to
            return compile_fx_inner(aot_gm, aot_inputs, **kwargs)

        # the AOT cache would skip inner_compile (and so the rewrite and its log) on a hit
        with torch._functorch.config.patch(enable_autograd_cache=False):
            return compile_fx(gm, example_inputs, inner_compile=inner_compile)

    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def fw_compiler(aot_gm: fx.GraphModule, aot_inputs: Sequence[Any]) -> Callable[..., Any]:
        _rewrite(aot_gm, static_input_indices_from_tracing_context(), ctx, rlog, registry, door="backend.eager")
        return make_boxed_func(aot_gm.forward)

    with torch._functorch.config.patch(enable_autograd_cache=False):
        return aot_autograd(fw_compiler=fw_compiler, decompositions=decomposition_table())(gm, example_inputs)


__all__ = ["k3fuse_backend", "BackendOptionError", "COMPILERS"]
