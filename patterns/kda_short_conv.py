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
HF transformers' Kimi Linear decodes the conv as `causal_conv1d_update` (`short_conv_hf`, variant
"conv1d"): q/k/v [T, 1, C/3], the window cast to the taps' dtype, `F.conv1d(window, w.unsqueeze(1),
groups=C)` with one output position, the new state `window[:, :, -(K-1):]` and the nn.Conv1d weight
[C, 1, K]; C (groups) and -(K-1) (the state's slice start) are free sizes. Traced
for fp32 and bf16 trunks with fp32 taps, and with bf16 taps (HF's bf16 checkpoints convolve in bf16:
refused by the fp32-taps guard). The rewrite squeezes the unit dims off q/k/v and the weight for the op
and puts them back on its conv ([T, C, 1]); the new state is cast to the window's dtype where HF's
state copy casts it back.
Independent of the other rules: the site starts at the q, k, v projections' outputs (decode_gemm,
after it, still takes those projections) and ends at the conv output, which kda_delta_rule's
operands (its l2-normalised q and k, its v) are computed from: either order finds both sites.

Needs: conv_state [T, C, K-1], q/k/v [T, C/3] in one trunk dtype (the context's, when it names one),
the taps a static fp32 [C, K], decode tokens; on a GPU, a kernel that covers (C, K, dtype) at those
tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from k3fuse.kernels.ops.kda_conv import KDAConvSpec
from k3fuse.rule_api import (DecodeContext, GuardFailure, Match, PatternSpec, Rule, Variant, failures, kernel_covers,
                             shape_of, site_tokens, static_weight, token_count)
from k3fuse.spelling import short_conv, short_conv_hf

from ._pattern_tools import dtype_of, per_dtype, randn, trunk_dtype

aten = torch.ops.aten
prims = torch.ops.prims
T, W, K = 2, 4, 4  # example sizes (the pattern is shape-agnostic)
HF_W = 7  # the conv1d example's q width: C = 21 is the groups literal, a free size no other literal equals
HF_K = 5  # the conv1d example's taps: the state slice starts at -(K-1) = -4, a free size too


@dataclass(frozen=True)
class Form:
    """conv1d: HF's `short_conv_hf` (unit dims on q/k/v, the weight and the conv), else K3's `short_conv`."""

    conv1d: bool = False


def _hf_example(trunk: torch.dtype, taps: torch.dtype) -> tuple[torch.Tensor, ...]:
    C = 3 * HF_W
    return (randn(T, C, HF_K - 1, dtype=trunk), randn(T, 1, HF_W, dtype=trunk), randn(T, 1, HF_W, dtype=trunk),
            randn(T, 1, HF_W, dtype=trunk), randn(C, 1, HF_K, dtype=taps))


def _hf_spec(trunk: torch.dtype, taps: torch.dtype) -> PatternSpec:
    key = Variant("conv1d" if taps == torch.float32 else "conv1d+taps", trunk, Form(conv1d=True))
    name = str(key) if taps == torch.float32 else f"conv1d[{str(trunk).removeprefix('torch.')} taps]"
    return PatternSpec(name, short_conv_hf, lambda: _hf_example(trunk, taps), key,
                       (("channels", 3 * HF_W), ("state_start", 1 - HF_K)))


def _example(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    return (randn(T, 3 * W, K - 1, dtype=dtype), randn(T, W, dtype=dtype), randn(T, W, dtype=dtype),
            randn(T, W, dtype=dtype), randn(3 * W, K))


def _dims(shape) -> list[str] | None:
    return [str(d) for d in shape] if shape is not None else None


def _unit_dim_dropped(shape, dim: int):
    """`shape` without its unit dim `dim` (HF's [T, 1, C/3] activations, [C, 1, K] conv weight)."""
    if shape is not None and len(shape) == 3 and shape[dim] == 1:
        return (*shape[:dim], *shape[dim + 1:])
    return shape


def _shape_failure(match: Match) -> GuardFailure | None:
    """conv_state [T, C, K-1], q/k/v [T, C/3], conv_weight [C, K], C and K static (the pattern alone
    would admit broadcasts); the conv1d form's [T, 1, C/3] q/k/v, [C, 1, K] weight and groups C."""
    shapes = {n: shape_of(match[n]) for n in ("conv_state", "q", "k", "v", "conv_weight")}
    hf = match.params(Form).conv1d
    if hf:
        shapes.update({n: _unit_dim_dropped(shapes[n], 1) for n in ("q", "k", "v", "conv_weight")})
    state, weight = shapes["conv_state"], shapes["conv_weight"]
    if state is not None and len(state) == 3 and weight is not None and len(weight) == 2:
        tokens, C, km1 = state
        if isinstance(C, int) and isinstance(km1, int) and C % 3 == 0 and tuple(weight) == (C, km1 + 1) \
                and all(s is not None and len(s) == 2 and str(s[0]) == str(tokens) and s[1] == C // 3
                        for s in (shapes["q"], shapes["k"], shapes["v"])) \
                and (not hf or (match.scalars.get("channels") == C and match.scalars.get("state_start") == -km1)):
            return None
    want = ("conv_state [T, C, K-1], q/k/v [T, 1, C/3] and conv_weight [C, 1, K] with groups=C" if hf else
            "conv_state [T, C, K-1], q/k/v [T, C/3] and conv_weight [C, K]")
    values = {n: _dims(shape_of(match[n])) for n in shapes}
    if hf:
        values.update(groups=match.scalars.get("channels"), state_start=match.scalars.get("state_start"))
    return GuardFailure("site", "shape", f"short-conv operands are not {want}", values)


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
        hf = [_hf_spec(torch.float32, torch.float32), _hf_spec(torch.bfloat16, torch.float32),
              _hf_spec(torch.bfloat16, torch.bfloat16)]
        return per_dtype("window", short_conv, _example, Form()) + hf

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
        hf = match.params(Form).conv1d
        operands = {n: match[n] for n in ("q", "k", "v", "conv_weight")}
        if hf:  # the op takes q/k/v [T, C/3] and the taps [C, K]: HF's unit dims squeezed off (views)
            operands = {n: match.insert(aten.squeeze.dim, (node, 1)) for n, node in operands.items()}
        state_dtype = dtype_of(match.outputs[1])
        new = match.replace_with(torch.ops.k3fuse.kda_short_conv.default, conv_state=match["conv_state"],
                                 q=operands["q"], k=operands["k"], v=operands["v"], weight=operands["conv_weight"],
                                 strict=ctx.strict)
        _, conv, state = new
        for copy in [u for u in state.users if _is_contiguous_copy(u)]:  # the op's state is contiguous already
            copy.replace_all_uses_with(state)
            match.graph.erase_node(copy)
        if hf:
            _reroute(match, conv, aten.unsqueeze.default, (conv, -1))  # HF's conv keeps its position dim
            if dtype_of(state) != state_dtype:  # HF slices the cast window: the same values in the taps' dtype
                _reroute(match, state, prims.convert_element_type.default, (state, state_dtype))
        _, C, km1 = shape_of(match["conv_state"])
        match.note(channels=C, taps=km1 + 1)
        return new


def _reroute(match: Match, node: fx.Node, target, args: tuple) -> None:
    """Give `node`'s readers `target(*args)` (inserted right after it) instead of `node`."""
    readers = list(node.users)
    if not readers:
        return
    after = match.insert(target, args, before=node.next)
    for reader in readers:
        reader.replace_input_with(node, after)


__all__ = ["KDAShortConv"]
