"""Serving engines' own all-reduce and norm ops, translated to the ATen the rules trace, and back.

Serving engines write the collectives and norms the rules trace as their own ops. Each engine
module (k3fuse/engines/) registers its spellings here (`register_engine_spelling`);
`translate_engine_ops` rewrites them to the ATen the rules trace (functional all_reduce +
wait_tensor over the c10d group, the residual add, the RMSNorm function the engine module hands
over: k3fuse.spelling.rms_norm), and `restore_engine_ops` puts back every translation no rule
consumed, so an engine's graph reaches its compiler as it came wherever k3fuse did not fuse. The
add and the norm are k3fuse's: for a bf16 trunk the engine's norm of the fp32 sum becomes the norm
of the sum rounded to bf16 (what the fused kernel computes): it differs from the engine's by bf16
roundings only. `prior_fusions` names the engine ops that already fused what a rule looks for.
"""
from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from .graph_facts import NodeRecipe, fill_fake_values, is_erased, node_order, node_value

aten = torch.ops.aten
_FUNCTIONALIZED = (torch.ops.higher_order.auto_functionalized, torch.ops.higher_order.auto_functionalized_v2)


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
    """Teach the translation an engine op (called by k3fuse.engines' modules)."""
    _ENGINE_SPELLINGS[spelling.qualname] = spelling


def engine_spellings() -> dict[str, EngineSpelling]:
    return dict(_ENGINE_SPELLINGS)


def _called_op(node: fx.Node) -> Any:
    """The op a call node runs, directly or through auto_functionalized(_v2)."""
    return node.args[0] if node.target in _FUNCTIONALIZED else node.target


def _spelling_of(node: fx.Node) -> EngineSpelling | None:
    op = _called_op(node) if node.op == "call_function" else None
    return _ENGINE_SPELLINGS.get(op._schema.name) if isinstance(op, torch._ops.OpOverload) else None


# --- reading an engine call ------------------------------------------------------------------------
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
    if _spelling_of(node) is None:
        return None
    hop = node.target
    functional = hop in _FUNCTIONALIZED
    op = _called_op(node)
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


# --- what a translation records ---------------------------------------------------------------------
@dataclass(frozen=True)
class OpResult:
    """The engine op's own result."""


@dataclass(frozen=True)
class ResultItem:
    """Item `index` of the engine op's result (a getitem node)."""

    index: int


@dataclass(frozen=True)
class MutatedInput:
    """The input an in-place engine op wrote its result into, as read after the op."""

    node: fx.Node


ValueOrigin = OpResult | ResultItem | MutatedInput


@dataclass
class Rewired:
    """Readers of one value of the engine op, rewired to the ATen node that stands for it now."""

    origin: ValueOrigin
    stand_in: fx.Node
    users: list[fx.Node]


@dataclass
class EngineTranslation:
    """One engine op rewritten to ATen, with what `restore_engine_ops` needs to put it back."""

    engine: str
    original: NodeRecipe
    inserted: list[fx.Node] = field(default_factory=list)
    rewired: list[Rewired] = field(default_factory=list)
    #: the getitem nodes' meta, by index, for rebuilding them
    item_meta: dict[int, dict[str, Any]] = field(default_factory=dict)
    #: alias nodes standing for a mutated input, dropped once consumed
    stand_ins: list[fx.Node] = field(default_factory=list)
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


#: traces a function of example tensors to ATen as the rules' patterns are traced (the matcher's
#: `trace_aten`, handed in by the pipeline)
AtenTracer = Callable[[Callable[..., Any], list[torch.Tensor]], fx.GraphModule]
_TRACED_NORMS: dict[tuple[Any, ...], fx.GraphModule] = {}


def _all_reduce(graph: fx.Graph, x: fx.Node, group: str, like: Any) -> list[fx.Node]:
    from .compat import ALL_REDUCE, WAIT_TENSOR

    ar = graph.call_function(ALL_REDUCE, (x, "sum", group))
    wait = graph.call_function(WAIT_TENSOR, (ar,))
    if like is not None:
        ar.meta["val"] = wait.meta["val"] = like
    return [ar, wait]


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
    fill_fake_values(new)
    return new


def _getitems(node: fx.Node) -> dict[int, fx.Node]:
    return {u.args[1]: u for u in node.users if u.op == "call_function" and u.target is operator.getitem}


def _source(origin: ValueOrigin, op_node: fx.Node, items: dict[int, fx.Node]) -> fx.Node:
    """The node that held `origin`'s value before the translation."""
    if isinstance(origin, ResultItem):
        return items[origin.index]
    if isinstance(origin, MutatedInput):
        return origin.node
    return op_node


# --- translating one call ---------------------------------------------------------------------------
def _translate_all_reduce(graph: fx.Graph, node: fx.Node, spelling: AllReduceSpelling, call: _EngineCall,
                          items: dict[int, fx.Node], record: EngineTranslation) -> bool:
    """The engine all-reduce as all_reduce + wait_tensor (+ the copy back of an in-place one)."""
    x = call.named[spelling.tensor_arg]
    group = spelling.resolve(call.named[spelling.group_arg])
    if not spelling.mutates:
        with graph.inserting_before(node):
            record.inserted = _all_reduce(graph, x, group, node_value(node))
        record.rewired.append(Rewired(OpResult(), record.inserted[-1], list(node.users)))
    elif call.functional:  # auto_functionalized -> getitem(i): the new value of the mutated tensor
        index = call.mutated.get(spelling.tensor_arg)
        if index is None or index not in items:
            return False
        with graph.inserting_before(node):
            record.inserted = _all_reduce(graph, x, group, node_value(items[index]))
        record.rewired.append(Rewired(ResultItem(index), record.inserted[-1], list(items[index].users)))
    else:  # in place: later readers of x read the sum; the copy-back makes that explicit
        order = node_order(graph)
        later = [u for u in x.users if u is not node and order[u] > order[node]]
        with graph.inserting_before(node):
            record.inserted = _all_reduce(graph, x, group, node_value(x))
            back = graph.call_function(aten.copy_.default, (x, record.inserted[-1]))
            back.meta["val"] = node_value(x)
            record.inserted.append(back)
        record.rewired.append(Rewired(MutatedInput(x), back, later))
    return True


def _translate_norm(graph: fx.Graph, node: fx.Node, spelling: AddRMSNormSpelling, call: _EngineCall,
                    items: dict[int, fx.Node], record: EngineTranslation, trace: AtenTracer) -> bool:
    """The engine norm as k3fuse's RMSNorm (of x + residual for the fused add); a functionalised
    call's mutated inputs are read through alias stand-ins (the native op leaves them as they were)."""
    named = call.named
    if spelling.variance_size_arg and named.get(spelling.variance_size_arg) is not None:
        return False
    x, weight, eps = named[spelling.x_arg], named[spelling.weight_arg], named[spelling.eps_arg]
    if not isinstance(node_value(x), torch.Tensor) or not isinstance(eps, (int, float)):
        return False
    with graph.inserting_before(node):
        if spelling.residual_arg is None:
            record.inserted = _inline_rms_norm(graph, x, weight, eps, spelling.norm, trace)
            record.rewired.append(Rewired(OpResult(), record.inserted[-1], list(node.users)))
            return True
        total = graph.call_function(aten.add.Tensor, (x, named[spelling.residual_arg]))
        fill_fake_values([total])
        record.inserted = [total, *_inline_rms_norm(graph, total, weight, eps, spelling.norm, trace)]
        values: dict[int, fx.Node] = {0: record.inserted[-1], 1: total}
        if call.functional:
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
            return False
        record.rewired.append(Rewired(ResultItem(index), values[index], list(item.users)))
    return True


def _input_nodes(node: fx.Node) -> list[fx.Node]:
    """The call's tensor inputs, those in list arguments included."""
    inputs = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, fx.Node)]
    return inputs + [a for v in node.kwargs.values() if isinstance(v, (list, tuple)) for a in v
                     if isinstance(a, fx.Node)]


def _find_slots(node: fx.Node, record: EngineTranslation) -> bool:
    """Record which inserted node reads each input of the original; False when one has none."""
    inputs = _input_nodes(node)
    for reader in record.inserted:
        for position, arg in enumerate(reader.args):
            if isinstance(arg, fx.Node) and arg in inputs and arg not in record.slots:
                record.slots[arg] = (reader, position)
    return all(a in record.slots for a in inputs)


def _rewire(record: EngineTranslation, op_node: fx.Node, items: dict[int, fx.Node]) -> None:
    """Point each recorded reader at the stand-in of the value it read."""
    for r in record.rewired:
        old = _source(r.origin, op_node, items)
        for u in r.users:
            u.replace_input_with(old, r.stand_in)


def _translate(graph: fx.Graph, node: fx.Node, spelling: EngineSpelling, call: _EngineCall,
               trace: AtenTracer) -> EngineTranslation | None:
    """Insert the ATen for one engine call, rewire its readers and erase it; None (the graph as it
    was) when the call cannot be translated, or could not be restored (an input no inserted node
    reads directly)."""
    record = EngineTranslation(engine=spelling.engine, original=NodeRecipe.of(node))
    items = _getitems(node)
    if isinstance(spelling, AllReduceSpelling):
        done = _translate_all_reduce(graph, node, spelling, call, items, record)
    elif isinstance(spelling, AddRMSNormSpelling):
        done = _translate_norm(graph, node, spelling, call, items, record, trace)
    else:
        done = False
    if not (done and _find_slots(node, record)):
        for n in reversed(record.inserted):  # read by nothing outside the translation yet
            graph.erase_node(n)
        return None
    record.item_meta = {i: dict(g.meta) for i, g in items.items()}
    _rewire(record, node, items)
    for item in items.values():
        graph.erase_node(item)
    graph.erase_node(node)
    return record


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


# --- putting back what no rule consumed ----------------------------------------------------------------
def _intact(t: EngineTranslation, rebuilt: set[fx.Node]) -> bool:
    """No inserted node was erased, and only the rewired readers, the translation's own nodes and
    restored nodes read them."""
    allowed = set(t.inserted) | {u for r in t.rewired for u in r.users} | rebuilt
    return not any(is_erased(n) for n in t.inserted) and all(u in allowed for n in t.inserted for u in n.users)


def _restore(graph: fx.Graph, t: EngineTranslation, rebuilt: set[fx.Node]) -> None:
    with graph.inserting_before(t.inserted[0]):
        original = t.original.rebuild(graph, fx.node.map_arg(t.original.args, t.current),
                                      fx.node.map_arg(t.original.kwargs, t.current))
        rebuilt.add(original)
        for r in t.rewired:
            if isinstance(r.origin, OpResult):
                src = original
            elif isinstance(r.origin, ResultItem):
                src = graph.call_function(operator.getitem, (original, r.origin.index))
                src.meta.update(t.item_meta.get(r.origin.index, {}))
                rebuilt.add(src)
            else:
                src = t.current(r.origin.node)
            for u in list(r.stand_in.users):
                if u in r.users or u in rebuilt:
                    u.replace_input_with(r.stand_in, src)
    for n in reversed(t.inserted):
        graph.erase_node(n)


def restore_engine_ops(graph: fx.Graph, translations: list[EngineTranslation],
                       rebuilt: set[fx.Node] | None = None) -> int:
    """Put back each translation whose nodes no rule consumed; drop the stand-ins of consumed ones.
    `rebuilt`: nodes other restorations put back, which may read these translations' values.
    Returns how many were restored."""
    restored = 0
    rebuilt = set(rebuilt or ())  # and the nodes put back by later translations here
    for t in reversed(translations):
        if not _intact(t, rebuilt):
            _drop_stand_ins(graph, t)
            continue
        _restore(graph, t, rebuilt)
        restored += 1
    return restored


def _drop_stand_ins(graph: fx.Graph, t: EngineTranslation) -> None:
    """A consumed translation keeps its ATen; its alias stand-ins read the mutated input itself,
    and a copy-back that now copies an input onto itself is dropped."""
    for alias in t.stand_ins:
        if is_erased(alias):
            continue
        src = alias.args[0]
        for u in list(alias.users):
            u.replace_input_with(alias, src)
            if u.target is aten.copy_.default and u.args[0] is u.args[1] and not u.users:
                graph.erase_node(u)
        graph.erase_node(alias)


def prior_fusions(graph: fx.Graph, site_op: Any) -> list[tuple[fx.Node, PriorFusion]]:
    """Engine ops in `graph` that already fused a site a rule built around `site_op` would look for."""
    schema = getattr(site_op, "_schema", None)
    qualname = schema.name if schema is not None else None
    found = []
    for node in graph.nodes:
        spelling = _spelling_of(node)
        if isinstance(spelling, PriorFusion) and qualname in spelling.takes:
            found.append((node, spelling))
    return found


__all__ = ["AllReduceSpelling", "AddRMSNormSpelling", "PriorFusion", "EngineSpelling", "EngineTranslation",
           "OpResult", "ResultItem", "MutatedInput", "Rewired", "AtenTracer", "register_engine_spelling",
           "engine_spellings", "translate_engine_ops", "restore_engine_ops", "prior_fusions"]
