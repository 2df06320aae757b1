"""Triton fused routing: sigmoid, correction bias, top-k, renormalisation and scaling in one kernel.

Why: the model's router tail (k3fuse/model/layers.py `route`) is five to eight small kernels per
layer at decode (sigmoid, add, topk, gather, sum, add, div, mul), each a launch on a [T, 896]
tensor: launch-bound, not bandwidth-bound. One program per token does all of it.

One program per token: it loads the token's E logits (E <= MAX_EXPERTS, one block), computes
scores = sigmoid(logits) and biased = scores + b_corr, packs each expert into one uint64 key (the
biased score's order-preserving bits, then the inverted index, so ties go to the lowest index as in
the reference's stable sort, kernels/lib/reference/routing.py) and takes the k largest keys with one
bitonic top-k (tl.topk): no per-selection block reductions, which made a 16-step selection loop cost
~10 µs. The selected scores are recomputed from their logits and added in selection order, so the
weights are w_i / (((w_0 + w_1) + ...) + eps) * routed_scaling with the reference's order of additions.

Bits: idx and weights equal the reference's bit for bit for the same inputs on the same device:
* sigmoid is spelled as torch's CUDA kernel computes it, 1 / (1 + expf(-x)), with libdevice's expf
  (the CUDA math library's expf, what nvcc compiles std::exp to without fast-math) and IEEE
  round-to-nearest division (tl.math.div_rn; Triton's `/` is an approximate division). On another
  device (the CPU reference, the interpreter's numpy exp) sigmoid may differ by an ulp, which can
  only flip a selection whose biased scores are within an ulp of each other;
* the selection compares the same fp32 values the reference sorts; ties (==, so -0.0 == +0.0) go
  to the lowest index;
* the weight sum adds in selection order, one fp32 rounding per add; the division is div_rn and
  the scaling one fp32 multiply, as in the reference.
NaN: a NaN biased score counts as larger than every number (torch.sort / torch.topk's order),
NaNs among themselves by index; its weight is NaN and so are the other weights of that token
(the sum is NaN), as in the reference. No workspace, no atomics: deterministic, batch-invariant
(a token's result does not depend on the others), CUDA-graph safe once compiled (`warmup`).

logits fp32 [T, E] (unit inner stride, any row stride), b_corr fp32 [E] contiguous ->
(weights fp32 [T, k], idx int64 [T, k]) new contiguous.
"""
from __future__ import annotations

import os

import torch

from . import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

MAX_TOKENS = 64
MAX_EXPERTS = 2048  # one block of E scores per program (K3: 896 -> a 1024 block)
MAX_TOP_K = 32  # K3: 16

#: Triton's CPU interpreter (TRITON_INTERPRET=1, read when triton is imported) has no libdevice
#: (Triton 3.6: its functions are stubs that return None there), so under it expf is tl.exp, which
#: the interpreter runs as numpy's float32 exp. Compiled for a GPU it is libdevice's expf.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

if HAVE_TRITON:
    #: tl.gather (Triton >= 3.2) picks the selected scores on chip instead of reloading their logits
    HAS_GATHER = tl.constexpr(hasattr(tl, "gather"))

    if INTERPRET:
        @triton.jit
        def _expf(x):
            return tl.exp(x)
    else:
        @triton.jit
        def _expf(x):
            return libdevice.exp(x)

    @triton.jit
    def _sigmoid(x):
        """1 / (1 + expf(-x)) as torch's CUDA sigmoid computes it (IEEE division, libdevice expf)."""
        return tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), 1.0 + _expf(-x))

    @triton.jit
    def _route_topk_kernel(logits_ptr, bias_ptr, w_ptr, idx_ptr, E, l_st, routed_scaling, eps,
                           TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_E)
        valid = offs < E
        x = tl.load(logits_ptr + t * l_st + offs, mask=valid, other=0.0)
        b = tl.load(bias_ptr + offs, mask=valid, other=0.0)
        scores = _sigmoid(x)
        biased = scores + b
        # One int64 key per expert whose order is the selection order. High word: the biased score's
        # bits as an order-preserving int32 (negative floats get their magnitude bits flipped; -0.0
        # becomes +0.0 so the two tie; every NaN the largest). Low word: BLOCK_E - 1 - index, so the
        # lowest index wins a tie. Padding lanes get -2**63, below every real key (-inf is above it).
        bits = biased.to(tl.int32, bitcast=True)
        bits = tl.where(bits == -2147483648, 0, bits)
        ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        ordered = tl.where(biased != biased, 0x7FFFFFFF, ordered)
        key = (ordered.to(tl.int64) << 32) | (BLOCK_E - 1 - offs).to(tl.int64)
        key = tl.where(valid, key, tl.full([BLOCK_E], -2147483648, tl.int64) << 32)
        top = tl.topk(key, BLOCK_K)  # bitonic top-k, descending: the selection order
        sel = (BLOCK_E - 1 - (top & (BLOCK_E - 1))).to(tl.int32)
        kofs = tl.arange(0, BLOCK_K)
        kmask = kofs < TOP_K
        # the selected unbiased scores: gathered on chip where Triton has tl.gather, else recomputed
        # from their logits (the same bits either way)
        if HAS_GATHER:
            w = tl.gather(scores, sel, 0)
        else:
            w = _sigmoid(tl.load(logits_ptr + t * l_st + sel, mask=kmask, other=0.0))
        # The sum in selection order, one rounding per add. Block reductions of the k values would
        # each cost a barrier; instead the k scores go to the output row, and every thread reads them
        # back as scalars and adds them in order (the barriers make the row visible, then keep it
        # until every thread has read it).
        row = w_ptr + t * TOP_K
        tl.store(row + kofs, w, mask=kmask)
        tl.debug_barrier()
        total = tl.load(row)
        for i in tl.static_range(1, TOP_K):
            total = total + tl.load(row + i)
        tl.debug_barrier()
        denom = total + eps
        weights = tl.math.div_rn(w, tl.full([BLOCK_K], 0.0, tl.float32) + denom) * routed_scaling
        tl.store(row + kofs, weights, mask=kmask)
        tl.store(idx_ptr + t * TOP_K + kofs, sel.to(tl.int64), mask=kmask)


def _block(n: int) -> int:
    return max(16, 1 << (int(n) - 1).bit_length())


#: warps per program, by BLOCK_E; bench/bench_route_topk.py --warps measures the choices
WARPS_BY_BLOCK = {1024: 8}  # H200, E = 896: 4.0-4.1 µs with 8 warps, 5.0-5.1 with 4 (bench --warps 4,8)


def pick_config(E: int, top_k: int) -> dict:
    """BLOCK_E: the experts in one power-of-two block; BLOCK_K: the k outputs (a power of two for the
    bitonic top-k, at most BLOCK_E); warps by block size."""
    block_e = _block(E)
    return {"BLOCK_E": block_e, "BLOCK_K": min(_block(top_k), block_e),
            "num_warps": WARPS_BY_BLOCK.get(block_e, 4 if block_e >= 1024 else 2)}


def missing_features() -> str | None:
    """What this triton lacks for the kernel (tl.topk), or None."""
    if not hasattr(tl, "topk"):
        return f"triton {triton.__version__} has no tl.topk (needs triton >= 3.4)"
    return None


def run(logits, b_corr, top_k, routed_scaling, eps=1e-20, out: tuple | None = None,
        num_warps: int | None = None):
    """(weights, idx); `out` = (weights fp32 [T, k], idx int64 [T, k]) contiguous buffers to write;
    `num_warps` overrides the configured warps (the benchmark's sweep)."""
    T, E = logits.shape
    cfg = pick_config(E, top_k)
    if num_warps is not None:
        cfg["num_warps"] = int(num_warps)
    if out is None:
        weights = torch.empty((T, top_k), dtype=torch.float32, device=logits.device)
        idx = torch.empty((T, top_k), dtype=torch.int64, device=logits.device)
    else:
        weights, idx = out
        assert weights.is_contiguous() and idx.is_contiguous() and tuple(weights.shape) == (T, top_k)
    if T == 0:
        return weights, idx
    _route_topk_kernel[(T,)](logits, b_corr, weights, idx, E, logits.stride(0), float(routed_scaling),
                             float(eps), TOP_K=int(top_k), BLOCK_E=cfg["BLOCK_E"], BLOCK_K=cfg["BLOCK_K"],
                             num_warps=cfg["num_warps"])
    return weights, idx


