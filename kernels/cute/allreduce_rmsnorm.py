"""allreduce_rmsnorm on CUDA: the MoE tail's all-reduce + RMSNorm in the out-projection op's protocol.

Two launches, the gemm_ar_residual protocol without the GEMM (gemm_ar_residual.py, oneshot_ar.py):
1. push (triton/lamport_push.py): this rank's latent partial x [T, L] as fp32 into slot [rank] of
   buffer gen[3] of every rank's symmetric workspace (-0.0 written as +0.0; the buffer index read
   on the device, so CUDA-graph replays stay correct);
2. the one-shot epilogue (oneshot_ar.py) built with has_residual=False: polls its local buffer
   (Lamport sentinel, or the acquire/release flags under K3FUSE_AR_PROTOCOL=flags), sums the W
   slots in fixed rank order in fp32 (bitwise identical on every rank), writes the sum rounded to
   x's dtype and the RMSNorm of the fp32 sum times the weight, resets the buffer of two calls ago
   and rotates the generation.
Same workspace family (symm_workspace.get_workspace per group / hidden = L / lane), same rules:
accept/decline from shared facts only (`decide`), no per-rank fallback (dispatch raises
K3FuseCollectiveError), every spin bounded (K3FUSE_AR_TIMEOUT_S), every kernel compiled before the
first remote store, and a failure after it fails the workspace on every rank.
Run on one H200 at world 1 (tests/gpu/test_moe_tail_gpu.py, both protocols, docs/perf.md 0c); its
world-2 run over NVLink, and so the rule's default, wait for a 2-GPU machine.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import compat, gemm_ar_residual, oneshot_ar

_IO_DTYPES = (torch.bfloat16, torch.float16)
NAMES = {"lamport": "cute.allreduce_rmsnorm", "flags": "cute.allreduce_rmsnorm.flags"}


def _triton_ok() -> bool:
    try:
        from ..triton import lamport_push
    except Exception:
        return False
    return lamport_push.HAVE_TRITON


def decide(T: int, L: int, x_dtype, w_shape, w_dtype, world_size: int, max_tokens: int, *,
           cute_ok: bool, triton_ok: bool, dist_ok: bool) -> str | None:
    """Accept (None) or decline (the reason) from facts every rank shares: shapes, dtypes, world
    size, configuration; never pointers or strides (misaligned tensors are staged)."""
    if not cute_ok:
        return f"CuTe DSL unavailable ({compat.IMPORT_ERROR or 'disabled'})"
    if not triton_ok:
        return "triton unavailable (the push kernel)"
    if not dist_ok:
        return "torch.distributed not initialized"
    if not 1 <= world_size <= oneshot_ar.MAX_WORLD:
        return f"world_size {world_size} outside [1, {oneshot_ar.MAX_WORLD}]"
    if x_dtype not in _IO_DTYPES:
        return f"dtype {x_dtype} unsupported"
    if tuple(w_shape) != (L,) or w_dtype not in compat.TORCH2CUTE:
        return "norm_weight shape/dtype mismatch"
    if oneshot_ar.pick_threads(L) is None:
        return f"latent {L} not a multiple of 4*threads"
    if not 1 <= T <= max_tokens:
        return f"tokens {T} outside [1, max_tokens {max_tokens}]"
    return None


def _reason(x, norm_weight, world_size, max_tokens) -> str | None:
    L = x.shape[-1]
    return decide(x.numel() // max(L, 1), L, x.dtype, tuple(norm_weight.shape), norm_weight.dtype, world_size,
                  max_tokens, cute_ok=compat.available(), triton_ok=_triton_ok(),
                  dist_ok=dist.is_available() and dist.is_initialized())


def _aligned(t: torch.Tensor) -> torch.Tensor:
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    return t.contiguous() if not t.is_contiguous() else t.clone()


def _run(x, norm_weight, eps, group_name, world_size, max_tokens):
    from ..symm_workspace import collective_call

    L = x.shape[-1]

    def body(ws):   # staging inside the call: its failure fails the group on every rank too
        return _launch(ws, _aligned(x.reshape(-1, L)), _aligned(norm_weight), eps, max_tokens, x.shape)

    return collective_call("allreduce_rmsnorm", group_name, world_size, max_tokens, L, x.device,
                           dict(protocol=gemm_ar_residual.protocol(), path="push", cute=compat.cute_version()),
                           body)


def _launch(ws, x2, nw, eps, max_tokens, out_shape):
    from ..triton import lamport_push

    T, L = x2.shape
    # 1. every kernel compiled and fetched before anything is pushed
    key, build = oneshot_ar.builder(ws.world, L, max_tokens, False, True, x2.dtype, nw.dtype, False,
                                    gemm_ar_residual._flags_rank(ws.rank), has_residual=False)
    epilogue = compat.compiled(key, build)
    if not torch.cuda.is_current_stream_capturing():
        lamport_push.precompile(x2, ws.ptrs, ws.gen, ws.rank, max_tokens)
    out = torch.empty_like(x2)
    normed = torch.empty_like(x2)
    ws.start_barrier(("allreduce_rmsnorm", T, x2.dtype, nw.dtype))   # every rank compiled: then push
    # 2. push, then the epilogue (`out` stands in for the residual: only its row count is used)
    lamport_push.run(x2, ws.ptrs, ws.gen, ws.rank, max_tokens)
    epilogue(ws.datas[ws.rank], *ws.padded(ws.flags, oneshot_ar.MAX_WORLD), ws.gen, out, out, nw, out, normed,
             ws.err, float(eps), gemm_ar_residual._timeout_ns())
    ws.after_call()
    return out.view(out_shape), normed.view(out_shape)


# --- dispatcher entry points (arguments in schema order, without strict) ------------------------
def supports(x, norm_weight, eps, group_name, world_size, max_tokens=64, **_):
    return _reason(x, norm_weight, world_size, max_tokens)


def run(x, norm_weight, eps, group_name, world_size, max_tokens=64, **_):
    return _run(x, norm_weight, eps, group_name, world_size, max_tokens)


def covers(shape: dict) -> str | None:
    """Compile-time limits for the rule's kernel-shape guard: {"M", "L", "dtype", "w_dtype",
    "world_size", "max_tokens"}."""
    L, M = shape["L"], shape["M"]
    if shape.get("dtype") not in _IO_DTYPES:
        return f"dtype {shape.get('dtype')} (bf16/fp16 only)"
    if shape.get("w_dtype", shape["dtype"]) not in compat.TORCH2CUTE:
        return f"norm weight dtype {shape.get('w_dtype')}"
    if oneshot_ar.pick_threads(L) is None:
        return f"L={L} not a multiple of 4*threads (<= 16 float4 per thread)"
    if not 1 <= shape.get("world_size", 2) <= oneshot_ar.MAX_WORLD:
        return f"world_size {shape.get('world_size')} > {oneshot_ar.MAX_WORLD}"
    if not 1 <= M <= shape.get("max_tokens", 64):
        return f"M={M} outside [1, max_tokens]"
    return None


def _warmup(proto: str):
    def warm(shapes) -> None:
        """Compile the epilogue for [{"M", "L", "world_size", "max_tokens", "dtype", "group"}] before
        CUDA-graph capture (the push compiles on the first real call, which also creates the
        workspace collectively and must happen before capture too)."""
        if gemm_ar_residual.protocol() != proto:
            return
        for s_ in shapes:
            rank = gemm_ar_residual.warmup_rank(s_)
            dt = s_.get("dtype", torch.bfloat16)
            key, build = oneshot_ar.builder(s_.get("world_size", 2), s_["L"], s_.get("max_tokens", 64), False, True,
                                            dt, s_.get("w_dtype", dt), False, gemm_ar_residual._flags_rank(rank),
                                            has_residual=False)
            compat.compiled(key, build)
    return warm


if compat.HAVE_CUTE:
    from ..dispatch import Impl, register_impl

    for _proto, _name in NAMES.items():
        register_impl("allreduce_rmsnorm", Impl(_name, supports=gemm_ar_residual._only(_proto, supports), run=run,
                                                priority=100, warmup=_warmup(_proto), covers=covers))
