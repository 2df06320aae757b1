"""moe_front_sharded on CUDA: each rank's 1/TP slice of [router ; W_down] in one GEMM, gathered over NVLink.

Why: the router (E x H, fp32 logits) and the latent down-projection (L x H) read the same input and
are replicated on every rank, so every rank streams all E + L weight rows. Sharded, rank r streams
only its E/W router rows and L/W latent rows, and the ranks exchange the [T, E/W + L/W] results.
The weight read drops by (W-1)/W; the exchange is T x (E + L) / W fp32 per peer (9 KB at one token).

Two launches, in the one-shot all-reduce's protocol family (kernels/cute/oneshot_ar.py,
kernels/symm_workspace.py), no multicast:
1. push: the Triton split-K GEMM (triton/splitk_gemm.py) over the two weight slices at once (its
   `weight2`: rows [0, E/W) from the router slice, the rest from the latent slice; no stacked copy)
   with its Lamport push epilogue: fp32 into slot [rank] of buffer gen[3] of every rank's symmetric
   workspace (hidden = E/W + L/W), +0.0 written for -0.0 (the "not written" sentinel);
2. gather (this file), launched with programmatic dependent launch (USE_PDL) so that it starts
   while the GEMM streams: one program per (token row, source rank) polls its slot of the local buffer
   with volatile loads until no word is the sentinel, writes the router columns into the fp32
   logits and the latent columns into the latent (x's dtype), resets that source's rows of the
   buffer used two calls ago and, as the last program, advances the protocol words (row count,
   epoch, buffer index). Every rank reads the same words, so the logits are bitwise identical on
   every rank, which keeps routing identical across ranks.
Same rules as the fused all-reduces: accept/decline from shared facts only (`decide`), every spin
bounded (K3FUSE_AR_TIMEOUT_S; a timeout writes the error words, NaN-fills the columns of the source
that never arrived and the host raises CollectiveTimeoutError naming the op, this rank and the
missing peer), every kernel compiled
before the first remote store, a failure after it fails the workspace on every rank.
The Lamport protocol only (K3FUSE_AR_PROTOCOL=lamport, the default): the flag protocol never resets
the sentinels, so under `flags` this kernel declines (a configuration fact every rank shares).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # pragma: no cover - CPU CI without triton
    HAVE_TRITON = False

NAME = "triton.moe_front_sharded"
OP = "moe_front_sharded"
ERR_KIND = 3          # err[2] of a timeout in this op (symm_workspace.ArWorkspace.describe)
MAX_WORLD = 8
_IO_DTYPES = (torch.bfloat16, torch.float16)

if HAVE_TRITON:
    from triton.language.extra.cuda import gdc_wait, globaltimer

    SENTINEL = tl.constexpr(-2**31)     # 0x80000000, the bits of -0.0: "not written yet"

    @triton.jit
    def _gather_kernel(data_ptr, gen_ptr, err_ptr, logits_ptr, latent_ptr, n_rows, timeout_ns,
                       WORLD: tl.constexpr, MAXT: tl.constexpr, NB: tl.constexpr, E1: tl.constexpr,
                       L1: tl.constexpr, BLOCK: tl.constexpr, KIND: tl.constexpr):
        # data: the local workspace [3, WORLD, MAXT, NB] as int32 words; program (t, src) owns
        # slot [b, src, t, :] of this call and rows t, t + n_rows, ... of slot [bc, src] to reset
        t = tl.program_id(0)
        src = tl.program_id(1)
        b = tl.load(gen_ptr + 3)
        bc = b + 2                                   # the buffer of two calls ago, never a remainder
        bc = tl.where(bc >= 3, bc - 3, bc)
        t_prev = tl.load(gen_ptr + 2).to(tl.int32)
        g = tl.load(gen_ptr)
        cols = tl.arange(0, BLOCK)
        in_row = cols < NB
        sentinel = tl.full((BLOCK,), SENTINEL, tl.int32)
        # 1. reset this source's rows of the buffer used two calls ago (written by the previous call)
        for row in range(t, t_prev, n_rows):
            tl.store(data_ptr + ((bc * WORLD + src) * MAXT + row) * NB + cols, sentinel, mask=in_row)
        # 2. poll this call's slot (local memory, pushed by rank src's GEMM) until nothing is the
        #    sentinel; bounded: a workspace that already failed never spins (timeout 0)
        failed = (tl.load(err_ptr, volatile=True) != 0).to(tl.int32)
        limit = tl.where(failed != 0, 0, timeout_ns)
        slot = data_ptr + ((b * WORLD + src) * MAXT + t) * NB + cols
        words = tl.load(slot, mask=in_row, other=0, volatile=True)
        pending = tl.sum(((words == SENTINEL) & in_row).to(tl.int32), axis=0)
        start = globaltimer()
        while pending != 0:
            words = tl.load(slot, mask=in_row, other=0, volatile=True)
            pending = tl.sum(((words == SENTINEL) & in_row).to(tl.int32), axis=0)
            if pending != 0:
                if globaltimer() - start > limit:
                    if failed == 0:          # the first failure names the source still missing
                        tl.store(err_ptr + 1, src)
                        tl.store(err_ptr + 2, KIND)
                        tl.store(err_ptr + 3, t)
                        tl.store(err_ptr, 1)
                    failed = pending * 0 + 1
                    pending = pending * 0
                elif tl.load(err_ptr, volatile=True) != 0:
                    failed = pending * 0 + 1     # a rank reported a failure: stop, never a hang
                    pending = pending * 0
        vals = words.to(tl.float32, bitcast=True)
        vals = tl.where(failed != 0, float("nan"), vals)   # never a plausible value after a failure
        # 3. unpack: router columns -> fp32 logits [T, W * E1], latent columns -> latent [T, W * L1]
        is_router = cols < E1
        tl.store(logits_ptr + t * (WORLD * E1) + src * E1 + cols, vals, mask=is_router)
        if L1 > 0:
            lat_cols = cols - E1
            tl.store(latent_ptr + t * (WORLD * L1) + src * L1 + lat_cols,
                     vals.to(latent_ptr.dtype.element_ty), mask=(cols >= E1) & in_row)
        # 4. the last program records this call's row count, advances the epoch, rotates b; under
        #    PDL first wait for the whole push GEMM (it reads gen[3]), so stream order after this
        #    kernel still covers the GEMM (a no-op without PDL)
        gdc_wait()
        tl.debug_barrier()
        old = tl.atomic_add(gen_ptr + 1, 1, sem="acq_rel", scope="gpu")
        if old == n_rows * WORLD - 1:
            tl.store(gen_ptr + 1, 0)
            tl.store(gen_ptr + 2, g * 0 + n_rows)
            tl.store(gen_ptr, g + 1)
            nb = b + 1
            tl.store(gen_ptr + 3, tl.where(nb >= 3, nb - 3, nb))


#: programmatic dependent launch: the gather launches while the push GEMM streams its weights and
#: polls as the pushes land, instead of launching after the GEMM's last CTA exits
USE_PDL = True

#: push-GEMM configs measured fastest on H200 (bench/bench_moe_front.py --sweep), keyed by
#: (router rows per rank, latent rows per rank, K, BLOCK_M bucket); other shapes use the heuristic
TUNED: dict[tuple[int, int, int, int], dict] = {
    # K3 at TP 2 (896 / 2 router rows, 3584 / 2 latent rows, H 7168); H200, 2026-12-01
    (448, 1792, 7168, 16): dict(BLOCK_N=64, SPLIT_K=7, BLOCK_K=128, num_warps=4, num_stages=3),  # 14.0 us (T 1, 8)
    (448, 1792, 7168, 64): dict(BLOCK_N=64, SPLIT_K=2, BLOCK_K=128, num_warps=4, num_stages=5),  # 18.1 us (T 64)
    # TP 4 and TP 8 (one rank's slice on one H200, --sweep --as-tp 4 / 8; op time, gather included)
    (224, 896, 7168, 16): dict(BLOCK_N=32, SPLIT_K=7, BLOCK_K=128, num_warps=4, num_stages=5),   # 9.15 us (T 1, 8)
    (224, 896, 7168, 64): dict(BLOCK_N=32, SPLIT_K=7, BLOCK_K=128, num_warps=4, num_stages=3),   # 13.9 us (T 64)
    (112, 448, 7168, 16): dict(BLOCK_N=16, SPLIT_K=7, BLOCK_K=128, num_warps=4, num_stages=5),   # 8.01 us (T 1, 8)
    (112, 448, 7168, 64): dict(BLOCK_N=16, SPLIT_K=7, BLOCK_K=128, num_warps=4, num_stages=3),   # 11.2 us (T 64)
}


def push_config(T: int, e1: int, l1: int, H: int) -> dict | None:
    """The split-K config of the push GEMM: the measured one for this shape, else the heuristic."""
    from . import splitk_gemm

    cfg = TUNED.get((e1, l1, H, splitk_gemm._block_m(T)))
    if cfg is not None:
        return dict(cfg, BLOCK_M=splitk_gemm._block_m(T))
    return splitk_gemm.pick_config(T, e1 + l1, H, rows_first=e1 if l1 else None)


def _protocol() -> str:
    from ..cute.gemm_ar_residual import protocol

    return protocol()


def _block(nb: int) -> int:
    return triton.next_power_of_2(nb)


def _num_warps(block: int) -> int:
    return max(1, min(8, block // 256))


def decide(T: int, H: int, E: int, L: int, x_dtype, w_dtype, world_size: int, max_tokens: int, *,
           triton_ok: bool, dist_ok: bool, protocol: str) -> str | None:
    """Accept (None) or decline (the reason) from facts every rank shares: shapes, dtypes, world
    size and configuration; never pointers or strides (misaligned inputs are staged)."""
    from . import splitk_gemm

    if not triton_ok:
        return "triton unavailable"
    if not dist_ok:
        return "torch.distributed not initialized"
    if protocol != "lamport":
        return f"K3FUSE_AR_PROTOCOL={protocol} (the gather polls Lamport sentinels)"
    if not 1 <= world_size <= MAX_WORLD:
        return f"world_size {world_size} outside [1, {MAX_WORLD}]"
    if x_dtype not in _IO_DTYPES or w_dtype != x_dtype:
        return f"dtype x {x_dtype} / weights {w_dtype} (bf16 or fp16, the same)"
    if E % world_size or L % world_size:
        return f"router rows {E} / latent rows {L} not divisible by world_size {world_size}"
    if not 1 <= T <= min(max_tokens, splitk_gemm.MAX_M):
        return f"tokens {T} outside [1, max_tokens {min(max_tokens, splitk_gemm.MAX_M)}]"
    e1, l1 = E // world_size, L // world_size
    rows_first = e1 if l1 else None
    if H % splitk_gemm.BLOCK_K or splitk_gemm.pick_config(T, e1 + l1, H, rows_first=rows_first) is None:
        return (f"no split-K tile for router slice {e1} + latent slice {l1} rows, K={H} "
                f"(needs K % {splitk_gemm.BLOCK_K} == 0 and the router slice a multiple of "
                f"{splitk_gemm.MIN_BLOCK_N})")
    return None


def _triton_ok() -> bool:
    return HAVE_TRITON


def _dist_ok() -> bool:
    return dist.is_available() and dist.is_initialized()


def _staged(t: torch.Tensor) -> torch.Tensor:
    """`t` if contiguous and 16-byte aligned, else an aligned copy (a decision no rank declines on)."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    return t.contiguous() if not t.is_contiguous() else t.clone()


def supports(x, router_w, down_w, group_name, world_size, max_tokens=64, **_) -> str | None:
    H = x.shape[-1]
    if router_w.dim() != 2 or router_w.shape[1] != H or (down_w is not None and
                                                          (down_w.dim() != 2 or down_w.shape[1] != H)):
        return "x / router_w / down_w shapes do not fit"
    if not x.is_cuda:
        return "not a CUDA tensor"
    L = down_w.shape[0] if down_w is not None else 0
    if down_w is not None and down_w.dtype != router_w.dtype:
        return f"router_w {router_w.dtype} and down_w {down_w.dtype} differ"
    return decide(x.numel() // max(H, 1), H, router_w.shape[0], L, x.dtype, router_w.dtype, world_size,
                  max_tokens, triton_ok=_triton_ok(), dist_ok=_dist_ok(), protocol=_protocol())


def covers(shape: dict) -> str | None:
    """Compile-time limits for the rule's kernel-shape guard: {"M", "E", "L", "H", "dtype",
    "world_size", "max_tokens", "x_dtype" (default: dtype)} (L = 0 for the router-only form)."""
    dt = shape.get("dtype")
    return decide(shape["M"], shape["H"], shape["E"], shape.get("L", 0), shape.get("x_dtype", dt), dt,
                  shape.get("world_size", 2),
                  shape.get("max_tokens", 64), triton_ok=_triton_ok(), dist_ok=True, protocol=_protocol())


def run(x, router_w, down_w, group_name, world_size, max_tokens=64, **_):
    from ..symm_workspace import collective_call

    H = x.shape[-1]
    E = router_w.shape[0]
    L = down_w.shape[0] if down_w is not None else 0
    nb = (E + L) // world_size

    def body(ws):   # staging inside the call: its failure fails the group on every rank too
        return _launch(ws, _staged(x.reshape(-1, H)), _staged(router_w),
                       _staged(down_w) if down_w is not None else None, max_tokens)

    logits, latent = collective_call(OP, group_name, world_size, max_tokens, nb, x.device,
                                     dict(protocol=_protocol(), path="moe_front_sharded"), body)
    lead = x.shape[:-1]
    return logits.view(*lead, E), latent.view(*lead, L)


def _slices(ws, router_w: torch.Tensor, down_w: torch.Tensor | None):
    """This rank's rows (views, no copy): the rank within the TP group, never the global one."""
    e1 = router_w.shape[0] // ws.world
    r = router_w.narrow(0, ws.rank * e1, e1)
    if down_w is None:
        return r, None
    l1 = down_w.shape[0] // ws.world
    return r, down_w.narrow(0, ws.rank * l1, l1)


def _launch(ws, x2: torch.Tensor, router_w: torch.Tensor, down_w: torch.Tensor | None, max_tokens: int):
    from ..symm_workspace import timeout_ns
    from . import splitk_gemm

    T = x2.shape[0]
    w_r, w_d = _slices(ws, router_w, down_w)
    e1 = w_r.shape[0]
    l1 = w_d.shape[0] if w_d is not None else 0
    nb = e1 + l1
    logits = torch.empty((T, ws.world * e1), dtype=torch.float32, device=x2.device)
    latent = torch.empty((T, ws.world * l1), dtype=x2.dtype, device=x2.device)
    push = (ws.ptrs, ws.gen, ws.rank, max_tokens)
    cfg = push_config(T, e1, l1, x2.shape[1])
    block = _block(nb)
    grid = (T, ws.world)
    args = (ws.datas[ws.rank].view(torch.int32), ws.gen, ws.err, logits, latent if l1 else logits, T,
            timeout_ns())
    pdl = USE_PDL
    kw = dict(WORLD=ws.world, MAXT=max_tokens, NB=nb, E1=e1, L1=l1, BLOCK=block, KIND=ERR_KIND,
              num_warps=_num_warps(block), launch_pdl=pdl)
    # 1. both kernels compiled before anything is pushed (Triton compiles on first launch)
    if not torch.cuda.is_current_stream_capturing():
        splitk_gemm.precompile(x2, w_r, None, torch.float32, config=cfg, push=push, weight2=w_d, pdl_trigger=pdl)
        _gather_kernel.warmup(*args, grid=grid, **kw)
    ws.start_barrier((OP, T, e1, l1, x2.dtype))   # every rank compiled both: then push
    # 2. push this rank's slice into every rank, then gather the W slices locally
    splitk_gemm.run(x2, w_r, None, torch.float32, config=cfg, push=push, weight2=w_d, pdl_trigger=pdl)
    _gather_kernel[grid](*args, **kw)
    ws.after_call()
    return logits, latent


def _warmup(shapes) -> None:
    """Nothing to compile ahead without a workspace: the first real call (before CUDA-graph
    capture, which also creates the workspace collectively) compiles both kernels before its push."""
    return None


if HAVE_TRITON:
    from ..dispatch import Impl, register_impl

    register_impl(OP, Impl(NAME, supports=supports, run=run, priority=100, warmup=_warmup, covers=covers))
