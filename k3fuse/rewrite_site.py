"""What one occurrence of a pattern is (`Match`), the pattern spelling a rule declares
(`PatternSpec`, `Variant`), and how a rewrite inserts and rewires nodes (`Match.replace_with` for
the common case: one op takes the site's place).

Shared by the matcher (which builds Matches) and the rules (which rewrite them); it knows neither.
"""
from __future__ import annotations

import operator
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.fx as fx

from .guards import GuardFailure
from .graph_facts import fake_call, is_erased, node_order
from .vocabulary import is_metadata_check


class RewriteError(RuntimeError):
    """A rewrite could not be placed in the graph (its inputs come after its outputs' users)."""


P = TypeVar("P")


@dataclass(frozen=True)
class Variant:
    """Which spelling of a rule matched, as data: its form (e.g. "plain+norm"), the trunk dtype a
    spelling with casts was traced for (None: the spelling has no casts, one trace serves every
    dtype) and the rule's typed parameters of the form (a frozen dataclass the rewrite reads through
    `Match.params`, so no rule parses a name). `str()` is the name the log shows: the form, with the
    dtype when it is not fp32."""

    form: str
    dtype: torch.dtype | None = None
    params: Any = None

    def __str__(self) -> str:
        if self.dtype is None or self.dtype == torch.float32:
            return self.form
        return f"{self.form}[{str(self.dtype).removeprefix('torch.')}]"


@dataclass(frozen=True)
class PatternSpec:
    """One spelling variant of a rule's pattern: a plain torch function and example inputs.

    Tensor example inputs become pattern placeholders (any graph value can bind to them).
    float / int / str example inputs become *literal wildcards*: whatever literal the graph has
    in that position is captured in `Match.scalars[name]` (use them for eps, group names).
    free_sizes: (name, size) pairs of example tensor sizes the trace bakes into op arguments (an
    expand's shape, an empty's size, an arange's end) that the graph may have any value of: each
    is an int literal wildcard too, captured under its name. Pick sizes no other literal of the
    pattern has (the trace checks each appears; the guards check it against the input shapes).
    """

    name: str
    fn: Callable[..., Any]
    example_inputs: Callable[[], tuple[Any, ...]]
    variant: Variant | None = None
    free_sizes: tuple[tuple[str, int], ...] = ()

    @property
    def key(self) -> Variant:
        """The typed variant (`Variant(name)` when the spec did not set one)."""
        return self.variant if self.variant is not None else Variant(self.name)


#: k3fuse's K3 math helpers: a frame there is the helper, not the model line that called it
_HELPER_FILES = (str(Path(__file__).with_name("spelling.py")),)


def _stack_source(node: fx.Node) -> str | None:
    trace = node.meta.get("stack_trace")
    if not trace:
        return None
    found = re.findall(r'File "([^"]+)", line (\d+)', trace)
    if not found:
        return None
    path, line = next(((p, n) for p, n in reversed(found) if p not in _HELPER_FILES), found[-1])
    return f"{path}:{line}"


@dataclass
class Match:
    """One occurrence of a pattern in a graph.

    inputs:  pattern placeholder name -> graph node bound to it (the value the pattern consumed,
             possibly a view; outside the match).
    scalars: literal-wildcard name -> the literal found in the graph.
    outputs: graph nodes computing the pattern's outputs, in the pattern's return order.
    nodes:   every graph node the match covers (interior + outputs), in graph order; interior
             nodes have no users outside the match.
    refused: set by the matcher when the site looks like the pattern but cannot be rewritten
             (an interior value is used outside); the pipeline logs it as a rejected site.
    key:     the variant as data (`Variant`); `variant` is its name in the log.
    payload: what a structural rule's `find` worked out for this site and its `rewrite` needs
             (instead of a side table keyed by the match).
    """

    variant: str
    graph: fx.Graph
    inputs: dict[str, fx.Node]
    scalars: dict[str, Any]
    outputs: list[fx.Node]
    nodes: list[fx.Node]
    refused: GuardFailure | None = None
    reason: str | None = None
    values: dict[str, Any] = field(default_factory=dict)
    key: Variant | None = None
    payload: Any = None
    _insert_before: fx.Node | None = field(default=None, repr=False)
    _new: list[fx.Node] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.key is None:
            self.key = Variant(self.variant)

    # --- reading ---------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> Any:
        if name in self.inputs:
            return self.inputs[name]
        if name in self.scalars:
            return self.scalars[name]
        raise KeyError(f"pattern has no input or scalar named {name!r}; inputs={list(self.inputs)}, "
                       f"scalars={list(self.scalars)}")

    def params(self, kind: type[P]) -> P:
        """The matched variant's typed parameters (`Variant.params`), checked to be a `kind`."""
        params = self.key.params if self.key is not None else None
        if not isinstance(params, kind):
            raise TypeError(f"variant {self.variant!r} carries {type(params).__name__}, not {kind.__name__}")
        return params

    def val(self, name_or_node: str | fx.Node) -> Any:
        """The meta value (FakeTensor) of an input name or a node; None if unknown."""
        node = self.inputs[name_or_node] if isinstance(name_or_node, str) else name_or_node
        return node.meta.get("val")

    def shapes(self) -> dict[str, list[Any]]:
        """Shapes of inputs and outputs, for the log."""
        out: dict[str, list[Any]] = {}
        named = list(self.inputs.items()) + [(f"out{i}", n) for i, n in enumerate(self.outputs)]
        for name, node in named:
            v = node.meta.get("val")
            if isinstance(v, torch.Tensor):
                out[name] = [int(s) if isinstance(s, int) else str(s) for s in v.shape]
        return out

    def source(self) -> str | None:
        """`file:line` of the model code that produced the match (from the stack trace meta)."""
        for node in reversed(self.nodes):
            src = _stack_source(node)
            if src:
                return src
        return None

    def is_stale(self) -> bool:
        """True once another rewrite erased one of this match's nodes or inputs."""
        return any(is_erased(n) for n in [*self.nodes, *self.inputs.values()])

    # --- rewriting -------------------------------------------------------------------------------
    def note(self, reason: str | None = None, **values: Any) -> None:
        """Record why the rewrite took the form it did (e.g. unicast instead of multicast); the
        pipeline puts `reason` and `values` on the site's applied event."""
        if reason is not None:
            self.reason = reason
        self.values.update(values)

    def _insertion_point(self) -> fx.Node:
        """Insert before the earliest output, so no read moves earlier than the original outputs.

        If a bound input comes later than that (multi-output patterns), insert after the last
        input instead, provided every outside user of an output still comes after it.
        """
        if self._insert_before is not None:
            return self._insert_before
        order = node_order(self.graph)
        first_out = min(self.outputs, key=order.__getitem__)
        last_in = max(self.inputs.values(), key=order.__getitem__, default=None)
        if last_in is None or order[last_in] < order[first_out]:
            self._insert_before = first_out
            return first_out
        matched = set(self.nodes)
        outside_users = [u for o in self.outputs for u in o.users if u not in matched]
        if any(order[u] <= order[last_in] for u in outside_users):
            raise RewriteError(f"cannot place the replacement: input {last_in.name} comes after a user of "
                               f"the outputs {[o.name for o in self.outputs]}")
        self._insert_before = last_in.next
        return self._insert_before

    def insert(self, target: Callable[..., Any], args: tuple[Any, ...],
               kwargs: dict[str, Any] | None = None, *, before: fx.Node | None = None,
               provenance: fx.Node | None = None) -> fx.Node:
        """Insert `target(*args, **kwargs)` where the replacement belongs (or before `before`); fills
        meta["val"] and the provenance (stack trace, module stack) of `provenance` or of the match."""
        kwargs = kwargs or {}
        with self.graph.inserting_before(before if before is not None else self._insertion_point()):
            node = self.graph.call_function(target, args, kwargs)
        val = fake_call(target, args, kwargs)
        if val is not None:
            node.meta["val"] = val
        sources = (provenance,) if provenance is not None else (self.outputs[0], *self.nodes)
        for key in ("stack_trace", "nn_module_stack"):  # provenance: the code the match came from
            src = next((n for n in sources if key in n.meta), None)
            if src is not None:
                node.meta[key] = src.meta[key]
        self._new.append(node)
        return node

    def replace_with(self, op: torch._ops.OpOverload, **arguments: Any) -> list[fx.Node]:
        """The common rewrite: insert `op` called with `arguments` by its schema's names (defaults
        where left out), send the pattern's outputs to its result (one output, one result) or to its
        items in order, and erase what is left dead. Returns the new nodes, the op first."""
        fused = self.insert(op, schema_args(op, arguments))
        if len(self.outputs) == 1 and len(op._schema.returns) == 1:
            self.replace([fused])
            return [fused]
        items = [self.insert(operator.getitem, (fused, i)) for i in range(len(self.outputs))]
        self.replace(items)
        return [fused, *items]

    def replace(self, replacements: Sequence[fx.Node]) -> None:
        """Send every outside use of output i to replacements[i]; erase the matched nodes left dead."""
        if len(replacements) != len(self.outputs):
            raise RewriteError(f"{len(self.outputs)} pattern outputs but {len(replacements)} replacements")
        new = set(self._new)
        for old, rep in zip(self.outputs, replacements):
            old.replace_all_uses_with(rep, delete_user_cb=lambda user: user not in new)
        for node in reversed(self.nodes):
            if is_erased(node):
                continue
            if node.users and all(is_metadata_check(u) for u in node.users):
                for check in list(node.users):  # a dtype assert on a value that no longer exists
                    self.graph.erase_node(check)
            if not node.users:
                self.graph.erase_node(node)

    def discard_new_nodes(self) -> None:
        """Erase what `insert` added (a rewrite that gave up half-way leaves the graph as it was)."""
        for node in reversed(self._new):
            if not is_erased(node) and not node.users:
                self.graph.erase_node(node)
        self._new.clear()

    @property
    def new_nodes(self) -> list[fx.Node]:
        return list(self._new)


def schema_args(op: torch._ops.OpOverload, arguments: dict[str, Any]) -> tuple[Any, ...]:
    """`arguments` by name as `op`'s positional arguments, in schema order up to the last one
    given, the schema's defaults filling the gaps."""
    schema = op._schema.arguments
    unknown = sorted(set(arguments) - {a.name for a in schema})
    if unknown:
        raise TypeError(f"{op} has no argument(s) {unknown}; its schema: {op._schema}")
    last = max((i for i, a in enumerate(schema) if a.name in arguments), default=-1)
    out = []
    for a in schema[:last + 1]:
        if a.name in arguments:
            out.append(arguments[a.name])
        elif a.has_default_value():
            out.append(a.default_value)
        else:
            raise TypeError(f"{op}: argument {a.name!r} missing; its schema: {op._schema}")
    return tuple(out)


__all__ = ["Variant", "PatternSpec", "Match", "RewriteError", "schema_args"]
