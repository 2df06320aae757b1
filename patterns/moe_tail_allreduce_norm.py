"""The MoE tail: the latent all-reduce and the latent RMSNorm -> k3fuse.allreduce_rmsnorm.

Why: after the routed experts each TP rank holds a latent partial [T, L] (L = 3584 in K3); the
model all-reduces it (NCCL, a latency-bound collective of a few KB to 450 KB) and RMSNorms the sum
(a second, memory-bound launch) before W_up. k3fuse.allreduce_rmsnorm does both in the one-shot
protocol family of the out-projection op (kernels/ops/allreduce_rmsnorm.py: a push of the partial
into every peer's symmetric buffer, then the one-shot epilogue polls, sums in fixed rank order and
normalises in registers).

Spelling: k3fuse.spelling's own functions, traced as the model calls them (LatentMoE.forward):
    r = all_reduce_sum(partial, group)        # all_reduce + wait_tensor
    h = rms_norm(r, latent_norm.weight, eps)  # variance in fp32, times the weight, cast back
once per trunk dtype (a bf16 trunk has the casts, fp32 none); the group name and eps are literal
wildcards captured from the graph. The op returns the sum as well, so a graph that reads r
elsewhere keeps reading it (from the op); the rewrite replaces both outputs either way.
Not taken by oproj_allreduce_residual (it runs first): its patterns start at a linear and go
through a residual add; the latent all-reduce reads a weighted sum of expert outputs and has no
add before its norm.

Needs: tp >= 2 (a collective), decode tokens, a static norm weight, the trunk dtype, the context's
TP group; on a GPU a kernel that covers (L, dtype) at the site's tokens. Off by default until
measured on H200.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch import Tensor

from k3fuse.kernels.ops.allreduce_rmsnorm import AllReduceNormSpec
from k3fuse.rule_api import (ALL_REDUCE, WAIT_TENSOR, DecodeContext, GuardFailure, Match, PatternSpec, Rule, failures,
                             forward_users, is_metadata_check, kernel_covers, op_name, same_group, shape_of,
                             site_tokens, static_weight, token_count, tp_at_least)

from ._pattern_tools import GROUP, all_reduce_sum, collective_weight, dtype_of, per_dtype, randn, rms_norm, trunk_dtype

T, L = 4, 16  # example shapes: tokens, latent width
aten = torch.ops.aten


def _tail(x: Tensor, norm_weight: Tensor, eps: float, group_name: str) -> tuple[Tensor, Tensor]:
    r = all_reduce_sum(x, group_name)
    return r, rms_norm(r, norm_weight, eps)


def _operand_failure(match: Match) -> GuardFailure | None:
    """x [..., L] with a norm weight [L] and a numeric eps."""
    x, w = shape_of(match["x"]), shape_of(match["norm_weight"])
    values = {"x": [str(d) for d in x] if x is not None else None,
              "norm_weight": [str(d) for d in w] if w is not None else None}
    if x is None or w is None or len(x) < 1 or len(w) != 1 or w[0] != x[-1]:
        return GuardFailure("site", "shape", "the norm weight is not [L] for the all-reduced [..., L]", values)
    eps = match.scalars.get("eps")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool):
        return GuardFailure("site", "eps", "eps is not a numeric literal", {**values, "eps": repr(eps)})
    return None


class MoETailAllReduceNorm(Rule):
    """all_reduce(latent partial) -> wait -> rms_norm(., w, eps)  ->  k3fuse.allreduce_rmsnorm."""

    name = "moe_tail_allreduce_norm"
    emits = ("allreduce_rmsnorm",)
    description = ("MoE tail: the latent partial's all_reduce -> latent RMSNorm -> k3fuse.allreduce_rmsnorm "
                   "(one-shot push + epilogue, the out-projection op's protocol)")
    default_on = False
    default_off_reason = "no H200 measurement yet"
    site_op = ALL_REDUCE

    def patterns(self) -> list[PatternSpec]:
        return per_dtype("norm", _tail, lambda d: (randn(T, L, dtype=d), randn(L, dtype=d), 1e-5, GROUP))

    def explain_miss(self, graph: fx.Graph, ctx: DecodeContext) -> tuple[str, dict[str, Any]] | None:
        """Each all-reduce's waited value and what reads it: the closest site is one whose reader is
        an RMSNorm-like pow (then the norm differs from k3fuse.spelling.rms_norm), else the first
        all-reduce and its readers. (The matcher's generic near-miss starts from the pattern's
        first output, here the all-reduced sum itself, so it has nothing to follow.)"""
        best: tuple[int, str, dict[str, Any]] | None = None
        for node in graph.nodes:
            if node.target is not self.site_op:
                continue
            for wait in (u for u in node.users if u.target is WAIT_TENSOR):
                readers = forward_users(wait)
                names = [f"{op_name(u)} ({u.name})" for u in readers]
                values = {"all_reduce": node.name, "wait": wait.name, "readers": [op_name(u) for u in readers]}
                if any(u.target is aten.pow.Tensor_Scalar for u in readers):
                    cand = (2, f"norm: the all-reduced {wait.name} is squared ({', '.join(names)}) but the rest is "
                               "not k3fuse.spelling.rms_norm (weight, casts, mean over the last dim, eps literal)",
                            values)
                else:
                    cand = (1, f"norm: the all-reduced {wait.name} (from {node.name}) feeds "
                               f"{', '.join(names) or 'nothing'}, not an RMSNorm (aten.pow -> mean -> rsqrt)", values)
                if best is None or cand[0] > best[0]:
                    best = cand
        if best is None:
            return "norm: no _c10d_functional.all_reduce in the graph (TP 1, or the collective is spelled otherwise)", {}
        return best[1], best[2]

    def check_contract(self, ctx: DecodeContext) -> list[GuardFailure]:
        return failures(tp_at_least(ctx, 2))

    def check_site(self, match: Match, ctx: DecodeContext) -> list[GuardFailure]:
        found = failures(_operand_failure(match), static_weight(match["norm_weight"], "norm_weight"),
                         collective_weight(match["norm_weight"], "norm_weight", dtype_of(match["x"]), dims=1),
                         token_count(match["x"], ctx), trunk_dtype(match["x"], "x", ctx.dtype),
                         same_group(match["group_name"], ctx))
        if found:
            return found
        spec = AllReduceNormSpec(L=int(shape_of(match["x"])[-1]), dtype=dtype_of(match["x"]),
                                 w_dtype=dtype_of(match["norm_weight"]), world_size=ctx.tp_size,
                                 max_tokens=ctx.tokens[1])
        return failures(kernel_covers(ctx, spec, site_tokens(match["x"])))

    def rewrite(self, match: Match, ctx: DecodeContext) -> list[fx.Node]:
        new = match.replace_with(torch.ops.k3fuse.allreduce_rmsnorm.default, x=match["x"],
                                 norm_weight=match["norm_weight"], eps=float(match["eps"]),
                                 group_name=match["group_name"], world_size=ctx.tp_size, max_tokens=ctx.tokens[1],
                                 strict=ctx.strict)
        _, summed, _ = new  # the outside readers of the sum now read the op's first output
        match.note(eps=float(match["eps"]), sum_read_elsewhere=any(not is_metadata_check(u) for u in summed.users))
        return new


__all__ = ["MoETailAllReduceNorm"]
