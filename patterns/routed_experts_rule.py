"""The routed experts: gate/up projections, SiTU-GLU, down projection per (token, slot) pair ->
k3fuse.routed_experts.

Why: at decode the routed experts are the MoE's largest weight read, and the model's spellings
either sort the pairs and launch three grouped GEMMs plus the sort, searchsorted, gathers and the
scatter back (CUDA), or copy one expert weight per pair (CPU). k3fuse.routed_experts is one op
whose kernel reads each selected expert's weights once per step, so the whole block is one
dispatch (and one place to put a better kernel).

Spelling: `routed_experts_grouped` and `routed_experts_gathered` of k3fuse/spelling.py, imported and
traced as is (the model calls `routed_experts`, which picks one of them, so they cannot drift):
    grouped:  argsort(experts) -> index_select -> searchsorted(arange(1, E+1)) -> index_select(a, order // k)
              -> _grouped_mm(w1), _grouped_mm(w3) -> situ_glu -> _grouped_mm(w2) -> index_copy back
    gathered: a expanded to [T, k, L] -> bmm(w1[experts]), bmm(w3[experts]) -> situ_glu -> bmm(w2[experts])
top_k, beta and linear_beta are literal wildcards. The example tensors are meta tensors with T*k
expert ids, where k is the int wildcard's sentinel (traced into the expand's shape and the
floor division): no real allocation. The trace bakes sizes into arguments (the expand's [T, k, L],
the scatter buffer's [T*k, L], arange's end E), so those are free sizes (`PatternSpec.free_sizes`),
captured and checked against the operands' shapes; the factory ops' meta device matches any
device. `torch._grouped_mm` has a fake impl for bf16 only (this torch), so the grouped spelling is
traced in bf16, the one dtype `use_grouped_mm` picks it for that the op runs in; the gathered one
in fp32 and bf16 (its situ_glu casts differ).
Runs after fused_routing (the expert ids are route_topk's, reshaped); shared_expert_stream, after
it, anchors its join on the routed output further down (the weighted sum, all-reduce and W_up), which
is still computed from the MoE input through the op, so it finds its join as before.

Needs: a [T, L] (any trunk dtype), experts int64 [T*top_k], w1/w3 [E, I, L] and w2 [E, L, I] static
in a's dtype, decode tokens; on a GPU, a kernel that covers (E, I, L, top_k, dtype) at those tokens.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from k3fuse.context import DecodeContext
from k3fuse.guards import (GuardFailure, failures, kernel_covers, shape_of, site_tokens,
                           static_weight, token_count)
from k3fuse.kernels.ops.routed_experts import RoutedExpertsSpec
from k3fuse.matcher import compiled_patterns, int_sentinel, near_miss
from k3fuse.rule import Match, PatternSpec, Rule, Variant
from k3fuse.spelling import routed_experts_gathered, routed_experts_grouped

from ._pattern_tools import dtype_of, numeric_literals

aten = torch.ops.aten

#: example sizes: distinctive, so no other literal of the traced pattern equals them (they become free
#: sizes); L and I multiples of 8 (torch._grouped_mm's 16-byte row alignment in bf16)
T, L, E, I = 1031, 1048, 1021, 1040
TOP_K, BETA, LINEAR_BETA = 16, 4.0, 25.0
GATHERED, GROUPED = "gathered", "grouped"


def _top_k_sentinel() -> int:
    """The value the matcher traces top_k (parameter 5) as: the example's T*k expert ids use it."""
    return int_sentinel(5)


def _example(dtype: torch.dtype) -> tuple:
    meta = {"device": "meta", "dtype": dtype}
    pairs = T * _top_k_sentinel()
    return (torch.empty(T, L, **meta), torch.empty(pairs, device="meta", dtype=torch.int64),
            torch.empty(E, I, L, **meta), torch.empty(E, I, L, **meta), torch.empty(E, L, I, **meta),
            TOP_K, BETA, LINEAR_BETA)


def _spec(form: str, fn: Any, dtype: torch.dtype, free_sizes: tuple[tuple[str, int], ...]) -> PatternSpec:
    key = Variant(form, dtype)
    return PatternSpec(str(key), fn, lambda: _example(dtype), key, free_sizes)


def _operand_failure(match: Match) -> GuardFailure | None:
    """a [T, L]; experts int64 [T*k]; w1/w3 [E, I, L], w2 [E, L, I] in a's dtype; the free sizes
    the match captured equal those shapes; numeric beta and linear_beta."""
    a, experts = shape_of(match["a"]), shape_of(match["experts"])
    w1, w3, w2 = (shape_of(match[n]) for n in ("w1", "w3", "w2"))
    top_k = match.scalars.get("top_k")
    values: dict[str, Any] = {n: [str(d) for d in s] if s is not None else None
                              for n, s in (("a", a), ("experts", experts), ("w1", w1), ("w3", w3), ("w2", w2))}
    values["top_k"] = top_k
    dtypes = {n: dtype_of(match[n]) for n in ("a", "w1", "w3", "w2")}
    if len(set(dtypes.values())) != 1 or dtype_of(match["experts"]) != torch.int64:
        return GuardFailure("site", "dtype", "a and the expert weights do not share a dtype, or the expert ids "
                            "are not int64", {**values, **{f"{n}_dtype": str(d) for n, d in dtypes.items()},
                                             "experts_dtype": str(dtype_of(match["experts"]))})
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
        return GuardFailure("site", "top_k", "top_k is not a positive int literal", values)
    if (a is None or len(a) != 2 or experts is None or len(experts) != 1 or w1 is None or len(w1) != 3
            or w3 is None or tuple(w3) != tuple(w1) or w2 is None or len(w2) != 3):
        return GuardFailure("site", "shape", "operands are not a [T, L], experts [T*k], w1/w3 [E, I, L], "
                            "w2 [E, L, I]", values)
    if not (str(experts[0]) == str(a[0] * top_k) and str(w1[2]) == str(a[1])
            and [str(d) for d in w2] == [str(w1[0]), str(a[1]), str(w1[1])]):
        return GuardFailure("site", "shape", "operand shapes disagree: expected experts [T*top_k], w1/w3 "
                            "[E, I, L], w2 [E, L, I] for a [T, L]", values)
    captured = {"tokens": a[0], "latent": a[1], "pairs": experts[0], "n_experts": w1[0]}
    for name, want in captured.items():
        if name in match.scalars and str(match.scalars[name]) != str(want):
            return GuardFailure("site", "shape", f"the traced size {name} is not the operands'",
                                {**values, name: match.scalars[name], "expected": str(want)})
    return numeric_literals(match.scalars, ("beta", "linear_beta"), values)


class RoutedExperts(Rule):
    """sort/grouped GEMMs or gather/bmm over the (token, slot) pairs  ->  k3fuse.routed_experts."""

    name = "routed_experts"
    emits = ("routed_experts",)
    description = ("the routed experts (W1/W3 projections, SiTU-GLU, W2 per (token, slot) pair; grouped GEMMs or "
                   "gathered bmm) -> k3fuse.routed_experts (one op: each selected expert's weights read once)")
    site_op = aten._grouped_mm.default

    def patterns(self) -> list[PatternSpec]:
        gathered_sizes = (("tokens", T), ("latent", L))
        return [_spec(GROUPED, routed_experts_grouped, torch.bfloat16,
                      (("pairs", T * _top_k_sentinel()), ("latent", L), ("n_experts", E))),
                _spec(GATHERED, routed_experts_gathered, torch.float32, gathered_sizes),
                _spec(GATHERED, routed_experts_gathered, torch.bfloat16, gathered_sizes)]

    def explain_miss(self, graph: fx.Graph, ctx: DecodeContext) -> tuple[str, dict[str, Any]] | None:
        """The matcher's near-miss search from the spelling whose GEMM the graph has: _grouped_mm
        for the grouped spelling, bmm for the gathered one."""
        present = {n.target for n in graph.nodes if n.op == "call_function"}
        compiled = compiled_patterns(self)
        for site_op, form in ((aten._grouped_mm.default, GROUPED), (aten.bmm.default, GATHERED)):
            if site_op in present:
                return near_miss(graph, [c for c in compiled if c.spec.key.form == form], site_op=site_op)
        return "no aten._grouped_mm or aten.bmm in the graph (no routed experts)", {}

    def check_site(self, match: Match, ctx: DecodeContext) -> list[GuardFailure]:
        found = failures(_operand_failure(match),
                         *(static_weight(match[n], n) for n in ("w1", "w3", "w2")))
        if found:
            return found
        found = failures(token_count(match["a"], ctx))
        if found:
            return found
        w1 = shape_of(match["w1"])
        spec = RoutedExpertsSpec(E=w1[0], I=w1[1], L=w1[2], top_k=match["top_k"], dtype=dtype_of(match["a"]))
        return failures(kernel_covers(ctx, spec, site_tokens(match["a"])))

    def rewrite(self, match: Match, ctx: DecodeContext) -> list[fx.Node]:
        z = match.insert(torch.ops.k3fuse.routed_experts.default,
                         (match["a"], match["experts"], match["w1"], match["w3"], match["w2"], match["top_k"],
                          float(match["beta"]), float(match["linear_beta"]), ctx.strict))
        match.replace([z])
        w1 = shape_of(match["w1"])
        match.note(top_k=match["top_k"], E=w1[0], I=w1[1])
        return [z]


__all__ = ["RoutedExperts"]
