"""allreduce_rmsnorm: the MoE tail, the latent partial [T, L] all-reduced and RMSNorm'd in one op:
(summed, rms_norm(summed) * norm_weight), both in x.dtype, summed and normalised in fp32 (the graph
may read the sum elsewhere, so the op returns it too).

CUDA: the out-projection op's protocol without the GEMM (kernels/collective.py):
1. push (lib/triton/lamport_push.py): this rank's x as fp32 into slot [rank] of buffer gen[3] of
   every rank's symmetric workspace (-0.0 written as +0.0; the buffer index read on the device, so
   CUDA-graph replays stay correct);
2. the one-shot epilogue (lib/cute/oneshot_epilogue.py) built with has_residual=False: polls its
   local buffer (Lamport sentinel, or the acquire/release flags under K3FUSE_AR_PROTOCOL=flags),
   sums the W slots in fixed rank order in fp32 (bitwise identical on every rank), writes the sum
   rounded to x's dtype and the RMSNorm of the fp32 sum times the weight.
Accept/decline from shared facts only (the Spec), no per-rank fallback.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .. import collective
from ..declare import SYNC, OpDecl, declare
from ..dispatch import Impl, register_impl
from ..lib.reference import allreduce, stock
from ..spec import Spec, call_only
from .decode_gemm import IO_DTYPES

OP = "allreduce_rmsnorm"
NAMES = {"lamport": "cute.allreduce_rmsnorm", "flags": "cute.allreduce_rmsnorm.flags"}


@dataclass(frozen=True, kw_only=True)
class AllReduceNormSpec(Spec):
    """x [tokens, L], norm weight [L]."""

    op: ClassVar[str] = OP
    L: int
    dtype: torch.dtype
    w_dtype: torch.dtype
    world_size: int
    max_tokens: int
    w_fits: bool = call_only(True)  # norm weight is [L]
    dist_ready: bool = call_only(True)

    @classmethod
    def from_call(cls, x, norm_weight, eps, group_name, world_size, max_tokens=64, **_: Any) -> AllReduceNormSpec:
        L = x.shape[-1]
        return cls(tokens=x.numel() // max(L, 1), L=int(L), dtype=x.dtype, w_dtype=norm_weight.dtype,
                   world_size=int(world_size), max_tokens=int(max_tokens),
                   w_fits=tuple(norm_weight.shape) == (L,), dist_ready=collective.dist_ready())


def _accepts(proto: str):
    def accepts(spec: AllReduceNormSpec) -> str | None:
        from ..lib.cute import compat, oneshot_epilogue

        if not compat.available():
            return f"CuTe DSL unavailable ({compat.IMPORT_ERROR or 'disabled'})"
        if spec.dtype not in IO_DTYPES:
            return f"dtype {spec.dtype} (bf16/fp16 only)"
        if spec.w_dtype not in compat.TORCH2CUTE or not spec.w_fits:
            return f"norm weight dtype {spec.w_dtype}" if spec.w_fits else "norm_weight shape/dtype mismatch"
        if oneshot_epilogue.pick_threads(spec.L) is None:
            return f"L={spec.L} not a multiple of 4*threads (<= 16 float4 per thread)"
        if not 1 <= spec.world_size <= collective.MAX_WORLD:
            return f"world_size {spec.world_size} > {collective.MAX_WORLD}"
        if not 1 <= spec.tokens <= spec.max_tokens:
            return f"M={spec.tokens} outside [1, max_tokens]"
        if not spec.dist_ready:
            return "torch.distributed not initialized"
        if collective.protocol() != proto:
            return f"K3FUSE_AR_PROTOCOL={collective.protocol()}"
        return None
    return accepts


def run(x, norm_weight, eps, group_name, world_size, max_tokens=64, **_):
    from ..lib.cute import compat

    L = x.shape[-1]
    x2 = collective.staged(x.reshape(-1, L))
    nw = collective.staged(norm_weight)
    facts = dict(protocol=collective.protocol(), path="push", cute=compat.cute_version())
    return collective.run_collective(OP, group_name, world_size, max_tokens, L, x.device, facts,
                                     lambda ws: _launch(ws, x2, nw, eps, max_tokens, x.shape))


def _launch(ws, x2, nw, eps, max_tokens, out_shape):
    from ..lib.cute import compat, oneshot_epilogue
    from ..lib.triton import lamport_push

    # 1. every kernel compiled and fetched before anything is pushed
    key, build = oneshot_epilogue.builder(ws.world, x2.shape[1], max_tokens, False, True, x2.dtype, nw.dtype, False,
                                          collective.flags_rank(ws.rank), has_residual=False)
    epilogue = compat.compiled(key, build)
    if not torch.cuda.is_current_stream_capturing():
        lamport_push.precompile(x2, ws.ptrs, ws.gen, ws.rank, max_tokens)
    out = torch.empty_like(x2)
    normed = torch.empty_like(x2)
    # 2. push, then the epilogue (`out` stands in for the residual: only its row count is used)
    lamport_push.run(x2, ws.ptrs, ws.gen, ws.rank, max_tokens)
    epilogue(ws.datas[ws.rank], *ws.padded(ws.flags, collective.MAX_WORLD), ws.gen, out, out, nw, out, normed,
             ws.err, float(eps), collective.timeout_ns())
    ws.after_call()
    return out.view(out_shape), normed.view(out_shape)


def _warmup(proto: str):
    def warm(shapes) -> None:
        """Compile the epilogue for [{"M", "L", "world_size", "max_tokens", "dtype", "group"}] before
        CUDA-graph capture (the push compiles on the first real call, which also creates the
        workspace collectively and must happen before capture too)."""
        from ..lib.cute import compat, oneshot_epilogue

        if collective.protocol() != proto:
            return
        for s_ in shapes:
            rank = collective.warmup_rank(s_)
            dt = s_.get("dtype", torch.bfloat16)
            key, build = oneshot_epilogue.builder(s_.get("world_size", 2), s_["L"], s_.get("max_tokens", 64), False,
                                                  True, dt, s_.get("w_dtype", dt), False, collective.flags_rank(rank),
                                                  has_residual=False)
            compat.compiled(key, build)
    return warm


def _fake(x, norm_weight, eps, group_name, world_size, max_tokens=64, strict=False):
    torch._check(x.dim() >= 1, lambda: "k3fuse.allreduce_rmsnorm: x must be [..., L], got a scalar")
    torch._check(norm_weight.dim() == 1 and norm_weight.shape[0] == x.shape[-1],
                 lambda: f"k3fuse.allreduce_rmsnorm: norm_weight is {tuple(norm_weight.shape)}, expected "
                         f"[L] = ({x.shape[-1]},) (x is {tuple(x.shape)})")
    torch._check(x.dtype.is_floating_point,
                 lambda: f"k3fuse.allreduce_rmsnorm: x must be floating point, got {x.dtype}")
    torch._check(world_size >= 1, lambda: f"k3fuse.allreduce_rmsnorm: world_size={world_size} must be >= 1")
    return x.new_empty(x.shape), x.new_empty(x.shape)


DECL = OpDecl(OP, "(Tensor x, Tensor norm_weight, float eps, str group_name, int world_size, int max_tokens=64, "
                  "bool strict=False) -> (Tensor, Tensor)",
              _fake, stock.allreduce_rmsnorm, allreduce.allreduce_rmsnorm, traits=SYNC, collective=True,
              spec=AllReduceNormSpec)
DECLS = (DECL,)
declare(DECL)
for _proto, _name in NAMES.items():
    register_impl(OP, Impl(_name, _accepts(_proto), run, priority=100, warmup=_warmup(_proto),
                           needs=("cute.compat", "cute.oneshot_epilogue", "triton.lamport_push")))
