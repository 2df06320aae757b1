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
* *Reversible graph rewrites*: `split_addmm` turns `addmm(b, x, w)` into `mm(x, w) + b` so the
  bias spelling of a linear matches the `mm`+`add` spelling; `restore_addmm` folds back every
  pair no rule consumed, so the unrewritten part of a graph reaches the compiler as it came.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from .ir import node_value

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
