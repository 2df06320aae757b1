"""What a rule is: patterns traced from plain torch functions, guards, and a rewrite.

A rule author writes::

    class LinearResidual(Rule):
        name = "linear_residual"
        description = "residual + x @ w.T -> one fused op"

        def patterns(self):
            def plain(x, w, residual):
                return residual + F.linear(x, w)
            return [PatternSpec("plain", plain, lambda: (torch.randn(4, 8), torch.randn(16, 8), torch.randn(4, 16)))]

        def check_site(self, match, ctx):
            return failures(static_weight(match["w"]))

        def rewrite(self, match, ctx):
            out = match.insert(torch.ops.mylib.linear_residual.default,
                               (match["x"], match["w"], match["residual"]))
            match.replace([out])
            return [out]

The engine traces each PatternSpec to ATen with the doors' decomposition table, matches it in
every spelling (see normalize.py) and hands each match to the guards and then to `rewrite`.
"""
from __future__ import annotations

import hashlib
import inspect
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.fx as fx
from torch.fx.node import map_arg

from .guards import GuardFailure

if TYPE_CHECKING:
    from .context import DecodeContext


class RewriteError(RuntimeError):
    """A rewrite could not be placed in the graph (its inputs come after its outputs' users)."""


@dataclass(frozen=True)
class PatternSpec:
    """One spelling variant of a rule's pattern: a plain torch function and example inputs.

    Tensor example inputs become pattern placeholders (any graph value can bind to them).
    float / int / str example inputs become *literal wildcards*: whatever literal the graph has
    in that position is captured in `Match.scalars[name]` (use them for eps, group names).
    """

    name: str
    fn: Callable[..., Any]
    example_inputs: Callable[[], tuple[Any, ...]]


def _stack_source(node: fx.Node) -> str | None:
    trace = node.meta.get("stack_trace")
    if not trace:
        return None
    found = re.findall(r'File "([^"]+)", line (\d+)', trace)
    if not found:
        return None
    path, line = found[-1]
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
    _anchor: fx.Node | None = field(default=None, repr=False)
    _new: list[fx.Node] = field(default_factory=list, repr=False)

    # --- reading ---------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> Any:
        if name in self.inputs:
            return self.inputs[name]
        if name in self.scalars:
            return self.scalars[name]
        raise KeyError(f"pattern has no input or scalar named {name!r}; inputs={list(self.inputs)}, "
                       f"scalars={list(self.scalars)}")

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
        return any(getattr(n, "_erased", False) for n in [*self.nodes, *self.inputs.values()])

    # --- rewriting -------------------------------------------------------------------------------
    def note(self, reason: str | None = None, **values: Any) -> None:
        """Record why the rewrite took the form it did (e.g. unicast instead of multicast); the
        pipeline puts `reason` and `values` on the site's applied event."""
        if reason is not None:
            self.reason = reason
        self.values.update(values)

    def _insertion_anchor(self) -> fx.Node:
        """Insert before the earliest output, so no read moves earlier than the original outputs.

        If a bound input comes later than that (multi-output patterns), insert after the last
        input instead, provided every outside user of an output still comes after it.
        """
        if self._anchor is not None:
            return self._anchor
        order = {n: i for i, n in enumerate(self.graph.nodes)}
        first_out = min(self.outputs, key=order.__getitem__)
        last_in = max(self.inputs.values(), key=order.__getitem__, default=None)
        if last_in is None or order[last_in] < order[first_out]:
            self._anchor = first_out
            return first_out
        matched = set(self.nodes)
        outside_users = [u for o in self.outputs for u in o.users if u not in matched]
        if any(order[u] <= order[last_in] for u in outside_users):
            raise RewriteError(f"cannot place the replacement: input {last_in.name} comes after a user of "
                               f"the outputs {[o.name for o in self.outputs]}")
        self._anchor = last_in.next
        return self._anchor

    def insert(self, target: Callable[..., Any], args: tuple[Any, ...],
               kwargs: dict[str, Any] | None = None) -> fx.Node:
        """Insert `target(*args, **kwargs)` where the replacement belongs; fills meta["val"]."""
        kwargs = kwargs or {}
        anchor = self._insertion_anchor()
        with self.graph.inserting_before(anchor):
            node = self.graph.call_function(target, args, kwargs)
        val = fake_call(target, args, kwargs)
        if val is not None:
            node.meta["val"] = val
        for key in ("stack_trace", "nn_module_stack"):  # provenance: the code the match came from
            src = next((n for n in (self.outputs[0], *self.nodes) if key in n.meta), None)
            if src is not None:
                node.meta[key] = src.meta[key]
        self._new.append(node)
        return node

    def replace(self, replacements: Sequence[fx.Node]) -> None:
        """Send every outside use of output i to replacements[i]; erase the matched nodes left dead."""
        if len(replacements) != len(self.outputs):
            raise RewriteError(f"{len(self.outputs)} pattern outputs but {len(replacements)} replacements")
        new = set(self._new)
        for old, rep in zip(self.outputs, replacements):
            old.replace_all_uses_with(rep, delete_user_cb=lambda user: user not in new)
        from .normalize import is_metadata_check

        for node in reversed(self.nodes):
            if getattr(node, "_erased", False):
                continue
            if node.users and all(is_metadata_check(u) for u in node.users):
                for check in list(node.users):  # a dtype assert on a value that no longer exists
                    self.graph.erase_node(check)
            if not node.users:
                self.graph.erase_node(node)

    def discard_new_nodes(self) -> None:
        """Erase what `insert` added (a rewrite that gave up half-way leaves the graph as it was)."""
        for node in reversed(self._new):
            if not getattr(node, "_erased", False) and not node.users:
                self.graph.erase_node(node)
        self._new.clear()

    @property
    def new_nodes(self) -> list[fx.Node]:
        return list(self._new)


def fake_call(target: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run `target` on the meta values of its arguments (fake tensors), or None if unknown."""
    from torch._guards import detect_fake_mode

    def val(n: fx.Node) -> Any:
        return n.meta.get("val")

    vargs = map_arg(args, val)
    vkwargs = map_arg(kwargs, val)
    leaves = [v for v in torch.utils._pytree.tree_leaves((vargs, vkwargs)) if isinstance(v, torch.Tensor)]
    try:
        mode = detect_fake_mode(leaves)
        if mode is None:
            return None
        with mode:
            return target(*vargs, **vkwargs)
    except Exception:  # a shape the fake impl cannot handle: the offline door re-propagates
        return None


class Rule:
    """Base class: a K3 decode rewrite. Subclasses set `name`, `description` and override hooks."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    #: True puts the rule under the multicast policy: the engine adds the `multicast` contract guard,
    #: which rejects it under policy "require" where multicast is unavailable. It does not mean the
    #: fused op uses multicast (no k3fuse kernel does: the fused all-reduce is a unicast one-shot)
    uses_multicast: ClassVar[bool] = False
    #: names of the torch.ops.k3fuse ops the rewrite inserts (contract guard: a kernel exists for
    #: the context's device)
    emits: ClassVar[tuple[str, ...]] = ()
    #: False: the rule runs only when named (K3FUSE_RULES=+name, enabled_rules): kept for users who
    #: measure a gain on their setup, off by default because the layer benchmark measured none
    default_on: ClassVar[bool] = True
    default_off_reason: ClassVar[str] = ""
    #: the op a site of this rule is built around (e.g. the all_reduce); near-miss reports start
    #: from it. None: the op of each pattern's first output
    anchor: ClassVar[Any] = None

    def patterns(self) -> Sequence[PatternSpec]:
        """Spelling variants of this rule's pattern (genuinely different computations only)."""
        return ()

    def check_contract(self, ctx: DecodeContext) -> list[GuardFailure]:
        """Once per graph: TP size, device, dtype... Empty list means the rule may run."""
        return []

    def check_site(self, match: Match, ctx: DecodeContext) -> list[GuardFailure]:
        """Per match: shapes, divisibility by TP, static weights. Empty list means rewrite it."""
        return []

    def rewrite(self, match: Match, ctx: DecodeContext) -> list[fx.Node]:
        """Insert the fused op (with `match.insert`), rewire users (`match.replace`), return new nodes."""
        raise NotImplementedError(f"rule {self.name!r} does not implement rewrite()")

    def find(self, graph: fx.Graph, ctx: DecodeContext) -> list[Match]:
        """Sites to consider. Default: every non-overlapping match of `patterns()`.

        Structural rules (stream placement, prefetch) override this and build Matches themselves.
        """
        from .matcher import compiled_patterns, find_matches

        return find_matches(graph, compiled_patterns(self))

    def explain_miss(self, graph: fx.Graph, ctx: DecodeContext) -> tuple[str, dict[str, Any]] | None:
        """Why `find` returned nothing: (reason, values) naming the closest candidate and the first
        node where it diverged from the pattern, or why there was no candidate at all.

        Default: the matcher's near-miss search from the rule's `anchor` op. Structural rules
        override it. The pipeline puts the answer on the rule's `not_matched` event.
        """
        from .matcher import compiled_patterns, near_miss

        return near_miss(graph, compiled_patterns(self), anchor=self.anchor)

    def fingerprint(self) -> str:
        """Hash of this rule's source, for compile-cache keys."""
        try:
            src = inspect.getsource(type(self))
        except (OSError, TypeError):
            src = repr(type(self))
        return hashlib.sha256(src.encode()).hexdigest()[:16]

    def __repr__(self) -> str:
        return f"<Rule {self.name}>"


__all__ = ["PatternSpec", "Match", "Rule", "RewriteError", "fake_call"]
