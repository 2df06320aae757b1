"""Replicated router GEMM + replicated latent down-projection -> one sharded GEMM + all-gather.

Why: every TP rank computes the full router logits x @ W_r.T and latent x @ W_down.T from
replicated weights, so each rank streams all of W_r and W_down (64 of 184 MB per rank and layer at
K3 TP8, batch 1). k3fuse.moe_front_sharded has each rank read only its 1/TP rows of both (one GEMM)
and all-gathers the [T, (E+L)/TP] results; the logits stay fp32, so top-k picks the same experts
on every rank. The op takes the FULL weights and slices its rows by the group rank at run time, so
the rewritten graph is rank-agnostic (one exported artifact serves every rank).

Pattern: the router spelling F.linear(x.float(), W_r.float()) (fp32 logits that feed the sigmoid
scores) and the latent F.linear(x, W_down) of the same x. The latent is the router input's other
linear that is not part of the shared-expert SiTU-GLU MLP (whose gate/up read the same x).
Needs from the weights: W_r [E, H] and W_down [L, H] static and replicated (the K3 contract),
E and L divisible by TP.
"""
from __future__ import annotations

import functools
import operator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor

from k3fuse.context import DecodeContext
from k3fuse.guards import (GuardFailure, decode_token_range, divisible, failures, shape_of, static_weight,
                           token_count, tp_at_least)
from k3fuse.matcher import CompiledPattern, compile_pattern, find_matches
from k3fuse.normalize import skip_transparent, value_root
from k3fuse.rule import Match, PatternSpec, Rule

from ._spelling import TRUNK_DTYPES, cast_free, dtype_of, linear, per_dtype, randn, trunk_dtype
from .shared_expert_stream import shared_mlp_linears

T, E, L, H = 4, 6, 8, 16  # example shapes


def _router(x: Tensor, router_w: Tensor) -> Tensor:
    return F.linear(x.float(), router_w.float())


@functools.cache
def _router_patterns() -> tuple[CompiledPattern, ...]:
    return tuple(compile_pattern(s) for s in per_dtype("router", _router, lambda d: (randn(T, H, dtype=d),
                                                                                   randn(E, H, dtype=d))))


@functools.cache
def _linear_patterns() -> tuple[CompiledPattern, ...]:
    return tuple(compile_pattern(s) for s in cast_free("latent", linear, lambda d: (randn(T, H, dtype=d),
                                                                                   randn(L, H, dtype=d))))


def _scores_pick_experts(logits: fx.Node) -> bool:
    """Router logits: their sigmoid (plus the correction bias) is what top-k selects experts from."""
    frontier, seen = [(u, False) for u in logits.users], set()
    while frontier:
        node, scored = frontier.pop()
        if node in seen:
            continue
        seen.add(node)
        if scored and node.target is torch.ops.aten.topk.default:
            return True
        if node.target is torch.ops.aten.sigmoid.default and not scored:
            frontier += [(u, True) for u in node.users]
        elif skip_transparent(node)[0] in (logits,) or (scored and node.target is torch.ops.aten.add.Tensor):
            frontier += [(u, scored) for u in node.users]
    return False


def _unique(matches: list[Match]) -> list[Match]:
    """One match per output node (the dtype variants of a cast-free pattern are the same graph)."""
    seen: dict[fx.Node, Match] = {}
    for m in matches:
        if m.refused is None:
            seen.setdefault(m.outputs[0], m)
    return list(seen.values())


class MoEFrontSharded(Rule):
    """Router + latent down-projection of the same input -> k3fuse.moe_front_sharded."""

    name = "moe_front_sharded"
    emits = ("moe_front_sharded",)
    description = ("replicated router GEMM (fp32 logits) + replicated latent down-projection of the same "
                   "input -> k3fuse.moe_front_sharded (each rank reads 1/TP of the rows, one all-gather)")

    def patterns(self) -> list[PatternSpec]:
        """The two pieces the rule pairs (see `find`): router spelling and latent linear."""
        return [p.spec for p in (*_router_patterns(), *_linear_patterns())]

    def find(self, graph: fx.Graph, ctx: DecodeContext) -> list[Match]:
        routers = [m for m in _unique(find_matches(graph, _router_patterns(), overlap=True))
                   if dtype_of(m.outputs[0]) == torch.float32 and _scores_pick_experts(m.outputs[0])]
        if not routers:
            return []
        linears = _unique(find_matches(graph, _linear_patterns(), overlap=True))
        shared = shared_mlp_linears(graph)
        router_outs = {m.outputs[0] for m in routers}
        order = {n: i for i, n in enumerate(graph.nodes)}
        found = []
        for r in routers:
            x = value_root(r["x"])
            latents = [m for m in linears if value_root(m["x"]) is x and m.outputs[0] not in router_outs
                       and m.outputs[0] not in shared]
            if not latents:
                continue
            refused = None
            if len(latents) > 1:
                refused = GuardFailure("site", "ambiguous_latent", "the router input feeds several candidate "
                                       "latent projections", {"candidates": [m.outputs[0].name for m in latents]})
            lat = latents[0]
            suffix = r.variant.removeprefix("router")
            found.append(Match(
                variant="router+latent" + suffix, graph=graph,
                inputs={"x": r["x"], "router_w": r["router_w"], "down_w": lat["w"]}, scalars={},
                outputs=[r.outputs[0], lat.outputs[0]],
                nodes=sorted(set(r.nodes) | set(lat.nodes), key=order.__getitem__), refused=refused))
        return found

    def check_contract(self, ctx: DecodeContext) -> list[GuardFailure]:
        return failures(tp_at_least(ctx, 2), decode_token_range(ctx))

    def check_site(self, match: Match, ctx: DecodeContext) -> list[GuardFailure]:
        e = (shape_of(match["router_w"]) or (None,))[0]
        l_ = (shape_of(match["down_w"]) or (None,))[0]
        return failures(static_weight(match["router_w"], "router_w"), static_weight(match["down_w"], "down_w"),
                        divisible(e, ctx.tp_size, "n_experts"), divisible(l_, ctx.tp_size, "latent"),
                        token_count(match["x"], ctx), trunk_dtype(match["x"], "x", ctx.dtype),
                        None if dtype_of(match["down_w"]) in TRUNK_DTYPES else
                        GuardFailure("site", "dtype", "weight dtype not supported", {"down_w": str(dtype_of(match["down_w"]))}))

    def rewrite(self, match: Match, ctx: DecodeContext) -> list[fx.Node]:
        fused = match.insert(torch.ops.k3fuse.moe_front_sharded.default,
                             (match["x"], match["router_w"], match["down_w"], ctx.group_name, ctx.tp_size,
                              ctx.tokens[1], ctx.strict))
        logits = match.insert(operator.getitem, (fused, 0))
        latent = match.insert(operator.getitem, (fused, 1))
        match.replace([logits, latent])
        match.note(rows_per_rank={"router": shape_of(match["router_w"])[0] // ctx.tp_size,
                                  "latent": shape_of(match["down_w"])[0] // ctx.tp_size})
        return [fused, logits, latent]


__all__ = ["MoEFrontSharded"]
