"""The KDA delta-rule step -> k3fuse.kda_delta_rule (one pass over the fp32 recurrent state).

Why: the step reads the fp32 state S [T, h, 128, 128] (403 MB at 64 tokens, TP1, K3) and
Inductor splits it at the first reduction (S^T k), so its two pointwise kernels read S twice
(~380 us at 64 tokens on H200). Value column j of the update needs only column j of S, so one
kernel that owns (token, head, block of value columns) reads S once and writes it once.

Spelling: `delta_rule` of k3fuse/model/layers.py, imported and traced as is (the model calls the
same function, so the two cannot drift):
    S = recurrent * torch.exp(g).unsqueeze(-1)
    e = beta.unsqueeze(-1) * (vc - torch.einsum("thkv,thk->thv", S, kc))
    S = S + kc.unsqueeze(-1) * e.unsqueeze(-2)
    o = torch.einsum("thkv,thk->thv", S, qc)
einsum lowers to bmm with an operand order that depends on which of T and h are 1 (a size-1
batch dim is folded differently), so the one spelling is traced at four example shapes: the same
computation in the four ATen forms a decode graph can hold. Needs: every operand fp32, shapes
[T, h, dk, dv] / [T, h, dk] / [T, h] / [T, h, dv] / [T, h, dk] (no broadcasting), decode tokens.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from k3fuse.context import DecodeContext
from k3fuse.guards import GuardFailure, decode_token_range, failures, kernel_covers, shape_of, token_count
from k3fuse.model.layers import delta_rule
from k3fuse.rule import Match, PatternSpec, Rule

from ._spelling import randn

D = 8  # example head dim (the pattern is shape-agnostic except for which dims are 1)

#: (variant, T, h): einsum's four bmm forms; "tokens" is the general one (T >= 2, h >= 2, and a
#: dynamic token dim)
FORMS = (("tokens", 2, 2), ("one_token", 1, 2), ("one_head", 2, 1), ("one_token_one_head", 1, 1))


def _example(T: int, h: int) -> tuple[torch.Tensor, ...]:
    return (randn(T, h, D, D), randn(T, h, D), randn(T, h), randn(T, h, D), randn(T, h, D), randn(T, h, D))


def _shape_failure(match: Match) -> GuardFailure | None:
    """The operands have exactly the shapes the op takes (the pattern alone would admit broadcasts)."""
    shapes = {name: shape_of(match[name]) for name in ("recurrent", "g", "beta", "kc", "vc", "qc")}
    rec = shapes["recurrent"]
    if rec is not None and len(rec) == 4:
        T, h, dk, dv = rec
        want = {"g": (T, h, dk), "beta": (T, h), "kc": (T, h, dk), "vc": (T, h, dv), "qc": (T, h, dk)}
        if all(shapes[n] is not None and tuple(shapes[n]) == s for n, s in want.items()):
            return None
    return GuardFailure("site", "shape", "delta-rule operands are not [T, h, dk, dv] / [T, h, dk] / [T, h] / "
                                         "[T, h, dv] / [T, h, dk]",
                        {n: [str(d) for d in s] if s is not None else None for n, s in shapes.items()})


def _dtype_failure(match: Match) -> GuardFailure | None:
    dtypes = {}
    for name in ("recurrent", "g", "beta", "kc", "vc", "qc"):
        val = match.val(name)
        dtypes[name] = str(val.dtype) if isinstance(val, torch.Tensor) else None
    if all(d == "torch.float32" for d in dtypes.values()):
        return None
    return GuardFailure("site", "dtype", "the delta rule is fused for fp32 operands only", dtypes)


class KDADeltaRule(Rule):
    """S' = S*exp(g); e = beta*(v - S'^T k); S_new = S' + k e^T; o = S_new^T q -> k3fuse.kda_delta_rule."""

    name = "kda_delta_rule"
    emits = ("kda_delta_rule",)
    description = ("the KDA delta-rule step (decay, k-reduction, rank-1 update, q-reduction over the fp32 "
                   "state) -> k3fuse.kda_delta_rule (reads and writes the state once)")

    def patterns(self) -> list[PatternSpec]:
        return [PatternSpec(name, delta_rule, lambda T=T, h=h: _example(T, h)) for name, T, h in FORMS]

    def check_contract(self, ctx: DecodeContext) -> list[GuardFailure]:
        return failures(decode_token_range(ctx))

    def check_site(self, match: Match, ctx: DecodeContext) -> list[GuardFailure]:
        found = failures(_shape_failure(match), _dtype_failure(match))
        if found:
            return found
        found = failures(token_count(match["recurrent"], ctx))
        if found:
            return found
        T, h, dk, dv = shape_of(match["recurrent"])
        shape = {"heads": h, "dk": dk, "dv": dv, "dtype": torch.float32}
        return failures(kernel_covers(ctx, "kda_delta_rule", shape, T if isinstance(T, int) else None))

    def rewrite(self, match: Match, ctx: DecodeContext) -> list[fx.Node]:
        fused = match.insert(torch.ops.k3fuse.kda_delta_rule.default,
                             (match["recurrent"], match["g"], match["beta"], match["kc"], match["vc"],
                              match["qc"], ctx.strict))
        state = match.insert(operator.getitem, (fused, 0))
        out = match.insert(operator.getitem, (fused, 1))
        match.replace([state, out])
        return [fused, state, out]

__all__ = ["KDADeltaRule"]
