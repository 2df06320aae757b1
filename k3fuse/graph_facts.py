"""Facts about the ATen FX graph every door hands to the pipeline, defined once.

Qualified op names, what a collective, its handle and a synchronisation point are, the marker the
doors put on static placeholders, node order and node values (traced, or computed on fake tensors
for a new node), whether a node was erased, and the recipe that rebuilds an erased one. Ops
declare their own traits (`OpTraits`: a synchronisation point, an op that only orders itself
inside a collective's window, argument positions taken only for ordering, a side-stream bracket)
with `declare_op_traits`; k3fuse's fused ops do so where they are declared (kernels/ops/), so the
verifier and the rules know no op by name.

A leaf over torch.fx: imports nothing from k3fuse.
"""
from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.fx as fx
from torch._ops import OpOverload, OpOverloadPacket

#: node.meta key the doors set on placeholders that are static (parameters, buffers and constants
#: the graph never mutates); nothing else may be assumed static
STATIC_META = "k3fuse_static"
#: the functional collectives' op namespace (k3fuse.compat holds the ops themselves)
COLLECTIVE_NAMESPACE = "_c10d_functional"
WAIT_TENSOR = f"{COLLECTIVE_NAMESPACE}::wait_tensor"


@dataclass(frozen=True)
class OpTraits:
    """What the verifier and the rules need to know about an op's ordering.

    sync: data written elsewhere is valid after the call (a wait, a fused collective, a join).
    collective_window: takes a collective handle only to sit inside the collective's window (never reads it).
    ordering_args: argument positions taken only to be ordered after them, never read.
    side_stream: the op brackets a region of nodes that runs on a side stream: "fork" opens it (the
    region reads the main stream's values only through the fork's output), "end" closes it (its
    argument 0 is the region's output), "join" orders the main stream after it (argument 0 the same
    output). A marker's last argument is its region's site number. `verify.check_side_streams`.
    """

    sync: bool = False
    collective_window: bool = False
    ordering_args: frozenset[int] = frozenset()
    side_stream: Literal["fork", "end", "join"] | None = None


_TRAITS: dict[str, OpTraits] = {WAIT_TENSOR: OpTraits(sync=True)}
_NO_TRAITS = OpTraits()


def declare_op_traits(qualname: str, traits: OpTraits) -> None:
    """Declare the ordering traits of op "namespace::name" (called where the op is declared)."""
    _TRAITS[qualname] = traits


def op_traits(node_or_qualname: fx.Node | str | None) -> OpTraits:
    name = op_qualname(node_or_qualname) if isinstance(node_or_qualname, fx.Node) else node_or_qualname
    return _TRAITS.get(name or "", _NO_TRAITS)


def op_qualname(node: fx.Node) -> str | None:
    """'namespace::name' of an op call node, without the overload; None for non-op nodes."""
    if node.op != "call_function":
        return None
    target = node.target
    if isinstance(target, OpOverload):
        return target._schema.name
    if isinstance(target, OpOverloadPacket):
        return target._qualified_op_name
    return None


def is_sync(node: fx.Node) -> bool:
    return op_traits(node).sync


def is_wait(node: fx.Node) -> bool:
    return op_qualname(node) == WAIT_TENSOR


def is_collective(node: fx.Node) -> bool:
    """A functional collective call (its output is a handle until its wait_tensor)."""
    name = op_qualname(node)
    return name is not None and name.startswith(COLLECTIVE_NAMESPACE + "::") and name != WAIT_TENSOR


def is_handle(node: fx.Node) -> bool:
    """Output of a functional collective (or an item of a coalesced one) not yet waited on."""
    if is_collective(node):
        return True
    return (node.op == "call_function" and node.target is operator.getitem
            and isinstance(node.args[0], fx.Node) and is_collective(node.args[0]))


def mark_static(node: fx.Node, static: bool = True) -> None:
    """The doors' marker: this placeholder is a static weight (or explicitly not)."""
    node.meta[STATIC_META] = bool(static)


def is_static_placeholder(node: object) -> bool:
    """A placeholder the door marked static (parameter, buffer or constant never mutated)."""
    return isinstance(node, fx.Node) and node.op == "placeholder" and bool(node.meta.get(STATIC_META))


def is_static_value(node: fx.Node) -> bool:
    """A value no synchronisation can change: a static placeholder or a get_attr constant."""
    return node.op == "get_attr" or is_static_placeholder(node)


def node_value(node: Any) -> Any:
    """The traced value of a node (meta["val"]: a fake tensor, SymInt, ...), None for a non-node."""
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def tensor_value(node: Any) -> torch.Tensor | None:
    """The node's traced value if it is a tensor, else None."""
    v = node_value(node)
    return v if isinstance(v, torch.Tensor) else None


def leading_tokens(shape: Sequence[Any]) -> int | None:
    """Tokens of a decode activation of `shape` [..., features]: the product of the leading dims,
    None when one of them is symbolic."""
    n = 1
    for d in shape[:-1]:
        if not isinstance(d, int):
            return None
        n *= d
    return n


def node_order(graph: fx.Graph) -> dict[fx.Node, int]:
    """Each node's position in graph order (the order the code runs in)."""
    return {n: i for i, n in enumerate(graph.nodes)}


def is_erased(node: Any) -> bool:
    """True once `graph.erase_node` removed `node` (torch.fx keeps no public flag for it)."""
    return bool(getattr(node, "_erased", False))


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


def fill_fake_values(nodes: Sequence[fx.Node]) -> None:
    """Give each new node without one its meta value, computed by `fake_call`."""
    for n in nodes:
        if "val" not in n.meta:
            val = fake_call(n.target, n.args, n.kwargs)
            if val is not None:
                n.meta["val"] = val


@dataclass(frozen=True)
class NodeRecipe:
    """What rebuilds a call node a reversible rewrite erased: its name, target, arguments and meta."""

    name: str
    target: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    meta: dict[str, Any]

    @classmethod
    def of(cls, node: fx.Node) -> NodeRecipe:
        return cls(node.name, node.target, tuple(node.args), dict(node.kwargs), dict(node.meta))

    def rebuild(self, graph: fx.Graph, args: tuple[Any, ...] | None = None,
                kwargs: dict[str, Any] | None = None) -> fx.Node:
        """The node again at the graph's insertion point (with `args` / `kwargs` where given)."""
        node = graph.create_node("call_function", self.target, self.args if args is None else args,
                                 self.kwargs if kwargs is None else kwargs, name=self.name)
        node.meta.update(self.meta)
        return node


__all__ = ["STATIC_META", "WAIT_TENSOR", "OpTraits", "declare_op_traits", "op_traits", "op_qualname", "COLLECTIVE_NAMESPACE",
           "is_sync", "is_wait", "is_collective", "is_handle", "mark_static", "is_static_placeholder",
           "is_static_value", "node_order", "node_value", "tensor_value", "leading_tokens", "is_erased", "fake_call",
           "fill_fake_values", "NodeRecipe"]
