"""Door (c): rewrite a torch.export ExportedProgram offline, for engines that run it without Inductor.

The program is decomposed with the same table as the other doors, static placeholders come from
its graph signature (parameters, buffers it never mutates, lifted constants), the pipeline runs,
every node gets a meta["val"], and the result is an ExportedProgram that saves and loads with
torch.export.save/load (the k3fuse ops are registered by `k3fuse.load()`, which every k3fuse entry
point runs) and can be exported again. The context comes from k3fuse.doors, as in the other doors.
"""
from __future__ import annotations

import contextlib
import copy
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind, OutputSpec, TensorArgument

from . import graph_facts
from .context import DecodeContext
from .doors import context_for
from .graph_facts import is_collective
from .log import RewriteLog
from .matcher import decomposition_table
from .pipeline import RuleRegistry, run_pipeline
from .usage_error import UsageError
from .rule import Rule
from .plugins import install_plugins

_STATIC_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)


def written_placeholders(graph: fx.Graph) -> set[str]:
    """Placeholders an in-place op writes (non-functional IR, before run_decompositions)."""
    from .vocabulary import value_root

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
    """Set the static marker (graph_facts.mark_static) on the named placeholders (False on the others);
    returns their count."""
    count = 0
    for node in graph.nodes:
        if node.op == "placeholder":
            graph_facts.mark_static(node, node.name in static_names)
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

#: key in a collective node's meta["custom"] holding the size of its group (see record_group_sizes)
GROUP_SIZE_KEY = "k3fuse_group_size"


def _node_group(node: fx.Node, names: Any) -> str | None:
    """The group name among a collective's string arguments (the last one in `names`)."""
    found = [a for a in node.args if isinstance(a, str) and a in names]
    return found[-1] if found else None


def _arg_group_size(node: fx.Node) -> int | None:
    """The `group_size` argument of an all-gather / reduce-scatter, or None (all-reduce has none)."""
    packet = getattr(node.target, "_overloadpacket", None)
    pos = _GROUP_SIZE_ARG.get(getattr(packet, "__name__", ""))
    if pos is not None and len(node.args) > pos and isinstance(node.args[pos], int):
        return node.args[pos]
    return None


def _recorded_group_size(node: fx.Node) -> int | None:
    size = (node.meta.get("custom") or {}).get(GROUP_SIZE_KEY)
    return size if isinstance(size, int) and not isinstance(size, bool) and size >= 1 else None


def _live_group_sizes(names: list[str]) -> dict[str, int]:
    """Sizes of the named groups that exist as live process groups in this process."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return {}
    from .compat import resolve_group

    sizes = {}
    for name in names:
        try:
            sizes[name] = dist.get_world_size(resolve_group(name))
        except RuntimeError:
            pass
    return sizes


def collective_group_sizes(graph: fx.Graph) -> dict[str, int | None]:
    """Each group name the graph's collectives use -> its size, or None where nothing records it.

    The size comes from, in this order: the collective's own `group_size` argument (all-gather,
    reduce-scatter); the size `record_group_sizes` wrote into the node's meta["custom"] when the
    program was saved (this is what an all-reduce-only TP program carries, since
    `all_reduce(t, "sum", group_name)` names its group but not its size); the world_size of k3fuse
    collective ops over that group (a program k3fuse already rewrote); a live process group of
    that name in this process. A program exported and saved by plain torch.export while no group
    was live records nothing for its all-reduces: those groups map to None.
    """
    sizes: dict[str, int | None] = {name: None for name in collective_group_names(graph)}
    collectives = [(n, _node_group(n, sizes)) for n in graph.nodes if is_collective(n)]
    for read in (_arg_group_size, _recorded_group_size):  # an argument outranks a record
        for node, name in collectives:
            if name is not None and sizes[name] is None:
                sizes[name] = read(node)
    for name, size in _fused_op_group_sizes(graph).items():
        if sizes.get(name) is None:
            sizes[name] = size
    for name, size in _live_group_sizes([n for n, s in sizes.items() if s is None]).items():
        sizes[name] = size
    return sizes


def _fused_op_group_sizes(graph: fx.Graph) -> dict[str, int]:
    """group_name -> world_size of the k3fuse collective ops already in the graph (a rewritten
    program), where world_size > 1: each fused op carries the size it was built for."""
    sizes: dict[str, int] = {}
    for node in graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None or not schema.name.startswith("k3fuse::"):
            continue
        values = {a.name: (node.args[i] if i < len(node.args) else node.kwargs.get(a.name))
                  for i, a in enumerate(schema.arguments)}
        name, size = values.get("group_name"), values.get("world_size")
        if isinstance(name, str) and isinstance(size, int) and size > 1:
            sizes.setdefault(name, size)
    return sizes


def record_group_sizes(ep: ExportedProgram, sizes: dict[str, int] | None = None) -> ExportedProgram:
    """Write the size of its group into every collective node's meta["custom"]; returns `ep`.

    Why: a TP program's all-reduces are `_c10d_functional.all_reduce(t, "sum", group_name)`, which
    names the group but not its size, and the name alone ("0") means nothing once the program is
    saved and the process group is gone. Without the size, `k3fuse apply` cannot tell that
    `--tp 4` is wrong for a program exported at TP 2, and the rewrite would bake the wrong
    world_size (and weight shards) into the fused ops. torch.export.save/load keep
    node.meta["custom"] (and run_decompositions carries it over), so the size travels with the
    program and `collective_group_sizes` reads it back offline.

    The sizes come from `sizes` (group name -> size) where given, else from the graph itself
    (all-gather / reduce-scatter arguments, an earlier record) or a live process group of that
    name. `save_program` calls this, so a program saved with k3fuse while its process group is
    live (as every rank of an export run is) carries its sizes; call it yourself before
    torch.export.save when you save without k3fuse. Groups whose size cannot be found are left
    unrecorded. Only node metadata changes (in place): the graph, its code and weights do not.
    A size in `sizes` that contradicts a collective's own `group_size` argument is a ValueError.
    """
    found = collective_group_sizes(ep.graph)
    for name, size in (sizes or {}).items():
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"group size for {name!r} must be a positive int, got {size!r}")
    for node in ep.graph.nodes:
        if not is_collective(node):
            continue
        name = _node_group(node, found)
        if name is None:
            continue
        own = _arg_group_size(node)
        size = (sizes or {}).get(name, found[name])
        if own is not None and size != own:
            raise ValueError(f"group {name!r} given size {size} but {node.name} gathers over {own} ranks")
        if size is not None:
            node.meta["custom"] = {**(node.meta.get("custom") or {}), GROUP_SIZE_KEY: size}
    return ep


def strip_group_sizes(ep: ExportedProgram) -> ExportedProgram:
    """Remove what `record_group_sizes` wrote (in place; returns `ep`): the program then looks
    like one saved by plain torch.export, whose all-reduces do not record their group size."""
    for node in ep.graph.nodes:
        custom = node.meta.get("custom")
        if custom and GROUP_SIZE_KEY in custom:
            node.meta["custom"] = {k: v for k, v in custom.items() if k != GROUP_SIZE_KEY}
    return ep


def load_program(path: str | os.PathLike[str]) -> ExportedProgram:
    """Load a .pt2 that may come from anyone: nothing in it runs (k3fuse.archive says what it may hold).

    The file must be a regular file; it is opened once, checked through that one open file (every
    entry's CRC, no pickle, no compiled library, no symbolic expression that is more than numbers and
    symbols, sample inputs that load with weights_only=True) and the same open file is handed to
    torch's loader, so a file swapped after the check is never read. Raises
    `k3fuse.archive.ProgramRefused` (a ValueError naming the entry) for a file k3fuse will not load,
    and `k3fuse.fileio.NotAFile` for a FIFO, a device or a directory. The k3fuse ops and the
    reference model's types are registered first (see `k3fuse.load`)."""
    from .archive import ProgramRefused, check_archive
    from .fileio import open_regular
    from .model import stack  # noqa: F401  DecodeState is a safe global for the sample inputs

    install_plugins()
    with open_regular(path, "a program") as f:
        models = check_archive(f, path)
        if "model" not in models:
            raise ProgramRefused(path, None, f"holds the programs {models}, none named 'model' (what "
                                             "torch.export.save writes)")
        f.seek(0)
        return _load_checked(f)


def _load_checked(f: Any) -> ExportedProgram:
    """torch's loader on an archive check_archive admitted: load_pt2 where torch has it, since
    torch.export.load retries a failed archive as the older format (whose entries are pickles) after
    logging a traceback."""
    try:
        from torch.export.pt2_archive._package import load_pt2
    except ImportError:  # an older torch: the checks above already keep the retry from unpickling
        return torch.export.load(f)
    return load_pt2(f).exported_programs["model"]


def save_program(ep: ExportedProgram, path: str | os.PathLike[str], *,
                 group_sizes: dict[str, int] | None = None) -> None:
    """torch.export.save to a temporary file next to `path`, renamed over it when complete: an
    interrupted save (Ctrl-C, full disk) leaves whatever was at `path` before, never half a program,
    and keeps its mode, owner and symlink (k3fuse.fileio). A failed write raises
    k3fuse.fileio.WriteFailed (an OSError) naming `path`.

    Records each collective's group size first (`record_group_sizes`, from `group_sizes`, the
    graph or the live process group), so `k3fuse apply` can check `--tp` against the program."""
    from .fileio import write_stream

    record_group_sizes(ep, group_sizes)
    write_stream(path, lambda f: torch.export.save(ep, f))


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


class ProgramTypeError(UsageError, TypeError):
    """k3fuse.apply was given something other than an ExportedProgram (a module, a path)."""

    def __init__(self, value: Any):
        if isinstance(value, (str, os.PathLike)):
            super().__init__(f"k3fuse.apply takes an ExportedProgram, got the path {str(value)!r}",
                             "load it first (k3fuse.offline.load_program: nothing in the file runs) or run "
                             "`k3fuse apply PATH -o OUT.pt2`")
        elif isinstance(value, torch.nn.Module):
            super().__init__(f"k3fuse.apply takes an ExportedProgram, got the module {type(value).__name__}",
                             "export it first: k3fuse.apply(torch.export.export(model, args), ctx), or compile it: "
                             "torch.compile(model, backend='k3fuse')")
        else:
            super().__init__(f"k3fuse.apply takes an ExportedProgram, got {type(value).__name__}",
                             "pass the result of torch.export.export")


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
    if not isinstance(exported_program, ExportedProgram):
        raise ProgramTypeError(exported_program)
    ctx = context_for(ctx, "torch")
    with _quiet_torch_internals():
        if decompose:  # a fresh graph module; weights are shared, never written
            ep = exported_program.run_decompositions(decomposition_table())
        else:
            ep = exported_program._update(copy.deepcopy(exported_program.graph_module),
                                          exported_program.graph_signature)
    gm = ep.graph_module
    mark_static_placeholders(gm.graph, static_placeholder_names(ep))
    install_plugins()
    rlog = run_pipeline(gm, ctx, rules=rules, door="offline", log=log)
    if rlog.applied() == 0:
        return ep, rlog
    _fill_missing_vals(gm)
    sig = type(ep.graph_signature)(input_specs=list(ep.graph_signature.input_specs),
                                   output_specs=_rebuild_output_specs(ep, gm))
    with _quiet_torch_internals():
        return ep._update(gm, sig), rlog


@contextlib.contextmanager
def _quiet_torch_internals() -> Iterator[None]:
    """torch's ExportedProgram deep-copies its own pytree specs (run_decompositions, _update), which
    trips torch's own deprecation of LeafSpec: a warning about torch's internals, nothing the caller
    can act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                                category=FutureWarning)
        yield


__all__ = ["apply", "ProgramTypeError", "load_program", "save_program", "collective_group_sizes", "record_group_sizes",
           "strip_group_sizes", "GROUP_SIZE_KEY", "static_placeholder_names", "written_placeholders",
           "mark_static_placeholders", "collective_group_names"]
