"""gemm_ar_residual(_rmsnorm) on CUDA: decode GEMM with a Lamport push epilogue, then the CuTe
one-shot all-reduce epilogue kernel (poll, fixed-order sum, residual, RMSNorm; oneshot_ar.py).

Why this split: the GEMM grid (hundreds of CTAs) is not co-resident, so no CTA of it can wait for
a whole row; instead every GEMM CTA pushes its fp32 outputs into every rank's symmetric buffer
while the weights stream (remote writes overlap the GEMM), and a second kernel of one CTA per
token polls only local memory. No fence/flag round trip, no multicast (unicast peer pointers from
torch symmetric memory, symm_workspace.py). GEMM: the CuTe GEMV (few tokens) or the Triton
split-K kernel, chosen as for decode_gemm.
Every spin is bounded (K3FUSE_AR_TIMEOUT_S, default 5 s; see symm_workspace.py for what a serving
process sees): a peer that never arrives is reported as CollectiveTimeoutError naming the op, the
rank and the peer, never a hang. Accept/decline uses only facts every rank shares (`decide`);
misaligned tensors are staged. Every kernel is compiled before the first remote store, and a
failure after it fails the workspace on every rank.
K3FUSE_AR_PROTOCOL=lamport (default; runtime stats name "cute.oneshot_ar") or flags (explicit
acquire/release flags per source rank and row after the same push; "cute.oneshot_ar.flags"). Read
once per process: both share the workspace, and the Lamport one needs its sentinel invariant.
"""
from __future__ import annotations


import torch
import torch.distributed as dist

from k3fuse import settings

from . import compat, decode_gemm, decode_gemv, oneshot_ar

_PROTOCOL: list[str] = []


def protocol() -> str:
    """K3FUSE_AR_PROTOCOL (lamport | flags), read on first use and then fixed for the process."""
    if not _PROTOCOL:
        _PROTOCOL.append(settings.get("K3FUSE_AR_PROTOCOL"))
    return _PROTOCOL[0]


def _flags_rank(rank: int) -> int | None:
    return rank if protocol() == "flags" else None


def _timeout_ns() -> int:
    """The spin bound in ns (K3FUSE_AR_TIMEOUT_S, default 5 s; a runtime argument, not a key)."""
    from ..symm_workspace import timeout_ns

    return timeout_ns()


_IO_DTYPES = (torch.bfloat16, torch.float16)


def decide(T: int, H: int, K: int, x_dtype, res_dtype, addend, norm, world_size: int,
           max_tokens: int, *, cute_ok: bool, triton_ok: bool, dist_ok: bool, w_dtype=None,
           w_dims: int = 2) -> str | None:
    """Accept (None) or decline (the reason) from facts every rank shares: shapes, dtypes, world
    size and configuration. Never pointers, strides or per-rank state: misaligned or
    non-contiguous tensors are staged into aligned scratch by `_run`, not declined.

    addend / norm: None, or (shape, dtype) of that tensor."""
    if not cute_ok:
        return f"CuTe DSL unavailable ({compat.IMPORT_ERROR or 'disabled'})"
    if not dist_ok:
        return "torch.distributed not initialized"
    if not 1 <= world_size <= oneshot_ar.MAX_WORLD:
        return f"world_size {world_size} outside [1, {oneshot_ar.MAX_WORLD}]"
    if res_dtype not in _IO_DTYPES or x_dtype != res_dtype:
        return f"dtype {res_dtype} unsupported"
    if w_dims != 2 or (w_dtype is not None and w_dtype != x_dtype):
        # e.g. an fp8 / int8 / fp32 weight with a bf16 x: no push-GEMM variant reads it
        return f"weight {w_dims}-D {w_dtype} (the kernels read a 2-D weight in x's dtype {x_dtype})"
    if addend is not None and (tuple(addend[0]) != (T, H) or addend[1] != res_dtype):
        return "addend shape/dtype mismatch"
    if norm is not None and (tuple(norm[0]) != (H,) or norm[1] not in compat.TORCH2CUTE):
        return "norm_weight shape/dtype mismatch"
    if oneshot_ar.pick_threads(H) is None:
        return f"hidden {H} not a multiple of 4*threads"
    if T > max_tokens:
        return f"tokens {T} > max_tokens {max_tokens}"
    if _gemm_path(T, H, K, x_dtype, cute_ok=cute_ok, triton_ok=triton_ok) is None:
        return f"no decode GEMM kernel with a push epilogue for x ({T}, {K}) w ({H}, {K})"
    return None


def covers(shape: dict) -> str | None:
    """Compile-time limits for the rule's kernel-shape guard: {"M", "N" (hidden), "K", "dtype",
    "w_dtype", "norm_dtype" (None: no norm), "addend", "world_size", "max_tokens"}."""
    dt = shape.get("dtype")
    norm = None if shape.get("norm_dtype") is None else ((shape["N"],), shape["norm_dtype"])
    addend = ((shape["M"], shape["N"]), dt) if shape.get("addend") else None
    return decide(shape["M"], shape["N"], shape["K"], dt, dt, addend, norm, shape.get("world_size", 2),
                  shape.get("max_tokens", 64), cute_ok=compat.available(), triton_ok=_triton_ok(),
                  dist_ok=True, w_dtype=shape.get("w_dtype", dt))


def _triton_ok() -> bool:
    try:
        from ..triton import splitk_gemm
    except Exception:
        return False
    return splitk_gemm.HAVE_TRITON


def _reason(x, weight, residual, addend, norm_weight, world_size, max_tokens) -> str | None:
    H, K = weight.shape[0], weight.shape[-1]
    if x.shape[-1] != K or residual.shape[-1] != H:
        return "x/weight/residual shapes do not fit"
    T = x.numel() // x.shape[-1]
    if residual.numel() != T * H:
        return "residual shape mismatch"
    if addend is not None and tuple(addend.shape) != tuple(residual.shape):
        return "addend shape/dtype mismatch"
    return decide(T, H, K, x.dtype, residual.dtype,
                  None if addend is None else ((T, H), addend.dtype),
                  None if norm_weight is None else (tuple(norm_weight.shape), norm_weight.dtype),
                  world_size, max_tokens, cute_ok=compat.available(), triton_ok=_triton_ok(),
                  dist_ok=dist.is_available() and dist.is_initialized(), w_dtype=weight.dtype,
                  w_dims=weight.dim())


def _pdl(path: str | None) -> bool:
    # never with flags: the epilogue's flag store must follow the whole GEMM push
    return path == "gemv" and settings.get("K3FUSE_AR_PDL") and protocol() == "lamport"


def _gemm_path(T: int, N: int, K: int, dtype, *, cute_ok: bool | None = None,
               triton_ok: bool | None = None) -> str | None:
    """GEMV or Triton split-K push, from the shape and dtype only (alignment is staged)."""
    cute_ok = compat.available() if cute_ok is None else cute_ok
    if dtype not in _IO_DTYPES:
        return None
    if (cute_ok and T <= decode_gemm.gemv_max_m(N, K) and 1 <= T <= 8
            and decode_gemv.pick_config(T, N, K) is not None):
        return "gemv"
    triton_ok = _triton_ok() if triton_ok is None else triton_ok
    if not triton_ok:
        return None
    from ..triton import splitk_gemm

    return "splitk" if 1 <= T <= splitk_gemm.MAX_M and splitk_gemm.pick_config(T, N, K) is not None else None


def _aligned(t: torch.Tensor | None) -> torch.Tensor | None:
    """`t` itself if contiguous and 16-byte aligned, else a staged copy (fresh allocations are)."""
    if t is None or (t.is_contiguous() and t.data_ptr() % 16 == 0):
        return t
    return t.contiguous() if not t.is_contiguous() else t.clone()


def _run(op, x, weight, residual, addend, norm_weight, eps, group_name, world_size, max_tokens):
    from ..symm_workspace import collective_call

    K, H = x.shape[-1], weight.shape[0]
    T = x.numel() // K
    path = _gemm_path(T, H, K, x.dtype)
    if path is None:
        raise RuntimeError(f"no decode GEMM kernel for x {tuple(x.shape)} w {tuple(weight.shape)}")

    def body(ws):
        # staging inside the call: an allocation failure here fails the group on every rank too
        x2 = _aligned(x.reshape(-1, K))
        res2 = _aligned(residual.reshape(T, H))
        add2 = _aligned(addend.reshape(T, H)) if addend is not None else None
        nw = _aligned(norm_weight) if norm_weight is not None else res2[0]
        return _launch(op, ws, x2, _aligned(weight), res2, add2, nw, norm_weight is not None, eps, path,
                       residual.shape, max_tokens, T, H, K)

    return collective_call(op, group_name, world_size, max_tokens, H, x.device,
                           dict(protocol=protocol(), path=path, cute=compat.cute_version()), body)


def _launch(op, ws, x2, weight, res2, add2, nw, has_norm, eps, path, out_shape, max_tokens, T, H, K):
    # 1. every kernel compiled and fetched before anything is pushed
    pdl = _pdl(path)
    key, build = oneshot_ar.builder(ws.world, H, max_tokens, add2 is not None, has_norm,
                                    res2.dtype, nw.dtype, pdl, _flags_rank(ws.rank))
    epilogue = compat.compiled(key, build)
    if path == "gemv":   # the exact variant run_push fetches (same builder arguments)
        rows, threads = decode_gemv.pick_config(T, H, K)
        key, build = decode_gemv.builder(T, K, rows, threads, x2.dtype, weight.dtype, torch.float32,
                                         False, weight.dtype, push=(ws.world, ws.rank, max_tokens, H))
        compat.compiled(key, build)
    else:
        from ..triton import splitk_gemm

        if not torch.cuda.is_current_stream_capturing():
            splitk_gemm.precompile(x2, weight, None, torch.float32,
                                   push=(ws.ptrs, ws.gen, ws.rank, max_tokens))
    out = torch.empty_like(res2)
    normed = torch.empty_like(res2) if has_norm else out
    tmo = _timeout_ns()
    # 2. every rank has these kernels before any rank pushes (the bound never covers a compile)
    ws.start_barrier((op, path, T, add2 is not None, has_norm, res2.dtype, nw.dtype))
    # 3. push, then the epilogue (a failure anywhere fails the workspace on every rank: _run)
    if path == "gemv":
        decode_gemv.run_push(x2, weight, ws.datas, ws.gen, ws.rank, max_tokens)
    else:
        splitk_gemm.run(x2, weight, None, torch.float32, push=(ws.ptrs, ws.gen, ws.rank, max_tokens))
    epilogue(ws.datas[ws.rank], *ws.padded(ws.flags, oneshot_ar.MAX_WORLD), ws.gen, res2,
             add2 if add2 is not None else res2, nw, out, normed, ws.err, float(eps), tmo)
    ws.after_call()
    out = out.view(out_shape)
    return (out, normed.view(out_shape)) if has_norm else out


def check_timeout(group_name: str, max_tokens: int, hidden: int, device: torch.device) -> None:
    """Raise CollectiveTimeoutError if a spin on this workspace timed out (synchronises)."""
    from ..symm_workspace import _workspaces, current_lane

    ws = _workspaces.get((group_name, device.index, max_tokens, hidden, current_lane()))
    if ws is not None:
        ws.raise_if_failed(ws.last_op, sync=True)


# --- dispatcher entry points (arguments in schema order) ----------------------------------------
def ar_supports(x, weight, residual, addend, group_name, world_size, max_tokens=64, **_):
    return _reason(x, weight, residual, addend, None, world_size, max_tokens)


def ar_run(x, weight, residual, addend, group_name, world_size, max_tokens=64, **_):
    return _run("gemm_ar_residual", x, weight, residual, addend, None, 0.0, group_name, world_size,
                max_tokens)


def arn_supports(x, weight, residual, addend, norm_weight, eps, group_name, world_size,
                 max_tokens=64, **_):
    return _reason(x, weight, residual, addend, norm_weight, world_size, max_tokens)


def arn_run(x, weight, residual, addend, norm_weight, eps, group_name, world_size, max_tokens=64,
            **_):
    return _run("gemm_ar_residual_rmsnorm", x, weight, residual, addend, norm_weight, eps,
                group_name, world_size, max_tokens)


def warmup_rank(shape: dict) -> int:
    """The rank within the TP group for a warm-up shape: {"group": c10d group name} if given,
    else WORLD only when its size is the shape's world_size (a sub-group needs "group")."""
    W = shape.get("world_size", 2)
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    name = shape.get("group") or shape.get("group_name")
    if name is not None:
        from k3fuse.compat import resolve_group

        return dist.get_rank(resolve_group(name))
    if dist.get_world_size() != W:
        raise ValueError(f"fused all-reduce warm-up for world_size {W} in a process group of "
                         f"{dist.get_world_size()} ranks: pass the TP group's name as shape['group'] "
                         "(the kernels are specialised on the rank within that group)")
    return dist.get_rank()


def _warmup(norm: bool, proto: str):
    def warm(shapes) -> None:
        """Compile the CuTe kernels for [{"M", "N" (hidden), "K", "world_size", "max_tokens",
        "dtype", "addend", "group" (c10d group name; required for a TP sub-group)}] before
        CUDA-graph capture, with the rank within the TP group (this rank's GEMV push variant
        included). The symmetric workspace is created collectively by the first real call,
        which must also happen before capture (it compiles the Triton variant)."""
        if protocol() != proto:
            return
        for s_ in shapes:
            rank = warmup_rank(s_)
            M, N, K = s_["M"], s_["N"], s_["K"]
            W, MT = s_.get("world_size", 2), s_.get("max_tokens", 64)
            dt = s_.get("dtype", torch.bfloat16)
            path = _gemm_path(M, N, K, dt)
            key, build = oneshot_ar.builder(W, N, MT, bool(s_.get("addend", False)), norm, dt, dt,
                                            _pdl(path), _flags_rank(rank))
            compat.compiled(key, build)
            if path == "gemv":
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
                                               priority=100, warmup=_warmup(False, _proto),
                                               covers=_only(_proto, covers)))
        register_impl("gemm_ar_residual_rmsnorm", Impl(_name, supports=_only(_proto, arn_supports),
                                                       run=arn_run, priority=100, warmup=_warmup(True, _proto),
                                                       covers=_only(_proto, covers)))
