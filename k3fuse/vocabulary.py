"""The matcher's vocabulary: what an ATen node computes, whatever the spelling.

One traced pattern matches every way a model writes it because the matcher reads graphs through
these tables and functions:

* *equivalent spellings*: `canonical(node)` names an op by what it computes. Each recogniser in
  `EQUIVALENCES` turns one family of spellings into one key: `t`, `transpose` and `permute` that
  swap the last two dims are `transpose_last2`; `_to_copy(dtype=)`, `to.dtype` and
  `convert_element_type` are one `cast`. Arguments a spelling may write or leave out at their
  default (`DEFAULT_KWARGS`: `add(x, y, alpha=1)`; trailing positional arguments at their schema
  default: `topk(x, k, -1, True)`) are dropped, and dims are counted from the end (`DIM_ARGS`:
  `gather(x, 1, i)` on a 2-D x is `gather(x, -1, i)`). A new spelling of an existing computation is
  one more recogniser or table entry here. The recognisers besides transposes and casts:
  - `scalar_tensor(v)` and `full([], v)` (Inductor's constant folding of it) are one 0-d fill;
  - `unsqueeze(f(x), d)` and `f(unsqueeze(x, d))` are one value for an elementwise unary f
    (`UNSQUEEZE_COMMUTES`: `exp(g).unsqueeze(-1)` is `g[..., None].exp()`); the inner node of the
    pair is `absorbed` by the match of the outer one;
  - `squeeze.dim(x, d)` and `squeeze.dims(x, [d])` (torch.export's core decomposition) are one squeeze;
  - `topk(..., sorted=False)` is `topk(..., sorted=True)`: an unsorted top-k promises the set, in
    any order, so the sorted one is one of its answers (a rewrite may return it);
  - the two decompositions of silu, Inductor's `x / (1 + exp(-x))` and torch.export's core
    `x * sigmoid(x)`, and `silu` itself, are one silu (the inner nodes `absorbed`);
  these two *fold* an inner node into the outer one, so `canonical(node, fold=False)` also gives the
  node as written: a pattern input may sit between the two (K3's `kc.unsqueeze(-1)` where the
  graph's kc is a silu's output), and the matcher tries that reading when the folded one differs;
  - `split(x, n, d)` (chunk) is `split_with_sizes(x, [n, ...], d)` (torch.export's core decomposition).
  Sizes never enter a canonical form (a slice's `-n` stays `-n`): patterns are traced at example
  sizes, so a form that depends on them would match one model and miss the next.
* *transparent* nodes the matcher walks through: `VIEW_LIKE` ops and casts that keep the dtype.
* *copies that stand for their source*: `copy(dst, src)` (functionalised `dist.all_reduce(t)`:
  all_reduce -> wait -> `copy(t, reduced)`) and `copy_` in graphs that are not functionalised are
  the copied value `src` when nothing reads `dst` after the copy and the copy neither casts nor
  broadcasts (`copied_value`); `skip_transparent` / `value_root` walk through them to `src`.
* `COMMUTATIVE` ops try both operand orders; `METADATA_CHECKS` read metadata only and never make
  a value "used outside" a match.
* one reversible spelling rewrite: `split_addmm` turns `addmm(b, x, w)` into `mm(x, w) + b`, so the
  bias spelling of a linear matches the `mm` + `add` one; `restore_addmm` folds back every pair no
  rule consumed, so the unrewritten part of a graph reaches the compiler as it came.

A leaf over graph_facts: the matcher, the engine translations and the rules read it.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from .graph_facts import node_value

aten = torch.ops.aten
prims = torch.ops.prims

#: ops that only change how a value is viewed or stored, never the value itself
VIEW_LIKE = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.clone.default,
                       aten.alias.default, aten.contiguous.default})
#: in-place and functionalised copies: their result is the copied value (args[1]), see `copied_value`
COPY_OPS = frozenset({aten.copy.default, aten.copy_.default})
#: the dtype casts, pure when `cast_dtype` says so
CAST_OPS = frozenset({prims.convert_element_type.default, aten._to_copy.default, aten.to.dtype})
#: ops that swap the last two dims in some spelling (`_swaps_last_two` says which calls do)
TRANSPOSES = frozenset({aten.t.default, aten.permute.default, aten.transpose.int})
#: two-tensor ops whose operand order does not matter (only with their default scaling)
COMMUTATIVE = frozenset({aten.add.Tensor, aten.mul.Tensor})
#: keyword arguments a spelling may write at their default or leave out: op -> {name: default}
DEFAULT_KWARGS: dict[Any, dict[str, Any]] = {aten.add.Tensor: {"alpha": 1}, aten.mul.Tensor: {"alpha": 1},
                                             aten.addmm.default: {"beta": 1, "alpha": 1}}
#: elementwise unary ops, which commute with unsqueeze: `f(x).unsqueeze(d)` == `f(x.unsqueeze(d))`
UNSQUEEZE_COMMUTES = frozenset({aten.exp.default, aten.neg.default, aten.sigmoid.default, aten.tanh.default,
                                aten.log.default, aten.sqrt.default, aten.rsqrt.default, aten.abs.default,
                                aten.relu.default, aten.silu.default, aten.reciprocal.default})
#: ops whose int argument at these positions is a dim of their first argument (of their result, for
#: unsqueeze), compared counted from the end: HF's `x[..., None]` is `unsqueeze(x, rank)`, K3's `unsqueeze(x, -1)`
DIM_ARGS: dict[Any, tuple[int, ...]] = {aten.gather.default: (1,), aten.unsqueeze.default: (1,)}
#: checks torch.export inserts for `.float()` / `.to()` calls that were no-ops: they read a value's
#: metadata only, so they never make a value "used outside" a match and die with it
METADATA_CHECKS = frozenset({aten._assert_tensor_metadata.default})

#: what `canonical` returns: (op key, arguments)
Canonical = tuple[tuple[Any, ...], tuple[Any, ...]]
TRANSPOSE_LAST2 = ("transpose_last2",)
CAST = ("cast",)
SCALAR_FILL = ("scalar_fill",)
SQUEEZE = ("squeeze",)
SILU = ("silu",)
SPLIT = ("split_with_sizes",)
UNSQUEEZED = "unsqueezed"  # ("unsqueezed", f, d): f(x) with a unit dim inserted at d, either order


def _rank(node: Any) -> int | None:
    v = node_value(node)
    return v.dim() if isinstance(v, torch.Tensor) else None


def cast_dtype(node: fx.Node) -> torch.dtype | None:
    """Target dtype if `node` is a pure dtype cast (no device/layout change), else None."""
    if node.op != "call_function" or node.target not in CAST_OPS:
        return None
    if node.target in (prims.convert_element_type.default, aten.to.dtype):
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


def _as_transpose(node: fx.Node) -> Canonical | None:
    if node.target in TRANSPOSES and _swaps_last_two(node):
        return TRANSPOSE_LAST2, (node.args[0],)
    return None


def _as_cast(node: fx.Node) -> Canonical | None:
    dtype = cast_dtype(node)
    return (CAST, (node.args[0], dtype)) if dtype is not None else None


def _from_end(dim: Any, rank: int | None) -> Any:
    """`dim` counted from the end (-1 the last) when the rank is known, else as written."""
    if isinstance(dim, int) and not isinstance(dim, bool) and rank:
        return dim % rank - rank
    return dim


def _unsqueezed_pair(node: fx.Node) -> tuple[Any, fx.Node, fx.Node, int] | None:
    """(f, x, inner node, d) when `node` is `unsqueeze(f(x), d)` or `f(unsqueeze(x, d))` for f in
    UNSQUEEZE_COMMUTES; d counted from the end of the result."""
    outer_rank = _rank(node)
    if node.target is aten.unsqueeze.default and len(node.args) == 2:
        inner = node.args[0]
        if isinstance(inner, fx.Node) and inner.op == "call_function" and inner.target in UNSQUEEZE_COMMUTES \
                and len(inner.args) == 1 and not inner.kwargs:
            return inner.target, inner.args[0], inner, _from_end(node.args[1], outer_rank)
    if node.target in UNSQUEEZE_COMMUTES and len(node.args) == 1 and not node.kwargs:
        inner = node.args[0]
        if isinstance(inner, fx.Node) and inner.op == "call_function" and inner.target is aten.unsqueeze.default \
                and len(inner.args) == 2:
            return node.target, inner.args[0], inner, _from_end(inner.args[1], outer_rank)
    return None


def _as_unsqueezed(node: fx.Node) -> Canonical | None:
    found = _unsqueezed_pair(node)
    if found is None:
        return None
    f, x, _, d = found
    return (UNSQUEEZED, f, d), (x,)


def _as_squeeze(node: fx.Node) -> Canonical | None:
    if node.target not in (aten.squeeze.dim, aten.squeeze.dims) or len(node.args) != 2:
        return None
    dims = node.args[1] if node.target is aten.squeeze.dims else [node.args[1]]
    rank = _rank(node.args[0])
    return SQUEEZE, (node.args[0], tuple(sorted(_from_end(d, rank) for d in dims)))


def _as_topk(node: fx.Node) -> Canonical | None:
    """topk(x, k, dim=-1, largest=True, sorted=True): `sorted` dropped (see the module docstring)."""
    if node.target is not aten.topk.default:
        return None
    given = {**dict(zip(("self", "k", "dim", "largest", "sorted"), node.args)), **node.kwargs}
    dim, largest = given.get("dim", -1), given.get("largest", True)
    args: tuple[Any, ...] = (given["self"], given["k"], _from_end(dim, _rank(given["self"])))
    return (node.target,), args if largest is True else (*args, largest)


def _is_call(node: Any, target: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is target and not node.kwargs


def _silu_parts(node: fx.Node) -> tuple[fx.Node, list[fx.Node]] | None:
    """(x, inner nodes) when `node` computes silu(x): `silu(x)`, `x * sigmoid(x)` (either order) or
    `x / (exp(-x) + 1)` (either order of the add)."""
    if _is_call(node, aten.silu.default) and len(node.args) == 1:
        return node.args[0], []
    if _is_call(node, aten.mul.Tensor) and len(node.args) == 2:
        for x, sig in (node.args, node.args[::-1]):
            if _is_call(sig, aten.sigmoid.default) and sig.args[0] is x:
                return x, [sig]
    if _is_call(node, aten.div.Tensor) and len(node.args) == 2:
        x, add = node.args
        if _is_call(add, aten.add.Tensor) and len(add.args) == 2:
            for exp, one in (add.args, add.args[::-1]):
                if one == 1 and _is_call(exp, aten.exp.default) and _is_call(exp.args[0], aten.neg.default) \
                        and exp.args[0].args[0] is x:
                    return x, [add, exp, exp.args[0]]
    return None


def _as_silu(node: fx.Node) -> Canonical | None:
    found = _silu_parts(node)
    return (SILU, (found[0],)) if found is not None else None


def _as_split(node: fx.Node) -> Canonical | None:
    """split(x, n, d) as split_with_sizes(x, [n] * (size / n), d) where the size is known and a multiple."""
    if node.target is aten.split_with_sizes.default and len(node.args) >= 2:
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
        return SPLIT, (node.args[0], list(node.args[1]), _from_end(dim, _rank(node.args[0])))
    if node.target is not aten.split.Tensor or len(node.args) < 2 or not isinstance(node.args[1], int):
        return None
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    val = node_value(node.args[0])
    size = val.shape[dim] if isinstance(val, torch.Tensor) and isinstance(dim, int) else None
    if not isinstance(size, int) or node.args[1] < 1 or size % node.args[1]:
        return None
    return SPLIT, (node.args[0], [node.args[1]] * (size // node.args[1]), _from_end(dim, val.dim()))


def _as_scalar_fill(node: fx.Node) -> Canonical | None:
    """A 0-d tensor of one value: `scalar_tensor(v)`, as traced, or `full([], v)`, which Inductor's joint-graph
    constant folding makes of it (a masked_fill's -inf, for one). Layout, device and pin_memory are dropped,
    as factory ops traced on meta tensors match any device."""
    if node.target is aten.scalar_tensor.default and len(node.args) == 1:
        return SCALAR_FILL, (node.args[0], node.kwargs.get("dtype"))
    if node.target is aten.full.default and len(node.args) == 2 and list(node.args[0]) == []:
        return SCALAR_FILL, (node.args[1], node.kwargs.get("dtype"))
    return None


#: recognisers of equivalent spellings, tried in order: each names what a node computes or passes
EQUIVALENCES: tuple[Callable[[fx.Node], Canonical | None], ...] = (_as_transpose, _as_cast, _as_scalar_fill,
                                                                   _as_unsqueezed, _as_squeeze, _as_topk, _as_silu,
                                                                   _as_split)
#: the recognisers that read an inner node into the outer one (`absorbed`); `canonical(fold=False)` skips them
FOLDING = frozenset({_as_unsqueezed, _as_silu})


def absorbed(node: fx.Node) -> list[fx.Node]:
    """The nodes a recogniser folded into `node`'s canonical form that belong to its match: the inner
    node of an unsqueeze / unary pair, the sigmoid or exp chain of a silu, each while only the folded
    form reads it (one shared with other readers stays theirs)."""
    if node.op != "call_function":
        return []
    pair = _unsqueezed_pair(node)
    silu = _silu_parts(node) if pair is None else None
    inner = [pair[2]] if pair is not None else silu[1] if silu is not None else []
    own = {node, *inner}
    return [n for n in inner if all(u in own or is_metadata_check(u) for u in n.users)]


_POSITIONAL_DEFAULTS: dict[Any, tuple[tuple[bool, Any], ...]] = {}


def _positional_defaults(target: Any) -> tuple[tuple[bool, Any], ...]:
    """(has a default, default) per positional argument of an op's schema (cached per op)."""
    if target not in _POSITIONAL_DEFAULTS:
        schema = getattr(target, "_schema", None)
        args = [a for a in schema.arguments if not a.kwarg_only] if schema is not None else []
        _POSITIONAL_DEFAULTS[target] = tuple((a.has_default_value(), a.default_value if a.has_default_value()
                                              else None) for a in args)
    return _POSITIONAL_DEFAULTS[target]


def _normalised_args(node: fx.Node) -> tuple[Any, ...]:
    """Positional args with dims counted from the end (`DIM_ARGS`) and trailing schema defaults dropped."""
    args = list(node.args)
    for i in DIM_ARGS.get(node.target, ()):
        if i < len(args):
            args[i] = _from_end(args[i], _rank(node if node.target is aten.unsqueeze.default else args[0]))
    defaults = _positional_defaults(node.target)
    while args and len(args) <= len(defaults):
        has_default, default = defaults[len(args) - 1]
        last = args[-1]
        if not has_default or isinstance(last, fx.Node) or not _is_default(last, default):
            break
        args.pop()
    return tuple(args)


def _is_default(value: Any, default: Any) -> bool:
    if isinstance(value, (list, tuple)) and isinstance(default, (list, tuple)):
        return list(value) == list(default)
    return type(value) is type(default) and value == default


def canonical(node: fx.Node, fold: bool = True) -> Canonical:
    """(op key, arguments) naming what `node` computes, independent of how it was spelled.

    Arguments are positional args followed by non-default kwargs as (name, value) pairs; tensor
    arguments stay fx.Nodes. Two call nodes compute the same function of their arguments when
    their keys are equal and their arguments match. Without `fold`, no inner node is read into
    `node` (`FOLDING`): the node as written, its direct inputs its arguments.
    """
    for recognise in EQUIVALENCES:
        if not fold and recognise in FOLDING:
            continue
        found = recognise(node)
        if found is not None:
            return found
    kwargs = dict(node.kwargs)
    for name, default in DEFAULT_KWARGS.get(node.target, {}).items():
        if kwargs.get(name, default) == default:
            kwargs.pop(name, None)
    return (node.target,), _normalised_args(node) + tuple(sorted(kwargs.items()))


def op_key(node: fx.Node, fold: bool = True) -> tuple[Any, ...]:
    """The op key of `canonical(node, fold)`."""
    return canonical(node, fold)[0]


def is_commutative(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target in COMMUTATIVE and len(node.args) == 2
            and node.kwargs.get("alpha", 1) == 1)


#: `x op c` that is `x` when the scalar c is the identity: op -> (identity, c's positions). Inductor's joint-graph
#: pass (`remove_no_ops`) drops them; from torch 2.14 also with a literal c, e.g. the router's `* routed_scaling`
#: at 1.0, so a pattern traced with c as a literal wildcard meets x where it expects the op
IDENTITY_LITERALS: dict[Any, tuple[float, tuple[int, ...]]] = {
    aten.mul.Tensor: (1.0, (0, 1)), aten.div.Tensor: (1.0, (1,)),
    aten.add.Tensor: (0.0, (0, 1)), aten.sub.Tensor: (0.0, (1,))}


def identity_operand(node: fx.Node) -> tuple[fx.Node, Any, float] | None:
    """(x, c, identity) when `node` is `x op c` with a literal scalar c that Inductor removes at its
    identity (`IDENTITY_LITERALS`) and the op keeps x's dtype; else None. Read on patterns: the
    matcher lets the graph leave such an op out when c is a literal wildcard (bound to the identity)."""
    if node.op != "call_function" or node.target not in IDENTITY_LITERALS or len(node.args) != 2 \
            or node.kwargs.get("alpha", 1) != 1:
        return None
    identity, positions = IDENTITY_LITERALS[node.target]
    for i in positions:
        x, c = node.args[1 - i], node.args[i]
        if isinstance(x, fx.Node) and isinstance(c, (int, float)) and not isinstance(c, bool):
            xv, v = node_value(x), node_value(node)
            if isinstance(xv, torch.Tensor) and isinstance(v, torch.Tensor) and xv.dtype == v.dtype:
                return x, c, identity
    return None


def is_layout_only(node: fx.Node) -> bool:
    """Views and transposes: no kernel, free to keep alive beside a fused op for another reader."""
    return is_transparent(node) or (node.op == "call_function" and op_key(node) == TRANSPOSE_LAST2)


def forward_users(node: fx.Node) -> list[fx.Node]:
    """The non-transparent readers of `node`'s value: views, casts and in-place copies of it are
    walked through (the matcher's view of who consumes a value), metadata checks dropped."""
    out: list[fx.Node] = []
    todo = [(user, node) for user in node.users]
    seen: set[fx.Node] = set()
    while todo:
        user, parent = todo.pop(0)
        if user in seen or is_metadata_check(user):
            continue
        seen.add(user)
        if is_transparent(user) or copied_value(user) is parent:
            todo += [(u, user) for u in user.users]
        else:
            out.append(user)
    return out


def op_name(node: Any, overload: bool = False) -> str:
    """Short name of what a node computes, for reasons: `aten.view`, `_c10d_functional.wait_tensor`;
    with `overload`, the overload too (`aten.squeeze.dims`): two overloads of one op are two spellings."""
    if not isinstance(node, fx.Node):
        return repr(node)
    if node.op != "call_function":
        return node.op
    key = op_key(node)
    if key in (TRANSPOSE_LAST2, CAST):
        return key[0]
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return str(target) if overload else str(target.overloadpacket)
    return getattr(target, "__name__", str(target))


def op_names_apart(expected: fx.Node, found: list[fx.Node]) -> tuple[str, list[str]]:
    """`op_name` of a pattern node and of the graph nodes found in its place, with the overloads
    where a short name alone would read the same on both sides ("aten.squeeze ... not aten.squeeze")."""
    names = [op_name(n) for n in found]
    want = op_name(expected)
    if want in names:
        return op_name(expected, overload=True), [op_name(n, overload=True) for n in found]
    return want, names


# --- the reversible addmm split -------------------------------------------------------------------
_SPLIT_MARK = "k3fuse_split_addmm"


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


__all__ = ["VIEW_LIKE", "COPY_OPS", "CAST_OPS", "TRANSPOSES", "COMMUTATIVE", "DEFAULT_KWARGS", "METADATA_CHECKS",
           "UNSQUEEZE_COMMUTES", "DIM_ARGS", "EQUIVALENCES", "FOLDING", "TRANSPOSE_LAST2", "CAST", "SCALAR_FILL",
           "SQUEEZE", "UNSQUEEZED", "SILU", "SPLIT", "Canonical", "canonical", "absorbed", "op_key", "cast_dtype",
           "copied_value", "IDENTITY_LITERALS", "identity_operand", "is_commutative", "is_transparent",
           "is_layout_only", "is_metadata_check", "skip_transparent", "value_root", "forward_users", "op_name",
           "op_names_apart", "split_addmm", "restore_addmm", "strip_transparent"]
