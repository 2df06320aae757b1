"""KDA's short causal conv over [q; k; v] -> k3fuse.kda_short_conv (one kernel, the window never stored).

Why: the model builds the [T, C, K] window (a cat of q, k, v, then a cat onto the conv state), slices
the new state out of it and reduces it against the fp32 taps; Inductor compiles that to three
kernels that write and re-read the window. k3fuse.kda_short_conv reads the state, q, k, v and the
taps once and writes the new state and the fp32 conv once (kernels/lib/triton/kda_conv.py; the
figures in docs/perf/2026-12-04-w4a16-ncu-combine-conv.md 0m).

Spelling: `short_conv` of k3fuse/spelling.py, imported and traced as is (the model calls the same
function, so the two cannot drift):
    u = torch.cat([q, k, v], dim=-1)
    window = torch.cat([conv_state, u.unsqueeze(-1)], dim=-1)
    new_state = window[..., 1:].contiguous()
    conv = F.silu((window.float() * conv_weight).sum(-1))
traced per trunk dtype (a bf16 trunk has the cast, an fp32 one none). The matcher walks through
the `.contiguous()` copy (a clone) and stops at the slice; the op's new state is already
contiguous, so the rewrite drops that copy too.
Independent of the other rules: the site starts at the q, k, v projections' outputs (decode_gemm,
after it, still takes those projections) and ends at the conv output, which kda_delta_rule's
operands (its l2-normalised q and k, its v) are computed from: either order finds both sites.

Needs: conv_state [T, C, K-1], q/k/v [T, C/3] in one trunk dtype (the context's, when it names one),
the taps a static fp32 [C, K], decode tokens; on a GPU, a kernel that covers (C, K, dtype) at those
tokens.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from k3fuse.kernels.ops.kda_conv import KDAConvSpec
from k3fuse.rule_api import (DecodeContext, GuardFailure, Match, PatternSpec, Rule, failures, kernel_covers, shape_of,
                             site_tokens, static_weight, token_count)
from k3fuse.spelling import short_conv

from ._pattern_tools import dtype_of, per_dtype, randn, trunk_dtype

aten = torch.ops.aten
T, W, K = 2, 4, 4  # example sizes (the pattern is shape-agnostic)


def _example(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    return (randn(T, 3 * W, K - 1, dtype=dtype), randn(T, W, dtype=dtype), randn(T, W, dtype=dtype),
            randn(T, W, dtype=dtype), randn(3 * W, K))


def _dims(shape) -> list[str] | None:
    return [str(d) for d in shape] if shape is not None else None


def _shape_failure(match: Match) -> GuardFailure | None:
    """conv_state [T, C, K-1], q/k/v [T, C/3], conv_weight [C, K], C and K static (the pattern alone
    would admit broadcasts)."""
    shapes = {n: shape_of(match[n]) for n in ("conv_state", "q", "k", "v", "conv_weight")}
    state, weight = shapes["conv_state"], shapes["conv_weight"]
    if state is not None and len(state) == 3 and weight is not None and len(weight) == 2:
        tokens, C, km1 = state
        if isinstance(C, int) and isinstance(km1, int) and C % 3 == 0 and tuple(weight) == (C, km1 + 1) \
                and all(s is not None and len(s) == 2 and str(s[0]) == str(tokens) and s[1] == C // 3
                        for s in (shapes["q"], shapes["k"], shapes["v"])):
            return None
    return GuardFailure("site", "shape", "short-conv operands are not conv_state [T, C, K-1], q/k/v [T, C/3] "
                                         "and conv_weight [C, K]",
                        {n: _dims(s) for n, s in shapes.items()})


def _dtype_failure(match: Match, ctx: DecodeContext) -> GuardFailure | None:
    """conv_state, q, k, v in one trunk dtype (the context's, when it names one); fp32 taps."""
    dtypes = {n: str(dtype_of(match[n])) for n in ("conv_state", "q", "k", "v", "conv_weight")}
    wrong = trunk_dtype(match["conv_state"], "conv_state", ctx.dtype)
    if wrong is not None:
        return GuardFailure(wrong.level, wrong.guard, wrong.message, {**dtypes, **wrong.values})
    if len({dtypes[n] for n in ("conv_state", "q", "k", "v")}) != 1:
        return GuardFailure("site", "dtype", "conv_state, q, k and v are not in one dtype", dtypes)
    if dtype_of(match["conv_weight"]) != torch.float32:
        return GuardFailure("site", "dtype", "the conv taps are fused in fp32 only", dtypes)
    return None


def _is_contiguous_copy(node: fx.Node) -> bool:
    """`x.contiguous()` / `x.clone()` in ATen: a copy with a contiguous (or the source's) layout."""
    return (node.op == "call_function" and node.target is aten.clone.default
            and node.kwargs.get("memory_format", torch.preserve_format) in (torch.contiguous_format,
                                                                            torch.preserve_format))


class KDAShortConv(Rule):
    """window = [conv_state | cat(q, k, v)]; conv = silu(sum(window * w)); state = window[..., 1:]
    -> k3fuse.kda_short_conv."""

    name = "kda_short_conv"
    emits = ("kda_short_conv",)
    description = ("KDA's short causal conv over [q; k; v] (window, fp32 taps, silu, rolled conv state) -> "
                   "k3fuse.kda_short_conv (reads the state once, writes the new state once)")
    site_op = aten.cat.default

    def patterns(self) -> list[PatternSpec]:
        return per_dtype("window", short_conv, _example)

    def check_site(self, match: Match, ctx: DecodeContext) -> list[GuardFailure]:
        found = failures(_shape_failure(match))
        if found:
            return found
        found = failures(_dtype_failure(match, ctx), static_weight(match["conv_weight"], "conv_weight"))
        if found:
            return found
        found = failures(token_count(match["q"], ctx))
        if found:
            return found
        _, C, km1 = shape_of(match["conv_state"])
        spec = KDAConvSpec(channels=C, taps=km1 + 1, dtype=dtype_of(match["conv_state"]))
        return failures(kernel_covers(ctx, spec, site_tokens(match["q"])))

    def rewrite(self, match: Match, ctx: DecodeContext) -> list[fx.Node]:
        new = match.replace_with(torch.ops.k3fuse.kda_short_conv.default, conv_state=match["conv_state"],
                                 q=match["q"], k=match["k"], v=match["v"], weight=match["conv_weight"],
                                 strict=ctx.strict)
        _, _, state = new
        for copy in [u for u in state.users if _is_contiguous_copy(u)]:  # the op's state is contiguous already
            copy.replace_all_uses_with(state)
            match.graph.erase_node(copy)
        _, C, km1 = shape_of(match["conv_state"])
        match.note(channels=C, taps=km1 + 1)
        return new


__all__ = ["KDAShortConv"]
