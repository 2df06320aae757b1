"""gemm_ar_residual(_rmsnorm) on CUDA: decode GEMM with a Lamport push epilogue, then the CuTe
one-shot all-reduce epilogue kernel (poll, fixed-order sum, residual, RMSNorm; oneshot_ar.py).

Why this split: the GEMM grid (hundreds of CTAs) is not co-resident, so no CTA of it can wait for
a whole row; instead every GEMM CTA pushes its fp32 outputs into every rank's symmetric buffer
while the weights stream (remote writes overlap the GEMM), and a second kernel of one CTA per
token polls only local memory. No fence/flag round trip, no multicast (unicast peer pointers from
torch symmetric memory, symm_workspace.py). GEMM: the CuTe GEMV (few tokens) or the Triton
split-K kernel, chosen as for decode_gemm.
Set K3FUSE_AR_TIMEOUT_MS=<ms> for a debug build whose polls give up after that long and report
it (RuntimeError from `check_timeout`) instead of hanging.
K3FUSE_AR_PROTOCOL=lamport (default; runtime stats name "cute.oneshot_ar") or flags (explicit
acquire/release flags per source rank and row after the same push; "cute.oneshot_ar.flags"). Read
once per process: both share the workspace, and the Lamport one needs its sentinel invariant.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from . import compat, decode_gemm, decode_gemv, oneshot_ar

_PROTOCOL: list[str] = []


def protocol() -> str:
    """K3FUSE_AR_PROTOCOL (lamport | flags), read on first use and then fixed for the process."""
    if not _PROTOCOL:
        p = os.environ.get("K3FUSE_AR_PROTOCOL", "lamport").strip().lower() or "lamport"
        if p not in ("lamport", "flags"):
            raise ValueError(f"K3FUSE_AR_PROTOCOL={p!r}: expected 'lamport' or 'flags'")
        _PROTOCOL.append(p)
    return _PROTOCOL[0]


def _flags_rank(rank: int) -> int | None:
    return rank if protocol() == "flags" else None


def _debug() -> tuple[bool, int]:
    """(debug build?, timeout in ns) from K3FUSE_AR_TIMEOUT_MS (read per call; part of the key)."""
    ms = float(os.environ.get("K3FUSE_AR_TIMEOUT_MS", "0") or 0)
    return ms > 0, int(ms * 1e6)


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
    if _gemm_path(x2, weight) is None:
        return f"no decode GEMM kernel with a push epilogue for x {tuple(x2.shape)} w {tuple(weight.shape)}"
    for t in (x, residual, addend, norm_weight):
        if t is not None and t.data_ptr() % 16:
            return "a tensor is not 16-byte aligned"
    return None


def _pdl(path: str | None) -> bool:
    # never with flags: the epilogue's flag store must follow the whole GEMM push
    return path == "gemv" and os.environ.get("K3FUSE_AR_PDL", "0") == "1" and protocol() == "lamport"


def _gemm_path(x2, weight) -> str | None:
    if (compat.available() and x2.shape[0] <= decode_gemm.gemv_max_m(*weight.shape)
            and decode_gemv.supports(x2, weight, None, torch.float32)):
        return "gemv"
    try:
        from ..triton import splitk_gemm
    except Exception:
        return None
    return "splitk" if splitk_gemm.supports(x2, weight, None, torch.float32) else None


def _run(x, weight, residual, addend, norm_weight, eps, group_name, world_size, max_tokens):
    from ..symm_workspace import get_workspace

    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    T, H = x2.shape[0], weight.shape[0]
    ws = get_workspace(group_name, world_size, max_tokens, H, x.device)
    path = _gemm_path(x2, weight)
    if path == "gemv":
        decode_gemv.run_push(x2, weight, ws.datas, ws.gen, ws.rank, max_tokens)
    elif path == "splitk":
        from ..triton import splitk_gemm

        splitk_gemm.run(x2, weight, None, torch.float32, push=(ws.ptrs, ws.gen, ws.rank, max_tokens))
    else:
        raise RuntimeError(f"no decode GEMM kernel for x {tuple(x2.shape)} w {tuple(weight.shape)}")
    res2 = residual.reshape(T, H)
    out = torch.empty_like(res2)
    has_norm = norm_weight is not None
    normed = torch.empty_like(res2) if has_norm else out
    debug, timeout_ns = _debug()
    nw = norm_weight if has_norm else res2[0]
    # K3FUSE_AR_PDL=1: launch the epilogue as a programmatic dependent of the CuTe GEMV (which
    # triggers early). Off by default: on 2 x H200 it measured no faster (docs/perf.md).
    pdl = _pdl(path)
    key, build = oneshot_ar.builder(ws.world, H, max_tokens, addend is not None, has_norm, debug,
                                    res2.dtype, nw.dtype, pdl, _flags_rank(ws.rank))
    fn = compat.compiled(key, build)
    fn(ws.datas[ws.rank], *ws.padded(ws.flags, oneshot_ar.MAX_WORLD), ws.gen, res2, addend.reshape(T, H) if addend is not None else res2, nw,
       out, normed, ws.err, float(eps), timeout_ns)
    out = out.view(residual.shape)
    return (out, normed.view(residual.shape)) if has_norm else out


def check_timeout(group_name: str, max_tokens: int, hidden: int, device: torch.device) -> None:
    """Raise if a debug build's spin loop timed out (reads err[0]; synchronises)."""
    from ..symm_workspace import _workspaces

    ws = _workspaces.get((group_name, device.index, max_tokens, hidden))
    if ws is not None and int(ws.err.item()) != 0:
        raise RuntimeError(f"one-shot all-reduce: rank {ws.rank} timed out waiting for its peers' "
                           "partials (K3FUSE_AR_TIMEOUT_MS)")


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


def _warmup(norm: bool, proto: str):
    def warm(shapes) -> None:
        """Compile the CuTe kernels for [{"M", "N" (hidden), "K", "world_size", "max_tokens",
        "dtype", "addend"}] before CUDA-graph capture (this rank's GEMV push variant included).
        The symmetric workspace is created collectively by the first real call, which must also
        happen before capture (it compiles the Triton variant)."""
        if protocol() != proto:
            return
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        for s_ in shapes:
            M, N, K = s_["M"], s_["N"], s_["K"]
            W, MT = s_.get("world_size", 2), s_.get("max_tokens", 64)
            dt = s_.get("dtype", torch.bfloat16)
            debug, _ = _debug()
            use_gemv = M <= decode_gemm.gemv_max_m(N, K) and decode_gemv.pick_config(M, N, K) is not None
            key, build = oneshot_ar.builder(W, N, MT, bool(s_.get("addend", False)), norm, debug, dt, dt,
                                            _pdl("gemv" if use_gemv else None), _flags_rank(rank))
            compat.compiled(key, build)
            if use_gemv:
                rows, threads = decode_gemv.pick_config(M, N, K)
                key, build = decode_gemv.builder(M, K, rows, threads, dt, dt, torch.float32, False, dt,
                                                 push=(W, rank, MT, N))
                compat.compiled(key, build)
    return warm


def _only(proto: str, supports):
    """supports() of one protocol's Impl: declines unless K3FUSE_AR_PROTOCOL selects it."""
    def f(*args, **kw):
        if protocol() != proto:
            return f"K3FUSE_AR_PROTOCOL={protocol()}"
        return supports(*args, **kw)
    return f


if compat.HAVE_CUTE:
    from ..dispatch import Impl, register_impl

    # the same kernels, recorded under distinct names so stats show which protocol ran
    for _proto, _name in (("lamport", "cute.oneshot_ar"), ("flags", "cute.oneshot_ar.flags")):
        register_impl("gemm_ar_residual", Impl(_name, supports=_only(_proto, ar_supports), run=ar_run,
                                               priority=100, warmup=_warmup(False, _proto)))
        register_impl("gemm_ar_residual_rmsnorm", Impl(_name, supports=_only(_proto, arn_supports),
                                                       run=arn_run, priority=100, warmup=_warmup(True, _proto)))
