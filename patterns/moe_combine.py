"""The routed experts' weighted combine and its cast to the trunk dtype -> k3fuse.moe_combine.

Why: Inductor compiles the model's combine `(z.float().view(T, k, L) * weights[..., None]).sum(1)`
to a reduction over the slot dim whose loads stride by L across the slots, the slowest kernel of the
layer after the GEMMs and the KDA step at 64 tokens (docs/perf/2026-12-04-w4a16-ncu-combine-conv.md 0m).
k3fuse.moe_combine reads z once, each program a contiguous row segment per slot
(kernels/lib/triton/moe_combine.py), and writes the trunk-dtype partial directly.

Spelling: `moe_combine` of k3fuse/spelling.py followed by the model's cast, traced as the model
calls them (LatentMoE.forward: `moe_combine(z, weights, k).to(x.dtype)`, x's dtype being z's):
    convert(z, fp32) -> view [T, k, L] -> mul(unsqueeze(weights, -1)) -> sum over dim 1 -> convert(z's dtype)
once per trunk dtype (an fp32 trunk has no casts). top_k is read off the weights' shape: the view
that bakes it in is transparent to the matcher, so the guards check every shape instead (z
[T*k, L], weights [T, k], the product [T, k, L], the sum [T, L]).
HF transformers' experts (`batched_mm_experts_forward`) weight the pairs before the view, with flat
routing weights: `(z * weights.reshape(-1).unsqueeze(-1)).view(T, k, L).sum(1).to(dtype)`, weights
[T*k] in pair order. The same values (pair p = token p // k, slot p % k); the op is given the weights
viewed [T, k]. In a 16-bit trunk HF's multiply promotes z to fp32 itself (no cast node): variant
"combine_flat", traced for 16-bit trunks (in fp32 the K3 pattern is that spelling already).
Runs after routed_experts, whose op produces z (both the BF16 op and the MXFP4 / int4 one; the
combine reads only z and the routing weights, whatever produced them). It touches no linear or
collective: moe_tail_allreduce_norm (before it) reads the combine's output at TP > 1 and keeps
reading it from this op (the match's output is rewired); shared_expert_stream (after it) anchors
its join on the routed output downstream of the latent all-reduce, norm and W_up, which is still
computed from the MoE input through route_topk, routed_experts and this op, so it finds its join
as before (and in the other order too: its rewrite touches neither z nor the weights).

Needs: z [T*k, L] in a trunk dtype (the context's, when set) and the output in z's dtype, weights
fp32 [T, k], k and L static, decode tokens; on a GPU, a kernel that covers (L, k, dtype) at those
tokens.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from k3fuse.kernels.ops.moe_combine import MoECombineSpec
from k3fuse.rule_api import (DecodeContext, GuardFailure, Match, PatternSpec, Rule, failures, is_transparent,
                             kernel_covers, node_value, shape_of, token_count)
from k3fuse.spelling import moe_combine

from ._pattern_tools import dtype_of, per_dtype, randn, trunk_dtype

aten = torch.ops.aten
T, K, L = 3, 4, 8  # example shapes: tokens, slots, latent width (views are transparent: any will do)


def _combine(z: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return moe_combine(z, weights, weights.shape[1]).to(z.dtype)


def _example(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return randn(T * K, L, dtype=dtype), randn(T, K)


def _combine_flat(z: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """HF's combine: flat [T*k] weights times z before the view, fp32 by promotion, cast back."""
    return (z * weights.unsqueeze(-1)).view(-1, K, z.shape[-1]).sum(1).to(z.dtype)


def _flat_example(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return randn(T * K, L, dtype=dtype), randn(T * K)


def _z_rows(match: Match) -> fx.Node:
    """z as [T*k, L]. In an fp32 trunk nothing casts z, so the pattern's z binds the graph's view of
    it ([T, k, L]); walk back through views to the first 2-D value (the routed experts' output)."""
    node = match["z"]
    while (val := node_value(node)) is not None and val.dim() != 2 and is_transparent(node):
        node = node.args[0]
    return node


def _sum_node(match: Match) -> fx.Node | None:
    return next((n for n in match.nodes if n.op == "call_function" and n.target is aten.sum.dim_IntList), None)


def _slots(match: Match) -> tuple[Any, Any] | None:
    """(T, k): the weights' shape, or for flat [T*k] weights the product's [T, k, L] view."""
    w = shape_of(match["weights"])
    if w is not None and len(w) == 2:
        return tuple(w)
    total = _sum_node(match)
    prod = shape_of(total.args[0]) if total is not None else None
    if w is not None and len(w) == 1 and prod is not None and len(prod) == 3:
        return prod[0], prod[1]
    return None


def _shape_failure(match: Match) -> GuardFailure | None:
    """z [T*k, L], weights [T, k] (or flat [T*k]) with k and L static, the product [T, k, L] and its
    sum [T, L]: the view of z the matcher walked through is then z's rows as (token, slot)."""
    z, w = shape_of(_z_rows(match)), shape_of(match["weights"])
    total = _sum_node(match)
    prod = shape_of(total.args[0]) if total is not None else None
    out = shape_of(total) if total is not None else None
    values: dict[str, Any] = {n: [str(d) for d in s] if s is not None else None
                              for n, s in (("z", z), ("weights", w), ("product", prod), ("sum", out))}
    slots = _slots(match)
    if z is None or slots is None or prod is None or out is None or len(z) != 2:
        return GuardFailure("site", "shape", "the combine's operands are not z [T*k, L] and weights [T, k] or "
                            "[T*k]", values)
    tokens, k = slots
    if not isinstance(k, int) or not isinstance(z[1], int):
        return GuardFailure("site", "top_k", "top_k and L must be static (only the token count may be symbolic)",
                            values)
    want = {"z": [str(tokens * k), str(z[1])], "product": [str(tokens), str(k), str(z[1])],
            "sum": [str(tokens), str(z[1])]}
    if len(w) == 1:
        want["weights"] = [str(tokens * k)]
    if any(values[n] != s for n, s in want.items()):
        return GuardFailure("site", "shape", "the combine's shapes disagree: expected z [T*k, L], the product "
                            "[T, k, L] and the sum [T, L] for weights [T, k]", {**values, "expected": want})
    return None


def _dtype_failure(match: Match, ctx: DecodeContext) -> GuardFailure | None:
    """fp32 weights; z in a trunk dtype (the context's, when set) and the result cast back to it."""
    z, w, out = dtype_of(_z_rows(match)), dtype_of(match["weights"]), dtype_of(match.outputs[0])
    if w != torch.float32 or out != z:
        return GuardFailure("site", "dtype", "the combine is fused for fp32 weights and a result in z's dtype",
                            {"z": str(z), "weights": str(w), "out": str(out)})
    return trunk_dtype(_z_rows(match), "z", ctx.dtype)


class MoECombine(Rule):
    """z [T*k, L] viewed [T, k, L] * weights[..., None] -> sum over the slots -> cast  ->  k3fuse.moe_combine."""

    name = "moe_combine"
    emits = ("moe_combine",)
    description = ("the routed experts' weighted combine (z [T*k, L] viewed [T, k, L] times the routing weights, "
                   "summed over the slots in fp32, cast to the trunk dtype) -> k3fuse.moe_combine (one "
                   "coalesced pass over z, slots added in order)")
    site_op = aten.sum.dim_IntList

    def patterns(self) -> list[PatternSpec]:
        flat = [s for s in per_dtype("combine_flat", _combine_flat, _flat_example) if s.key.dtype != torch.float32]
        return per_dtype("combine", _combine, _example) + flat

    def check_site(self, match: Match, ctx: DecodeContext) -> list[GuardFailure]:
        found = failures(_shape_failure(match), _dtype_failure(match, ctx))
        if found:
            return found
        found = failures(token_count(_sum_node(match), ctx))
        if found:
            return found
        tokens, k = _slots(match)
        z = _z_rows(match)
        spec = MoECombineSpec(L=int(shape_of(z)[1]), top_k=k, dtype=dtype_of(z))
        return failures(kernel_covers(ctx, spec, tokens if isinstance(tokens, int) else None))

    def rewrite(self, match: Match, ctx: DecodeContext) -> list[fx.Node]:
        _, k = _slots(match)
        z, weights = _z_rows(match), match["weights"]
        flat = len(shape_of(weights)) == 1
        if flat:  # HF's pair-order weights, as the [T, k] the op takes (a view)
            weights = match.insert(aten.view.default, (weights, [-1, k]))
        new = match.replace_with(torch.ops.k3fuse.moe_combine.default, z=z, weights=weights, top_k=k,
                                 strict=ctx.strict)
        match.note(top_k=k, L=int(shape_of(z)[1]), **({"weights": "flat [T*k]"} if flat else {}))
        return new


__all__ = ["MoECombine"]
