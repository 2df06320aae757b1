"""`OpDecl`, one fused op's declaration, and `declare`, which turns it into torch.ops.k3fuse.<op>.

A declaration holds everything the rest of k3fuse knows about an op (docs/architecture.md "Custom
ops"): its schema; its fake impl (output shapes/dtypes only, so FakeTensor tracing, AOT, Inductor
and torch.export never run a kernel or a collective); its stock sequence (the unfused torch ops it
replaced: the kill switch and the call guard run it); its plain-torch reference (the CPU path and
the numerical oracle); whether it is a collective (no per-rank fallback); its ordering traits for
the verifier (`k3fuse.graph_facts.OpTraits`: sync point, anchor, ordering-only arguments); and its `Spec`
type (kernels/spec.py), which the implementations' predicates read. `declare` defines the
torch.library op, whose one CompositeExplicitAutograd impl (every device) hands the arguments,
minus `strict`, to `kernels.dispatch.dispatch`, which picks and counts the implementation.

Each op module under kernels/ops/ declares its ops and registers its implementations on import.
Ops are inference-only (Autograd falls through: outputs never require grad). Collective ops: every
rank must pick the same implementation (a predicate decides from shapes, dtypes, world size and
configuration only), or the ranks would run different collectives.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from k3fuse.graph_facts import OpTraits, declare_op_traits

from . import collective_guard  # noqa: F401  (installs the guard every collective op's dispatch runs)
from . import dispatch as _dispatch

NAMESPACE = "k3fuse"
REFERENCE_PRIORITY = -100


@dataclass(frozen=True)
class OpDecl:
    """One fused op, declared once.

    reference: the "reference" Impl (any device, lowest priority; None: the op is not dispatched).
    eager: the op's own eager body when it is more than a dispatch (the fork returns x_pass, the
    join waits for the side stream); default: dispatch with the schema's arguments.
    side_effect: returns nothing yet must survive dead-code elimination (l2_prefetch).
    spec: the op's Spec type; `Spec.from_call` builds what the implementations' predicates read.
    """

    name: str
    schema: str
    fake: Callable[..., Any]
    stock: Callable[..., Any] | None
    reference: Callable[..., Any] | None
    traits: OpTraits = OpTraits()
    collective: bool = False
    side_effect: bool = False
    eager: Callable[..., Any] | None = None
    spec: Any = None  # the op's Spec subclass (kernels/spec.py); None: implementations get None

    @property
    def qualname(self) -> str:
        return f"{NAMESPACE}::{self.name}"


def _always(spec: object) -> None:
    return None


def rows(x: torch.Tensor, features) -> tuple:
    """The shape of x with its last dim replaced by `features`."""
    return (*x.shape[:-1], features)


def check_gemm(x: torch.Tensor, weight: torch.Tensor, op: str) -> None:
    torch._check(x.shape[-1] == weight.shape[-1],
                 lambda: f"k3fuse.{op}: x {tuple(x.shape)} and weight {tuple(weight.shape)} "
                         "disagree on the reduction dim")


SYNC = OpTraits(sync=True)

_lib = torch.library.Library(NAMESPACE, "DEF")


def _dispatching_eager(decl: OpDecl) -> Callable[..., Any]:
    """The default eager body: the schema's arguments in order (defaults filled in), handed to
    dispatch positionally, `strict` and `max_tokens` by keyword. The argument layout is worked out
    once here; a call only indexes."""
    arguments = torch._C.parse_schema(decl.qualname + decl.schema).arguments
    names = [a.name for a in arguments]
    index = {n: i for i, n in enumerate(names)}
    defaults = tuple(a.default_value if a.has_default_value() else None for a in arguments)
    keyword_positions = [(n, index[n]) for n in ("max_tokens", "strict") if n in index]
    positions = [i for i, n in enumerate(names) if n not in ("max_tokens", "strict")]

    def eager(*args: Any, **kwargs: Any) -> Any:
        full = [*args, *defaults[len(args):]]
        for name, value in kwargs.items():
            full[index[name]] = value
        return _dispatch.dispatch(decl.name, *[full[i] for i in positions],
                                  **{n: full[i] for n, i in keyword_positions})

    eager.__name__ = f"_{decl.name}"
    return eager


def _group_positions(decl: OpDecl) -> tuple[int, int]:
    """Where (group_name, world_size) sit among the arguments dispatch receives (schema order
    without max_tokens and strict): the collective guard reads them on every call."""
    names = [a.name for a in torch._C.parse_schema(decl.qualname + decl.schema).arguments
             if a.name not in ("max_tokens", "strict")]
    return names.index("group_name"), names.index("world_size")


def declare(decl: OpDecl) -> None:
    """Define the op and register everything its declaration says (once, on import)."""
    _lib.define(decl.name + decl.schema)
    torch.library.impl(decl.qualname, "CompositeExplicitAutograd", lib=_lib)(decl.eager or _dispatching_eager(decl))
    torch.library.register_fake(decl.qualname, lib=_lib)(decl.fake)
    # Inference-only: declare the op non-differentiable (Autograd falls through), so weights that
    # happen to require grad neither trip autograd's "no autograd kernel" warning nor make
    # torch.compile trace a backward; outputs never require grad.
    _lib.impl(decl.name, torch.library.fallthrough_kernel, "Autograd")
    declare_op_traits(decl.qualname, decl.traits)
    _dispatch.declare(decl.name, decl.spec.from_call if decl.spec is not None else None)
    if decl.collective:
        _dispatch.COLLECTIVE_OPS.add(decl.name)
        _dispatch.COLLECTIVE_ARGS[decl.name] = _group_positions(decl)
    if decl.stock is not None:
        _dispatch.register_stock(decl.name, decl.stock)
    if decl.reference is not None:
        _dispatch.register_impl(decl.name, _dispatch.Impl(_dispatch.REFERENCE, _always, decl.reference,
                                                          REFERENCE_PRIORITY, _dispatch.ALL_DEVICES))
    if decl.side_effect:
        _keep_alive(decl.name)


def _keep_alive(name: str) -> None:
    """An op that returns nothing would be dropped by every dead-code pass: mark it side-effectful.

    `torch.fx.node.has_side_effect` on the packet and the overload makes `Node.is_impure()` true,
    which fx `eliminate_dead_code`, AOTAutograd, Inductor's scheduler and torch.export all honour
    (verified on CPU with torch 2.13 in tests/test_ops.py: DCE, torch.compile(inductor) with the op
    between a functional all_reduce and its wait, export + save/load).

    Not chosen: `torch.library._register_effectful_op(..., EffectType.ORDERED)` (also keeps it, but
    threads an effect token through AOT and export: a `with_effects` wrapper node plus a token
    input/output that every rule, the verifier and post-grad insertion would have to handle), and a
    `mutates_args` dummy (a fake mutation makes functionalization copy the weights).
    """
    packet = getattr(getattr(torch.ops, NAMESPACE), name)
    torch.fx.node.has_side_effect(packet)
    torch.fx.node.has_side_effect(packet.default)


__all__ = ["OpDecl", "SYNC", "NAMESPACE", "declare", "check_gemm", "rows"]
