"""Canonical spelling of ATen graphs, so one traced pattern matches every way a model writes it.

Three kinds of normalisation live here:

* *Equivalence* (read-only): `canonical(node)` names an op by what it computes. `t`, `transpose`
  and `permute` that swap the last two dims are one op; `_to_copy(dtype=)` and
  `convert_element_type` are one cast; `add(x, y, alpha=1)` drops its default. View-like ops
  (`view`, `reshape`, `_unsafe_view`, `clone`, `alias`, dtype-preserving casts) are *transparent*:
  the matcher walks through them.
* *In-place copies*: `copy(dst, src)` (functionalised `dist.all_reduce(t)`: all_reduce -> wait ->
  `copy(t, reduced)`) and `copy_` in graphs that are not functionalised stand for the copied value
  `src` when nothing reads `dst` after the copy and the copy neither casts nor broadcasts.
  `skip_transparent` / `value_root` walk through them to `src` (never to `dst`, unlike a view).
* *Engine spellings* (reversible): serving engines' own all-reduce and norm ops
  (`translate_engine_ops`, registered by k3fuse/engines/) become the ATen the rules trace, and
  go back as they were where no rule fused them (`restore_engine_ops`).
* *Reversible graph rewrites*: `split_addmm` turns `addmm(b, x, w)` into `mm(x, w) + b` so the
  bias spelling of a linear matches the `mm`+`add` spelling; `restore_addmm` folds back every
  pair no rule consumed, so the unrewritten part of a graph reaches the compiler as it came.
"""
from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from .graph_facts import node_value

aten = torch.ops.aten
prims = torch.ops.prims

#: ops that only change how a value is viewed or stored, never the value itself
VIEW_LIKE = frozenset(
    {
        aten.view.default,
        aten.reshape.default,
        aten._unsafe_view.default,
        aten.clone.default,
        aten.alias.default,
        aten.contiguous.default,
    }
)
#: in-place and functionalised copies: their result is the copied value (args[1]), see `copied_value`
COPY_OPS = frozenset({aten.copy.default, aten.copy_.default})
CAST_OPS = frozenset({prims.convert_element_type.default, aten._to_copy.default, aten.to.dtype})
#: two-tensor ops whose operand order does not matter (only with their default scaling)
COMMUTATIVE = frozenset({aten.add.Tensor, aten.mul.Tensor})
_SPLIT_MARK = "k3fuse_split_addmm"


def _rank(node: Any) -> int | None:
    v = node_value(node)
    return v.dim() if isinstance(v, torch.Tensor) else None


def cast_dtype(node: fx.Node) -> torch.dtype | None:
    """Target dtype if `node` is a pure dtype cast (no device/layout change), else None."""
    if node.op != "call_function" or node.target not in CAST_OPS:
        return None
    if node.target is prims.convert_element_type.default:
        return node.args[1]
    if node.target is aten.to.dtype:
        return node.args[1]
    extra = {k: v for k, v in node.kwargs.items() if k != "dtype" and v is not None}
    src = node_value(node.args[0])
    if "device" in extra and isinstance(src, torch.Tensor) and torch.device(extra["device"]) == src.device:
        del extra["device"]
    if extra.get("layout") == torch.strided:
        del extra["layout"]
    if extra or len(node.args) > 1:
        return None
    return node.kwargs.get("dtype")


#: checks torch.export inserts for `.float()` / `.to()` calls that were no-ops: they read a value's
#: metadata only, so they never make a value "used outside" a match and die with it
METADATA_CHECKS = frozenset({aten._assert_tensor_metadata.default})


def is_metadata_check(node: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in METADATA_CHECKS


def is_transparent(node: Any) -> bool:
    """True for nodes the matcher walks through: views, clones and casts that keep the dtype."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    if node.target in VIEW_LIKE:
        return True
    dtype = cast_dtype(node)
    src = node_value(node.args[0]) if node.args else None
    return dtype is not None and isinstance(src, torch.Tensor) and src.dtype == dtype


def copied_value(node: Any) -> fx.Node | None:
    """`src` when `node` is `copy(dst, src)` / `copy_(dst, src)` whose result is just `src`, else None.

    The result stands for `src` only if the copy neither casts nor broadcasts (same shape and
    dtype) and nothing reads `dst` after the copy: a later reader of `dst` sees the copied value
    through the mutation (copy_) or keeps the old one alive (copy), so a rewrite that drops the
    copy would change what it reads.
    """
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.target not in COPY_OPS:
        return None
    if len(node.args) < 2 or not isinstance(node.args[0], fx.Node) or not isinstance(node.args[1], fx.Node):
        return None
    dst, src = node.args[0], node.args[1]
    dv, sv = node_value(dst), node_value(src)
    if not (isinstance(dv, torch.Tensor) and isinstance(sv, torch.Tensor)):
        return None
    if dv.dtype != sv.dtype or tuple(dv.shape) != tuple(sv.shape):
        return None
    if any(u is not node and not is_metadata_check(u) and node < u for u in dst.users):
        return None
    return src


def skip_transparent(node: Any) -> tuple[Any, list[fx.Node]]:
    """The first non-transparent producer of `node`, and the transparent nodes passed on the way
    (views and casts to their input, in-place copies to the copied value)."""
    passed: list[fx.Node] = []
    while True:
        if is_transparent(node):
            passed.append(node)
            node = node.args[0]
            continue
        src = copied_value(node)
        if src is None:
            return node, passed
        passed.append(node)
        node = src


def value_root(node: Any) -> Any:
    """`node` with any chain of transparent ops stripped: two nodes with one root hold one value."""
    return skip_transparent(node)[0]


def _swaps_last_two(node: fx.Node) -> bool:
    if node.target is aten.t.default:
        return True
    rank = _rank(node.args[0])
    if node.target is aten.permute.default:
        perm = list(node.args[1])
        n = len(perm)
        perm = [p % n for p in perm]
        return n >= 2 and perm == list(range(n - 2)) + [n - 1, n - 2]
    if node.target is aten.transpose.int:
        d0, d1 = node.args[1], node.args[2]
        if rank is None:
            return {d0, d1} == {-1, -2}
        return sorted((d0 % rank, d1 % rank)) == [rank - 2, rank - 1]
    return False


def canonical(node: fx.Node) -> tuple[Any, tuple[Any, ...]]:
    """(op key, arguments) naming what `node` computes, independent of how it was spelled.

    Arguments are positional args followed by non-default kwargs as (name, value) pairs; tensor
    arguments stay fx.Nodes. Two call nodes compute the same function of their arguments when
    their keys are equal and their arguments match.
    """
    target = node.target
    if target in (aten.t.default, aten.permute.default, aten.transpose.int) and _swaps_last_two(node):
        return ("transpose_last2",), (node.args[0],)
    dtype = cast_dtype(node)
    if dtype is not None:
        return ("cast",), (node.args[0], dtype)
    kwargs = dict(node.kwargs)
    if target in COMMUTATIVE and kwargs.get("alpha", 1) == 1:
        kwargs.pop("alpha", None)
    if target is aten.addmm.default:
        if kwargs.get("beta", 1) == 1:
            kwargs.pop("beta", None)
        if kwargs.get("alpha", 1) == 1:
            kwargs.pop("alpha", None)
    extra = tuple(sorted(kwargs.items()))
    return (target,), tuple(node.args) + extra


def is_commutative(node: fx.Node) -> bool:
    return (
        node.op == "call_function"
        and node.target in COMMUTATIVE
        and len(node.args) == 2
        and node.kwargs.get("alpha", 1) == 1
    )


# --- reversible graph rewrites -------------------------------------------------------------------


def split_addmm(graph: fx.Graph) -> int:
    """Rewrite `addmm(b, x, w)` (beta = alpha = 1) as `mm(x, w) + b`; returns how many.

    The new nodes carry node.meta[_SPLIT_MARK] so `restore_addmm` can fold back the pairs that
    no rule consumed.
    """
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.addmm.default:
            continue
        if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
            continue
        bias, x, w = node.args[:3]
        with graph.inserting_before(node):
            mm = graph.call_function(aten.mm.default, (x, w))
            add = graph.call_function(aten.add.Tensor, (mm, bias))
        for new in (mm, add):
            new.meta.update({k: v for k, v in node.meta.items() if k != "val"})
            new.meta[_SPLIT_MARK] = True
        out = node_value(node)
        if isinstance(out, torch.Tensor):
            add.meta["val"] = out
            mm_val = _fake_mm(node_value(x), node_value(w))
            if mm_val is not None:
                mm.meta["val"] = mm_val
        node.replace_all_uses_with(add)
        graph.erase_node(node)
        count += 1
    return count


def restore_addmm(graph: fx.Graph) -> int:
    """Fold back `mm` + `add` pairs made by `split_addmm` that are still intact."""
    count = 0
    for add in list(graph.nodes):
        if not add.meta.get(_SPLIT_MARK) or add.target is not aten.add.Tensor:
            continue
        mm, bias = add.args
        if not (isinstance(mm, fx.Node) and mm.meta.get(_SPLIT_MARK) and mm.target is aten.mm.default):
            continue
        if len(mm.users) != 1:
            continue
        with graph.inserting_before(add):
            addmm = graph.call_function(aten.addmm.default, (bias, *mm.args))
        addmm.meta.update({k: v for k, v in add.meta.items() if k != _SPLIT_MARK})
        add.replace_all_uses_with(addmm)
        graph.erase_node(add)
        graph.erase_node(mm)
        count += 1
    for node in graph.nodes:  # a rule consumed one half: the other half is a plain node now
        node.meta.pop(_SPLIT_MARK, None)
    return count


def strip_transparent(graph: fx.Graph) -> None:
    """Remove every transparent node (used on pattern graphs, which carry no layout meaning)."""
    for node in list(graph.nodes):
        if is_transparent(node):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)


def _fake_mm(x: Any, w: Any) -> torch.Tensor | None:
    """Meta value of mm(x, w) in the fake mode of its inputs; None if unknown or mixed modes."""
    from torch._subclasses.fake_tensor import FakeTensor

    if not (isinstance(x, FakeTensor) and isinstance(w, FakeTensor)) or x.fake_mode is not w.fake_mode:
        return None
    with x.fake_mode:
        return torch.ops.aten.mm.default(x, w)


__all__ = [
    "VIEW_LIKE",
    "COPY_OPS",
    "CAST_OPS",
    "copied_value",
    "COMMUTATIVE",
    "canonical",
    "cast_dtype",
    "is_commutative",
    "is_transparent",
    "is_metadata_check",
    "METADATA_CHECKS",
    "skip_transparent",
    "value_root",
    "split_addmm",
    "restore_addmm",
    "strip_transparent",
]


# --- engine spellings --------------------------------------------------------------------------
# Serving engines write the collectives and norms the rules trace as their own ops. Each engine
# module (k3fuse/engines/) registers its spellings here; `translate_engine_ops` rewrites them to the
# ATen the rules trace (functional all_reduce + wait_tensor over the c10d group, the residual add,
# the RMSNorm function the engine module hands over: k3fuse.spelling.rms_norm), and
# `restore_engine_ops` puts back every translation no rule consumed, so an engine's graph reaches
# its compiler as it came wherever k3fuse did not fuse. The add and the norm are k3fuse's: for a
# bf16 trunk the engine's norm of the fp32 sum becomes the norm of the sum rounded to bf16 (what
# the fused kernel computes): it differs from the engine's by bf16 roundings only.


@dataclass(frozen=True)
class AllReduceSpelling:
    """An engine's sum all-reduce over a group it names its own way (`resolve`: the engine's group
    name -> the c10d group name; raises when this process has no such group). `mutates`: the op
    writes the sum into its tensor argument and returns nothing."""

    qualname: str
    engine: str
    resolve: Callable[[str], str]
    tensor_arg: str = "tensor"
    group_arg: str = "group_name"
    mutates: bool = False


@dataclass(frozen=True)
class AddRMSNormSpelling:
    """An engine's fused residual add + RMSNorm returning (norm(x + residual), x + residual); with
    `residual_arg=None`, a plain RMSNorm returning norm(x). Translated only without a variance-size
    override (the norm then covers all of the last dim, as k3fuse's)."""

    qualname: str
    engine: str
    norm: Callable[[torch.Tensor, torch.Tensor | None, float], torch.Tensor]  # the RMSNorm the rules trace
    x_arg: str = "x"
    residual_arg: str | None = "x_residual"
    weight_arg: str = "weight"
    eps_arg: str = "epsilon"
    variance_size_arg: str | None = "variance_size"


@dataclass(frozen=True)
class PriorFusion:
    """An engine op that already fused what a rule looks for (`takes`: the qualnames of the ops a
    rule's site is built around: `Rule.site_op`), and what to switch off so that k3fuse can fuse it
    instead."""

    qualname: str
    engine: str
    takes: tuple[str, ...]
    advice: str


EngineSpelling = AllReduceSpelling | AddRMSNormSpelling | PriorFusion
_ENGINE_SPELLINGS: dict[str, EngineSpelling] = {}


def register_engine_spelling(spelling: EngineSpelling) -> None:
    """Teach the normalisation an engine op (called by k3fuse.engines' modules)."""
    _ENGINE_SPELLINGS[spelling.qualname] = spelling


def engine_spellings() -> dict[str, EngineSpelling]:
    return dict(_ENGINE_SPELLINGS)


@dataclass(frozen=True)
class _EngineCall:
    """An engine op call: the op, its arguments by schema name, and for a functionalised call
    (auto_functionalized v1 or v2) the getitem index holding each mutated argument's new value."""

    op: Any
    named: dict[str, Any]
    functional: bool
    mutated: dict[str, int]


def _engine_call(node: fx.Node) -> _EngineCall | None:
    """The engine op `node` calls, directly or through auto_functionalized(_v2); None for anything
    else, and for a v2 call on views of its bases (their size/stride/offset would need replaying)."""
    if node.op != "call_function":
        return None
    hop = node.target
    functional = hop in (torch.ops.higher_order.auto_functionalized, torch.ops.higher_order.auto_functionalized_v2)
    op = node.args[0] if functional else hop
    if not isinstance(op, torch._ops.OpOverload) or op._schema.name not in _ENGINE_SPELLINGS:
        return None
    named: dict[str, Any] = {}
    mutated: dict[str, int] = {}
    positional = () if functional else node.args
    returns = max(1, len(op._schema.returns))  # an op returning nothing still leads with one None
    writes = [a.name for a in op._schema.arguments if a.is_write]
    for i, arg in enumerate(op._schema.arguments):
        if i < len(positional):
            named[arg.name] = positional[i]
        elif arg.name in node.kwargs:
            named[arg.name] = node.kwargs[arg.name]
        elif hop is torch.ops.higher_order.auto_functionalized_v2 and f"_{arg.name}_base_index" in node.kwargs:
            if any(f"_{arg.name}_{k}" in node.kwargs for k in ("size", "stride", "storage_offset", "slice_dim")):
                return None
            base = node.kwargs[f"_{arg.name}_base_index"]
            named[arg.name] = node.kwargs["_all_bases"][base]
            mutated[arg.name] = returns + base
        elif arg.has_default_value():
            named[arg.name] = arg.default_value
    if hop is torch.ops.higher_order.auto_functionalized:
        mutated = {name: returns + k for k, name in enumerate(writes)}
    return _EngineCall(op, named, functional, mutated)


@dataclass
class EngineTranslation:
    """One engine op rewritten to ATen, with what `restore_engine_ops` needs to put it back.

    readers: (where the value came from: None the op's result, int its getitem, or the input node
    an in-place op mutated; the node standing for it now; the users rewired to that node)."""

    engine: str
    target: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    meta: dict[str, Any]
    name: str
    inserted: list[fx.Node]
    readers: list[tuple[Any, fx.Node, list[fx.Node]]]
    getitem_meta: dict[int, dict[str, Any]]
    stand_ins: list[fx.Node]  # alias nodes standing for a mutated input, dropped once consumed
    #: each input node of the original -> (an inserted node reading it, the argument position): a
    #: rule that replaces an input (decode_gemm the projection before the all-reduce) rewires
    #: these, so the restored op reads the input's replacement
    slots: dict[fx.Node, tuple[fx.Node, int]] = field(default_factory=dict)

    def current(self, value: Any) -> Any:
        """`value` (an input of the original) as the graph holds it now."""
        if isinstance(value, fx.Node) and value in self.slots:
            reader, position = self.slots[value]
            return reader.args[position]
        return value


def fake_call(target: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run `target` on the meta values of its arguments (fake tensors), or None if unknown."""
    from torch._guards import detect_fake_mode

    def val(n: fx.Node) -> Any:
        return n.meta.get("val")

    vargs = fx.node.map_arg(args, val)
    vkwargs = fx.node.map_arg(kwargs, val)
    leaves = [v for v in torch.utils._pytree.tree_leaves((vargs, vkwargs)) if isinstance(v, torch.Tensor)]
    try:
        mode = detect_fake_mode(leaves)
        if mode is None:
            return None
        with mode:
            return target(*vargs, **vkwargs)
    except Exception:  # a shape the fake impl cannot handle: the offline door re-propagates
        return None


def _set_vals(nodes: list[fx.Node]) -> None:
    for n in nodes:
        if "val" not in n.meta:
            val = fake_call(n.target, n.args, n.kwargs)
            if val is not None:
                n.meta["val"] = val


def _all_reduce(graph: fx.Graph, x: fx.Node, group: str, like: Any) -> list[fx.Node]:
    from .compat import ALL_REDUCE, WAIT_TENSOR

    ar = graph.call_function(ALL_REDUCE, (x, "sum", group))
    wait = graph.call_function(WAIT_TENSOR, (ar,))
    if like is not None:
        ar.meta["val"] = wait.meta["val"] = like
    return [ar, wait]


_TRACED_NORMS: dict[tuple[Any, ...], fx.GraphModule] = {}


#: traces a function of example tensors to ATen as the rules' patterns are traced (the matcher's
#: `trace_aten`, handed in by the pipeline)
AtenTracer = Callable[[Callable[..., Any], list[torch.Tensor]], fx.GraphModule]


def _inline_rms_norm(graph: fx.Graph, x: fx.Node, weight: Any, eps: float, rms_norm: Callable[..., Any],
                     trace: AtenTracer) -> list[fx.Node]:
    """rms_norm(x, weight, eps) traced as the rules trace it, inserted at the insertion point;
    returns the new nodes, the result last."""
    x_dtype = node_value(x).dtype
    w_dtype = node_value(weight).dtype if isinstance(weight, fx.Node) else None
    key = (rms_norm, x_dtype, w_dtype, float(eps))
    traced = _TRACED_NORMS.get(key)
    if traced is None:
        example = [torch.zeros(2, 8, dtype=x_dtype)] + ([torch.ones(8, dtype=w_dtype)] if w_dtype else [])

        def norm(x_: torch.Tensor, *w: torch.Tensor) -> torch.Tensor:
            return rms_norm(x_, w[0] if w else None, float(eps))

        traced = trace(norm, example)
        _TRACED_NORMS[key] = traced
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    val_map: dict[fx.Node, fx.Node] = dict(zip(placeholders, [x] + ([weight] if w_dtype else [])))
    out = graph.graph_copy(traced.graph, val_map)
    new = [val_map[n] for n in traced.graph.nodes if n.op == "call_function"]
    assert out is new[-1]
    _set_vals(new)
    return new


def _getitems(node: fx.Node) -> dict[int, fx.Node]:
    return {u.args[1]: u for u in node.users if u.op == "call_function" and u.target is operator.getitem}


def _translate(graph: fx.Graph, node: fx.Node, spelling: EngineSpelling, call: _EngineCall,
               trace: AtenTracer) -> EngineTranslation | None:
    named, functional = call.named, call.functional
    record = EngineTranslation(spelling.engine, node.target, node.args, dict(node.kwargs), dict(node.meta), node.name,
                               [], [], {}, [])
    items = _getitems(node)
    if isinstance(spelling, AllReduceSpelling):
        x = named[spelling.tensor_arg]
        group = spelling.resolve(named[spelling.group_arg])
        if not spelling.mutates:
            with graph.inserting_before(node):
                record.inserted = _all_reduce(graph, x, group, node_value(node))
            record.readers.append((None, record.inserted[-1], list(node.users)))
        elif functional:  # auto_functionalized -> getitem(i): the new value of the mutated tensor
            index = call.mutated.get(spelling.tensor_arg)
            if index is None or index not in items:
                return None
            with graph.inserting_before(node):
                record.inserted = _all_reduce(graph, x, group, node_value(items[index]))
            record.readers.append((index, record.inserted[-1], list(items[index].users)))
        else:  # in place: later readers of x read the sum; the copy-back makes that explicit
            order = node_order_of(graph)
            later = [u for u in x.users if u is not node and order[u] > order[node]]
            with graph.inserting_before(node):
                record.inserted = _all_reduce(graph, x, group, node_value(x))
                back = graph.call_function(aten.copy_.default, (x, record.inserted[-1]))
                back.meta["val"] = node_value(x)
                record.inserted.append(back)
            record.readers.append((x, back, later))
    elif isinstance(spelling, AddRMSNormSpelling):
        if spelling.variance_size_arg and named.get(spelling.variance_size_arg) is not None:
            return None
        x, weight, eps = named[spelling.x_arg], named[spelling.weight_arg], named[spelling.eps_arg]
        if not isinstance(node_value(x), torch.Tensor) or not isinstance(eps, (int, float)):
            return None
        with graph.inserting_before(node):
            if spelling.residual_arg is None:
                record.inserted = _inline_rms_norm(graph, x, weight, eps, spelling.norm, trace)
                record.readers.append((None, record.inserted[-1], list(node.users)))
            else:
                residual = named[spelling.residual_arg]
                total = graph.call_function(aten.add.Tensor, (x, residual))
                _set_vals([total])
                record.inserted = [total, *_inline_rms_norm(graph, total, weight, eps, spelling.norm, trace)]
                values: dict[int, fx.Node] = {0: record.inserted[-1], 1: total}
                if functional:  # the mutated inputs after the call: the native op leaves them as they were
                    for arg_name, index in call.mutated.items():
                        if index not in items:
                            continue  # nothing reads it: no stand-in (it would be a reader of x)
                        alias = graph.call_function(aten.alias.default, (named[arg_name],))
                        alias.meta["val"] = node_value(named[arg_name])
                        record.inserted.append(alias)
                        record.stand_ins.append(alias)
                        values[index] = alias
                for index, item in items.items():
                    if index not in values:
                        return None
                    record.readers.append((index, values[index], list(item.users)))
    else:
        return None
    record.getitem_meta = {i: dict(g.meta) for i, g in items.items()}
    inputs = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, fx.Node)]
    inputs += [a for v in node.kwargs.values() if isinstance(v, (list, tuple)) for a in v if isinstance(a, fx.Node)]
    for reader in record.inserted:
        for position, arg in enumerate(reader.args):
            if isinstance(arg, fx.Node) and arg in inputs and arg not in record.slots:
                record.slots[arg] = (reader, position)
    if any(a not in record.slots for a in inputs):
        # an input no inserted node reads directly: put the node back as it was (cannot be restored)
        for source, value, users in record.readers:
            old = node if source is None else (items[source] if isinstance(source, int) else source)
            for u in users:
                u.replace_input_with(value, old)
        for n in reversed(record.inserted):
            graph.erase_node(n)
        return None
    for source, value, users in record.readers:
        old = node if source is None else (items[source] if isinstance(source, int) else source)
        for u in users:
            u.replace_input_with(old, value)
    for item in items.values():
        graph.erase_node(item)
    graph.erase_node(node)
    return record


def node_order_of(graph: fx.Graph) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def translate_engine_ops(graph: fx.Graph, trace: AtenTracer) -> list[EngineTranslation]:
    """Rewrite every registered engine all-reduce and norm to the ATen the rules trace (norms
    traced with `trace`, the matcher's `trace_aten`)."""
    out = []
    for node in list(graph.nodes):
        call = _engine_call(node)
        if call is None:
            continue
        record = _translate(graph, node, _ENGINE_SPELLINGS[call.op._schema.name], call, trace)
        if record is not None:
            out.append(record)
    return out


def restore_engine_ops(graph: fx.Graph, translations: list[EngineTranslation],
                       rebuilt: set[fx.Node] | None = None) -> int:
    """Put back each translation whose nodes no rule consumed; drop the stand-ins of consumed ones.
    `rebuilt`: nodes other restorations put back, which may read these translations' values.
    Returns how many were restored."""
    restored = 0
    rebuilt = set(rebuilt or ())  # and the nodes put back by later translations here
    for t in reversed(translations):
        allowed = set(t.inserted) | {u for _, _, users in t.readers for u in users} | rebuilt
        intact = not any(getattr(n, "_erased", False) for n in t.inserted) and all(
            u in allowed for n in t.inserted for u in n.users)
        if not intact:
            _drop_stand_ins(graph, t)
            continue
        with graph.inserting_before(t.inserted[0]):
            args = fx.node.map_arg(t.args, t.current)
            kwargs = fx.node.map_arg(t.kwargs, t.current)
            original = graph.create_node("call_function", t.target, args, kwargs, name=t.name)
            original.meta.update(t.meta)
            rebuilt.add(original)
            for source, value, users in t.readers:
                if source is None:
                    src = original
                elif isinstance(source, int):
                    src = graph.call_function(operator.getitem, (original, source))
                    src.meta.update(t.getitem_meta.get(source, {}))
                    rebuilt.add(src)
                else:
                    src = t.current(source)
                for u in list(value.users):
                    if u in users or u in rebuilt:
                        u.replace_input_with(value, src)
        for n in reversed(t.inserted):
            graph.erase_node(n)
        restored += 1
    return restored


def _drop_stand_ins(graph: fx.Graph, t: EngineTranslation) -> None:
    """A consumed translation keeps its ATen; its alias stand-ins read the mutated input itself,
    and a copy-back that now copies an input onto itself is dropped."""
    for alias in t.stand_ins:
        if getattr(alias, "_erased", False):
            continue
        src = alias.args[0]
        for u in list(alias.users):
            u.replace_input_with(alias, src)
            if u.target is aten.copy_.default and u.args[0] is u.args[1] and not u.users:
                graph.erase_node(u)
        graph.erase_node(alias)


# --- the fp32-residual norm (SGLang's native RMSNorm) ---------------------------------------------
# x.float() + residual.float() in fp32, the sum kept in the trunk dtype as the next residual and
# normalised in fp32. The rules trace the add in the trunk dtype and the norm of that sum
# (k3fuse.spelling.rms_norm). The translation adds in the trunk dtype, normalises the rounded sum
# and makes the weight's promotion to fp32 an explicit cast (what the fused kernel computes: it
# differs from the fp32-sum norm by one rounding of the sum).

_FP32_RESIDUAL_ENGINES: set[str] = set()
_TRUNK_16 = (torch.bfloat16, torch.float16)


def register_fp32_residual_norm(engine: str) -> None:
    """An engine writes its residual add + RMSNorm in the fp32-residual form (called by its module)."""
    _FP32_RESIDUAL_ENGINES.add(engine)


@dataclass
class Fp32ResidualTranslation:
    """One fp32-residual add rewritten in the trunk dtype, with what putting it back needs."""

    #: per operand: its cast to fp32 if still in the graph, else what rebuilds it (name, target,
    #: arguments after the operand, kwargs, meta)
    upcasts: list[Any]
    total: fx.Node  # add(a, b) in the trunk dtype (stands for the residual the engine kept)
    total_f32: fx.Node  # convert(total, f32) (stands for the fp32 sum)
    weight_f32: fx.Node | None  # convert(w, f32) in the weight multiply, if there was one
    residual_readers: list[fx.Node]
    sum_readers: list[fx.Node]  # the fp32 sum's readers, and the weight multiply
    names: tuple[str, str]  # the fp32 sum's and the kept residual's node names
    meta: tuple[dict[str, Any], dict[str, Any]]
    kept_cast: tuple[Any, tuple[Any, ...], dict[str, Any]] = (None, (), {})  # target, args after the sum, kwargs


def _cast_of(node: Any, dtype: torch.dtype) -> fx.Node | None:
    """The input of `node` when it is a pure cast to `dtype`."""
    return node.args[0] if isinstance(node, fx.Node) and cast_dtype(node) == dtype else None


def _weight_multiply(total_f32: fx.Node) -> tuple[fx.Node, int] | None:
    """(mul, position of the weight) for `(sum * rsqrt(mean(sum^2) + eps)) * w` with w in a 16-bit
    dtype, the promotion the engine leaves implicit."""
    for normed in total_f32.users:
        if normed.target is not aten.mul.Tensor or len(normed.users) != 1:
            continue
        (mul,) = normed.users
        if mul.target is not aten.mul.Tensor or len(mul.args) != 2:
            continue
        position = 1 if mul.args[0] is normed else 0
        weight = mul.args[position]
        if isinstance(node_value(weight), torch.Tensor) and node_value(weight).dtype in _TRUNK_16:
            return mul, position
    return None


def translate_fp32_residual_norms(graph: fx.Graph, engines: set[str]) -> list[Fp32ResidualTranslation]:
    """Rewrite each `add(a.float(), b.float())` whose sum is also cast back to a and b's 16-bit
    dtype (the kept residual) to the trunk-dtype spelling the rules trace (see above), in graphs
    of an engine (`engines`: those whose ops the graph holds) that writes its norm that way."""
    if not _FP32_RESIDUAL_ENGINES & engines:
        return []
    out = []
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.add.Tensor or len(node.args) != 2 or node.kwargs:
            continue
        up_a, up_b = node.args
        a, b = _cast_of(up_a, torch.float32), _cast_of(up_b, torch.float32)
        if a is None or b is None or node_value(a) is None or node_value(b) is None:
            continue
        dtype = node_value(a).dtype
        if dtype not in _TRUNK_16 or node_value(b).dtype != dtype:
            continue
        kept = [u for u in node.users if cast_dtype(u) == dtype]
        if not kept:
            continue
        residual_readers = [r for k in kept for r in k.users]
        sum_readers = [u for u in node.users if u not in kept]
        with graph.inserting_before(node):
            total = graph.call_function(aten.add.Tensor, (a, b))
            total_f32 = graph.call_function(prims.convert_element_type.default, (total, torch.float32))
        _set_vals([total, total_f32])
        record = Fp32ResidualTranslation([], total, total_f32, None, residual_readers, sum_readers,
                                         (node.name, kept[0].name), (dict(node.meta), dict(kept[0].meta)),
                                         (kept[0].target, tuple(kept[0].args[1:]), dict(kept[0].kwargs)))
        for k in kept:
            k.replace_all_uses_with(total)
            graph.erase_node(k)
        node.replace_all_uses_with(total_f32)
        graph.erase_node(node)
        for up in (up_a, up_b):  # a dead cast would read the all-reduce: the rule could not take it
            if up.users:
                record.upcasts.append(up)
            else:
                record.upcasts.append((up.name, up.target, tuple(up.args[1:]), dict(up.kwargs), dict(up.meta)))
                graph.erase_node(up)
        found = _weight_multiply(total_f32)
        if found is not None:
            mul, position = found
            with graph.inserting_before(mul):
                record.weight_f32 = graph.call_function(prims.convert_element_type.default,
                                                        (mul.args[position], torch.float32))
            _set_vals([record.weight_f32])
            mul.replace_input_with(mul.args[position], record.weight_f32)
            record.sum_readers.append(mul)  # reads the weight's cast
        out.append(record)
    return out


def restore_fp32_residual_norms(graph: fx.Graph, translations: list[Fp32ResidualTranslation]) -> set[fx.Node]:
    """Put back each fp32-residual add no rule consumed; returns the nodes put back (readers of the
    engine ops' stand-ins, for `restore_engine_ops`)."""
    rebuilt: set[fx.Node] = set()
    for t in reversed(translations):
        new = [t.total, t.total_f32] + ([t.weight_f32] if t.weight_f32 is not None else [])
        allowed = set(new) | set(t.residual_readers) | set(t.sum_readers)
        if any(getattr(n, "_erased", False) for n in new) or any(u not in allowed for n in new for u in n.users):
            continue
        with graph.inserting_before(t.total):
            ups = []
            for operand, up in zip(t.total.args, t.upcasts):
                if isinstance(up, fx.Node):
                    ups.append(up)
                    continue
                name, target, rest, kwargs, meta = up
                cast = graph.create_node("call_function", target, (operand, *rest), kwargs, name=name)
                cast.meta.update(meta)
                ups.append(cast)
                rebuilt.add(cast)
            total = graph.create_node("call_function", aten.add.Tensor, tuple(ups), name=t.names[0])
            target, rest, kwargs = t.kept_cast
            kept = graph.create_node("call_function", target, (total, *rest), kwargs, name=t.names[1])
        total.meta.update(t.meta[0])
        kept.meta.update(t.meta[1])
        if t.weight_f32 is not None:
            t.weight_f32.replace_all_uses_with(t.weight_f32.args[0])
            graph.erase_node(t.weight_f32)
        t.total_f32.replace_all_uses_with(total)
        t.total.replace_all_uses_with(kept)
        graph.erase_node(t.total_f32)
        graph.erase_node(t.total)
    return rebuilt


def prior_fusions(graph: fx.Graph, site_op: Any) -> list[tuple[fx.Node, PriorFusion]]:
    """Engine ops in `graph` that already fused a site a rule built around `site_op` would look for."""
    qualname = getattr(site_op, "_schema", None)
    qualname = qualname.name if qualname is not None else None
    found = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        hops = (torch.ops.higher_order.auto_functionalized, torch.ops.higher_order.auto_functionalized_v2)
        op = node.args[0] if node.target in hops else node.target
        spelling = _ENGINE_SPELLINGS.get(op._schema.name) if isinstance(op, torch._ops.OpOverload) else None
        if isinstance(spelling, PriorFusion) and qualname in spelling.takes:
            found.append((node, spelling))
    return found


__all__ += ["fake_call", "register_fp32_residual_norm", "translate_fp32_residual_norms",
            "restore_fp32_residual_norms", "Fp32ResidualTranslation", "AllReduceSpelling", "AddRMSNormSpelling", "PriorFusion", "EngineTranslation", "register_engine_spelling",
            "engine_spellings", "translate_engine_ops", "restore_engine_ops", "prior_fusions"]
