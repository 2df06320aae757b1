"""The sharded MoE front's kernels: each rank's 1/TP slice of [router ; W_down] in one GEMM, gathered over NVLink.

Why: the router (E x H, fp32 logits) and the latent down-projection (L x H) read the same input and
are replicated on every rank, so every rank streams all E + L weight rows. Sharded, rank r streams
only its E/W router rows and L/W latent rows, and the ranks exchange the [T, E/W + L/W] results.
The weight read drops by (W-1)/W; the exchange is T x (E + L) / W fp32 per peer (9 KB at one token).

Two launches, in the one-shot all-reduce's protocol family (lib/cute/oneshot_epilogue.py,
kernels/collective.py), no multicast:
1. push: the split-K GEMM (splitk_gemm.py) over the two weight slices at once (its `weight2`: rows
   [0, E/W) from the router slice, the rest from the latent slice; no stacked copy) with its Lamport
   push epilogue: fp32 into slot [rank] of buffer gen[3] of every rank's symmetric workspace
   (hidden = E/W + L/W), +0.0 written for -0.0 (the "not written" sentinel);
2. gather (this file), launched with programmatic dependent launch (USE_PDL) so that it starts
   while the GEMM streams: one program per (token row, source rank) polls its slot of the local buffer
   with volatile loads until no word is the sentinel, writes the router columns into the fp32
   logits and the latent columns into the latent (x's dtype), resets that source's rows of the
   buffer used two calls ago and, as the last program, advances the protocol words (row count,
   epoch, buffer index). Every rank reads the same words, so the logits are bitwise identical on
   every rank, which keeps routing identical across ranks.
Every spin is bounded (K3FUSE_AR_TIMEOUT_S): a timeout writes the error words and NaN-fills the
columns of the source that never arrived; the host raises CollectiveTimeoutError naming the op,
this rank and the missing peer. When the op runs these (the Lamport protocol only, every kernel
compiled before the first remote store) is kernels/ops/moe_front.py's business.
"""
from __future__ import annotations

import torch

from . import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

from . import splitk_gemm
from ...collective import MAX_WORLD, NBUF, OP_KINDS

ERR_KIND = OP_KINDS["moe_front_sharded"]  # err[2] of a timeout in this op (collective.ArWorkspace.describe)

if HAVE_TRITON:
    from triton.language.extra.cuda import gdc_wait, globaltimer

    SENTINEL = tl.constexpr(-2**31)     # 0x80000000, the bits of -0.0: "not written yet"
    N_BUFFERS = tl.constexpr(NBUF)      # (a jit function reads only constexpr globals)

    @triton.jit
    def _gather_kernel(data_ptr, gen_ptr, err_ptr, logits_ptr, latent_ptr, n_rows, timeout_ns,
                       WORLD: tl.constexpr, MAXT: tl.constexpr, NB: tl.constexpr, E1: tl.constexpr,
                       L1: tl.constexpr, BLOCK: tl.constexpr, KIND: tl.constexpr):
        # data: the local workspace [NBUF, WORLD, MAXT, NB] as int32 words; program (t, src) owns
        # slot [b, src, t, :] of this call and rows t, t + n_rows, ... of slot [bc, src] to reset
        t = tl.program_id(0)
        src = tl.program_id(1)
        b = tl.load(gen_ptr + 3)
        bc = b + 2                                   # the buffer of two calls ago, never a remainder
        bc = tl.where(bc >= N_BUFFERS, bc - N_BUFFERS, bc)
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
            tl.store(gen_ptr + 3, tl.where(nb >= N_BUFFERS, nb - N_BUFFERS, nb))


#: programmatic dependent launch: the gather launches while the push GEMM streams its weights and
#: polls as the pushes land, instead of launching after the GEMM's last CTA exits
USE_PDL = True

#: push-GEMM configs measured fastest on H200 (bench/bench_moe_front.py --sweep), keyed by
#: (router rows per rank, latent rows per rank, K, BLOCK_M bucket); other shapes use the heuristic;
#: the sweep's timings are in docs/perf/2026-12-01-moe-front.md (0b, 0b.1)
TUNED: dict[tuple[int, int, int, int], dict] = {
    # K3 at TP 2 (896 / 2 router rows, 3584 / 2 latent rows, H 7168)
    (448, 1792, 7168, 16): dict(BLOCK_N=64, SPLIT_K=7, BLOCK_K=128, num_warps=4, num_stages=3),
    (448, 1792, 7168, 64): dict(BLOCK_N=64, SPLIT_K=2, BLOCK_K=128, num_warps=4, num_stages=5),
    # TP 4 and TP 8 (one rank's slice on one H200, --sweep --as-tp 4 / 8; op time, gather included)
    (224, 896, 7168, 16): dict(BLOCK_N=32, SPLIT_K=7, BLOCK_K=128, num_warps=4, num_stages=5),
    (224, 896, 7168, 64): dict(BLOCK_N=32, SPLIT_K=7, BLOCK_K=128, num_warps=4, num_stages=3),
    (112, 448, 7168, 16): dict(BLOCK_N=16, SPLIT_K=7, BLOCK_K=128, num_warps=4, num_stages=5),
    (112, 448, 7168, 64): dict(BLOCK_N=16, SPLIT_K=7, BLOCK_K=128, num_warps=4, num_stages=3),
}


def push_config(T: int, e1: int, l1: int, H: int) -> dict | None:
    """The split-K config of the push GEMM: the measured one for this shape, else the heuristic."""
    cfg = TUNED.get((e1, l1, H, splitk_gemm._block_m(T)))
    if cfg is not None:
        return dict(cfg, BLOCK_M=splitk_gemm._block_m(T))
    return splitk_gemm.pick_config(T, e1 + l1, H, rows_first=e1 if l1 else None)


def _block(nb: int) -> int:
    return triton.next_power_of_2(nb)


def _num_warps(block: int) -> int:
    return max(1, min(8, block // 256))


def slices(ws, router_w: torch.Tensor, down_w: torch.Tensor | None):
    """This rank's rows (views, no copy): the rank within the TP group, never the global one."""
    e1 = router_w.shape[0] // ws.world
    r = router_w.narrow(0, ws.rank * e1, e1)
    if down_w is None:
        return r, None
    l1 = down_w.shape[0] // ws.world
    return r, down_w.narrow(0, ws.rank * l1, l1)


def launch(ws, x2: torch.Tensor, router_w: torch.Tensor, down_w: torch.Tensor | None, max_tokens: int,
           timeout_ns: int):
    """Push this rank's slice of [router_w ; down_w] @ x2.T into every rank's workspace `ws`, then
    gather the W slices locally -> (logits fp32 [T, E], latent [T, L] in x2's dtype)."""
    T = x2.shape[0]
    w_r, w_d = slices(ws, router_w, down_w)
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
            timeout_ns)
    pdl = USE_PDL
    kw = dict(WORLD=ws.world, MAXT=max_tokens, NB=nb, E1=e1, L1=l1, BLOCK=block, KIND=ERR_KIND,
              num_warps=_num_warps(block), launch_pdl=pdl)
    # 1. both kernels compiled before anything is pushed (Triton compiles on first launch)
    if not torch.cuda.is_current_stream_capturing():
        splitk_gemm.precompile(x2, w_r, None, torch.float32, config=cfg, push=push, weight2=w_d, pdl_trigger=pdl)
        _gather_kernel.warmup(*args, grid=grid, **kw)
    ws.start_barrier(("moe_front_sharded", T, e1, l1, x2.dtype))   # every rank compiled both: then push
    # 2. push this rank's slice into every rank, then gather the W slices locally
    splitk_gemm.run(x2, w_r, None, torch.float32, config=cfg, push=push, weight2=w_d, pdl_trigger=pdl)
    _gather_kernel[grid](*args, **kw)
    ws.after_call()
    return logits, latent
