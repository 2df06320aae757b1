"""The router's tail: sigmoid, correction bias, top-k, gather, renormalise, scale -> k3fuse.route_topk.

Why: at decode the router tail is a chain of small launch-bound kernels per layer (sigmoid, add,
topk, gather, sum, add, div, mul on [T, 896] fp32); k3fuse.route_topk does it in one kernel, one
program per token (kernels/lib/triton/route_topk.py), with ties broken to the lowest expert index and
the weight sum in a fixed order, so its result is the same bits on every rank.

Spelling: `route` of k3fuse/spelling.py, imported and traced as is (the model calls the same
function, so the two cannot drift):
    scores = torch.sigmoid(logits.float())
    _, idx = torch.topk(scores + b_corr, top_k, dim=-1)
    weights = scores.gather(-1, idx)
    weights = weights / (weights.sum(-1, keepdim=True) + eps)
    return weights * routed_scaling, idx
top_k, routed_scaling and eps (1e-20 in the model) are literal wildcards captured from the graph. The example logits are meta tensors with 2^30 experts:
the int wildcard's sentinel is traced as topk's k, which must not exceed E even in a fake trace.
Runs after moe_front_sharded, which replaces the logits' producer (a top-k it can still walk to
from the router linear); the routed output that shared_expert_stream anchors its join on is
downstream of both, so the order of the three does not change what each finds.

Needs: logits fp32 [T, E] (the fp32 router; any trunk dtype), b_corr a static fp32 [E], decode
tokens; on a GPU, a kernel that covers (E, top_k) at those tokens.
Ties: the model's torch.topk breaks ties its own way; the fused op picks the lowest index, so the
rewrite can change the experts only where biased scores are exactly equal.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from k3fuse.kernels.ops.route_topk import RouteTopkSpec
from k3fuse.rule_api import (DecodeContext, GuardFailure, Match, PatternSpec, Rule, compiled_patterns, failures,
                             kernel_covers, near_miss, op_name, shape_of, site_tokens, skip_transparent,
                             static_weight, token_count)
from k3fuse.spelling import route

from ._pattern_tools import dtype_of, numeric_literals

#: example shapes: E large enough for topk's k to be the int wildcard's sentinel in a fake trace
T, E = 4, 1 << 30


def _example() -> tuple:
    return (torch.empty(T, E, device="meta"), torch.empty(E, device="meta"), 16, 2.5, 1e-20)


aten = torch.ops.aten


def _score_kind(node: fx.Node) -> str:
    """softmax (fused or decomposed: exp(l - amax) / sum) or the op's name."""
    if node.target in (aten._softmax.default, aten.softmax.int):
        return "softmax"
    if node.target is aten.div.Tensor and isinstance(node.args[0], fx.Node) and node.args[0].target is aten.exp.default:
        return "softmax"
    return op_name(node)


def _operand_failure(match: Match) -> GuardFailure | None:
    """logits fp32 [T, E], b_corr fp32 [E], 1 <= top_k <= E, numeric routed_scaling and eps."""
    logits, b_corr = shape_of(match["logits"]), shape_of(match["b_corr"])
    top_k = match.scalars.get("top_k")
    values = {"logits": [str(d) for d in logits] if logits is not None else None,
              "b_corr": [str(d) for d in b_corr] if b_corr is not None else None,
              "logits_dtype": str(dtype_of(match["logits"])), "b_corr_dtype": str(dtype_of(match["b_corr"])),
              "top_k": top_k}
    if dtype_of(match["logits"]) != torch.float32 or dtype_of(match["b_corr"]) != torch.float32:
        return GuardFailure("site", "dtype", "routing is fused for fp32 logits and correction bias only", values)
    if logits is None or len(logits) != 2 or b_corr is None or len(b_corr) != 1 or b_corr[0] != logits[1]:
        return GuardFailure("site", "shape", "router logits are not [T, E] with a correction bias [E]", values)
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not isinstance(logits[1], int) \
            or not 1 <= top_k <= logits[1]:
        return GuardFailure("site", "top_k", "top_k is not a literal between 1 and E", values)
    return numeric_literals(match.scalars, ("routed_scaling", "eps"), values)


class FusedRouting(Rule):
    """sigmoid -> + b_corr -> top-k -> gather -> / (sum + eps) -> * scale  ->  k3fuse.route_topk."""

    name = "fused_routing"
    emits = ("route_topk",)
    description = ("the router tail (sigmoid, correction bias, top-k, gather, renormalise, scale) -> "
                   "k3fuse.route_topk (one kernel, lowest-index ties, same bits on every rank)")
    site_op = torch.ops.aten.topk.default

    def patterns(self) -> list[PatternSpec]:
        return [PatternSpec("sigmoid", route, _example)]

    def explain_miss(self, graph: fx.Graph, ctx: DecodeContext) -> tuple[str, dict[str, Any]] | None:
        """A top-k over a score that is not sigmoid(logits) (+ bias) names that score; else the
        matcher's near-miss search from the top-k."""
        for node in graph.nodes:
            if node.target is not aten.topk.default:
                continue
            score, _ = skip_transparent(node.args[0])
            if isinstance(score, fx.Node) and score.target in (aten.add.Tensor, aten.sub.Tensor):
                score, _ = skip_transparent(score.args[0])
            if isinstance(score, fx.Node) and score.target is not aten.sigmoid.default:
                kind = _score_kind(score)
                return (f"sigmoid: the top-k {node.name} selects from {kind} ({score.name}), not sigmoid(logits) + "
                        "bias: only the sigmoid router is fused",
                        {"topk": node.name, "score": score.name, "op": op_name(score), "kind": kind})
        return near_miss(graph, compiled_patterns(self), site_op=self.site_op)

    def check_site(self, match: Match, ctx: DecodeContext) -> list[GuardFailure]:
        found = failures(_operand_failure(match), static_weight(match["b_corr"], "b_corr"))
        if found:
            return found
        found = failures(token_count(match["logits"], ctx))
        if found:
            return found
        spec = RouteTopkSpec(E=int(shape_of(match["logits"])[1]), top_k=match["top_k"], dtype=torch.float32)
        return failures(kernel_covers(ctx, spec, site_tokens(match["logits"])))

    def rewrite(self, match: Match, ctx: DecodeContext) -> list[fx.Node]:
        new = match.replace_with(torch.ops.k3fuse.route_topk.default, logits=match["logits"], b_corr=match["b_corr"],
                                 top_k=match["top_k"], routed_scaling=float(match["routed_scaling"]),
                                 eps=float(match["eps"]), strict=ctx.strict)
        match.note(top_k=match["top_k"], routed_scaling=match["routed_scaling"])
        return new


__all__ = ["FusedRouting"]
