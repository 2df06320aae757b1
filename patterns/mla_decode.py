"""The absorbed gated NoPE-MLA attention core over the paged latent cache -> k3fuse.mla_decode.

Why: the model's spelling (spelling.paged_mla_attention) gathers every sequence's pages to the block table's
width as fp32 (4 x the cache's bytes in bf16, 8 x in fp8), masks the tail, and runs the scores, softmax and
weighted sum as separate kernels over that copy. k3fuse.mla_decode reads each live cache entry once, every head
of a sequence sharing the read, split along the context (kernels/lib/triton/mla_decode.py).

Spelling: `paged_mla_attention` of k3fuse/spelling.py, traced as the model calls it (MLADecode.forward):
    kv = kv_cache[block_table.long()].view(B, -1, E).float() * kv_scale
    scores = (q.float() @ kv^T) * scale, masked where position >= seq_lens, softmax
    out = (probs @ kv[..., :kv_lora]).to(q.dtype)
once per (trunk dtype, cache dtype): a 16-bit cache in the trunk's dtype, or fp8 e4m3 (the casts differ).
The cache append before it (spelling.kv_cache_append, an index_put_ that Inductor fuses with the norm, concat and
cast that produce the entry) stays as it is: the op reads the appended cache, so the order holds, and moving the
scatter into the attention kernel would not remove the kernel that produces the entry.

The output gate sigmoid(W_g x) (setting `gate`, MLADecodeSettings): "inline" leaves its GEMM where the model
computes it, after the attention; "side_stream" brackets the GEMM with the side-stream markers, under the shared
expert's join discipline (kernels/ops/shared_expert.py, k3fuse.verify): the fork before x's first reader (the
q_a projection), the GEMM moved right after it reading the fork's copy of x, the end after it, the join, anchored
on the attention's output and keeping x alive, right before the gate's first reader. The side stream then runs the
GEMM while the main stream runs the q / kv projections, the append and the attention. Executed node by node (the
eager compiler, torch.export programs, CUDA graphs of either); Inductor lowers the markers to nothing, so under it
the GEMM stays on the main stream, as the shared expert's does. Which arm wins in the layer is measured on a GPU
(docs/perf.md); "inline" until then.

Needs: q [B, H, 576] bf16 / fp16 (an fp32 trunk is declined: no kernel takes fp32 queries), kv_lora 512 and the
entry 576 wide; the cache [blocks, block_size, 576] in q's dtype or fp8 e4m3 with its fp32 scale [1]; block_table
int32 [B, W] and seq_lens int32 [B]; a static block size; heads per rank within the op's range (K3: 96 / TP);
decode tokens (B); on a GPU, a kernel that covers the site. The log names what it saw: heads, block size, cache
dtype, the table's width and the longest context it can hold.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.fx as fx

from k3fuse.kernels.ops.mla_decode import ENTRY, LATENT, MAX_HEADS, MLADecodeSpec
from k3fuse.rule_api import (CAST_OPS, VIEW_LIKE, DecodeContext, GuardFailure, Match, PatternSpec, Rule, Variant,
                             failures, is_metadata_check, is_static, kernel_covers, node_order, op_qualname, shape_of,
                             token_count, value_root)
from k3fuse.spelling import paged_mla_attention

from ._mlp_branch import MLPBranch, linear_of, real_users
from ._pattern_tools import dtype_of, randn
from .shared_expert_stream import _FORK, _bracket

aten = torch.ops.aten
FP8 = torch.float8_e4m3fn
#: example sizes, pairwise distinct and none a dim index (0-2) so that no literal of the trace stands for two of
#: them: sequences, heads,
#: pages in the pool, page size, the table's width, the entry and its c_kv part. The trace bakes the batch, the
#: heads, the entry, the context (WIDTH * PAGE: an arange's end) and kv_lora (a slice's end) into the matmuls'
#: expands and the mask: free sizes, which the guards read back
B, H, BLOCKS, PAGE, WIDTH, E, KV_LORA = 6, 7, 61, 4, 9, 13, 11
CONTEXT = WIDTH * PAGE
FREE_SIZES = (("batch", B), ("heads", H), ("entry", E), ("context", CONTEXT), ("kv_lora", KV_LORA))
#: (trunk dtype, cache dtype) pairs the pattern is traced for; an fp32 trunk is traced so that it is declined
#: by name instead of missed
FORMS: tuple[tuple[torch.dtype, torch.dtype], ...] = (
    (torch.bfloat16, torch.bfloat16), (torch.bfloat16, FP8), (torch.float16, torch.float16), (torch.float16, FP8),
    (torch.float32, torch.float32), (torch.float32, FP8))


@dataclass(frozen=True)
class MLADecodeSettings:
    """gate: where the output gate's GEMM runs (module docstring): "inline" or "side_stream"."""

    gate: Literal["inline", "side_stream"] = "inline"

    def __post_init__(self) -> None:
        if self.gate not in ("inline", "side_stream"):
            raise ValueError(f"MLADecodeSettings.gate must be 'inline' or 'side_stream', got {self.gate!r}")


@dataclass(frozen=True)
class CacheForm:
    """The matched spelling's dtypes: the queries' (the trunk's) and the cache's."""

    dtype: torch.dtype
    cache_dtype: torch.dtype


def _core(q: torch.Tensor, kv_cache: torch.Tensor, kv_scale: torch.Tensor, block_table: torch.Tensor,
          seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    # kv_lora is a free size (a slice's end), not an int wildcard: a sentinel past the entry would clamp away
    return paged_mla_attention(q, kv_cache, kv_scale, block_table, seq_lens, scale, KV_LORA)


def _example(dtype: torch.dtype, cache_dtype: torch.dtype) -> tuple[Any, ...]:
    cache = randn(BLOCKS, PAGE, E).to(cache_dtype)
    table = torch.randperm(BLOCKS)[:B * WIDTH].view(B, WIDTH).int()
    return (randn(B, H, E, dtype=dtype), cache, torch.ones(1), table, torch.full((B,), 3, dtype=torch.int32),
            0.125)


def _name(dtype: torch.dtype, cache_dtype: torch.dtype) -> str:
    return "core" if cache_dtype == dtype else f"core+{str(cache_dtype).removeprefix('torch.')}"


def _cache(match: Match) -> fx.Node:
    """The cache as the gather reads it ([blocks, block_size, E]): the views the matcher walked through are
    not in the match, so the gather's own operand is taken."""
    gather = next((n for n in match.nodes if n.op == "call_function" and n.target is aten.index.Tensor), None)
    return gather.args[0] if gather is not None else match["kv_cache"]


def _operand(match: Match, name: str) -> fx.Node:
    """A pattern input as the op takes it: the value under the views the graph reads it through (the spelling's
    view of seq_lens to [B, 1, 1], for one)."""
    return value_root(match[name])


def _shapes(match: Match) -> dict[str, tuple[Any, ...] | None]:
    return {"q": shape_of(_operand(match, "q")), "kv_cache": shape_of(_cache(match)),
            "block_table": shape_of(_operand(match, "block_table")), "seq_lens": shape_of(_operand(match, "seq_lens")),
            "kv_scale": shape_of(_operand(match, "kv_scale"))}


def _site_values(match: Match) -> dict[str, Any]:
    """What the log records of a site: the shapes and dtypes the guards read."""
    shapes = _shapes(match)
    form = match.params(CacheForm)
    values: dict[str, Any] = {k: [str(d) for d in v] if v is not None else None for k, v in shapes.items()}
    values.update(dtype=str(form.dtype), cache_dtype=str(form.cache_dtype), kv_lora=str(match.scalars.get("kv_lora")))
    q, cache, table = shapes["q"], shapes["kv_cache"], shapes["block_table"]
    if q is not None and len(q) == 3:
        values["heads"] = str(q[1])
    if cache is not None and len(cache) == 3:
        values["block_size"] = str(cache[1])
        if table is not None and len(table) == 2:
            values["max_context"] = str(table[1] * cache[1])
    return values


def _shape_failure(match: Match, values: dict[str, Any]) -> GuardFailure | None:
    """q [B, H, 576], the cache [blocks, block_size, 576], table [B, W], lengths [B], one scale, kv_lora 512,
    heads within the op's range."""
    shapes = _shapes(match)
    q, cache, table, lens = shapes["q"], shapes["kv_cache"], shapes["block_table"], shapes["seq_lens"]
    if q is None or cache is None or table is None or lens is None or len(q) != 3 or len(cache) != 3 \
            or len(table) != 2 or len(lens) != 1:
        return GuardFailure("site", "shape", "the attention's operands are not q [B, H, E], kv_cache [blocks, "
                            "block_size, E], block_table [B, W] and seq_lens [B]", values)
    if str(match.scalars.get("kv_lora")) != str(LATENT) or str(q[2]) != str(ENTRY) or str(cache[2]) != str(ENTRY):
        return GuardFailure("site", "entry", f"the fused op serves entries of {ENTRY} values whose first {LATENT} "
                            "are c_kv (K3's kv_lora 512 + qk_shared 64)", values)
    if not isinstance(q[1], int) or not 1 <= q[1] <= MAX_HEADS:
        return GuardFailure("site", "heads", f"heads per rank must be static and 1-{MAX_HEADS} (K3: 96 / TP)",
                            values)
    if shapes["kv_scale"] is None or tuple(shapes["kv_scale"]) != (1,):
        return GuardFailure("site", "kv_scale", "the cache's scale is not one value", values)
    return None


def _dtype_failure(match: Match, values: dict[str, Any]) -> GuardFailure | None:
    """bf16 / fp16 queries; the cache in their dtype or fp8 e4m3; int32 table and lengths; an fp32 scale."""
    form = match.params(CacheForm)
    if form.dtype not in (torch.bfloat16, torch.float16):
        return GuardFailure("site", "dtype", "the fused op takes bf16 / fp16 queries (an fp32 trunk stays stock)",
                            values)
    if form.cache_dtype not in (form.dtype, FP8):
        return GuardFailure("site", "cache_dtype", "the cache must be in the queries' dtype or fp8 e4m3", values)
    found = {n: dtype_of(_operand(match, n)) for n in ("block_table", "seq_lens", "kv_scale")}
    if found != {"block_table": torch.int32, "seq_lens": torch.int32, "kv_scale": torch.float32}:
        return GuardFailure("site", "index_dtype", "block_table and seq_lens must be int32 and kv_scale fp32",
                            {**values, **{k: str(v) for k, v in found.items()}})
    return None


# --- the output gate on the side stream ------------------------------------------------------------------
def _forward_chain(node: fx.Node, limit: int = 12) -> list[fx.Node]:
    """`node`'s single-reader chain forward through views and casts (the attention's output to the gate's
    multiply: the W_UV bmm, its views, the fp32 cast)."""
    chain, cur = [], node
    for _ in range(limit):
        users = real_users(cur)
        if len(users) != 1:
            break
        cur = users[0]
        chain.append(cur)
    return chain


def _through_layout(node: Any) -> Any:
    """`node` with the views and casts in front of it stripped (backwards)."""
    while isinstance(node, fx.Node) and node.op == "call_function" and (node.target in VIEW_LIKE or node.target in
                                                                        CAST_OPS):
        node = node.args[0]
    return node


def _gate_site(attention: fx.Node) -> tuple[MLPBranch, fx.Node] | str:
    """(the gate GEMM as a one-projection region, its first reader) for the attention output `attention`, or why
    there is none: the multiply downstream of the attention whose other operand is sigmoid(linear(x, W_g))."""
    for node in _forward_chain(attention):
        if node.target is not torch.ops.aten.mul.Tensor:
            continue
        for other in node.args:
            sig = _through_layout(other)
            if not (isinstance(sig, fx.Node) and sig.target is torch.ops.aten.sigmoid.default):
                continue
            mm = _through_layout(sig.args[0])
            proj = linear_of(mm)
            if proj is None:
                return "the sigmoid's input is not a static-weight linear"
            if is_static(proj.x):
                return "the gate GEMM reads a static tensor, not an activation"
            readers = real_users(proj.out)
            if len(readers) != 1:
                return "the gate GEMM's output has other readers"
            return MLPBranch(proj.out, [proj], proj.out, [], None, []), readers[0]
    return "no multiply by sigmoid(linear(x)) downstream of the attention"


class MLADecode(Rule):
    """softmax(scale * q [c_kv | k_sh]^T) c_kv over the paged cache (gathered, masked) -> k3fuse.mla_decode."""

    name = "mla_decode"
    emits = ("mla_decode",)
    description = ("the absorbed MLA attention core over the paged latent cache (pages gathered to the table's "
                   "width in fp32, scores over [c_kv | k_sh], length mask, softmax, weighted sum of c_kv) -> "
                   "k3fuse.mla_decode (each live entry read once for all heads, split along the context)")
    site_op = aten.amax.default
    settings_type = MLADecodeSettings
    settings = MLADecodeSettings()

    def patterns(self) -> list[PatternSpec]:
        specs = []
        for dtype, cache_dtype in FORMS:
            key = Variant(_name(dtype, cache_dtype), dtype, CacheForm(dtype, cache_dtype))
            specs.append(PatternSpec(str(key), _core, lambda d=dtype, c=cache_dtype: _example(d, c), key,
                                     free_sizes=FREE_SIZES))
        return specs

    def check_site(self, match: Match, ctx: DecodeContext) -> list[GuardFailure]:
        values = _site_values(match)
        found = failures(_shape_failure(match, values), _dtype_failure(match, values))
        if found:
            return found
        found = failures(token_count(_operand(match, "q"), ctx))
        if found:
            return found
        shapes = _shapes(match)
        q, cache, table = shapes["q"], shapes["kv_cache"], shapes["block_table"]
        if not (isinstance(cache[1], int) and isinstance(table[1], int)):
            return []  # a symbolic page or table width: the op checks each call (its kernels take any page size)
        form = match.params(CacheForm)
        spec = MLADecodeSpec(tokens=q[0] if isinstance(q[0], int) else 1, heads=q[1], block_size=cache[1],
                             cache_dtype=form.cache_dtype, dtype=form.dtype, max_context=table[1] * cache[1])
        return failures(kernel_covers(ctx, spec, q[0] if isinstance(q[0], int) else None))

    def rewrite(self, match: Match, ctx: DecodeContext) -> list[fx.Node]:
        form = match.params(CacheForm)
        values = _site_values(match)
        new = match.replace_with(torch.ops.k3fuse.mla_decode.default, q=_operand(match, "q"), kv_cache=_cache(match),
                                 block_table=_operand(match, "block_table"), seq_lens=_operand(match, "seq_lens"),
                                 softmax_scale=float(match["scale"]), kv_scale=_operand(match, "kv_scale"),
                                 strict=ctx.strict)
        match.note(**{k: values[k] for k in ("heads", "block_size", "max_context")}, cache_dtype=str(form.cache_dtype))
        if self.settings_in(ctx).gate == "side_stream":
            new += self._gate_to_side_stream(match, new[0])
        return new

    @staticmethod
    def _gate_to_side_stream(match: Match, attention: fx.Node) -> list[fx.Node]:
        """Bracket the output gate's GEMM with the side-stream markers (module docstring); the reason in the log
        when the site has no gate to move."""
        site = _gate_site(attention)
        if isinstance(site, str):
            match.note(gate=f"inline: {site}")
            return []
        branch, reader = site
        graph, x, ops = match.graph, branch.x, torch.ops.k3fuse
        number = sum(1 for n in graph.nodes if op_qualname(n) == _FORK)
        order = node_order(graph)
        first_reader = min((u for u in x.users if not is_metadata_check(u)), key=order.__getitem__)
        fork = match.insert(ops.shared_expert_fork.default, (x, number), before=first_reader, provenance=branch.out)
        last = _bracket(graph, branch, fork)
        end = match.insert(ops.shared_expert_end.default, (branch.out, number), before=last.next,
                           provenance=branch.out)
        join = match.insert(ops.shared_expert_join.default, (branch.out, attention, [x], number), before=reader,
                            provenance=branch.out)
        branch.out.replace_all_uses_with(join, delete_user_cb=lambda u: u not in (end, join)
                                         and not is_metadata_check(u))
        match.note(gate="side_stream", gate_site=number, gate_join_before=reader.name)
        return [fork, end, join]


__all__ = ["MLADecode"]
