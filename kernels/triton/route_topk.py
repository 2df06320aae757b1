"""Triton fused routing: sigmoid, correction bias, top-k, renormalisation and scaling in one kernel.

Why: the model's router tail (k3fuse/model/layers.py `route`) is five to eight small kernels per
layer at decode (sigmoid, add, topk, gather, sum, add, div, mul), each a launch on a [T, 896]
tensor: launch-bound, not bandwidth-bound. One program per token does all of it.

One program per token: it loads the token's E logits (E <= MAX_EXPERTS, one block), computes
scores = sigmoid(logits) and biased = scores + b_corr, then selects the k experts in k iterations:
the largest available biased score, ties to the lowest index (the reference's stable sort,
kernels/reference/routing.py), removed from the available set. Each selected score is taken
from the unbiased scores and added to a running sum in selection order, so the weights are
w_i / (((w_0 + w_1) + ...) + eps) * routed_scaling with the reference's order of additions.

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

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    HAVE_TRITON = True
except Exception:  # pragma: no cover - CPU CI without triton
    HAVE_TRITON = False

MAX_TOKENS = 64
MAX_EXPERTS = 2048  # one block of E scores per program (K3: 896 -> a 1024 block)
MAX_TOP_K = 32  # K3: 16

#: Triton's CPU interpreter (TRITON_INTERPRET=1, read when triton is imported) has no libdevice
#: (Triton 3.6: its functions are stubs that return None there), so under it expf is tl.exp, which
#: the interpreter runs as numpy's float32 exp. Compiled for a GPU it is libdevice's expf.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

if HAVE_TRITON:

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
        is_nan = biased != biased
        avail = valid
        kofs = tl.arange(0, BLOCK_K)
        w_sel = tl.zeros([BLOCK_K], dtype=tl.float32)
        i_sel = tl.zeros([BLOCK_K], dtype=tl.int32)
        total = 0.0
        for i in tl.static_range(TOP_K):
            # NaN first (it sorts above every number), then the largest number; lowest index on ties
            nan_idx = tl.min(tl.where(avail & is_nan, offs, BLOCK_E), axis=0)
            num = avail & (biased == biased)
            top = tl.max(tl.where(num, biased, float("-inf")), axis=0)
            num_idx = tl.min(tl.where(num & (biased == top), offs, BLOCK_E), axis=0)
            sel = tl.where(nan_idx < BLOCK_E, nan_idx, num_idx)
            hit = offs == sel
            w = tl.sum(tl.where(hit, scores, 0.0), axis=0)  # exactly scores[sel] (the others add +0.0)
            avail = avail & (offs != sel)
            if i == 0:
                total = w
            else:
                total = total + w  # selection order, as the reference's ordered_sum
            w_sel = tl.where(kofs == i, w, w_sel)
            i_sel = tl.where(kofs == i, sel, i_sel)
        denom = total + eps
        weights = tl.math.div_rn(w_sel, tl.full([BLOCK_K], 0.0, tl.float32) + denom) * routed_scaling
        kmask = kofs < TOP_K
        tl.store(w_ptr + t * TOP_K + kofs, weights, mask=kmask)
        tl.store(idx_ptr + t * TOP_K + kofs, i_sel.to(tl.int64), mask=kmask)


def _block(n: int) -> int:
    return max(16, 1 << (int(n) - 1).bit_length())


def pick_config(E: int, top_k: int) -> dict:
    """BLOCK_E: the experts in one power-of-two block; BLOCK_K: the k outputs; warps by block size."""
    block_e = _block(E)
    return {"BLOCK_E": block_e, "BLOCK_K": _block(top_k), "num_warps": 4 if block_e >= 1024 else 2}


def _shape_limit(M: int, E: int, top_k: int, dtype) -> str | None:
    if dtype != torch.float32:
        return f"dtype {dtype} (fp32 logits only)"
    if not 1 <= M <= MAX_TOKENS:
        return f"T={M} (needs 1 <= T <= {MAX_TOKENS})"
    if not 1 <= E <= MAX_EXPERTS:
        return f"E={E} (needs 1 <= E <= {MAX_EXPERTS})"
    if not 1 <= top_k <= min(MAX_TOP_K, E):
        return f"top_k={top_k} (needs 1 <= top_k <= {MAX_TOP_K} and <= E)"
    return None


def supports(logits, b_corr, top_k, routed_scaling, eps=1e-20) -> str | None:
    if not HAVE_TRITON:
        return "triton not installed"
    if not (isinstance(logits, torch.Tensor) and isinstance(b_corr, torch.Tensor)):
        return "logits and b_corr must be tensors"
    if not (logits.is_cuda and b_corr.is_cuda):
        return "not CUDA tensors"
    if logits.dim() != 2 or b_corr.dim() != 1 or b_corr.shape[0] != logits.shape[1]:
        return f"logits {tuple(logits.shape)} / b_corr {tuple(b_corr.shape)} are not [T, E] / [E]"
    if b_corr.dtype != torch.float32:
        return f"b_corr dtype {b_corr.dtype} (fp32 only)"
    if logits.stride(1) != 1 or b_corr.stride(0) != 1:
        return "logits and b_corr need a unit inner stride"
    return _shape_limit(logits.shape[0], logits.shape[1], top_k, logits.dtype)


def run(logits, b_corr, top_k, routed_scaling, eps=1e-20, out: tuple | None = None):
    """(weights, idx); `out` = (weights fp32 [T, k], idx int64 [T, k]) contiguous buffers to write."""
    T, E = logits.shape
    cfg = pick_config(E, top_k)
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


# --- dispatcher registration ---------------------------------------------------------------------
def _supports(logits, b_corr, top_k, routed_scaling, eps=1e-20, **_) -> str | None:
    return supports(logits, b_corr, top_k, routed_scaling, eps)


def _covers(shape: dict) -> str | None:
    """Compile-time limit (dispatch.Impl.covers): shape {"M": tokens, "E", "top_k", "dtype"}."""
    return _shape_limit(shape["M"], shape["E"], shape["top_k"], shape.get("dtype", torch.float32))


def _run(logits, b_corr, top_k, routed_scaling, eps=1e-20, **_):
    return run(logits, b_corr, top_k, routed_scaling, eps)


def _warmup(shapes) -> None:
    """Triton compiles on first launch: launch once per {"M", "E", "top_k"} on zeros (the compiled
    code depends on E's block, top_k and the row stride's 16-divisibility)."""
    for s in shapes:
        dev = s.get("device", "cuda")
        logits = torch.zeros((s["M"], s["E"]), dtype=torch.float32, device=dev)
        b_corr = torch.zeros((s["E"],), dtype=torch.float32, device=dev)
        if supports(logits, b_corr, s["top_k"], 1.0) is None:
            run(logits, b_corr, s["top_k"], 1.0)


if HAVE_TRITON:
    from ..dispatch import Impl, register_impl

    register_impl("route_topk", Impl("triton.route_topk", supports=_supports, run=_run, priority=50,
                                     warmup=_warmup, covers=_covers))
