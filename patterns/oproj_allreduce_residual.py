"""Row-parallel projection -> all_reduce(sum) -> residual add [-> next RMSNorm] as one fused op.

Why: at decode each of these is a weight-bound GEMV, a latency-bound all-reduce of [T, H] and a
memory-bound add/norm, three launches and two round trips through HBM. One kernel streams the
weight, exchanges the partial sums (one-shot, over NVLink) and applies residual and norm in
registers (shared/docs/k3-decode.md, the K3 decode notes beside this repository: 46.6 us eager vs
~24 us fused at TP2).

Sites in a K3 layer:
  KDA out-projection   plain:   r = r + AR(o @ W_o.T); h = rmsnorm(r)       -> gemm_ar_residual_rmsnorm
                       AttnRes: p = p + AR(o @ W_o.T)  (prefix-sum add)      -> gemm_ar_residual
  MoE final reduction  y = y_routed + AR(h_sh @ W_d.T); r = r + y [-> rmsnorm] -> addend = y_routed
In-place reductions (`dist.all_reduce(t)`, as HF / third-party model code writes them) functionalise
to all_reduce -> wait -> `copy(t, reduced)`; the matcher reads the copy as the reduced value
(vocabulary.copied_value), so they match in every door without Inductor's remove_noop_ops.
Needs from the weights: the projection weight (and the norm weight) are static parameters.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import Tensor

from k3fuse.kernels.ops.oproj_allreduce import OProjNormSpec, OProjSpec
from k3fuse.rule_api import (ALL_REDUCE, DecodeContext, GuardFailure, Match, PatternSpec, Rule, failures,
                             kernel_covers, same_group, shape_of, site_tokens, static_weight, token_count, tp_at_least)

from ._pattern_tools import (GROUP, all_reduce_sum, cast_free, collective_weight, dtype_of, linear, per_dtype, randn,
                             rms_norm, trunk_dtype)

T, K, H = 4, 8, 16  # example shapes: tokens, local reduction width, hidden


@dataclass(frozen=True)
class Form:
    """What a variant fuses besides the projection, its all-reduce and the residual add."""

    addend: bool  # the MoE final reduction: y_routed + AR(...) before the residual add
    norm: bool  # the next RMSNorm


def _residual(x: Tensor, weight: Tensor, residual: Tensor, group_name: str) -> Tensor:
    return residual + all_reduce_sum(linear(x, weight), group_name)


def _residual_norm(x: Tensor, weight: Tensor, residual: Tensor, norm_weight: Tensor, eps: float,
                   group_name: str) -> tuple[Tensor, Tensor]:
    out = residual + all_reduce_sum(linear(x, weight), group_name)
    return out, rms_norm(out, norm_weight, eps)


def _moe(x: Tensor, weight: Tensor, residual: Tensor, addend: Tensor, group_name: str) -> Tensor:
    return residual + (addend + all_reduce_sum(linear(x, weight), group_name))


def _moe_norm(x: Tensor, weight: Tensor, residual: Tensor, addend: Tensor, norm_weight: Tensor, eps: float,
              group_name: str) -> tuple[Tensor, Tensor]:
    out = residual + (addend + all_reduce_sum(linear(x, weight), group_name))
    return out, rms_norm(out, norm_weight, eps)


def _rows_agree(match: Match) -> GuardFailure | None:
    """x's rows are the residual's rows ([T, K] against [T, H], or HF's [B, 1, H] with B*1 = T): the
    fused op computes in rows and returns the residual's shape."""
    x, res = shape_of(match["x"]), shape_of(match["residual"])
    if x is None or res is None:
        return GuardFailure("site", "shape", "no shape known for x or the residual", {})
    rows_x, rows_r = math.prod(x[:-1]), math.prod(res[:-1])
    if isinstance(rows_x, int) and isinstance(rows_r, int) and rows_x != rows_r:
        return GuardFailure("site", "shape", "x and the residual have different numbers of rows",
                            {"x": list(x), "residual": list(res)})
    return None


class OProjAllReduceResidual(Rule):
    """The row-parallel projection, its all-reduce and the residual add (+ next RMSNorm) fused."""

    name = "oproj_allreduce_residual"
    emits = ("gemm_ar_residual", "gemm_ar_residual_rmsnorm")
    description = ("row-parallel out-projection -> all_reduce -> residual add [-> next RMSNorm] (KDA "
                   "out-projection, AttnRes prefix add, MoE final reduction + residual) -> "
                   "k3fuse.gemm_ar_residual[_rmsnorm]")
    # near misses are reported from each all_reduce: the closest one and where it left the pattern
    site_op = ALL_REDUCE

    def patterns(self) -> list[PatternSpec]:
        def ex(dtype: torch.dtype, addend: bool, norm: bool) -> tuple:
            args = [randn(T, K, dtype=dtype), randn(H, K, dtype=dtype), randn(T, H, dtype=dtype)]
            if addend:
                args.append(randn(T, H, dtype=dtype))
            if norm:
                args += [randn(H, dtype=dtype), 1e-5]
            return (*args, GROUP)

        return [
            *per_dtype("plain+norm", _residual_norm, lambda d: ex(d, False, True), Form(addend=False, norm=True)),
            *per_dtype("moe+norm", _moe_norm, lambda d: ex(d, True, True), Form(addend=True, norm=True)),
            *cast_free("attnres", _residual, lambda d: ex(d, False, False), Form(addend=False, norm=False)),
            *cast_free("moe", _moe, lambda d: ex(d, True, False), Form(addend=True, norm=False)),
        ]

    def check_contract(self, ctx: DecodeContext) -> list[GuardFailure]:
        return failures(tp_at_least(ctx, 2))

    def check_site(self, match: Match, ctx: DecodeContext) -> list[GuardFailure]:
        x_dtype, form = dtype_of(match["x"]), match.params(Form)
        weights = [static_weight(match["weight"], "weight"), collective_weight(match["weight"], "weight", x_dtype)]
        if form.norm:
            weights += [static_weight(match["norm_weight"], "norm_weight"),
                        collective_weight(match["norm_weight"], "norm_weight", x_dtype, dims=1)]
        found = failures(*weights, token_count(match["x"], ctx), trunk_dtype(match["x"], "x", ctx.dtype),
                         same_group(match["group_name"], ctx), _rows_agree(match))
        if found:
            return found
        # on a GPU, a kernel for this shape at every token count the site can see (the weights'
        # dtypes included), else the site stays stock, with the kernels' reasons in the log
        w_shape = shape_of(match["weight"])
        spec = (OProjNormSpec if form.norm else OProjSpec)(
            H=int(w_shape[0]), K=int(w_shape[-1]), dtype=x_dtype, res_dtype=x_dtype, w_dtype=dtype_of(match["weight"]),
            addend=form.addend, norm_dtype=dtype_of(match["norm_weight"]) if form.norm else None,
            world_size=ctx.tp_size, max_tokens=ctx.tokens[1])
        return failures(kernel_covers(ctx, spec, site_tokens(match["x"])))

    def rewrite(self, match: Match, ctx: DecodeContext) -> list[fx.Node]:
        operands = dict(x=match["x"], weight=match["weight"], residual=match["residual"],
                        addend=match.inputs.get("addend"), group_name=match["group_name"], world_size=ctx.tp_size,
                        max_tokens=ctx.tokens[1], strict=ctx.strict)
        if match.params(Form).norm:
            return match.replace_with(torch.ops.k3fuse.gemm_ar_residual_rmsnorm.default, **operands,
                                      norm_weight=match["norm_weight"], eps=match["eps"])
        return match.replace_with(torch.ops.k3fuse.gemm_ar_residual.default, **operands)


__all__ = ["OProjAllReduceResidual"]
