"""The K3 decode spelling the rules trace (docs/architecture.md "Reference model spelling").

The math itself (rms_norm, situ_glu, linear, all_reduce_sum) is k3fuse.spelling's, the functions
the model computes with, re-exported here; this module adds what tracing a pattern needs.
Plain torch, no k3fuse ops: each rule traces these to ATen with the doors' decomposition table.
A trunk in fp32 has no casts in its graph and a bf16/fp16 trunk has them, so every pattern is
traced once per trunk dtype (`per_dtype`); the variant name carries the dtype only when it is
not fp32.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from k3fuse.rule_api import GuardFailure, PatternSpec, Variant, is_erased, is_metadata_check, node_order
from k3fuse.spelling import all_reduce_sum, linear, rms_norm, situ_glu

#: trunk dtypes the rules trace patterns for and accept (K3 ships a bf16 trunk; fp32 for tests)
TRUNK_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)
GROUP = "tp"  # example group name: a literal wildcard, the graph's own name is captured


def per_dtype(name: str, fn: Callable[..., Any], example: Callable[[torch.dtype], tuple[Any, ...]],
              params: Any = None) -> list[PatternSpec]:
    """One PatternSpec per trunk dtype, for spellings with casts (`.float()`, `.to(x.dtype)`), whose
    ATen differs by dtype: `example(dtype)` builds the example inputs; `params`: the variant's typed
    parameters (`Variant.params`)."""
    specs = []
    for dtype in TRUNK_DTYPES:
        key = Variant(name, dtype, params)
        specs.append(PatternSpec(str(key), fn, lambda dtype=dtype: example(dtype), key))
    return specs


def cast_free(name: str, fn: Callable[..., Any], example: Callable[[torch.dtype], tuple[Any, ...]],
              params: Any = None) -> list[PatternSpec]:
    """A spelling without casts traces to the same ATen in every dtype: one PatternSpec."""
    return [PatternSpec(name, fn, lambda: example(torch.float32), Variant(name, None, params))]


def randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype)


def dtype_of(node: Any) -> torch.dtype | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val.dtype if isinstance(val, torch.Tensor) else None


def trunk_dtype(node: Any, what: str, expected: torch.dtype | None = None) -> GuardFailure | None:
    """The activation feeding a fused op is in a dtype the ops support and, when the context fixes
    the trunk dtype (`DecodeContext.dtype`, passed as `expected`), in that one."""
    dtype = dtype_of(node)
    if dtype not in TRUNK_DTYPES:
        return GuardFailure("site", "dtype", f"{what} dtype not supported by the fused op",
                            {what: str(dtype), "allowed": [str(d) for d in TRUNK_DTYPES]})
    if expected is not None and dtype != expected:
        return GuardFailure("site", "dtype", f"{what} dtype is not the context's trunk dtype",
                            {what: str(dtype), "expected": str(expected)})
    return None


#: norm-weight dtypes the fused collectives' epilogues read
NORM_WEIGHT_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)


def collective_weight(node: Any, what: str, x_dtype: torch.dtype | None, dims: int = 2) -> GuardFailure | None:
    """A weight a fused collective reads is one it supports: a `dims`-D row-major tensor in x's dtype
    (a norm weight, dims=1: bf16 / fp16 / fp32). Declined here, at compile time, with the reason in
    the log: a weight the kernel cannot take would otherwise fail inside the collective call and
    take the group's workspace down for every layer."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return GuardFailure("site", "weight_layout", f"{what}: no shape/dtype known", {what: repr(node)})
    allowed = NORM_WEIGHT_DTYPES if dims == 1 else (x_dtype,)
    if val.dtype not in allowed:
        return GuardFailure("site", "weight_dtype", f"{what} dtype not supported by the fused collective",
                            {what: str(val.dtype), "allowed": [str(d) for d in allowed]})
    if val.dim() != dims:
        return GuardFailure("site", "weight_layout", f"{what} is not {dims}-D",
                            {what: list(val.shape)})
    try:
        contiguous = val.is_contiguous()
    except Exception:   # a symbolic stride: leave it to the staging copy
        contiguous = True
    if not contiguous:
        return GuardFailure("site", "weight_layout", f"{what} is not row-major contiguous (a per-call copy)",
                            {what: list(val.shape), "stride": [int(s) for s in val.stride()]})
    return None


def numeric_literals(scalars: dict[str, Any], names: Sequence[str], values: dict[str, Any]) -> GuardFailure | None:
    """The first of `names` whose captured literal is not a number (bool excluded), as a site failure."""
    for name in names:
        value = scalars.get(name)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return GuardFailure("site", name, f"{name} is not a numeric literal", {**values, name: repr(value)})
    return None


def erase_dead(graph: fx.Graph, nodes: Sequence[fx.Node]) -> None:
    """Erase `nodes` (reverse graph order) once unused, with any metadata-only asserts on them."""
    order = node_order(graph)
    for node in sorted(nodes, key=lambda n: -order.get(n, -1)):
        if is_erased(node):
            continue
        for user in list(node.users):
            if is_metadata_check(user):
                graph.erase_node(user)
        if not node.users:
            graph.erase_node(node)


__all__ = ["TRUNK_DTYPES", "GROUP", "rms_norm", "situ_glu", "all_reduce_sum", "linear",
           "per_dtype", "cast_free", "randn", "dtype_of", "trunk_dtype", "erase_dead"]
