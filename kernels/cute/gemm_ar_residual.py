"""gemm_ar_residual(_rmsnorm) on CUDA: decode GEMM into a local fp32 stage, then the CuTe
one-shot push/flag all-reduce with the residual (+ RMSNorm) epilogue (oneshot_ar.py).

Why two kernels and not one: the GEMM grid (hundreds of CTAs) is not co-resident, so a CTA of it
cannot wait for the whole row's partials; the second kernel has one CTA per token, which waits only
on peers. Multicast is never used (peer pointers from symmetric memory, see symm_workspace.py).
Set K3FUSE_AR_TIMEOUT_MS=<ms> for a debug build whose spin loops give up after that long and report
it (RuntimeError from `check_timeout`) instead of hanging.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from . import compat, decode_gemm, decode_gemv, oneshot_ar

_TIMEOUT_MS = float(os.environ.get("K3FUSE_AR_TIMEOUT_MS", "0") or 0)


def _debug() -> tuple[bool, int]:
    return _TIMEOUT_MS > 0, int(_TIMEOUT_MS * 1e6)


def _reason(x, weight, residual, addend, norm_weight, world_size, max_tokens) -> str | None:
    if not compat.available():
        return f"CuTe DSL unavailable ({compat.IMPORT_ERROR or 'disabled'})"
    if not (dist.is_available() and dist.is_initialized()):
        return "torch.distributed not initialized"
    if not 1 <= world_size <= oneshot_ar.MAX_WORLD:
        return f"world_size {world_size} outside [1, {oneshot_ar.MAX_WORLD}]"
    H = weight.shape[0]
    T = x.numel() // x.shape[-1]
    if residual.shape[-1] != H or residual.numel() != T * H or not residual.is_contiguous():
        return "residual shape/layout mismatch"
    if residual.dtype not in (torch.bfloat16, torch.float16) or x.dtype != residual.dtype:
        return f"dtype {residual.dtype} unsupported"
    if addend is not None and (addend.shape != residual.shape or addend.dtype != residual.dtype
                               or not addend.is_contiguous()):
        return "addend shape/dtype/layout mismatch"
    if norm_weight is not None and (norm_weight.shape != (H,) or not norm_weight.is_contiguous()
                                    or norm_weight.dtype not in compat.TORCH2CUTE):
        return "norm_weight shape/layout mismatch"
    if oneshot_ar.pick_threads(H) is None:
        return f"hidden {H} not a multiple of 4*threads"
    if T > max_tokens:
        return f"tokens {T} > max_tokens {max_tokens}"
    x2 = x.reshape(-1, x.shape[-1])
    if not (decode_gemv.supports(x2, weight, None, torch.float32) and x2.shape[0] <= decode_gemm.GEMV_MAX_M):
        try:
            from ..triton import splitk_gemm
            ok = splitk_gemm.supports(x2, weight, None, torch.float32)
        except Exception:
            ok = False
        if not ok and not decode_gemv.supports(x2, weight, None, torch.float32):
            return f"no decode GEMM kernel for x {tuple(x2.shape)} w {tuple(weight.shape)}"
    for t in (x, residual, addend, norm_weight):
        if t is not None and t.data_ptr() % 16:
            return "a tensor is not 16-byte aligned"
    return None


def _run(x, weight, residual, addend, norm_weight, eps, group_name, world_size, max_tokens):
    from ..symm_workspace import get_workspace

    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    T, H = x2.shape[0], weight.shape[0]
    ws = get_workspace(group_name, world_size, max_tokens, H, x.device)
    stage = ws.stage[:T]
    if not decode_gemm.best_gemm(x2, weight, stage):
        raise RuntimeError(f"no decode GEMM kernel for x {tuple(x2.shape)} w {tuple(weight.shape)}")
    res2 = residual.reshape(T, H)
    out = torch.empty_like(res2)
    has_norm = norm_weight is not None
    normed = torch.empty_like(res2) if has_norm else out
    debug, timeout_ns = _debug()
    nw = norm_weight if has_norm else res2[0]
    key, build = oneshot_ar.builder(ws.world, ws.rank, H, max_tokens, addend is not None, has_norm,
                                    debug, res2.dtype, nw.dtype)
    fn = compat.compiled(key, build)
    fn(stage, *ws.padded(ws.datas, oneshot_ar.MAX_WORLD), *ws.padded(ws.flags, oneshot_ar.MAX_WORLD),
       ws.gen, res2, addend.reshape(T, H) if addend is not None else res2, nw, out, normed, ws.err,
       float(eps), timeout_ns)
    out = out.view(residual.shape)
    return (out, normed.view(residual.shape)) if has_norm else out


def check_timeout(group_name: str, max_tokens: int, hidden: int, device: torch.device) -> None:
    """Raise if a debug build's spin loop timed out (reads err[0]; synchronises)."""
    from ..symm_workspace import _workspaces

    ws = _workspaces.get((group_name, device.index, max_tokens, hidden))
    if ws is not None and int(ws.err.item()) != 0:
        raise RuntimeError(f"one-shot all-reduce: rank {ws.rank} timed out waiting for source rank "
                           f"{int(ws.err.item()) - 1}")


# --- dispatcher entry points (arguments in schema order) ----------------------------------------
def ar_supports(x, weight, residual, addend, group_name, world_size, max_tokens=64, **_):
    return _reason(x, weight, residual, addend, None, world_size, max_tokens)


def ar_run(x, weight, residual, addend, group_name, world_size, max_tokens=64, **_):
    return _run(x, weight, residual, addend, None, 0.0, group_name, world_size, max_tokens)


def arn_supports(x, weight, residual, addend, norm_weight, eps, group_name, world_size,
                 max_tokens=64, **_):
    return _reason(x, weight, residual, addend, norm_weight, world_size, max_tokens)


def arn_run(x, weight, residual, addend, norm_weight, eps, group_name, world_size, max_tokens=64,
            **_):
    return _run(x, weight, residual, addend, norm_weight, eps, group_name, world_size, max_tokens)


if compat.HAVE_CUTE:
    from ..dispatch import Impl, register_impl

    register_impl("gemm_ar_residual", Impl("cute.oneshot_ar", supports=ar_supports, run=ar_run,
                                           priority=100))
    register_impl("gemm_ar_residual_rmsnorm", Impl("cute.oneshot_ar", supports=arn_supports,
                                                   run=arn_run, priority=100))
