"""Door (c): rewrite a torch.export ExportedProgram offline, for engines that run it without Inductor.

The program is decomposed with the same table as the other doors, static placeholders come from
its graph signature (parameters, buffers it never mutates, lifted constants), the pipeline runs,
every node gets a meta["val"], and the result is an ExportedProgram that saves and loads with
torch.export.save/load (the k3fuse ops are registered by `import k3fuse`) and can be exported again.
"""
from __future__ import annotations

import copy
import logging
import os
import zipfile
from typing import Any

import torch
import torch.fx as fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind, OutputSpec, TensorArgument

from . import ir
from .context import DecodeContext
from .ir import is_collective
from .log import RewriteLog
from .matcher import decomposition_table
from .pipeline import RuleRegistry, run_pipeline
from .rule import Rule
from .wiring import wire_defaults

_STATIC_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)


def written_placeholders(graph: fx.Graph) -> set[str]:
    """Placeholders an in-place op writes (non-functional IR, before run_decompositions)."""
    from .normalize import value_root

    written = set()
    for node in graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None or not schema.is_mutable:
            continue
        for arg, value in zip(schema.arguments, node.args):
            if arg.alias_info is not None and arg.alias_info.is_write and isinstance(value, fx.Node):
                root = value_root(value)
                if root.op == "placeholder":
                    written.add(root.name)
    return written


def static_placeholder_names(ep: ExportedProgram) -> set[str]:
    """Placeholders holding parameters, buffers the program never mutates, and lifted constants."""
    sig = ep.graph_signature
    mutated = {spec.target for spec in sig.output_specs if spec.kind == OutputKind.BUFFER_MUTATION}
    written = written_placeholders(ep.graph)
    names = set()
    for spec in sig.input_specs:
        if (spec.kind in _STATIC_KINDS and spec.target not in mutated and isinstance(spec.arg, TensorArgument)
                and spec.arg.name not in written):
            names.add(spec.arg.name)
    return names


def mark_static_placeholders(graph: fx.Graph, static_names: set[str]) -> int:
    """Set the static marker (ir.mark_static) on the named placeholders (False on the others); returns count."""
    count = 0
    for node in graph.nodes:
        if node.op == "placeholder":
            ir.mark_static(node, node.name in static_names)
            count += node.name in static_names
    return count


def collective_group_names(graph: fx.Graph) -> list[str]:
    """Group names the graph's functional collectives use, in first-use order."""
    seen: list[str] = []
    for node in graph.nodes:
        if is_collective(node):
            for a in node.args:
                if isinstance(a, str) and a not in ("sum", "avg", "max", "min", "product") and a not in seen:
                    seen.append(a)
    return seen


#: functional collectives whose arguments carry the group size, and its position
_GROUP_SIZE_ARG = {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 2, "all_gather_into_tensor_coalesced": 1,
                   "reduce_scatter_tensor_coalesced": 2}


def collective_group_sizes(graph: fx.Graph) -> dict[str, int | None]:
    """Each group name the graph's collectives use -> its size, or None where nothing records it.

    The size comes from the collective's own `group_size` argument (all-gather, reduce-scatter) or
    from a live process group of that name in this process. A plain all-reduce names its group but
    not its size, so a graph with only all-reduces gets None.
    """
    sizes: dict[str, int | None] = {name: None for name in collective_group_names(graph)}
    for node in graph.nodes:
        if not is_collective(node):
            continue
        packet = getattr(node.target, "_overloadpacket", None)
        pos = _GROUP_SIZE_ARG.get(getattr(packet, "__name__", ""))
        names = [a for a in node.args if isinstance(a, str) and a in sizes]
        if pos is not None and len(node.args) > pos and isinstance(node.args[pos], int) and names:
            sizes[names[-1]] = node.args[pos]
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from .compat import resolve_group

        for name, size in sizes.items():
            if size is None:
                try:
                    sizes[name] = dist.get_world_size(resolve_group(name))
                except RuntimeError:
                    pass
    return sizes


class _DropLoaderNoise(logging.Filter):
    """Two warnings torch.export.load logs on its way: "Fallback to weights_only=False" has a broken
    format string (two %s, one argument), so logging prints a 50-line "--- Logging error ---" block;
    "Ran into the following error when deserializing" is a traceback logged before the same error
    is raised (the caller reports it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        return not msg.startswith(("Fallback to weights_only=False", "Ran into the following error"))


def load_program(path: str | os.PathLike[str]) -> ExportedProgram:
    """torch.export.load with the k3fuse ops and the reference model's types registered (see
    `k3fuse.load`), without torch's logging-error block for example inputs of custom types."""
    from .model import stack  # noqa: F401  DecodeState is a safe global for torch.export.load

    wire_defaults()
    if not zipfile.is_zipfile(path):
        raise ValueError(f"{path} is not a zip archive")
    loggers = [logging.getLogger(name) for name in ("torch._export.serde.serialize", "torch.export")]
    quiet = _DropLoaderNoise()
    for lg in loggers:
        lg.addFilter(quiet)
    try:
        return torch.export.load(path)
    finally:
        for lg in loggers:
            lg.removeFilter(quiet)


def save_program(ep: ExportedProgram, path: str | os.PathLike[str]) -> None:
    """torch.export.save to a temporary file next to `path`, renamed over it when complete: an
    interrupted save (Ctrl-C, full disk) leaves whatever was at `path` before, never half a program."""
    from .fileio import atomic_write

    with atomic_write(path) as tmp:
        torch.export.save(ep, tmp)


def _lacks_val(node: fx.Node) -> bool:
    """A value-producing node without meta["val"] (ops returning nothing, like l2_prefetch, need none)."""
    if node.op == "output" or node.meta.get("val") is not None:
        return False
    schema = getattr(node.target, "_schema", None)
    return schema is None or len(schema.returns) > 0


def _fill_missing_vals(gm: fx.GraphModule) -> None:
    """Fake-propagate the graph if any node lacks meta["val"] (new nodes whose fake call failed)."""
    if not any(_lacks_val(n) for n in gm.graph.nodes):
        return
    from torch._guards import detect_fake_mode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*vals)


def _rebuild_output_specs(ep: ExportedProgram, gm: fx.GraphModule) -> list[OutputSpec]:
    out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    args = out_node.args[0]
    specs = []
    for spec, arg in zip(ep.graph_signature.output_specs, args):
        if isinstance(spec.arg, TensorArgument) and isinstance(arg, fx.Node):
            spec = OutputSpec(kind=spec.kind, arg=TensorArgument(name=arg.name), target=spec.target)
        specs.append(spec)
    return specs


def apply(
    exported_program: ExportedProgram,
    ctx: DecodeContext | dict[str, Any] | None = None,
    *,
    log: RewriteLog | str | os.PathLike[str] | None = None,
    rules: RuleRegistry | list[Rule] | None = None,
    decompose: bool = True,
) -> tuple[ExportedProgram, RewriteLog]:
    """Rewrite `exported_program` for decode; returns the new program and the rewrite log.

    The input program is not modified. `ctx` defaults to a context taken from the process group
    if one is initialised, else tp=1; for tp > 1 without a live group, pass group_name (the CLI
    takes it from the graph's collectives).
    """
    ctx = DecodeContext.coerce(ctx)
    if decompose:  # a fresh graph module; weights are shared, never written
        ep = exported_program.run_decompositions(decomposition_table())
    else:
        ep = exported_program._update(copy.deepcopy(exported_program.graph_module), exported_program.graph_signature)
    gm = ep.graph_module
    mark_static_placeholders(gm.graph, static_placeholder_names(ep))
    wire_defaults()
    rlog = run_pipeline(gm, ctx, rules=rules, door="offline", log=log)
    if rlog.applied() == 0:
        return ep, rlog
    _fill_missing_vals(gm)
    sig = type(ep.graph_signature)(input_specs=list(ep.graph_signature.input_specs),
                                   output_specs=_rebuild_output_specs(ep, gm))
    return ep._update(gm, sig), rlog


__all__ = ["apply", "load_program", "save_program", "collective_group_sizes", "static_placeholder_names", "written_placeholders", "mark_static_placeholders", "collective_group_names"]
