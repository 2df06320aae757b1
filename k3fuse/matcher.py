"""Traced-pattern matching over inference ATen graphs, robust to how the model spelled it.

A `PatternSpec` function is traced with make_fx (fake tensors) and the same decomposition table
the doors use (Inductor's `select_decomp_table()`), then stripped of transparent nodes and
addmm-split (vocabulary.py). Matching walks backwards from the pattern's outputs:

* a pattern op matches a graph op when `vocabulary.canonical` keys agree; view-like graph nodes in
  between are walked through and become part of the match;
* commutative ops (add, mul) try both operand orders, so every operand-order variant of a
  pattern is covered without listing it;
* a pattern placeholder binds to any graph value; a placeholder used twice must bind to the same
  value up to views;
* literal wildcards (float/int/str example inputs, and `PatternSpec.free_sizes`) capture the
  graph's literal; a free size also binds a symbolic size (a SymInt-valued node: a dynamic token
  count), captured as its SymInt;
* a `meta` device literal (a factory op in a pattern traced on meta tensors) matches any device;
* a pattern op `x * c`, `x / c`, `x + c`, `x - c` with a float wildcard c may be absent from the graph,
  which then has x where the op was: c binds its identity (1 or 0). Inductor removes these ops at
  their identity before any post-grad pass runs (torch 2.14 also with a literal c: the router's
  `* routed_scaling` at 1.0); the match prefers the op present (`find_matches` ranks by ops matched).

A match whose interior nodes (matched, but not outputs) feed anything outside the match is
returned with `refused` set: rewriting it would compute that value twice. Layout-only interior
nodes (views, transposes of a weight shared by two linears) are exempt: they cost nothing and
`Match.replace` keeps them alive for their other users.
"""
from __future__ import annotations

import inspect
import math
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.experimental.proxy_tensor import make_fx

from .guards import GuardFailure
from .graph_facts import node_order
from .rewrite_site import Match, PatternSpec
from .vocabulary import (absorbed, canonical, forward_users, identity_operand, is_commutative, is_layout_only,
                         is_metadata_check, op_key, op_name, op_names_apart, skip_transparent, split_addmm,
                         strip_transparent, value_root)


class HasPatterns(Protocol):
    """What the matcher needs of a rule: its pattern spellings."""

    def patterns(self) -> Sequence[PatternSpec]: ...


def decomposition_table() -> dict[Any, Any]:
    """The table every door decomposes with, so patterns and graphs share one IR."""
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


_SENTINEL_FLOAT = 0.000123456789012345
_SENTINEL_INT = 987_654_301


def int_sentinel(position: int) -> int:
    """The value an int literal wildcard at parameter `position` is traced as: a pattern whose
    example shapes depend on it (e.g. T*top_k expert ids) builds them from this."""
    return _SENTINEL_INT + 2 * position


@dataclass
class CompiledPattern:
    """A PatternSpec traced to normalised ATen, ready to match."""

    spec: PatternSpec
    graph: fx.Graph
    placeholder_names: dict[fx.Node, str]
    outputs: list[fx.Node]
    wildcards: dict[Any, str] = field(default_factory=dict)

    @property
    def variant(self) -> str:
        return self.spec.name

    def __str__(self) -> str:
        return f"pattern {self.spec.name}:\n{self.graph}"


def compile_pattern(spec: PatternSpec) -> CompiledPattern:
    """Trace `spec.fn` to ATen and normalise it; literal wildcards get sentinel values."""
    examples = tuple(spec.example_inputs())
    params = list(inspect.signature(spec.fn).parameters)
    if len(params) != len(examples):
        raise ValueError(f"pattern {spec.name!r}: fn takes {len(params)} args but example_inputs gives {len(examples)}")
    traced_args: list[Any] = []
    wildcards: dict[Any, str] = {}
    for i, (pname, ex) in enumerate(zip(params, examples)):
        if isinstance(ex, torch.Tensor):
            traced_args.append(ex)
        elif isinstance(ex, bool) or ex is None:
            traced_args.append(ex)
        elif isinstance(ex, float):
            s = _SENTINEL_FLOAT * (1 + i / 7)
            wildcards[s] = pname
            traced_args.append(s)
        elif isinstance(ex, int):
            s = int_sentinel(i)
            wildcards[s] = pname
            traced_args.append(s)
        elif isinstance(ex, str):
            s = f"__k3fuse_wildcard_{pname}__"
            wildcards[s] = pname
            traced_args.append(s)
        else:
            raise TypeError(f"pattern {spec.name!r}: unsupported example input {pname}={type(ex).__name__}")
    for pname, size in spec.free_sizes:
        if any(_same_literal(size, s) for s in wildcards):
            raise ValueError(f"pattern {spec.name!r}: free size {pname}={size} collides with another wildcard")
        wildcards[size] = pname

    def call(*args: Any) -> Any:
        return spec.fn(*args)

    # Trace in a fake mode of its own: a pattern compiled inside a compile (the Inductor post-grad
    # door) would otherwise join the ambient FakeTensorMode and leave its own guards and symbols in
    # the graph's ShapeEnv, where Dynamo later finds a guard on a symbol with no source.
    with torch._guards.tracing(None), unset_fake_temporarily():
        gm = make_fx(call, decomposition_table=decomposition_table(), tracing_mode="fake")(*traced_args)
    graph = gm.graph
    strip_transparent(graph)
    split_addmm(graph)
    graph.eliminate_dead_code()
    # make_fx keeps one placeholder per argument, in order (dead-code elimination keeps placeholders)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    names: dict[fx.Node, str] = dict(zip(placeholders, params))
    out_node = next(n for n in graph.nodes if n.op == "output")
    outs = out_node.args[0]
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    for o in outs:
        if not isinstance(o, fx.Node) or o.op != "call_function":
            raise ValueError(f"pattern {spec.name!r}: every output must be computed by an op, got {o}")
    used = {a for n in graph.nodes for a in _literals(n)}
    for sentinel, pname in wildcards.items():
        if not any(_same_literal(sentinel, u) for u in used):
            raise ValueError(
                f"pattern {spec.name!r}: literal argument {pname!r} does not appear as a literal in the traced "
                f"graph (folded or unused); pass it as a tensor or drop it"
            )
    return CompiledPattern(spec, graph, names, outs, wildcards)


def _literals(node: fx.Node) -> Iterator[Any]:
    for a in torch.utils._pytree.tree_leaves((node.args, dict(node.kwargs))):
        if not isinstance(a, fx.Node):
            yield a


def _same_literal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        return str(a) == str(b)  # the same size expression (never evaluated: that would add a guard)
    if isinstance(a, float) or isinstance(b, float):
        if isinstance(a, bool) or isinstance(b, bool):
            return False
        try:
            return math.isclose(float(a), float(b), rel_tol=1e-12, abs_tol=0.0)
        except (TypeError, ValueError):
            return False
    return type(a) is type(b) and a == b


_cache: "weakref.WeakKeyDictionary[HasPatterns, list[CompiledPattern]]" = weakref.WeakKeyDictionary()


def compiled_patterns(rule: HasPatterns) -> list[CompiledPattern]:
    """The rule's patterns, traced once per rule object."""
    if rule not in _cache:
        _cache[rule] = [compile_pattern(spec) for spec in rule.patterns()]
    return _cache[rule]


# --- matching ------------------------------------------------------------------------------------


@dataclass
class _State:
    nodes: dict[fx.Node, fx.Node]  # pattern call node -> graph node
    claimed: dict[fx.Node, fx.Node]  # graph node -> pattern node
    passed: list[fx.Node]  # transparent graph nodes walked through
    inputs: dict[str, fx.Node]
    scalars: dict[str, Any]

    def copy(self) -> _State:
        return _State(dict(self.nodes), dict(self.claimed), list(self.passed), dict(self.inputs), dict(self.scalars))


class _Matcher:
    def __init__(self, pattern: CompiledPattern, trace: list[tuple[int, fx.Node, Any]] | None = None):
        self.p = pattern
        self.keys = {n: op_key(n) for n in pattern.graph.nodes if n.op == "call_function"}
        self.free_names = {name for name, _ in pattern.spec.free_sizes}
        #: near-miss search: (pattern nodes matched so far, pattern node, graph value it failed on)
        self.trace = trace

    def _fail(self, st: _State, pn: fx.Node, gn: Any) -> None:
        if self.trace is not None:
            self.trace.append((len(st.nodes), pn, gn))

    def match_node(self, pn: fx.Node, gn: Any, st: _State) -> Iterator[_State]:
        if not isinstance(gn, fx.Node):
            self._fail(st, pn, gn)
            return
        if pn.op == "placeholder":
            name = self.p.placeholder_names[pn]
            bound = st.inputs.get(name)
            if bound is not None:
                if bound is gn or value_root(bound) is value_root(gn):
                    yield st
                return
            if gn in st.claimed:
                return
            st = st.copy()
            st.inputs[name] = gn
            yield st
            return
        yield from self._match_present(pn, gn, st)
        yield from self._match_elided(pn, gn, st)

    def _match_present(self, pn: fx.Node, gn: fx.Node, st: _State) -> Iterator[_State]:
        gn, passed = skip_transparent(gn)
        if pn in st.nodes:
            if st.nodes[pn] is gn:  # reached again, maybe through views of its own: they join the match
                if passed:
                    st = st.copy()
                    st.passed.extend(passed)
                yield st
            return
        if gn.op != "call_function" or gn in st.claimed:
            return
        if any(gn is b for b in st.inputs.values()):
            return
        pkey, pargs = canonical(pn)
        # the folded reading first; then the node as written, for a pattern whose input sits at the
        # inner node the fold reads through (`vocabulary.FOLDING`)
        for fold in (True, False):
            gkey, gargs = canonical(gn, fold)
            if gkey == pkey and len(gargs) == len(pargs):
                break
        else:
            self._fail(st, pn, gn)
            return
        st = st.copy()
        st.nodes[pn] = gn
        st.claimed[gn] = pn
        st.passed.extend(passed)
        if fold:
            st.passed.extend(absorbed(gn))  # the inner node of a spelling the vocabulary read as one op
        orders = [pargs]
        if is_commutative(pn):
            orders.append((pargs[1], pargs[0], *pargs[2:]))
        for order in orders:
            yield from self.match_args(list(zip(order, gargs)), st)

    def elidable(self, pn: fx.Node) -> tuple[fx.Node, str, float] | None:
        """(x, wildcard, identity) when the graph may leave out pattern op `pn` = `x op c` (c a float
        wildcard at its identity, see the module doc); x an op (the match keeps an op at each output)."""
        found = identity_operand(pn) if pn.op == "call_function" else None
        if found is None:
            return None
        operand, literal, identity = found
        name = self._wildcard(literal)
        if name is None or name in self.free_names or operand.op != "call_function" or not isinstance(literal, float):
            return None
        return operand, name, identity

    def _match_elided(self, pn: fx.Node, gn: fx.Node, st: _State) -> Iterator[_State]:
        """`pn` read as absent: its operand matches `gn` and its wildcard binds the identity."""
        found = self.elidable(pn)
        if found is None or pn in st.nodes:
            return
        operand, name, identity = found
        if name in st.scalars and not _same_literal(st.scalars[name], identity):
            return
        st = st.copy()
        st.scalars[name] = identity
        for s in self.match_node(operand, gn, st):
            s = s.copy()
            s.nodes[pn] = s.nodes[operand]
            yield s

    def candidates(self, pn: fx.Node, by_key: dict[Any, list[fx.Node]]) -> list[fx.Node]:
        """Graph nodes pattern output `pn` may start at: its op's, and its operand's where the op may be absent."""
        found = list(by_key.get(self.keys[pn], ()))
        elided = self.elidable(pn)
        if elided is not None:
            found += [n for n in self.candidates(elided[0], by_key) if n not in found]
        return found

    def match_args(self, pairs: list[tuple[Any, Any]], st: _State) -> Iterator[_State]:
        if not pairs:
            yield st
            return
        (pa, ga), rest = pairs[0], pairs[1:]
        if isinstance(pa, fx.Node):
            for s in self.match_node(pa, ga, st):
                yield from self.match_args(rest, s)
            return
        if isinstance(pa, (list, tuple)):
            if not isinstance(ga, (list, tuple)) or len(ga) != len(pa):
                return
            yield from self.match_args(list(zip(pa, ga)) + rest, st)
            return
        wildcard = self._wildcard(pa)
        if wildcard is not None:
            if isinstance(ga, fx.Node):
                # a free size may be symbolic (a graph traced with a dynamic token count): it binds
                # the node's SymInt, which the rule's guard compares with the operands' shapes
                size = ga.meta.get("val")
                if wildcard not in self.free_names or not isinstance(size, torch.SymInt):
                    return
                ga = size
            if wildcard in st.scalars:
                if not _same_literal(st.scalars[wildcard], ga):
                    return
            else:
                st = st.copy()
                st.scalars[wildcard] = ga
            yield from self.match_args(rest, st)
            return
        if isinstance(pa, torch.device) and pa.type == "meta" and isinstance(ga, (torch.device, str)):
            yield from self.match_args(rest, st)  # traced on meta: stands for the graph's device
            return
        if isinstance(ga, fx.Node) or not _literal_equal(pa, ga):
            return
        yield from self.match_args(rest, st)

    def _wildcard(self, literal: Any) -> str | None:
        for sentinel, name in self.p.wildcards.items():
            if _same_literal(sentinel, literal):
                return name
        return None

    def match_at(self, gn: fx.Node, by_key: dict[Any, list[fx.Node]]) -> Iterator[_State]:
        """Every way the whole pattern matches with its first output at `gn`."""
        start = _State({}, {}, [], {}, {})
        outputs = self.p.outputs

        def rest(i: int, st: _State) -> Iterator[_State]:
            if i == len(outputs):
                yield st
                return
            po = outputs[i]
            if po in st.nodes:
                yield from rest(i + 1, st)
                return
            for cand in self.candidates(po, by_key):
                for s in self.match_node(po, cand, st):
                    yield from rest(i + 1, s)

        for st in self.match_node(outputs[0], gn, start):
            if st.nodes.get(outputs[0]) is gn:
                yield from rest(1, st)


def _literal_equal(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_literal_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return _same_literal(a, b)
    return a == b


def _interior_escape(st: _State, outputs: set[fx.Node]) -> GuardFailure | None:
    """The first interior node with a user outside the match (layout-only nodes excepted)."""
    matched = set(st.claimed) | set(st.passed)
    for node in matched:
        if node in outputs or is_layout_only(node):
            continue
        for user in node.users:
            if user not in matched and not is_metadata_check(user):
                return GuardFailure(
                    "site", "interior_used_outside",
                    f"{node.name} is inside the match but also used by {user.name}",
                    {"node": node.name, "user": user.name},
                )
    return None


def _exclusive(st: _State) -> set[fx.Node]:
    """Matched nodes one match owns; layout-only nodes (a shared weight transpose) can be shared."""
    return {n for n in (*st.claimed, *st.passed) if not is_layout_only(n)}


def _ops_present(st: _State) -> int:
    """Pattern ops the graph spells out: an op matched as absent (its operand's graph node) does not count."""
    return sum(1 for p, g in st.nodes.items() if st.claimed.get(g) is p)


def _dtype_agreement(pattern: CompiledPattern, st: _State) -> int:
    """How many bound inputs have the dtype of the pattern's example input (a tie-breaker)."""
    score = 0
    for ph, name in pattern.placeholder_names.items():
        bound = st.inputs.get(name)
        pv, gv = ph.meta.get("val"), bound.meta.get("val") if bound is not None else None
        if isinstance(pv, torch.Tensor) and isinstance(gv, torch.Tensor) and pv.dtype == gv.dtype:
            score += 1
    return score


def _nodes_by_key(graph: fx.Graph) -> dict[Any, list[fx.Node]]:
    """The graph's call nodes by canonical op key, folded and as written (see `match_node`), in graph order."""
    by_key: dict[Any, list[fx.Node]] = {}
    for n in graph.nodes:
        if n.op == "call_function":
            for key in dict.fromkeys((op_key(n), op_key(n, fold=False))):
                by_key.setdefault(key, []).append(n)
    return by_key


def find_matches(graph: fx.Graph, patterns: Sequence[CompiledPattern], *, overlap: bool = False) -> list[Match]:
    """Matches of `patterns` in `graph`, earliest output first.

    Where variants compete for a site the most specific wins: the larger pattern (a linear with
    bias + residual beats a plain one that takes the bias for the residual), then the variant
    whose example dtypes agree with the graph's values (patterns traced per trunk dtype), then the
    listed order. Without `overlap`, a graph node belongs to at most one returned (unrefused)
    match. Refused matches (interior used outside) are returned too, with `refused` set.
    """
    order = node_order(graph)
    by_key = _nodes_by_key(graph)
    accepted: list[tuple[tuple[int, int, int], CompiledPattern, _State]] = []
    refusals: dict[fx.Node, tuple[tuple[int, int, int], CompiledPattern, _State, GuardFailure]] = {}
    for index, pattern in enumerate(patterns):
        m = _Matcher(pattern)
        for gn in m.candidates(pattern.outputs[0], by_key):
            refusal: tuple[_State, GuardFailure] | None = None
            for st in m.match_at(gn, by_key):
                escape = _interior_escape(st, {st.nodes[p] for p in pattern.outputs})
                if escape is None:
                    accepted.append(((_ops_present(st), _dtype_agreement(pattern, st), -index), pattern, st))
                    refusal = None
                    break
                refusal = refusal or (st, escape)
            if refusal is not None:
                score = (_ops_present(refusal[0]), _dtype_agreement(pattern, refusal[0]), -index)
                if gn not in refusals or refusals[gn][0] < score:
                    refusals[gn] = (score, pattern, refusal[0], refusal[1])
    found: list[Match] = []
    taken: set[fx.Node] = set()
    for _, pattern, st in sorted(accepted, key=lambda c: c[0], reverse=True):
        own = _exclusive(st)
        if not overlap and own & taken:
            continue
        taken |= own
        found.append(_to_match(graph, pattern, st, order))
    for _, pattern, st, failure in refusals.values():
        if not _exclusive(st) & taken:
            found.append(_to_match(graph, pattern, st, order, refused=failure))
    found.sort(key=lambda mt: order[mt.outputs[0]])
    return found


# --- near misses ---------------------------------------------------------------------------------


def _pattern_path(pattern: CompiledPattern, start: fx.Node) -> list[fx.Node]:
    """Pattern nodes from `start` forward to the first pattern output it reaches (BFS)."""
    outputs = set(pattern.outputs)
    prev: dict[fx.Node, fx.Node | None] = {start: None}
    todo = [start]
    while todo:
        node = todo.pop(0)
        if node in outputs:
            path = [node]
            while prev[path[-1]] is not None:
                path.append(prev[path[-1]])  # type: ignore[arg-type]
            return path[::-1]
        for user in node.users:
            if user.op == "call_function" and user not in prev:
                prev[user] = node
                todo.append(user)
    return [start]


def trace_aten(fn: Callable[..., Any], examples: list[torch.Tensor]) -> fx.GraphModule:
    """`fn` traced to ATen as patterns are (the doors' decompositions), in a fake mode of its own."""
    with torch._guards.tracing(None), unset_fake_temporarily():
        return make_fx(fn, decomposition_table=decomposition_table(), tracing_mode="fake")(*examples)


def near_miss(graph: fx.Graph, patterns: Sequence[CompiledPattern], site_op: Any = None
              ) -> tuple[str, dict[str, Any]] | None:
    """Why none of `patterns` matched: the closest candidate and where it diverged.

    Every graph node computing `site_op` (default: each pattern's first output op) is a
    candidate. From it the pattern's path to its output is followed forward through the graph's
    readers; where that reaches the output, the pattern is matched backwards from there. The
    candidate that got furthest wins; the reason names the first graph node that differs, e.g.
    `plain+norm: the residual add reads aten.mul (mul_3), not _c10d_functional.wait_tensor`.
    Returns None when a pattern does match (nothing to explain).
    """
    if not patterns:
        return None  # a structural rule without patterns: nothing to compare against
    by_key = _nodes_by_key(graph)
    best: tuple[int, str, dict[str, Any]] | None = None
    site_op_name = ""
    for pattern in patterns:
        m = _Matcher(pattern)
        start = pattern.outputs[0]
        if site_op is not None:
            start = next((n for n in pattern.graph.nodes if n.op == "call_function" and n.target == site_op), None)
            if start is None:
                continue
        site_op_name = op_name(start)
        path = _pattern_path(pattern, start)
        for ga in by_key.get(m.keys[start], ()):
            g, depth, miss = ga, 1, None
            for prev_p, pn in zip(path, path[1:]):
                nxt = [u for u in forward_users(g) if m.keys[pn] in (op_key(u), op_key(u, fold=False))]
                if not nxt and m.elidable(pn) is not None:
                    continue  # the graph may leave this op out: the match from `g` decides
                if not nxt:
                    found = forward_users(g)
                    expected, names = op_names_apart(pn, found)
                    miss = (f"{pattern.variant}: {op_name(g)} ({g.name}) feeds "
                            f"{', '.join(f'{n} ({u.name})' for n, u in zip(names, found)) or 'nothing'}, "
                            f"not {expected}",
                            {"candidate": ga.name, "diverged_at": g.name, "expected": expected, "found": names})
                    break
                g, depth = nxt[0], depth + 1
            if miss is None:
                trace: list[tuple[int, fx.Node, Any]] = []
                m.trace = trace
                try:
                    if any(True for _ in m.match_at(g, by_key)):
                        return None
                finally:
                    m.trace = None
                if not trace:
                    continue
                got, pn, gn = max(trace, key=lambda t: t[0])
                depth += got
                reader = next((u for u in pn.users if u.op == "call_function"), None)
                where = f"the {op_name(reader)} input" if reader is not None else "the output"
                expected, (found_name,) = op_names_apart(pn, [gn])
                found = f"{found_name} ({gn.name})" if isinstance(gn, fx.Node) else repr(gn)
                miss = (f"{pattern.variant}: {where} is {found}, not {expected}",
                        {"candidate": ga.name, "diverged_at": gn.name if isinstance(gn, fx.Node) else repr(gn),
                         "expected": expected, "found": found_name, "output": g.name})
            if best is None or depth > best[0]:
                best = (depth, *miss)
    if best is None:
        what = str(getattr(site_op, "overloadpacket", site_op)) if site_op is not None else site_op_name
        return f"no {what} in the graph", {}
    return best[1], best[2]


def _to_match(graph: fx.Graph, pattern: CompiledPattern, st: _State, order: dict[fx.Node, int],
              refused: GuardFailure | None = None) -> Match:
    nodes = sorted(set(st.claimed) | set(st.passed), key=order.__getitem__)
    return Match(
        variant=pattern.variant,
        key=pattern.spec.key,
        graph=graph,
        inputs=dict(st.inputs),
        scalars=dict(st.scalars),
        outputs=[st.nodes[p] for p in pattern.outputs],
        nodes=nodes,
        refused=refused,
    )


__all__ = ["trace_aten", "CompiledPattern", "compile_pattern", "int_sentinel", "compiled_patterns", "find_matches",
           "decomposition_table", "near_miss"]
