"""Door (a): the torch.compile backend "k3fuse".

    torch.compile(model, backend="k3fuse")                 # registered by the package entry point
    torch.compile(model, backend="k3fuse", options={"compiler": "eager", "context": {...}, "log": "rw.jsonl"})

Dynamo hands over the model's FX graph; AOT autograd functionalises it and decomposes it with
Inductor's table (both compilers, so rules see one IR); the pipeline rewrites the inference
graph; then Inductor compiles it ("inductor", default) or it runs as is ("eager"). Static
placeholders are the AOT inputs that are parameters/buffers (static_input_idxs) minus any the
graph mutates. Without a "context" option the context comes from the default process group
(collective: every rank compiles the same step) or is tp=1.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from .context import DecodeContext
from .inductor import mark_static_by_index, mutated_input_indices, static_input_indices_from_tracing_context
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
    ctx = DecodeContext.coerce(opts.get("context"))
    rlog = RewriteLog.coerce(opts.get("log"), rank=ctx.rank)
    rules: Sequence[Rule] | RuleRegistry | None = opts.get("rules")
    install_plugins()
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

    if compiler == "inductor":
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        def inner_compile(aot_gm: fx.GraphModule, aot_inputs: Sequence[Any], **kwargs: Any) -> Any:
            static = set(kwargs.get("static_input_idxs") or ())
            mutated = mutated_input_indices()
            _rewrite(aot_gm, static - mutated, ctx, rlog, registry, door="backend.inductor")
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
