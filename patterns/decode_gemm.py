"""Every remaining projection with a static weight at decode shapes -> k3fuse.decode_gemm.

Why: at 1..64 tokens a projection is a weight read with almost no reuse; cuBLAS reaches only
35-66 % of bandwidth on K3's skinny shapes (router, latent, shared, out-projection at high TP:
shared/docs/k3-decode.md, beside this repository). decode_gemm picks a GEMV kernel at 1-2 tokens and split-K above.

Spellings: F.linear(x, W) (mm, or addmm with a bias) and the fp32-cast router
F.linear(x.float(), W.float()), which becomes decode_gemm(x, W, out_dtype=fp32) so the casts of
the weight never materialise. Runs after the fusing rules: it takes only what they left.
Needs from the weights: W (and the bias) static.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor

from k3fuse.kernels.ops.decode_gemm import DecodeGemmSpec
from k3fuse.rule_api import (DecodeContext, GuardFailure, Match, PatternSpec, Rule, compiled_patterns, failures,
                             find_matches, is_static, kernel_covers, node_order, site_tokens, static_weight,
                             token_count, value_root)

from ._pattern_tools import cast_free, per_dtype, randn, trunk_dtype

T, K, N = 4, 16, 8  # example shapes


@dataclass(frozen=True)
class Form:
    bias: bool  # F.linear with a bias (addmm, or mm + add)
    fp32_out: bool  # the fp32-cast router: F.linear(x.float(), W.float())


def _linear(x: Tensor, weight: Tensor) -> Tensor:
    return F.linear(x, weight)


def _linear_bias(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    return F.linear(x, weight, bias)


def _fp32_out(x: Tensor, weight: Tensor) -> Tensor:
    return F.linear(x.float(), weight.float())


def _is_bias(node: fx.Node) -> bool:
    root = value_root(node)
    val = root.meta.get("val")
    return is_static(root) and isinstance(val, torch.Tensor) and val.dim() == 1


class DecodeGemm(Rule):
    """x @ W.T (+ b) with a static W -> k3fuse.decode_gemm (fp32 out for the router spelling)."""

    name = "decode_gemm"
    emits = ("decode_gemm",)
    description = ("projections with a static weight at decode shapes (mm / addmm, incl. the fp32-cast "
                   "router) -> k3fuse.decode_gemm (GEMV at 1-2 tokens, split-K above)")

    def patterns(self) -> list[PatternSpec]:
        low_precision = [s for s in per_dtype("fp32_out", _fp32_out, lambda d: (randn(T, K, dtype=d),
                                                                              randn(N, K, dtype=d)),
                                              Form(bias=False, fp32_out=True))
                         if s.key.dtype != torch.float32]  # in an fp32 trunk the router is a plain linear
        return [
            *cast_free("linear+bias", _linear_bias, lambda d: (randn(T, K, dtype=d), randn(N, K, dtype=d),
                                                               randn(N, dtype=d)), Form(bias=True, fp32_out=False)),
            *low_precision,
            *cast_free("linear", _linear, lambda d: (randn(T, K, dtype=d), randn(N, K, dtype=d)),
                       Form(bias=False, fp32_out=False)),
        ]

    def find(self, graph: fx.Graph, ctx: DecodeContext) -> list[Match]:
        """The bias spelling only where the added tensor is a real bias (a static vector): in
        `r = r + F.linear(o, W_o)` (TP=1) the residual is not one, and the plain linear is the site."""
        compiled = compiled_patterns(self)
        biased = [p for p in compiled if p.spec.key.params.bias]
        with_bias = [m for m in find_matches(graph, biased) if m.refused is None and _is_bias(m["bias"])]
        taken = {m.outputs[0].args[0] for m in with_bias}  # their mm nodes
        rest = [m for m in find_matches(graph, [p for p in compiled if p not in biased])
                if not (set(m.nodes) & taken)]
        order = node_order(graph)
        return sorted(with_bias + rest, key=lambda m: order[m.outputs[0]])

    def check_site(self, match: Match, ctx: DecodeContext) -> list[GuardFailure]:
        form = match.params(Form)
        bias = static_weight(match["bias"], "bias") if form.bias else None
        found = failures(static_weight(match["weight"], "weight"), bias, token_count(match["x"], ctx),
                         trunk_dtype(match["x"], "x", ctx.dtype))
        if found:
            return found
        x, w = match.val("x"), match.val("weight")
        spec = DecodeGemmSpec(N=int(w.shape[0]), K=int(w.shape[1]), dtype=x.dtype,
                              out_dtype=self._out_dtype(match) or x.dtype, bias=form.bias)
        return failures(kernel_covers(ctx, spec, site_tokens(match["x"])))

    @staticmethod
    def _out_dtype(match: Match) -> torch.dtype | None:
        return torch.float32 if match.params(Form).fp32_out else None

    def rewrite(self, match: Match, ctx: DecodeContext) -> list[fx.Node]:
        return match.replace_with(torch.ops.k3fuse.decode_gemm.default, x=match["x"], weight=match["weight"],
                                  bias=match.inputs.get("bias"), out_dtype=self._out_dtype(match), strict=ctx.strict)


__all__ = ["DecodeGemm"]
