"""mla_decode: K3's gated NoPE-MLA decode attention core over the paged latent cache, in one op.

For each sequence b and head h (k3-model.md section 2.4, absorbed form):
    out[b, h] = sum_{j < seq_lens[b]} softmax_j(softmax_scale * q[b, h] . entry_j) * c_kv_j
q [B, H, 576] = [q_lat (512) | q_sh (64)] per head (W_UK already absorbed into q_lat), the cache
kv_cache [num_blocks, block_size, 576] of entries [c_kv (512) | k_sh (64)] in q's dtype or fp8 e4m3,
kv_scale (fp32, one element: entry = kv_scale * stored; an fp8 cache needs it, a 16-bit cache may have
it, as the model's spelling multiplies every cache by its scale), block_table int32 [B, max_blocks]
(token j of sequence b in page block_table[b, j // block_size], row j % block_size), seq_lens
int32 [B] (the current token's entry included; a length past max_blocks * block_size attends over
the whole table, as the plain spelling does) -> out [B, H, 512] in q's dtype. The output gate, W_UV
and the cache append stay outside (patterns/mla_decode.py says why).

Stock: the plain spelling (pages gathered, fp32 scores, length mask, softmax, weighted sum);
reference: one sequence at a time in fp32 (lib/reference/mla_decode.py); CUDA: flash-decoding
split along the context plus the combine of the partials (lib/triton/mla_decode.py). `mla_combine`
is the combine alone, the entry decode context parallelism (DCP) merges exchanged partials with.
`decode_bytes` is the op's HBM traffic, the benchmark's denominator.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..declare import OpDecl, declare
from ..dispatch import Impl, register_impl
from ..lib.reference import mla_decode as reference
from ..spec import Spec, call_only, operands_misfit

OP = "mla_decode"
LATENT, ROPE = 512, 64
ENTRY = LATENT + ROPE
FP8 = torch.float8_e4m3fn
MAX_HEADS = 128  # heads a rank; K3: 96 / TP


@dataclass(frozen=True, kw_only=True)
class MLADecodeSpec(Spec):
    """`tokens` sequences (one decode token each) of `heads` heads over a paged cache of
    `block_size`-entry pages in `cache_dtype`, at most `max_context` entries a sequence (the block
    table's width times the page size); q and the output in `dtype`."""

    op: ClassVar[str] = OP
    heads: int
    block_size: int
    cache_dtype: torch.dtype
    dtype: torch.dtype = torch.bfloat16
    max_context: int
    fits: str | None = call_only(None)  # why a call's operands are not the layout above

    @classmethod
    def from_call(cls, q, kv_cache, block_table, seq_lens, softmax_scale, kv_scale=None, **_: Any) -> MLADecodeSpec:
        tensors = dict(q=q, kv_cache=kv_cache, block_table=block_table, seq_lens=seq_lens)
        if kv_scale is not None:
            tensors["kv_scale"] = kv_scale
        fits = operands_misfit(tensors, contiguous=False) or _layout_misfit(q, kv_cache, block_table, seq_lens, kv_scale)
        if fits is not None:
            return cls(tokens=0, heads=0, block_size=0, cache_dtype=torch.bfloat16, max_context=0, fits=fits)
        return cls(tokens=int(q.shape[0]), heads=int(q.shape[1]), block_size=int(kv_cache.shape[1]),
                   cache_dtype=kv_cache.dtype, dtype=q.dtype,
                   max_context=int(block_table.shape[1]) * int(kv_cache.shape[1]))


def _layout_misfit(q, kv_cache, block_table, seq_lens, kv_scale) -> str | None:
    """Why tensor operands are not the op's layout with what the kernel's 16-byte loads need."""
    if q.dim() != 3 or q.shape[-1] != ENTRY or kv_cache.dim() != 3 or kv_cache.shape[-1] != ENTRY:
        return f"q {tuple(q.shape)} / kv_cache {tuple(kv_cache.shape)} are not [B, H, {ENTRY}] / [blocks, page, {ENTRY}]"
    B = q.shape[0]
    if block_table.dim() != 2 or block_table.shape[0] != B or seq_lens.shape != (B,):
        return f"block_table {tuple(block_table.shape)} / seq_lens {tuple(seq_lens.shape)} are not [B={B}, W] / [B]"
    if block_table.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        return f"block_table {block_table.dtype} / seq_lens {seq_lens.dtype} (int32 only)"
    if q.stride(-1) != 1 or kv_cache.stride(-1) != 1 or block_table.stride(-1) != 1 or seq_lens.stride(0) != 1:
        return "q, kv_cache, block_table and seq_lens need a unit inner stride"
    size = kv_cache.element_size()
    if any(s * size % 16 for s in (kv_cache.storage_offset(), *kv_cache.stride()[:2])):
        return f"kv_cache rows must be 16-byte aligned (strides {kv_cache.stride()}, {size}-byte elements)"
    if kv_cache.dtype == FP8 and kv_scale is None:
        return "an fp8 cache needs its kv_scale"
    if kv_scale is not None and (kv_scale.dtype != torch.float32 or kv_scale.numel() != 1):
        return f"kv_scale must be one float32 element, got {kv_scale.dtype} {tuple(kv_scale.shape)}"
    return None


def accepts(spec: MLADecodeSpec) -> str | None:
    from ..lib.triton import mla_decode as kernel

    if spec.fits is not None:
        return spec.fits
    if spec.dtype not in kernel.QUERY_DTYPES:
        return f"q dtype {spec.dtype} (bf16/fp16 only)"
    if spec.cache_dtype not in (spec.dtype, kernel.FP8):
        return f"cache dtype {spec.cache_dtype} with q {spec.dtype} (the query's dtype or fp8 e4m3 only)"
    if not 1 <= spec.heads <= MAX_HEADS:
        return f"heads={spec.heads} (needs 1 <= heads <= {MAX_HEADS})"
    if spec.tokens < 1 or spec.block_size < 1 or spec.max_context < 1:
        return f"batch={spec.tokens}, block_size={spec.block_size}, max_context={spec.max_context} (need >= 1)"
    return None


def run(q, kv_cache, block_table, seq_lens, softmax_scale, kv_scale=None, **_):
    from ..lib.triton import mla_decode as kernel

    return kernel.run(q, kv_cache, block_table, seq_lens, softmax_scale, kv_scale)


def warmup(shapes) -> None:
    """Triton compiles on first launch: launch once per {"B", "heads", "block_size", "max_context",
    "cache_dtype", "dtype", "kv_scale" (whether calls pass a scale; default: fp8 caches only)} over
    zero lengths (the compiled code depends on the page size, the cache dtype, the scale, whether one
    split serves the call, and the 16-divisibility of heads and strides; never on the lengths), so
    warm every batch size the graphs will capture."""
    from ..lib.triton import mla_decode as kernel

    for s in shapes:
        dev, dtype = s.get("device", "cuda"), s.get("dtype", torch.bfloat16)
        cache_dtype, page = s.get("cache_dtype", dtype), s["block_size"]
        width = -(-s["max_context"] // page)
        q = torch.zeros((s["B"], s["heads"], ENTRY), dtype=dtype, device=dev)
        cache = torch.zeros((1, page, ENTRY), dtype=cache_dtype, device=dev)
        table = torch.zeros((s["B"], width), dtype=torch.int32, device=dev)
        lens = torch.zeros((s["B"],), dtype=torch.int32, device=dev)
        scale = torch.ones(1, dtype=torch.float32, device=dev) if s.get("kv_scale", cache_dtype == FP8) else None
        if accepts(MLADecodeSpec.from_call(q, cache, table, lens, 1.0, scale)) is None:
            kernel.run(q, cache, table, lens, 1.0, scale)


def _fake(q, kv_cache, block_table, seq_lens, softmax_scale, kv_scale=None, strict=False):
    name = "k3fuse.mla_decode"
    torch._check(q.dim() == 3 and q.shape[-1] == ENTRY,
                 lambda: f"{name}: q must be [B, heads, {ENTRY}] ([q_lat | q_sh] per head), got {tuple(q.shape)}")
    torch._check(kv_cache.dim() == 3 and kv_cache.shape[-1] == ENTRY,
                 lambda: f"{name}: kv_cache must be [num_blocks, block_size, {ENTRY}], got {tuple(kv_cache.shape)}")
    torch._check(block_table.dim() == 2 and block_table.shape[0] == q.shape[0],
                 lambda: f"{name}: block_table must be [B={q.shape[0]}, max_blocks], got {tuple(block_table.shape)}")
    torch._check(seq_lens.dim() == 1 and seq_lens.shape[0] == q.shape[0],
                 lambda: f"{name}: seq_lens must be [B={q.shape[0]}], got {tuple(seq_lens.shape)}")
    torch._check(block_table.dtype == torch.int32 and seq_lens.dtype == torch.int32,
                 lambda: f"{name}: block_table and seq_lens must be int32, got {block_table.dtype} / {seq_lens.dtype}")
    torch._check(kv_cache.dtype != FP8 or kv_scale is not None,
                 lambda: f"{name}: an fp8 kv_cache needs kv_scale (fp32, one element)")
    torch._check(q.dtype.is_floating_point, lambda: f"{name}: q must be floating point, got {q.dtype}")
    return q.new_empty((q.shape[0], q.shape[1], LATENT))


DECL = OpDecl(OP, "(Tensor q, Tensor kv_cache, Tensor block_table, Tensor seq_lens, float softmax_scale, "
                  "Tensor? kv_scale=None, bool strict=False) -> Tensor",
              _fake, reference.plain_spelling, reference.mla_decode, spec=MLADecodeSpec)
DECLS = (DECL,)
declare(DECL)
register_impl(OP, Impl("triton.mla_decode", accepts, run, priority=50, warmup=warmup, needs=("triton.mla_decode",)))


def mla_combine(partial_out: torch.Tensor, partial_lse: torch.Tensor, out: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None, lse_out: torch.Tensor | None = None) -> torch.Tensor:
    """Merge S partial attention results of each (sequence, head): the split kernel's second pass,
    and what decode context parallelism calls on the partials its ranks exchange.

    partial_out fp32 [B, H, S, D]: each part's normalised output (sum_j p_j c_kv_j over its
    entries, p summing to 1 within the part); partial_lse fp32 [B, H, S]: each part's natural-log
    log-sum-exp of its scaled scores, -inf for a part without entries (its partial_out is never
    read). Returns out [B, H, D] = sum_s exp(lse_s - LSE) partial_out_s, LSE = logsumexp_s(lse_s),
    in `out`'s dtype (`out_dtype`, default fp32, when none is given); zeros where no part has
    entries. `lse_out` fp32 [B, H] receives LSE, so merges chain (each rank's merged result is a
    part of the next merge). CUDA: the Triton combine; elsewhere the float reference."""
    if partial_out.is_cuda:
        from ..lib.triton import HAVE_TRITON

        if HAVE_TRITON:
            from ..lib.triton import mla_decode as kernel

            return kernel.combine(partial_out, partial_lse, out=out, out_dtype=out_dtype, lse_out=lse_out)
    merged, lse = reference.merge(partial_out, partial_lse)
    if lse_out is not None:
        lse_out.copy_(lse)
    if out is None:
        return merged.to(out_dtype or torch.float32)
    return out.copy_(merged)


@dataclass(frozen=True)
class DecodeBytes:
    """HBM bytes one mla_decode call must move: its cache entries (576 values each), q and out."""

    cache: int
    q: int
    out: int

    @property
    def total(self) -> int:
        return self.cache + self.q + self.out


def decode_bytes(total_tokens: int, batch: int, heads: int, cache_dtype: torch.dtype,
                 dtype: torch.dtype = torch.bfloat16) -> DecodeBytes:
    """The op's floor traffic: `total_tokens` = sum of seq_lens entries read once (the block table,
    the lengths and the split kernel's partials are extra), q read once, out written once."""
    return DecodeBytes(cache=ENTRY * cache_dtype.itemsize * total_tokens,
                       q=batch * heads * ENTRY * dtype.itemsize, out=batch * heads * LATENT * dtype.itemsize)
