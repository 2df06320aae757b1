"""gemm_ar_residual(_rmsnorm): a row-parallel projection, its all-reduce and the residual add (and
the RMSNorm after it) in one op: out = residual + all_reduce_sum(x @ weight.T) (+ addend).

CUDA: the decode GEMM with a Lamport push epilogue, then the CuTe one-shot epilogue kernel (poll,
fixed-order sum, residual, RMSNorm; lib/cute/oneshot_epilogue.py). Why this split: the GEMM grid
(hundreds of CTAs) is not co-resident, so no CTA of it can wait for a whole row; instead every GEMM
CTA pushes its fp32 outputs into every rank's symmetric buffer while the weights stream (remote
writes overlap the GEMM), and a second kernel of one CTA per token polls only local memory. No
fence/flag round trip, no multicast (kernels/collective.py). GEMM: the CuTe GEMV (few tokens) or
the Triton split-K kernel, chosen as for decode_gemm.
K3FUSE_AR_PROTOCOL=lamport (default; runtime stats name "cute.oneshot_ar") or flags (explicit
acquire/release flags per source rank and row after the same push; "cute.oneshot_ar.flags").
Accept/decline uses only facts every rank shares (the Spec: shapes, dtypes, world size,
configuration); misaligned tensors are staged.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from k3fuse import runtime

from .. import collective
from ..declare import SYNC, OpDecl, check_gemm, declare
from ..dispatch import Impl, loaded, register_impl
from ..lib.reference import allreduce, stock
from ..spec import Spec, call_only
from .decode_gemm import IO_DTYPES, DecodeGemmSpec, gemv_accepts, splitk_accepts

OP = "gemm_ar_residual"
OP_NORM = "gemm_ar_residual_rmsnorm"
#: the same kernels under one name per protocol, so the stats show which protocol ran
NAMES = {"lamport": "cute.oneshot_ar", "flags": "cute.oneshot_ar.flags"}


@dataclass(frozen=True, kw_only=True)
class OProjSpec(Spec):
    """x [tokens, K], weight [H, K], residual [tokens, H], optional addend like residual and norm weight [H]."""

    op: ClassVar[str] = OP
    H: int
    K: int
    dtype: torch.dtype
    res_dtype: torch.dtype
    addend: bool
    norm_dtype: torch.dtype | None  # None: no RMSNorm
    world_size: int
    max_tokens: int
    w_dtype: torch.dtype | None = None  # the weight's dtype (None: x's); e.g. fp8 / int8 / fp32 is declined
    w_dims: int = 2
    fits: str | None = call_only(None)  # why x / weight / residual / addend / norm weight disagree
    dist_ready: bool = call_only(True)

    @classmethod
    def from_call(cls, x, weight, residual, addend, *rest: Any, max_tokens: int = 64, **_: Any) -> OProjSpec:
        norm_weight, world_size = (rest[0], rest[3]) if len(rest) == 4 else (None, rest[1])
        H, K = weight.shape[0], weight.shape[-1]
        T = x.numel() // max(x.shape[-1], 1)
        fits = None
        if x.shape[-1] != K or residual.shape[-1] != H:
            fits = "x/weight/residual shapes do not fit"
        elif residual.numel() != T * H:
            fits = "residual shape mismatch"
        elif addend is not None and (tuple(addend.shape) != tuple(residual.shape) or addend.dtype != residual.dtype):
            fits = "addend shape/dtype mismatch"
        elif norm_weight is not None and tuple(norm_weight.shape) != (H,):
            fits = "norm_weight shape/dtype mismatch"
        return cls(tokens=T, H=int(H), K=int(K), dtype=x.dtype, res_dtype=residual.dtype, addend=addend is not None,
                   norm_dtype=None if norm_weight is None else norm_weight.dtype, world_size=int(world_size),
                   max_tokens=int(max_tokens), w_dtype=weight.dtype, w_dims=weight.dim(), fits=fits,
                   dist_ready=collective.dist_ready())


def gemm_path(T: int, N: int, K: int, dtype: torch.dtype) -> str | None:
    """GEMV or Triton split-K push, from the shape and dtype only (alignment is staged)."""
    # the push variants have the decode GEMM's limits (the same configs), so its predicates decide
    gemm = DecodeGemmSpec(tokens=T, N=N, K=K, dtype=dtype, out_dtype=torch.float32, bias=False)
    if gemv_accepts(gemm) is None:
        return "gemv"
    if loaded("triton.splitk_gemm") and splitk_accepts(gemm) is None:
        return "splitk"
    return None


def _accepts(proto: str):
    def accepts(spec: OProjSpec) -> str | None:
        from ..lib.cute import compat, oneshot_epilogue

        if collective.protocol() != proto:
            return f"K3FUSE_AR_PROTOCOL={collective.protocol()}"
        if spec.fits is not None:
            return spec.fits
        if not compat.available():
            return f"CuTe DSL unavailable ({compat.IMPORT_ERROR or 'disabled'})"
        if not spec.dist_ready:
            return "torch.distributed not initialized"
        if not 1 <= spec.world_size <= collective.MAX_WORLD:
            return f"world_size {spec.world_size} outside [1, {collective.MAX_WORLD}]"
        if spec.res_dtype not in IO_DTYPES or spec.dtype != spec.res_dtype:
            return f"dtype {spec.res_dtype} unsupported"
        if spec.w_dims != 2 or (spec.w_dtype is not None and spec.w_dtype != spec.dtype):
            # e.g. an fp8 / int8 / fp32 weight with a bf16 x: no push-GEMM variant reads it
            return f"weight {spec.w_dims}-D {spec.w_dtype} (the kernels read a 2-D weight in x's dtype {spec.dtype})"
        if spec.norm_dtype is not None and spec.norm_dtype not in compat.TORCH2CUTE:
            return "norm_weight shape/dtype mismatch"
        if oneshot_epilogue.pick_threads(spec.H) is None:
            return f"hidden {spec.H} not a multiple of 4*threads"
        if spec.tokens > spec.max_tokens:
            return f"tokens {spec.tokens} > max_tokens {spec.max_tokens}"
        if gemm_path(spec.tokens, spec.H, spec.K, spec.dtype) is None:
            return (f"no decode GEMM kernel with a push epilogue for x ({spec.tokens}, {spec.K}) "
                    f"w ({spec.H}, {spec.K})")
        return None
    return accepts


def _pdl(path: str | None) -> bool:
    # never with flags: the epilogue's flag store must follow the whole GEMM push
    return path == "gemv" and bool(runtime.path_setting("K3FUSE_AR_PDL")) and collective.protocol() == "lamport"


def _run(op, x, weight, residual, addend, norm_weight, eps, group_name, world_size, max_tokens):
    from ..lib.cute import compat

    K, H = x.shape[-1], weight.shape[0]
    T = x.numel() // K
    path = gemm_path(T, H, K, x.dtype)
    if path is None:
        raise RuntimeError(f"no decode GEMM kernel for x {tuple(x.shape)} w {tuple(weight.shape)}")
    facts = dict(protocol=collective.protocol(), path=path, cute=compat.cute_version())

    def launch(ws):   # staging inside the call: an allocation failure fails the group on every rank too
        res2 = collective.staged(residual.reshape(T, H))
        add2 = collective.staged(addend.reshape(T, H)) if addend is not None else None
        nw = collective.staged(norm_weight) if norm_weight is not None else res2[0]
        return _launch(ws, collective.staged(x.reshape(-1, K)), collective.staged(weight), res2, add2, nw,
                       norm_weight is not None, eps, path, residual.shape, max_tokens, T, H, K, op)

    return collective.run_collective(op, group_name, world_size, max_tokens, H, x.device, facts, launch)


def _launch(ws, x2, weight, res2, add2, nw, has_norm, eps, path, out_shape, max_tokens, T, H, K, op):
    from ..lib.cute import compat, gemv, oneshot_epilogue

    # 1. every kernel compiled and fetched before anything is pushed
    key, build = oneshot_epilogue.builder(ws.world, H, max_tokens, add2 is not None, has_norm, res2.dtype, nw.dtype,
                                          _pdl(path), collective.flags_rank(ws.rank))
    epilogue = compat.compiled(key, build)
    if path == "gemv":   # the exact variant run_push fetches (same builder arguments)
        rows, threads = gemv.pick_config(T, H, K)
        key, build = gemv.builder(T, K, rows, threads, x2.dtype, weight.dtype, torch.float32,
                                  False, weight.dtype, push=(ws.world, ws.rank, max_tokens, H))
        compat.compiled(key, build)
    else:
        from ..lib.triton import splitk_gemm

        if not torch.cuda.is_current_stream_capturing():
            splitk_gemm.precompile(x2, weight, None, torch.float32, push=(ws.ptrs, ws.gen, ws.rank, max_tokens))
    out = torch.empty_like(res2)
    normed = torch.empty_like(res2) if has_norm else out
    # 2. every rank has these kernels before any rank pushes (the bound never covers a compile)
    ws.start_barrier((op, path, T, add2 is not None, has_norm, res2.dtype, nw.dtype))
    # 3. push, then the epilogue
    if path == "gemv":
        gemv.run_push(x2, weight, ws.datas, ws.gen, ws.rank, max_tokens)
    else:
        splitk_gemm.run(x2, weight, None, torch.float32, push=(ws.ptrs, ws.gen, ws.rank, max_tokens))
    epilogue(ws.datas[ws.rank], *ws.padded(ws.flags, collective.MAX_WORLD), ws.gen, res2,
             add2 if add2 is not None else res2, nw, out, normed, ws.err, float(eps), collective.timeout_ns())
    ws.after_call()
    out = out.view(out_shape)
    return (out, normed.view(out_shape)) if has_norm else out


def ar_run(x, weight, residual, addend, group_name, world_size, max_tokens=64, **_):
    return _run(OP, x, weight, residual, addend, None, 0.0, group_name, world_size, max_tokens)


def arn_run(x, weight, residual, addend, norm_weight, eps, group_name, world_size, max_tokens=64, **_):
    return _run(OP_NORM, x, weight, residual, addend, norm_weight, eps, group_name, world_size, max_tokens)


def _warmup(norm: bool, proto: str):
    def warm(shapes) -> None:
        """Compile the CuTe kernels for [{"M", "N" (hidden), "K", "world_size", "max_tokens",
        "dtype", "addend", "group" (c10d group name; required for a TP sub-group)}] before
        CUDA-graph capture, with the rank within the TP group (this rank's GEMV push variant
        included). The symmetric workspace is created collectively by the first real call,
        which must also happen before capture (it compiles the Triton variant)."""
        from ..lib.cute import compat, gemv, oneshot_epilogue

        if collective.protocol() != proto:
            return
        for s_ in shapes:
            rank = collective.warmup_rank(s_)
            M, N, K = s_["M"], s_["N"], s_["K"]
            W, MT = s_.get("world_size", 2), s_.get("max_tokens", 64)
            dt = s_.get("dtype", torch.bfloat16)
            path = gemm_path(M, N, K, dt)
            key, build = oneshot_epilogue.builder(W, N, MT, bool(s_.get("addend", False)), norm, dt, dt,
                                                  _pdl(path), collective.flags_rank(rank))
            compat.compiled(key, build)
            if path == "gemv":
                rows, threads = gemv.pick_config(M, N, K)
                key, build = gemv.builder(M, K, rows, threads, dt, dt, torch.float32, False, dt,
                                          push=(W, rank, MT, N))
                compat.compiled(key, build)
    return warm


def _fake(x, weight, residual, addend, group_name, world_size, max_tokens=64, strict=False):
    check_gemm(x, weight, OP)
    return residual.new_empty(residual.shape)


def _fake_norm(x, weight, residual, addend, norm_weight, eps, group_name, world_size, max_tokens=64,
               strict=False):
    check_gemm(x, weight, OP_NORM)
    return residual.new_empty(residual.shape), residual.new_empty(residual.shape)


@dataclass(frozen=True, kw_only=True)
class OProjNormSpec(OProjSpec):
    op: ClassVar[str] = OP_NORM


DECLS = (
    OpDecl(OP, "(Tensor x, Tensor weight, Tensor residual, Tensor? addend, str group_name, "
               "int world_size, int max_tokens=64, bool strict=False) -> Tensor",
           _fake, stock.gemm_ar_residual, allreduce.gemm_ar_residual, traits=SYNC, collective=True,
           spec=OProjSpec),
    OpDecl(OP_NORM, "(Tensor x, Tensor weight, Tensor residual, Tensor? addend, Tensor norm_weight, float eps, "
                    "str group_name, int world_size, int max_tokens=64, bool strict=False) -> (Tensor, Tensor)",
           _fake_norm, stock.gemm_ar_residual_rmsnorm, allreduce.gemm_ar_residual_rmsnorm, traits=SYNC,
           collective=True, spec=OProjNormSpec),
)
for _decl in DECLS:
    declare(_decl)
_NEEDS = ("cute.compat", "cute.gemv", "cute.oneshot_epilogue")
for _proto, _name in NAMES.items():
    register_impl(OP, Impl(_name, _accepts(_proto), ar_run, priority=100, warmup=_warmup(False, _proto), needs=_NEEDS))
    register_impl(OP_NORM, Impl(_name, _accepts(_proto), arn_run, priority=100, warmup=_warmup(True, _proto),
                                needs=_NEEDS))
