"""The matcher's vocabulary: what an ATen node computes, whatever the spelling.

One traced pattern matches every way a model writes it because the matcher reads graphs through
these tables and functions:

* *equivalent spellings*: `canonical(node)` names an op by what it computes. Each recogniser in
  `EQUIVALENCES` turns one family of spellings into one key: `t`, `transpose` and `permute` that
  swap the last two dims are `transpose_last2`; `_to_copy(dtype=)`, `to.dtype` and
  `convert_element_type` are one `cast`. Arguments a spelling may write or leave out at their
  default (`DEFAULT_KWARGS`: `add(x, y, alpha=1)`) are dropped. A new spelling of an existing
  computation is one more recogniser or table entry here.
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
#: checks torch.export inserts for `.float()` / `.to()` calls that were no-ops: they read a value's
#: metadata only, so they never make a value "used outside" a match and die with it
METADATA_CHECKS = frozenset({aten._assert_tensor_metadata.default})

#: what `canonical` returns: (op key, arguments)
Canonical = tuple[tuple[Any, ...], tuple[Any, ...]]
TRANSPOSE_LAST2 = ("transpose_last2",)
CAST = ("cast",)
SCALAR_FILL = ("scalar_fill",)


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
EQUIVALENCES: tuple[Callable[[fx.Node], Canonical | None], ...] = (_as_transpose, _as_cast, _as_scalar_fill)


def canonical(node: fx.Node) -> Canonical:
    """(op key, arguments) naming what `node` computes, independent of how it was spelled.

    Arguments are positional args followed by non-default kwargs as (name, value) pairs; tensor
    arguments stay fx.Nodes. Two call nodes compute the same function of their arguments when
    their keys are equal and their arguments match.
    """
    for recognise in EQUIVALENCES:
        found = recognise(node)
        if found is not None:
            return found
    kwargs = dict(node.kwargs)
    for name, default in DEFAULT_KWARGS.get(node.target, {}).items():
        if kwargs.get(name, default) == default:
            kwargs.pop(name, None)
    return (node.target,), tuple(node.args) + tuple(sorted(kwargs.items()))


def op_key(node: fx.Node) -> tuple[Any, ...]:
    """The op key of `canonical(node)`."""
    return canonical(node)[0]


def is_commutative(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target in COMMUTATIVE and len(node.args) == 2
            and node.kwargs.get("alpha", 1) == 1)


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


def op_name(node: Any) -> str:
    """Short name of what a node computes, for reasons: `aten.view`, `_c10d_functional.wait_tensor`."""
    if not isinstance(node, fx.Node):
        return repr(node)
    if node.op != "call_function":
        return node.op
    key = op_key(node)
    if key in (TRANSPOSE_LAST2, CAST):
        return key[0]
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return str(target.overloadpacket)
    return getattr(target, "__name__", str(target))


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
           "EQUIVALENCES", "TRANSPOSE_LAST2", "CAST", "Canonical", "canonical", "op_key", "cast_dtype",
           "copied_value", "is_commutative", "is_transparent", "is_layout_only", "is_metadata_check",
           "skip_transparent", "value_root", "forward_users", "op_name", "split_addmm", "restore_addmm",
           "strip_transparent"]
