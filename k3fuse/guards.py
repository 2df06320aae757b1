"""Guard failures and the reusable predicates rules check before rewriting.

Three levels (see docs/architecture.md): *contract* (once per graph: TP size, device, dtype,
multicast refusal), *site* (per match: shapes, divisibility by TP, static weights) and *call*
(inside a fused op at run time). A predicate returns None when it holds and a `GuardFailure`
carrying the values it looked at when it does not, so every refusal is a log line with numbers.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

import torch
import torch.fx as fx

from .graph_facts import is_static_placeholder as is_static
from .graph_facts import leading_tokens, node_value

if TYPE_CHECKING:
    from .context import DecodeContext

GuardLevel = Literal["contract", "site", "call"]


@dataclass(frozen=True)
class KernelCatalog:
    """What the guards ask of the kernel registry, installed by k3fuse.plugins (kernels.dispatch),
    so the framework never imports the kernels.

    ops_without_kernel(ops): the ops with no CUDA kernel in this build.
    import_errors(): kernel modules that failed to import, {module: error}.
    coverage(spec, tokens): token counts at which no CUDA kernel of `spec.op` accepts `spec`, each
    with every kernel's reason.
    is_collective(op): the op is a collective (its ranks exchange data).
    """

    ops_without_kernel: Callable[[Iterable[str]], list[str]]
    import_errors: Callable[[], dict[str, str]]
    coverage: Callable[[KernelSpec, Iterable[int]], dict[int, list[str]]]
    is_collective: Callable[[str], bool]


class KernelSpec(Protocol):
    """What the coverage guard reads of an op's Spec (k3fuse.kernels.spec.Spec)."""

    op: ClassVar[str]

    def site_values(self) -> dict[str, Any]: ...


_catalog: KernelCatalog | None = None


def install_kernel_catalog(catalog: KernelCatalog) -> None:
    """Called by k3fuse.plugins (the package root and the doors)."""
    global _catalog
    _catalog = catalog


def _kernel_catalog() -> KernelCatalog:
    if _catalog is None:
        raise RuntimeError("no kernel registry installed: call k3fuse.plugins.install_plugins() (import k3fuse does)")
    return _catalog


@dataclass(frozen=True)
class GuardFailure:
    """One failed guard: where it applies, its name, why, and the values it saw."""

    level: GuardLevel
    guard: str
    message: str
    values: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        vals = ", ".join(f"{k}={v!r}" for k, v in self.values.items())
        return f"[{self.level}:{self.guard}] {self.message}" + (f" ({vals})" if vals else "")


def failures(*results: GuardFailure | None | Iterable[GuardFailure | None]) -> list[GuardFailure]:
    """Flatten predicate results into the list of failures (drops the Nones)."""
    out: list[GuardFailure] = []
    for r in results:
        if r is None:
            continue
        if isinstance(r, GuardFailure):
            out.append(r)
        else:
            out.extend(x for x in r if x is not None)
    return out


# --- contract predicates (once per graph) --------------------------------------------------------


def tp_at_least(ctx: DecodeContext, minimum: int = 2, level: GuardLevel = "contract") -> GuardFailure | None:
    """Tensor parallelism of at least `minimum` ranks (a fused collective needs a collective)."""
    if ctx.tp_size >= minimum:
        return None
    return GuardFailure(level, "tp_size", f"needs tp >= {minimum}", {"tp_size": ctx.tp_size, "minimum": minimum})


def device_capability_at_least(ctx: DecodeContext, minimum: tuple[int, int],
                               level: GuardLevel = "contract") -> GuardFailure | None:
    """A CUDA device of at least compute capability `minimum` (None on CPU fails)."""
    cap = ctx.device_capability
    if cap is not None and tuple(cap) >= tuple(minimum):
        return None
    return GuardFailure(level, "device_capability", f"needs compute capability >= {minimum}",
                        {"device_capability": cap, "minimum": minimum})


def kernels_available(ctx: DecodeContext, ops: Iterable[str], level: GuardLevel = "contract") -> GuardFailure | None:
    """Every op a rule emits has an implementation for the context's device.

    On CPU (no device capability) the reference implementation *is* the implementation. On a GPU a
    rule must not insert an op that would only ever run the reference fallback: strict mode would
    turn every call into an error, and the rewrite would be slower than the stock path.
    """
    if ctx.device_capability is None:
        return None
    catalog = _kernel_catalog()
    missing = catalog.ops_without_kernel(ops)
    if not missing:
        return None
    return GuardFailure(level, "kernel", f"no CUDA kernel for {', '.join('k3fuse.' + m for m in missing)} in this build",
                        {"ops": missing, "device_capability": ctx.device_capability,
                         "import_errors": catalog.import_errors()})


def site_tokens(node: Any) -> int | None:
    """Tokens of a decode activation node [..., features] (the product of its leading dims), or
    None when a dim is symbolic or the shape is unknown."""
    shape = shape_of(node)
    return None if shape is None else leading_tokens(shape)


def _spans(counts: Iterable[int]) -> str:
    """1,2,3,5,7,8 -> '1-3, 5, 7-8'."""
    out: list[str] = []
    for c in sorted(counts):
        if out and "-" in out[-1] and int(out[-1].split("-")[1]) == c - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{c}"
        elif out and "-" not in out[-1] and int(out[-1]) == c - 1:
            out[-1] = f"{out[-1]}-{c}"
        else:
            out.append(str(c))
    return ", ".join(out)


def kernel_covers(ctx: DecodeContext, spec: KernelSpec, tokens: int | None,
                  level: GuardLevel = "site") -> GuardFailure | None:
    """On a GPU, some CUDA kernel of `spec.op` accepts this site's `spec` (the op's Spec, built by
    the rule; the kernels' own predicates decide) at every token count the site can see: `tokens`
    when the graph fixes it, else the context's whole range.

    Why: an op inserted where no kernel serves the shape falls back on every call (strict mode
    raises, and the rewrite only adds a dispatch). On CPU the reference is the implementation.
    """
    if ctx.device_capability is None:
        return None
    counts = [tokens] if tokens is not None else range(ctx.tokens[0], ctx.tokens[1] + 1)
    uncovered = _kernel_catalog().coverage(spec, counts)
    if not uncovered:
        return None
    limits = sorted({why for whys in uncovered.values() for why in whys})
    op, shape = spec.op, spec.site_values()
    described = " ".join(f"{k}={v}" for k, v in shape.items())
    return GuardFailure(level, "kernel_shape",
                        f"no CUDA kernel of k3fuse.{op} serves {described} at tokens {_spans(uncovered)}",
                        {"op": op, **{k: str(v) if isinstance(v, torch.dtype) else v for k, v in shape.items()},
                         "tokens": _spans(uncovered), "limits": limits})


def dtype_in(ctx: DecodeContext, allowed: Iterable[torch.dtype], level: GuardLevel = "contract") -> GuardFailure | None:
    """The model dtype (when the context fixes one) is among `allowed`."""
    allowed = tuple(allowed)
    if ctx.dtype is None or ctx.dtype in allowed:
        return None
    return GuardFailure(level, "dtype", "model dtype not supported by the fused op",
                        {"dtype": str(ctx.dtype), "allowed": [str(d) for d in allowed]})


def multicast_refusal(ctx: DecodeContext, ops: Iterable[str], level: GuardLevel = "contract") -> GuardFailure | None:
    """The one multicast guard: under policy "require", a rule that inserts a collective op refuses.
    Why: k3fuse never uses NVLink multicast (a multicast object can take a host's shared GPUs
    down); its fused collectives are unicast one-shots over symmetric-memory peer buffers."""
    if ctx.multicast != "require":
        return None
    collective = sorted(op for op in ops if _kernel_catalog().is_collective(op))
    if not collective:
        return None
    return GuardFailure(level, "multicast", "NVLink multicast required, but k3fuse never uses it: its fused "
                        "collectives are unicast one-shots over symmetric-memory peer buffers",
                        {"policy": ctx.multicast, "ops": collective})


# --- site predicates (per match) -----------------------------------------------------------------


def divisible(value: int | torch.SymInt, by: int, what: str, level: GuardLevel = "site") -> GuardFailure | None:
    """`value` is a multiple of `by` (e.g. a weight dim and the TP size)."""
    if isinstance(value, int) and by > 0 and value % by == 0:
        return None
    return GuardFailure(level, "divisible", f"{what} is not divisible by {by}", {what: value, "by": by})


def static_weight(node: Any, what: str = "weight", level: GuardLevel = "site") -> GuardFailure | None:
    """`node` is a static placeholder, so the rewrite may read it early (prefetch, fuse)."""
    from .vocabulary import value_root

    root = value_root(node)
    if is_static(root):
        return None
    name = root.name if isinstance(root, fx.Node) else repr(root)
    kind = root.op if isinstance(root, fx.Node) else type(root).__name__
    return GuardFailure(level, "static_weight", f"{what} is not a static parameter",
                        {what: name, "node_kind": kind})


def token_count(node: Any, ctx: DecodeContext, dim: int | None = 0, what: str = "tokens",
                level: GuardLevel = "site") -> GuardFailure | None:
    """The token count of `node` (from its meta value) is within the context's range: its size
    along `dim`, or with dim=None the product of its leading dims (an activation [..., features]).

    A symbolic size passes here: the fused op checks it per call (call-level guard).
    """
    val = node_value(node)
    if not isinstance(val, torch.Tensor):
        return GuardFailure(level, "token_range", f"no shape known for {what}", {what: getattr(node, "name", node)})
    size = leading_tokens(val.shape) if dim is None else val.shape[dim]
    if not isinstance(size, int):
        return None
    lo, hi = ctx.tokens
    if lo <= size <= hi:
        return None
    return GuardFailure(level, "token_range", f"{what} outside the context's token range",
                        {what: size, "range": ctx.tokens})


def same_group(group_name: Any, ctx: DecodeContext, level: GuardLevel = "site") -> GuardFailure | None:
    """The collective runs over the context's TP group (a fused collective is built for that group)."""
    if group_name == ctx.group_name:
        return None
    return GuardFailure(level, "group", "the all-reduce is not over the context's TP group",
                        {"group_name": group_name, "tp_group": ctx.group_name})


def shape_of(node: Any) -> tuple[Any, ...] | None:
    """Shape of a node's meta value (ints or SymInts), or None if unknown."""
    val = node_value(node)
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


__all__ = [
    "GuardFailure",
    "GuardLevel",
    "failures",
    "tp_at_least",
    "device_capability_at_least",
    "KernelCatalog",
    "install_kernel_catalog",
    "kernels_available",
    "kernel_covers",
    "site_tokens",
    "dtype_in",
    "multicast_refusal",
    "divisible",
    "is_static",
    "static_weight",
    "token_count",
    "same_group",
    "shape_of",
]
