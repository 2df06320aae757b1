"""Replicated router GEMM + replicated latent down-projection -> one sharded GEMM + all-gather.

Why: every TP rank computes the full router logits x @ W_r.T and latent x @ W_down.T from
replicated weights, so each rank streams all of W_r and W_down (64 of 184 MB per rank and layer at
K3 TP8, batch 1). k3fuse.moe_front_sharded has each rank read only its 1/TP rows of both (one GEMM)
and all-gathers the [T, (E+L)/TP] results; the logits stay fp32, so top-k picks the same experts
on every rank. The op takes the FULL weights and slices its rows by the group rank at run time, so
the rewritten graph is rank-agnostic (one exported artifact serves every rank).

Router: any fp32 router linear F.linear(x.float(), W_r.float()) whose logits reach the expert
top-k (top-k over all E experts) through a score function (sigmoid or softmax) and selection-only
ops: views, the correction bias add, masked_fill / where (DeepSeek's group-limited top-k masks the
scores of the dropped groups), as HF transformers and the engines write it. The weights gathered
after top-k and their routed scaling are not part of the rewrite (only the logits are replaced).
Latent: the router input's other linear that the routed experts consume: among the readers of the
router input, the one whose value meets the routing decision first (Nemotron-H: the router input
also feeds the shared expert, which only meets the routing at the final sum). When the experts read
the router input itself (DeepSeek-V3, Kimi), the rewrite is the router-only form (down_w None).
Without any meeting point (front-only graphs) the one non-shared-expert linear of the input is the
latent.
Needs from the weights: W_r [E, H] (and W_down [L, H]) static and replicated (the K3 contract),
E and L divisible by TP; on a GPU, a kernel that covers (E, L, H, dtype, TP) at the site's tokens
(kernels/lib/triton/moe_gather.py: bf16/fp16 weights in the trunk dtype, K % 128 == 0).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor

from k3fuse.kernels.ops.moe_front import MoEFrontSpec
from k3fuse.rule_api import (CompiledPattern, DecodeContext, GuardFailure, Match, PatternSpec, Rule, Variant,
                             compile_pattern, divisible, failures, find_matches, forward_users, kernel_covers,
                             node_order, op_name, shape_of, site_tokens, skip_transparent, static_weight, token_count,
                             tp_at_least, value_root)

from ._mlp_branch import shared_mlp_linears
from ._pattern_tools import TRUNK_DTYPES, cast_free, collective_weight, dtype_of, linear, per_dtype, randn, trunk_dtype

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


aten = torch.ops.aten
_SCORE_FNS = (aten.sigmoid.default, aten._softmax.default, aten.softmax.int)
#: ops that may sit between the scores and the expert top-k, and which of their arguments carry the scores
_SELECTION = {aten.add.Tensor: (0, 1), aten.sub.Tensor: (0, 1), aten.mul.Tensor: (0, 1),
              aten.masked_fill.Scalar: (0,), aten.masked_fill.Tensor: (0,), aten.where.self: (1, 2),
              aten.unsqueeze.default: (0,), aten.squeeze.dim: (0,), aten.expand.default: (0,)}
_LEAVES = ("placeholder", "get_attr")


def _score_input(node: fx.Node) -> fx.Node | None:
    """The logits a score function reads: sigmoid(l), softmax(l), or the decomposed softmax
    exp(l - amax(l)) / sum(exp(...))."""
    if node.target in _SCORE_FNS:
        return node.args[0]
    if node.target is aten.div.Tensor and isinstance(node.args[0], fx.Node) and node.args[0].target is aten.exp.default:
        sub = node.args[0].args[0]
        if isinstance(sub, fx.Node) and sub.target is aten.sub.Tensor and getattr(sub.args[1], "target", None) \
                is aten.amax.default:
            return sub.args[0]
    return None


@dataclass
class _Trace:
    """Where the walk back from a top-k got to: the router logits, or the node it could not pass."""

    topk: fx.Node
    logits: fx.Node | None = None
    depth: int = -1
    stop: fx.Node | None = None
    reader: fx.Node | None = None
    scored: bool = False


def _trace_router(topk: fx.Node) -> _Trace:
    """Walk back from an expert top-k through selection ops and a score function to the logits."""
    out = _Trace(topk)
    stack: list[tuple[Any, fx.Node, int, bool]] = [(topk.args[0], topk, 0, False)]
    seen: set[fx.Node] = set()
    while stack:
        node, reader, depth, scored = stack.pop()
        if not isinstance(node, fx.Node) or node in seen or node.op in _LEAVES:
            continue
        seen.add(node)
        node, _ = skip_transparent(node)
        if not isinstance(node, fx.Node) or node.op in _LEAVES:
            continue
        if scored:
            if node.target is aten.mm.default:
                out.logits = node
                return out
            if depth > out.depth:
                out.depth, out.stop, out.reader, out.scored = depth, node, reader, True
            continue
        score_in = _score_input(node)
        if score_in is not None:
            stack.append((score_in, node, depth + 1, True))
            continue
        positions = _SELECTION.get(node.target)
        if positions is None:
            if depth > out.depth and node.target not in (aten.full.default, aten.scalar_tensor.default):
                out.depth, out.stop, out.reader, out.scored = depth, node, reader, False
            continue
        stack += [(node.args[i], node, depth + 1, False) for i in positions if i < len(node.args)]
    return out


def _last_dim(node: Any) -> Any:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val.shape[-1] if isinstance(val, torch.Tensor) and val.dim() else None


def _expert_topks(graph: fx.Graph) -> tuple[list[_Trace], list[_Trace]]:
    """(top-ks over all experts traced to router logits, the top-ks that did not get there)."""
    found, missed = [], []
    for node in graph.nodes:
        if node.target is not aten.topk.default:
            continue
        t = _trace_router(node)
        if t.logits is not None and _last_dim(node.args[0]) == _last_dim(t.logits):
            found.append(t)
        elif t.logits is None:
            missed.append(t)
    return found, missed


def _meet(nodes: list[fx.Node], index: dict[fx.Node, int], seed: fx.Node, target: set[fx.Node]) -> fx.Node | None:
    """The first node (graph order) that depends on `seed` and is in `target`."""
    reach = {seed}
    for node in nodes[index[seed] + 1:]:
        if any(i in reach for i in node.all_input_nodes):
            reach.add(node)
            if node in target:
                return node
    return None


def _cone(nodes: list[fx.Node], index: dict[fx.Node, int], seeds: list[fx.Node]) -> set[fx.Node]:
    reach = set(seeds)
    for node in nodes[min(index[s] for s in seeds) + 1:]:
        if any(i in reach for i in node.all_input_nodes):
            reach.add(node)
    return reach


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
                   "input (or the router alone) -> k3fuse.moe_front_sharded (each rank reads 1/TP of the rows, "
                   "one all-gather)")

    def patterns(self) -> list[PatternSpec]:
        """The two pieces the rule pairs (see `find`): router spelling and latent linear."""
        return [p.spec for p in (*_router_patterns(), *_linear_patterns())]

    def find(self, graph: fx.Graph, ctx: DecodeContext) -> list[Match]:
        return self._locate(graph)[0]

    def explain_miss(self, graph: fx.Graph, ctx: DecodeContext) -> tuple[str, dict[str, Any]] | None:
        return self._locate(graph)[1]

    def _locate(self, graph: fx.Graph) -> tuple[list[Match], tuple[str, dict[str, Any]] | None]:
        """The sites, or why there is none (the closest top-k and where its walk to a router stopped)."""
        traced, missed = _expert_topks(graph)
        if not traced and not missed:
            return [], ("router: no aten.topk in the graph (no router)", {})
        by_logits: dict[fx.Node, list[fx.Node]] = {}
        for t in traced:
            by_logits.setdefault(t.logits, []).append(t.topk)  # type: ignore[arg-type]
        routers = [m for m in _unique(find_matches(graph, _router_patterns(), overlap=True))
                   if dtype_of(m.outputs[0]) == torch.float32 and m.outputs[0] in by_logits]
        if not routers:
            return [], self._why_no_router(by_logits, missed)
        linears = _unique(find_matches(graph, _linear_patterns(), overlap=True))
        shared = shared_mlp_linears(graph)
        router_outs = {m.outputs[0] for m in routers}
        nodes = list(graph.nodes)
        index = node_order(graph)
        found = []
        for r in routers:
            lat, refused = self._latent(r, by_logits[r.outputs[0]], linears, shared, router_outs, nodes, index)
            key = Variant("router+latent" if lat is not None else "router", r.key.dtype)
            inputs = {"x": r["x"], "router_w": r["router_w"]}
            outputs, matched = [r.outputs[0]], set(r.nodes)
            if lat is not None:
                inputs["down_w"] = lat["w"]
                outputs.append(lat.outputs[0])
                matched |= set(lat.nodes)
            found.append(Match(
                variant=str(key), key=key, graph=graph, inputs=inputs,
                scalars={}, outputs=outputs, nodes=sorted(matched, key=index.__getitem__), refused=refused))
        return found, None

    @staticmethod
    def _latent(r: Match, topks: list[fx.Node], linears: list[Match], shared: set[fx.Node], router_outs: set[fx.Node],
                nodes: list[fx.Node], index: dict[fx.Node, int]) -> tuple[Match | None, GuardFailure | None]:
        """The latent projection the routed experts consume (None: they read the router input itself)."""
        x = value_root(r["x"])
        latents = [m for m in linears if value_root(m["x"]) is x and m.outputs[0] not in router_outs]
        owner = {n: m for m in latents for n in m.nodes}
        routing = _cone(nodes, index, topks)
        meets: list[tuple[int, str, Match | None, fx.Node]] = []
        for reader in forward_users(x):
            if reader in r.nodes:
                continue
            lat = owner.get(reader)
            seed = lat.outputs[0] if lat is not None else reader
            meet = _meet(nodes, index, seed, routing)
            if meet is not None:
                meets.append((index[meet], meet.name, lat, reader))
        if meets:
            first = min(m[0] for m in meets)
            winners = {id(m[2]): m for m in meets if m[0] == first}
            if len(winners) == 1:
                return next(iter(winners.values()))[2], None
            return None, GuardFailure("site", "ambiguous_latent", "several readers of the router input meet the "
                                      "routing decision first",
                                      {"meet": nodes[first].name, "readers": sorted(m[3].name for m in winners.values())})
        latents = [m for m in latents if m.outputs[0] not in shared]
        if len(latents) > 1:
            return latents[0], GuardFailure("site", "ambiguous_latent", "the router input feeds several candidate "
                                            "latent projections", {"candidates": [m.outputs[0].name for m in latents]})
        return (latents[0] if latents else None), None

    @staticmethod
    def _why_no_router(by_logits: dict[fx.Node, list[fx.Node]], missed: list[_Trace]) -> tuple[str, dict[str, Any]]:
        for logits, topks in by_logits.items():  # scores reach top-k, but the logits are not the fp32 router
            return (f"router: top-k {topks[0].name} selects from {logits.name}, not an fp32 router linear "
                    f"F.linear(x.float(), W.float()) ({dtype_of(logits)})",
                    {"topk": topks[0].name, "logits": logits.name, "dtype": str(dtype_of(logits))})
        t = max(missed, key=lambda t: t.depth)
        if t.stop is None:
            return f"router: top-k {t.topk.name} does not read a score of any logits", {"topk": t.topk.name}
        values = {"topk": t.topk.name, "diverged_at": t.stop.name, "op": op_name(t.stop),
                  "reader": t.reader.name if t.reader is not None else None}
        if t.scored:
            score = "softmax" if t.reader is not None and t.reader.target is aten.div.Tensor else op_name(t.reader)
            return (f"router: the score function {score} ({t.reader.name}) reads {op_name(t.stop)} ({t.stop.name}), "
                    "not a router linear", values)
        return (f"router: top-k {t.topk.name} reached through {op_name(t.stop)} ({t.stop.name}), not a score function "
                "(sigmoid, softmax), add, masked_fill or a view", values)

    def check_contract(self, ctx: DecodeContext) -> list[GuardFailure]:
        return failures(tp_at_least(ctx, 2))

    def check_site(self, match: Match, ctx: DecodeContext) -> list[GuardFailure]:
        e = (shape_of(match["router_w"]) or (None,))[0]
        checks = [static_weight(match["router_w"], "router_w"), divisible(e, ctx.tp_size, "n_experts"),
                  collective_weight(match["router_w"], "router_w", dtype_of(match["router_w"])),
                  token_count(match["x"], ctx), trunk_dtype(match["x"], "x", ctx.dtype)]
        if "down_w" in match.inputs:
            l_ = (shape_of(match["down_w"]) or (None,))[0]
            checks += [static_weight(match["down_w"], "down_w"), divisible(l_, ctx.tp_size, "latent"),
                       collective_weight(match["down_w"], "down_w", dtype_of(match["router_w"])),
                       None if dtype_of(match["down_w"]) in TRUNK_DTYPES else
                       GuardFailure("site", "dtype", "weight dtype not supported",
                                    {"down_w": str(dtype_of(match["down_w"]))})]
        found = failures(*checks)
        if found:
            return found
        # on a GPU, a kernel for this shape at every token count the site can see (never a rewrite
        # that only falls back); the weights' dtype is what the kernel reads
        spec = MoEFrontSpec(E=e, L=(shape_of(match["down_w"]) or (0,))[0] if "down_w" in match.inputs else 0,
                            H=int(shape_of(match["x"])[-1]), dtype=dtype_of(match["router_w"]),
                            world_size=ctx.tp_size, max_tokens=ctx.tokens[1])
        return failures(kernel_covers(ctx, spec, site_tokens(match["x"])))

    def rewrite(self, match: Match, ctx: DecodeContext) -> list[fx.Node]:
        down_w = match.inputs.get("down_w")
        new = match.replace_with(torch.ops.k3fuse.moe_front_sharded.default, x=match["x"], router_w=match["router_w"],
                                 down_w=down_w, group_name=ctx.group_name, world_size=ctx.tp_size,
                                 max_tokens=ctx.tokens[1], strict=ctx.strict)
        rows = {"router": shape_of(match["router_w"])[0] // ctx.tp_size}
        if down_w is None:
            match.note("router-only form: the experts read the router input itself (no latent projection)",
                       rows_per_rank=rows)
        else:
            rows["latent"] = shape_of(match["down_w"])[0] // ctx.tp_size
            match.note(rows_per_rank=rows)
        return new


__all__ = ["MoEFrontSharded"]
