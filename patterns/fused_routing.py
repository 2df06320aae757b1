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

HF transformers' routers (DeepSeek-V3, Kimi K2.5, Kimi Linear) are `route_grouped_hf`: the group-limited
block between the bias add and the final top-k (three top-k per router, even with one group), the
final top-k unsorted (the vocabulary reads it as sorted: an unsorted top-k promises only the set) and
the gather on dim 1. Variant "grouped": n_group, topk_group and the fill are wildcards too, the token
count and the group size free sizes. Keeping every group (topk_group >= n_group: K2.5's and Kimi
Linear's one group) the block changes nothing and the site is fused; fewer groups (DeepSeek-V3's 4 of
8) limit each token's experts, which route_topk does not do: the site is refused (`group_limited`).
Runs after moe_front_sharded, which replaces the logits' producer (a top-k it can still walk to
from the router linear); the routed output that shared_expert_stream anchors its join on is
downstream of both, so the order of the three does not change what each finds.

Needs: logits fp32 [T, E] (the fp32 router; any trunk dtype), b_corr a static fp32 [E], decode
tokens; on a GPU, a kernel that covers (E, top_k) at those tokens.
Ties: the model's torch.topk breaks ties its own way; the fused op picks the lowest index, so the
rewrite can change the experts only where biased scores are exactly equal.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from k3fuse.kernels.ops.route_topk import RouteTopkSpec
from k3fuse.rule_api import (DecodeContext, GuardFailure, Match, PatternSpec, Rule, Variant, compiled_patterns,
                             failures, int_sentinel, kernel_covers, near_miss, op_name, shape_of, site_tokens,
                             skip_transparent, static_weight, token_count)
from k3fuse.spelling import route, route_grouped_hf

from ._pattern_tools import dtype_of, numeric_literals

#: example shapes: E large enough for topk's k to be the int wildcard's sentinel in a fake trace
T, E = 4, 1 << 30


def _example() -> tuple:
    return (torch.empty(T, E, device="meta"), torch.empty(E, device="meta"), 16, 2.5, 1e-20)


@dataclass(frozen=True)
class Form:
    """grouped: HF's group-limited router (`route_grouped_hf`), else K3's `route`."""

    grouped: bool = False


#: the grouped example: the group size and the token count are free sizes (values no other literal of
#: the trace has); E a multiple of the n_group sentinel (parameter 6), which topk_group's (5) stays
#: below, so the fake trace's top-ks fit
GROUP_SIZE, GROUP_TOKENS = 3, 5


def _grouped_example() -> tuple:
    experts = GROUP_SIZE * int_sentinel(6)
    return (torch.empty(GROUP_TOKENS, experts, device="meta"), torch.empty(experts, device="meta"), 16, 2.5, 1e-20,
            4, 8, float("-inf"))


aten = torch.ops.aten


def _score_kind(node: fx.Node) -> str:
    """softmax (fused or decomposed: exp(l - amax) / sum) or the op's name."""
    if node.target in (aten._softmax.default, aten.softmax.int):
        return "softmax"
    if node.target is aten.div.Tensor and isinstance(node.args[0], fx.Node) and node.args[0].target is aten.exp.default:
        return "softmax"
    return op_name(node)


def _bias(match: Match) -> fx.Node:
    """The correction bias [E]: older HF routers add `e_score_correction_bias.unsqueeze(0)` [1, E]."""
    b = match["b_corr"]
    if b.op == "call_function" and b.target is aten.unsqueeze.default and b.args[1] == 0 \
            and shape_of(b.args[0]) is not None and len(shape_of(b.args[0])) == 1:
        return b.args[0]
    return b


def _operand_failure(match: Match) -> GuardFailure | None:
    """logits fp32 [T, E], b_corr fp32 [E], 1 <= top_k <= E, numeric routed_scaling and eps."""
    logits, b_corr = shape_of(match["logits"]), shape_of(_bias(match))
    top_k = match.scalars.get("top_k")
    values = {"logits": [str(d) for d in logits] if logits is not None else None,
              "b_corr": [str(d) for d in b_corr] if b_corr is not None else None,
              "logits_dtype": str(dtype_of(match["logits"])), "b_corr_dtype": str(dtype_of(_bias(match))),
              "top_k": top_k}
    if dtype_of(match["logits"]) != torch.float32 or dtype_of(_bias(match)) != torch.float32:
        return GuardFailure("site", "dtype", "routing is fused for fp32 logits and correction bias only", values)
    if logits is None or len(logits) != 2 or b_corr is None or len(b_corr) != 1 or b_corr[0] != logits[1]:
        return GuardFailure("site", "shape", "router logits are not [T, E] with a correction bias [E]", values)
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not isinstance(logits[1], int) \
            or not 1 <= top_k <= logits[1]:
        return GuardFailure("site", "top_k", "top_k is not a literal between 1 and E", values)
    return numeric_literals(match.scalars, ("routed_scaling", "eps"), values)


def _group_failure(match: Match) -> GuardFailure | None:
    """The grouped form: n_group groups of the captured size cover E, 1 <= topk_group, the captured
    token count is the logits'; then the semantic check: every group kept (topk_group >= n_group),
    else the groups limit each token's experts and route_topk would pick others."""
    E = shape_of(match["logits"])[1]
    n_group, topk_group, per_group = (match.scalars.get(n) for n in ("n_group", "topk_group", "per_group"))
    tokens, fill = match.scalars.get("tokens"), match.scalars.get("fill")
    values = {"n_group": n_group, "topk_group": topk_group, "group_size": per_group, "E": E, "fill": repr(fill)}
    ints = (n_group, topk_group, per_group)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in ints) or n_group * per_group != E:
        return GuardFailure("site", "groups", "the expert groups do not cover the E experts (n_group x group size)",
                            values)
    if str(tokens) != str(shape_of(match["logits"])[0]):
        return GuardFailure("site", "shape", "the group mask's token count is not the logits'",
                            {**values, "tokens": str(tokens), "logits": [str(d) for d in shape_of(match["logits"])]})
    if topk_group < n_group:
        return GuardFailure("site", "group_limited",
                            f"group-limited routing: each token takes its experts from its best {topk_group} of "
                            f"{n_group} expert groups, k3fuse.route_topk from all {E} experts (it would pick others)",
                            values)
    return numeric_literals(match.scalars, ("fill",), values)


class FusedRouting(Rule):
    """sigmoid -> + b_corr -> top-k -> gather -> / (sum + eps) -> * scale  ->  k3fuse.route_topk."""

    name = "fused_routing"
    emits = ("route_topk",)
    description = ("the router tail (sigmoid, correction bias, top-k, gather, renormalise, scale) -> "
                   "k3fuse.route_topk (one kernel, lowest-index ties, same bits on every rank)")
    site_op = torch.ops.aten.topk.default

    def patterns(self) -> list[PatternSpec]:
        grouped = Variant("grouped", None, Form(grouped=True))
        return [PatternSpec("sigmoid", route, _example, Variant("sigmoid", None, Form())),
                PatternSpec(str(grouped), route_grouped_hf, _grouped_example, grouped,
                            (("per_group", GROUP_SIZE), ("tokens", GROUP_TOKENS)))]

    def explain_miss(self, graph: fx.Graph, ctx: DecodeContext) -> tuple[str, dict[str, Any]] | None:
        """A router whose top-ks never select from sigmoid(logits) (+ bias) names its score; else (a
        sigmoid router, maybe with HF's group block and its top-ks over group scores) the matcher's
        near-miss search from the top-k."""
        other = None
        for node in graph.nodes:
            if node.target is not aten.topk.default:
                continue
            score, _ = skip_transparent(node.args[0])
            if isinstance(score, fx.Node) and score.target in (aten.add.Tensor, aten.sub.Tensor):
                score, _ = skip_transparent(score.args[0])
            if isinstance(score, fx.Node) and score.target is aten.sigmoid.default:
                return near_miss(graph, compiled_patterns(self), site_op=self.site_op)
            if isinstance(score, fx.Node) and other is None:
                other = (node, score)
        if other is not None:
            node, score = other
            kind = _score_kind(score)
            return (f"sigmoid: the top-k {node.name} selects from {kind} ({score.name}), not sigmoid(logits) + "
                    "bias: only the sigmoid router is fused",
                    {"topk": node.name, "score": score.name, "op": op_name(score), "kind": kind})
        return near_miss(graph, compiled_patterns(self), site_op=self.site_op)

    def check_site(self, match: Match, ctx: DecodeContext) -> list[GuardFailure]:
        found = failures(_operand_failure(match), static_weight(_bias(match), "b_corr"))
        if found:
            return found
        if match.params(Form).grouped:
            found = failures(_group_failure(match))
            if found:
                return found
        found = failures(token_count(match["logits"], ctx))
        if found:
            return found
        spec = RouteTopkSpec(E=int(shape_of(match["logits"])[1]), top_k=match["top_k"], dtype=torch.float32)
        return failures(kernel_covers(ctx, spec, site_tokens(match["logits"])))

    def rewrite(self, match: Match, ctx: DecodeContext) -> list[fx.Node]:
        new = match.replace_with(torch.ops.k3fuse.route_topk.default, logits=match["logits"], b_corr=_bias(match),
                                 top_k=match["top_k"], routed_scaling=float(match["routed_scaling"]),
                                 eps=float(match["eps"]), strict=ctx.strict)
        match.note(top_k=match["top_k"], routed_scaling=match["routed_scaling"])
        if match.params(Form).grouped:
            match.note(n_group=match["n_group"], topk_group=match["topk_group"])
        return new


__all__ = ["FusedRouting"]
