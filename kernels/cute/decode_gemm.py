"""decode_gemm on CUDA: registers the CuTe GEMV and picks GEMV vs Triton split-K per call.

Why: the GEMV (CUDA-core FMA, pure weight stream) wins at 1-2 tokens; above that the tensor-core
split-K kernel wins (FMA becomes compute-bound by 8..64 tokens). The crossover was measured on
H200 (docs/perf.md) and can be overridden with K3FUSE_GEMV_MAX_M for experiments.
"""
from __future__ import annotations


import torch

from k3fuse import settings

from . import compat, decode_gemv

GEMV_MAX_M = 2
# measured exceptions to the crossover (docs/perf.md): the narrow router keeps the GEMV up to M=4
GEMV_MAX_M_BY_SHAPE = {(896, 7168): 4}


def gemv_max_m(N: int, K: int) -> int:
    forced = settings.get("K3FUSE_GEMV_MAX_M")  # K3FUSE_GEMV_MAX_M overrides the measured crossover
    if forced is not None:
        return forced
    return GEMV_MAX_M_BY_SHAPE.get((N, K), GEMV_MAX_M)


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def gemv_supports(x, weight, bias, out_dtype=None, **_) -> str | None:
    if not compat.available():
        return f"CuTe DSL unavailable ({compat.IMPORT_ERROR or 'disabled'})"
    x2 = _flat(x)
    lim = gemv_max_m(weight.shape[0], weight.shape[1])
    if x2.shape[0] > lim:
        return f"M={x2.shape[0]} > {lim} (split-K measured faster)"
    if not decode_gemv.supports(x2, weight, bias, out_dtype or x.dtype):
        return f"shape/dtype/alignment unsupported (x {tuple(x.shape)} {x.dtype}, w {tuple(weight.shape)})"
    return None


def gemv_covers(shape: dict) -> str | None:
    """Compile-time limit of the GEMV (see dispatch.Impl.covers)."""
    if not compat.available():
        return f"CuTe DSL unavailable ({compat.IMPORT_ERROR or 'disabled'})"
    M, N, K = shape["M"], shape["N"], shape["K"]
    if shape.get("dtype") not in (torch.bfloat16, torch.float16):
        return f"dtype {shape.get('dtype')} (bf16/fp16 only)"
    if M > gemv_max_m(N, K):
        return f"M={M} > {gemv_max_m(N, K)}"
    if decode_gemv.pick_config(M, N, K) is None:
        return f"no GEMV config for N={N} K={K}"
    return None


def gemv_run(x, weight, bias, out_dtype=None, **_):
    y = decode_gemv.run(_flat(x), weight, bias, out_dtype or x.dtype)
    return y.view(*x.shape[:-1], weight.shape[0])


def gemv_warmup(shapes) -> None:
    """Compile the GEMV for every {"M","N","K","dtype","out_dtype"} with M <= GEMV_MAX_M."""
    for s in shapes:
        M, N, K = s["M"], s["N"], s["K"]
        dt = s.get("dtype", torch.bfloat16)
        cfg = decode_gemv.pick_config(M, N, K)
        if M > gemv_max_m(N, K) or cfg is None:
            continue
        key, build = decode_gemv.builder(M, K, *cfg, dt, dt, s.get("out_dtype") or dt,
                                         bool(s.get("bias", False)))
        compat.compiled(key, build)


if compat.HAVE_CUTE:
    from ..dispatch import Impl, register_impl

    register_impl("decode_gemm", Impl("cute.gemv", supports=gemv_supports, run=gemv_run,
                                      priority=100, warmup=gemv_warmup, covers=gemv_covers))
