"""moe_front_sharded: the replicated router and latent down-projection, computed sharded and gathered.

Takes the FULL replicated W_r [E, H] and W_down [L, H]; each rank computes its 1/world_size rows
(rank from the group at run time, views), so one rewritten graph serves every rank -> (router logits
fp32 [T, E], latent [T, L] in x.dtype). down_w None is the router-only form: latent is [T, 0].

Why: both read the same input and are replicated, so every rank streams all E + L weight rows.
Sharded, rank r streams only its E/W router rows and L/W latent rows, and the ranks exchange the
[T, E/W + L/W] results. CUDA (lib/triton/moe_gather.py): the split-K GEMM over the two slices with
its Lamport push epilogue, then the gather kernel, in the collectives' protocol family
(kernels/collective.py). The Lamport protocol only: the flag protocol never resets the sentinels,
so under K3FUSE_AR_PROTOCOL=flags this kernel declines (a configuration fact every rank shares).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .. import collective
from ..declare import SYNC, OpDecl, check_gemm, declare, rows
from ..dispatch import Impl, register_impl
from ..lib.reference import moe_front, stock
from ..spec import Spec, call_only
from .decode_gemm import IO_DTYPES

OP = "moe_front_sharded"
NAME = "triton.moe_front_sharded"


@dataclass(frozen=True, kw_only=True)
class MoEFrontSpec(Spec):
    """x [tokens, H], router_w [E, H], down_w [L, H] (L = 0: router only); dtype: the weights'."""

    op: ClassVar[str] = OP
    E: int
    L: int
    H: int
    dtype: torch.dtype
    world_size: int
    max_tokens: int
    x_dtype: torch.dtype | None = call_only(None)  # None: the weights' dtype
    fits: str | None = call_only(None)  # why x / router_w / down_w disagree
    dist_ready: bool = call_only(True)

    @classmethod
    def from_call(cls, x, router_w, down_w, group_name, world_size, max_tokens=64, **_: Any) -> MoEFrontSpec:
        H = x.shape[-1]
        fits = None
        if router_w.dim() != 2 or router_w.shape[1] != H or (down_w is not None and
                                                              (down_w.dim() != 2 or down_w.shape[1] != H)):
            fits = "x / router_w / down_w shapes do not fit"
        elif not x.is_cuda:
            fits = "not a CUDA tensor"
        elif down_w is not None and down_w.dtype != router_w.dtype:
            fits = f"router_w {router_w.dtype} and down_w {down_w.dtype} differ"
        return cls(tokens=x.numel() // max(H, 1), E=int(router_w.shape[0]),
                   L=int(down_w.shape[0]) if down_w is not None else 0, H=int(H), dtype=router_w.dtype,
                   world_size=int(world_size), max_tokens=int(max_tokens), x_dtype=x.dtype, fits=fits,
                   dist_ready=collective.dist_ready())


def accepts(spec: MoEFrontSpec) -> str | None:
    from ..lib.triton import splitk_gemm

    if spec.fits is not None:
        return spec.fits
    if not spec.dist_ready:
        return "torch.distributed not initialized"
    if collective.protocol() != "lamport":
        return f"K3FUSE_AR_PROTOCOL={collective.protocol()} (the gather polls Lamport sentinels)"
    W, T = spec.world_size, spec.tokens
    if not 1 <= W <= collective.MAX_WORLD:
        return f"world_size {W} outside [1, {collective.MAX_WORLD}]"
    x_dtype = spec.x_dtype or spec.dtype
    if x_dtype not in IO_DTYPES or spec.dtype != x_dtype:
        return f"dtype x {x_dtype} / weights {spec.dtype} (bf16 or fp16, the same)"
    if spec.E % W or spec.L % W:
        return f"router rows {spec.E} / latent rows {spec.L} not divisible by world_size {W}"
    if not 1 <= T <= min(spec.max_tokens, splitk_gemm.MAX_M):
        return f"tokens {T} outside [1, max_tokens {min(spec.max_tokens, splitk_gemm.MAX_M)}]"
    e1, l1 = spec.E // W, spec.L // W
    if spec.H % splitk_gemm.BLOCK_K or splitk_gemm.pick_config(T, e1 + l1, spec.H,
                                                               rows_first=e1 if l1 else None) is None:
        return (f"no split-K tile for router slice {e1} + latent slice {l1} rows, K={spec.H} "
                f"(needs K % {splitk_gemm.BLOCK_K} == 0 and the router slice a multiple of "
                f"{splitk_gemm.MIN_BLOCK_N})")
    return None


def run(x, router_w, down_w, group_name, world_size, max_tokens=64, **_):
    from ..lib.triton import moe_gather

    H = x.shape[-1]
    x2 = collective.staged(x.reshape(-1, H))
    E = router_w.shape[0]
    L = down_w.shape[0] if down_w is not None else 0
    router_w, down_w = collective.staged(router_w), collective.staged(down_w)
    facts = dict(protocol=collective.protocol(), path=OP)
    logits, latent = collective.run_collective(
        OP, group_name, world_size, max_tokens, (E + L) // world_size, x.device, facts,
        lambda ws: moe_gather.launch(ws, x2, router_w, down_w, max_tokens, collective.timeout_ns()))
    lead = x.shape[:-1]
    return logits.view(*lead, E), latent.view(*lead, L)


def _warmup(shapes) -> None:
    """Nothing to compile ahead without a workspace: the first real call (before CUDA-graph
    capture, which also creates the workspace collectively) compiles both kernels before its push."""
    return None


def _fake(x, router_w, down_w, group_name, world_size, max_tokens=64, strict=False):
    weights = (("router_w", router_w),) if down_w is None else (("router_w", router_w), ("down_w", down_w))
    for what, w in weights:
        check_gemm(x, w, OP)
        torch._check(w.shape[0] % world_size == 0,
                     lambda: f"k3fuse.moe_front_sharded: {what} rows {w.shape[0]} not divisible "
                             f"by world_size {world_size}")
    logits = x.new_empty(rows(x, router_w.shape[0]), dtype=torch.float32)
    latent = x.new_empty(rows(x, 0 if down_w is None else down_w.shape[0]))  # router-only: [T, 0]
    return logits, latent


DECL = OpDecl(OP, "(Tensor x, Tensor router_w, Tensor? down_w, str group_name, int world_size, "
                  "int max_tokens=64, bool strict=False) -> (Tensor, Tensor)",
              _fake, stock.moe_front_sharded, moe_front.moe_front_sharded, traits=SYNC, collective=True,
              spec=MoEFrontSpec)
DECLS = (DECL,)
declare(DECL)
register_impl(OP, Impl(NAME, accepts, run, priority=100, warmup=_warmup, needs=("triton.splitk_gemm", "triton.moe_gather")))
