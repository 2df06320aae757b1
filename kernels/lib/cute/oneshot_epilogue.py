"""CuTe DSL one-shot all-reduce epilogue: Lamport poll + fixed-order sum + residual (+ RMSNorm).

Why: a decode all-reduce of [T, 7168] is latency-bound. Instead of push -> fence -> flag -> poll
(a system-scope round trip after the GEMM), the GEMM itself pushes its fp32 partials with plain
stores into slot [rank] of every rank's symmetric buffer while it streams its weights (the
`push` epilogues of gemv.py and lib/triton/splitk_gemm.py); no multicast anywhere. The data is
its own flag (Lamport): buffers hold the sentinel -0.0 (bits 0x80000000) until written, the GEMM
never writes -0.0 (it writes +0.0 instead), and this kernel polls its *local* buffer with volatile
16-byte loads until no word is the sentinel. It sums the W slots in fixed rank order 0..W-1 in
fp32 (every rank reads the same words, so every rank's result is bitwise identical), adds the
residual (and addend), writes `out` and optionally RMSNorm of the fp32 sum times the weight (the
reference's rounding points).

Protocol state lives in device memory, so CUDA-graph replays stay correct: int64 words
(kernels/collective.py) gen[0] = epoch (64-bit), gen[3] = buffer index b in {0, 1, 2} (the GEMM reads
it too; rotated by the last CTA, never a remainder of the epoch, so the rotation survives
every wrap of the counter); each CTA resets buffer (b + 2) mod 3 (used at the previous call,
gen[2] rows) to the sentinel; the last CTA to finish (gen[1] arrival counter) stores the row count
in gen[2], advances the epoch and rotates b. Three buffers suffice: a peer writes buffer b + 2 two
calls later only after this rank pushed the next call, which it does after this kernel (and its
reset) finished.
Every spin is bounded (%globaltimer, `timeout_ns` = K3FUSE_AR_TIMEOUT_S): on timeout err[] names
the source rank that never arrived, the output is NaN, and a workspace whose err is set (here or
by a failing peer, which writes it remotely) never spins again; the host raises
(collective.CollectiveTimeoutError).

Flag variant (`flags_rank` set; K3FUSE_AR_PROTOCOL=flags): the same GEMM push (plain stores into
buffer g % 3), then explicit acquire/release flags instead of sentinels. Epoch e = g + 1 (gen[0]
in device memory, advanced by the last CTA as above, so graph replays stay correct). CTA t:
loads the static norm weight, then (thread r) `fence.acq_rel.sys` + `st.release.sys` of e into
flag [rank, t] of rank r (the GEMM's stores precede this kernel in stream order, the fence makes
them visible system-wide before the flag), then (thread s) spins with `ld.acquire.sys` on its own
flag [s, t] until flag - e >= 0 (int64 signed difference: wrap-safe; flags only grow), a CTA barrier,
and only then reads the peer slots. No buffer reset is needed (no sentinel); the flags live after
the data in the same symmetric allocation (kernels/collective.py). PDL is never used here: the flag
store must follow the GEMM's completion.
"""
from __future__ import annotations

from ...collective import MAX_WORLD, NBUF, OP_KINDS
from .compat import SELF as compat

VEC = 4  # fp32 per 16-byte access

if compat.HAVE_CUTE:
    import cutlass
    from cutlass import Float32, Int32, Int64, const_expr

    cute = compat.cute

    class LamportArResidualNorm:
        """One CTA per token row; `threads` each own H / (4 * threads) float4 chunks of the row."""

        def __init__(self, world: int, hidden: int, max_tokens: int, threads: int,
                     has_addend: bool, has_norm: bool, pdl: bool = False,
                     flags_rank: int | None = None, has_residual: bool = True):
            assert 1 <= world <= MAX_WORLD and hidden % (VEC * threads) == 0
            # has_residual=False: out = the sum itself (allreduce_rmsnorm, the MoE tail); the
            # residual argument is then only the row count of the grid (pass `out`), never read
            assert has_residual or not has_addend
            self.has_residual = has_residual
            # err[2] on a timeout: which op spun (collective.ArWorkspace.describe)
            self.err_kind = OP_KINDS["allreduce_rmsnorm" if not has_residual else
                                     "gemm_ar_residual_rmsnorm" if has_norm else "gemm_ar_residual"]
            self.world, self.H, self.max_t = world, hidden, max_tokens
            self.threads, self.vpt = threads, hidden // (VEC * threads)
            self.has_addend, self.has_norm = has_addend, has_norm
            self.num_warps = threads // 32
            # pdl: launched as a programmatic dependent of the push GEMM, so the launch and the
            # buffer reset overlap the GEMM's tail; it only polls data, and waits for the GEMM grid
            # to complete before exiting (so stream order after this kernel still covers the GEMM)
            self.pdl = pdl
            # flags_rank: None = Lamport (data is its own flag); r = acquire/release flag protocol
            # of rank r (module docstring); never with PDL (the flags must follow the GEMM)
            assert flags_rank is None or (not pdl and 0 <= flags_rank < world)
            self.flags, self.rank = flags_rank is not None, flags_rank

        @cute.jit
        def __call__(self, data: cute.Tensor,
                     f0: cute.Tensor, f1: cute.Tensor, f2: cute.Tensor, f3: cute.Tensor,
                     f4: cute.Tensor, f5: cute.Tensor, f6: cute.Tensor, f7: cute.Tensor,
                     gen: cute.Tensor, residual: cute.Tensor,
                     addend: cute.Tensor, norm_w: cute.Tensor, out: cute.Tensor, normed: cute.Tensor,
                     err: cute.Tensor, eps: Float32, timeout_ns: Int64, stream):
            self.kernel(data, f0, f1, f2, f3, f4, f5, f6, f7, gen, residual, addend, norm_w, out,
                        normed, err, eps, timeout_ns).launch(
                grid=(residual.shape[0], 1, 1), block=(self.threads, 1, 1), stream=stream,
                use_pdl=self.pdl)

        @cute.kernel
        def kernel(self, data: cute.Tensor,
                   f0: cute.Tensor, f1: cute.Tensor, f2: cute.Tensor, f3: cute.Tensor,
                   f4: cute.Tensor, f5: cute.Tensor, f6: cute.Tensor, f7: cute.Tensor,
                   gen: cute.Tensor, residual: cute.Tensor,
                   addend: cute.Tensor, norm_w: cute.Tensor, out: cute.Tensor, normed: cute.Tensor,
                   err: cute.Tensor, eps: Float32, timeout_ns: Int64):
            W: cutlass.Constexpr = self.world
            TH: cutlass.Constexpr = self.threads
            VPT: cutlass.Constexpr = self.vpt
            H: cutlass.Constexpr = self.H
            MT: cutlass.Constexpr = self.max_t
            tidx, _, _ = cute.arch.thread_idx()
            t, _, _ = cute.arch.block_idx()
            nblk, _, _ = cute.arch.grid_dim()
            warp = cute.arch.warp_idx()
            lane = cute.arch.lane_idx()

            # protocol state (int64 words, kernels/collective.py): gen[0] epoch (flags protocol; 64-bit,
            # never wraps in practice, compared by signed difference so even the wrap is safe),
            # gen[1] arrival counter, gen[2] rows written last call, gen[3] buffer index in
            # {0, 1, 2}: rotated by the last CTA, never computed as a remainder of the epoch
            g = gen[0]
            b = gen[3]
            bc = b + 2                      # the buffer used two calls ago (= previous call's - 1)
            if bc >= NBUF:
                bc = bc - NBUF
            tprev = Int32(gen[2])
            base = data.iterator
            # bounded spin (always on): give up after timeout_ns; a workspace that already timed
            # out (err[0] != 0) never spins again and its outputs are NaN
            tmo = timeout_ns
            failed = Int32(0)
            if compat.ld_relaxed_gpu_s32(err.iterator) != 0:
                tmo = Int64(0)
                failed = Int32(1)

            # 0. static weights only, before any wait (never peer data)
            wpre = []
            if const_expr(self.has_norm):
                wrow = cute.zipped_divide(norm_w, (VEC,))
                for j in cutlass.range_constexpr(VPT):
                    wv = cute.make_rmem_tensor((VEC,), norm_w.element_type)
                    cute.autovec_copy(wrow[None, tidx + j * TH], wv)
                    wpre.append(wv)

            if const_expr(not self.flags):
                # 1. reset the rows of buffer (g+2)%3 written at generation g-1 (rows t, t+T, ...)
                for row in cutlass.range(t, tprev, nblk):
                    for src in cutlass.range_constexpr(W):
                        for j in cutlass.range_constexpr(VPT):
                            off = ((bc * W + src) * MT + row) * H + (tidx + j * TH) * VEC
                            compat.st_v4_b32_splat(base + off, Int32(compat.SENTINEL))
            else:
                # 1. flags: release epoch g+1 into flag [RANK, t] of every rank (thread r -> rank
                #    r), after a system fence over the pushed data; then thread s acquires flag
                #    [s, t] of this rank until source s reached the epoch; a barrier for the CTA
                flags = [f0, f1, f2, f3, f4, f5, f6, f7]
                RANK: cutlass.Constexpr = self.rank
                ep = g + 1
                for r in cutlass.range_constexpr(W):
                    if tidx == r:
                        compat.fence_acq_rel_sys()
                        compat.st_release_sys_s64(flags[r].iterator + (RANK * MT + t), ep)
                if tidx < W:
                    fptr = flags[RANK].iterator + (tidx * MT + t)
                    fstart = compat.globaltimer_ns()
                    waiting = Int32(1)
                    while waiting != 0:
                        if compat.ld_acquire_sys_s64(fptr) - ep >= 0:
                            waiting = Int32(0)
                        else:
                            compat.nanosleep(Int32(64))
                            if compat.globaltimer_ns() - fstart > tmo:
                                if failed == 0:                # first failure: record it
                                    err[1] = tidx              # the source rank that never arrived
                                    err[2] = Int32(self.err_kind)
                                    err[3] = t
                                    err[0] = Int32(1)
                                waiting = Int32(0)
                            elif compat.ld_relaxed_gpu_s32(err.iterator) != 0:
                                waiting = Int32(0)             # a rank reported a failure
                cute.arch.sync_threads()
                if compat.ld_relaxed_gpu_s32(err.iterator) != 0:
                    failed = Int32(1)

            # 2. poll the W slots of row t (local memory, written by every rank's GEMM) and sum
            #    them in fixed rank order; then residual (+ addend) -> out
            rrow = cute.zipped_divide(residual[t, None], (VEC,))
            orow = cute.zipped_divide(out[t, None], (VEC,))
            arow = cute.zipped_divide(addend[t, None], (VEC,))
            keep = []
            ss = Float32(0.0)
            start = compat.globaltimer_ns()
            # poll in batches of chunks: all 16-byte volatile loads of a batch are in flight
            # together (one memory round trip when the peers are done), re-polled until no word
            # is the sentinel; at most 16 loads (64 registers) per batch. Flags: the data is
            # complete (acquired above), so each batch is loaded once.
            CB: cutlass.Constexpr = max(1, 16 // W)
            for b0 in cutlass.range_constexpr(0, VPT, CB):
                chunks = list(range(b0, min(VPT, b0 + CB)))
                raw = cute.make_rmem_tensor((len(chunks) * W * VEC,), Int32)
                pending = Int32(1)
                while pending != 0:
                    p = Int32(0)
                    for ci in cutlass.range_constexpr(len(chunks)):
                        c = tidx + chunks[ci] * TH
                        for src in cutlass.range_constexpr(W):
                            ptr = base + ((b * W + src) * MT + t) * H + c * VEC
                            v0, v1, v2, v3 = compat.ld_volatile_v4_b32(ptr)
                            q = (ci * W + src) * VEC
                            raw[q] = v0
                            raw[q + 1] = v1
                            raw[q + 2] = v2
                            raw[q + 3] = v3
                    if const_expr(not self.flags):
                        for q in cutlass.range_constexpr(0, len(chunks) * W * VEC, VEC):  # after all loads
                            p = p | compat.any_sentinel4(raw[q], raw[q + 1], raw[q + 2], raw[q + 3])
                    pending = p
                    if pending != 0:
                        compat.nanosleep(Int32(128))
                        if compat.globaltimer_ns() - start > tmo:
                            if failed == 0:
                                # first failure: name a source whose slot is still the sentinel
                                for ci in cutlass.range_constexpr(len(chunks)):
                                    for src in cutlass.range_constexpr(W):
                                        q = (ci * W + src) * VEC
                                        if compat.any_sentinel4(raw[q], raw[q + 1], raw[q + 2], raw[q + 3]) != 0:
                                            err[1] = Int32(src)
                                err[2] = Int32(self.err_kind)
                                err[3] = t
                                err[0] = Int32(1)
                            failed = Int32(1)
                            pending = Int32(0)
                        elif compat.ld_relaxed_gpu_s32(err.iterator) != 0:
                            failed = Int32(1)                  # a rank reported a failure
                            pending = Int32(0)
                for ci in cutlass.range_constexpr(len(chunks)):
                    j = chunks[ci]
                    c = tidx + j * TH
                    acc = cute.make_rmem_tensor((VEC,), Float32)
                    for src in cutlass.range_constexpr(W):     # fixed rank order: bitwise identical
                        for e in cutlass.range_constexpr(VEC):
                            f = compat.b32_as_f32(raw[(ci * W + src) * VEC + e])
                            if const_expr(src == 0):
                                acc[e] = f
                            else:
                                acc[e] = acc[e] + f
                    if failed != 0:          # timed out or poisoned: never a plausible value
                        for e in cutlass.range_constexpr(VEC):
                            acc[e] = compat.b32_as_f32(Int32(0x7FC00000))
                    s = acc.load()
                    if const_expr(self.has_residual):
                        res = cute.make_rmem_tensor((VEC,), residual.element_type)
                        cute.autovec_copy(rrow[None, c], res)
                        s = res.load().to(Float32) + s
                    if const_expr(self.has_addend):
                        ad = cute.make_rmem_tensor((VEC,), addend.element_type)
                        cute.autovec_copy(arow[None, c], ad)
                        s = s + ad.load().to(Float32)
                    o = cute.make_rmem_tensor((VEC,), out.element_type)
                    o.store(s.to(out.element_type))
                    cute.autovec_copy(o, orow[None, c])
                    if const_expr(self.has_norm):
                        # normalise the fp32 sum (before rounding), as the reference does
                        ss = ss + (s * s).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                        k = cute.make_rmem_tensor((VEC,), Float32)
                        k.store(s)
                        keep.append(k)

            # 3. RMSNorm of the fp32 row (block reduction of the sum of squares)
            if const_expr(self.has_norm):
                smem = compat.SmemAllocator()
                red = smem.allocate_tensor(Float32, cute.make_layout((self.num_warps,)), byte_alignment=16)
                wsum = cute.arch.warp_reduction_sum(ss)
                if lane == 0:
                    red[warp] = wsum
                cute.arch.sync_threads()
                tot = Float32(0.0)
                for wi in cutlass.range_constexpr(self.num_warps):
                    tot = tot + red[wi]
                rstd = cute.math.rsqrt(tot / Float32(H) + eps)
                nrow = cute.zipped_divide(normed[t, None], (VEC,))
                for j in cutlass.range_constexpr(VPT):
                    c = tidx + j * TH
                    nv = cute.make_rmem_tensor((VEC,), normed.element_type)
                    nv.store(((keep[j].load() * rstd) * wpre[j].load().to(Float32)).to(normed.element_type))
                    cute.autovec_copy(nv, nrow[None, c])

            # 4. the last CTA to finish records this call's row count and advances the generation
            if const_expr(self.pdl):
                compat.griddep_wait()
            cute.arch.sync_threads()
            if tidx == 0:
                old = compat.atom_add_acq_rel_gpu_u64(gen.iterator + 1, Int64(1))
                if old == Int64(nblk - 1):
                    gen[1] = Int64(0)
                    gen[2] = Int64(nblk)
                    gen[0] = g + 1
                    nb = b + 1
                    if nb >= NBUF:
                        nb = nb - NBUF
                    gen[3] = nb


def pick_threads(hidden: int) -> int | None:
    for th in (256, 224, 192, 128, 512, 96, 64):
        if hidden % (VEC * th) == 0 and hidden // (VEC * th) <= 16:
            return th
    return None


def builder(world, hidden, max_tokens, has_addend, has_norm, io_dtype, w_dtype, pdl=False,
            flags_rank=None, has_residual=True):
    """(key, build) for compat.compiled / compat.compile_to_ptx_on_cpu.

    flags_rank=None: Lamport protocol; flags_rank=r: acquire/release flag protocol of rank r.
    has_residual=False: no residual (allreduce_rmsnorm; `out` is the sum); the key of every
    residual variant is unchanged, the residual-free one ends with "nores".
    Every build has the bounded spin (timeout_ns is a runtime argument, K3FUSE_AR_TIMEOUT_S)."""
    th = pick_threads(hidden)
    key = ("lamport_ar" if flags_rank is None else "flag_ar", 2, world, hidden, max_tokens, th,
           has_addend, has_norm, io_dtype, w_dtype, pdl, flags_rank) + (() if has_residual else ("nores",))

    def build():
        C = compat.TORCH2CUTE
        H, MT = hidden, max_tokens
        ft = compat.fake_tensor
        data = ft(cutlass.Float32, (NBUF, world, MT, H), (world * MT * H, MT * H, H, 1))
        gen = ft(cutlass.Int64, (4,), (1,), align=8)          # int64 protocol words
        row = lambda dt: ft(C[dt], (cute.sym_int(), H), (H, 1))
        nw = ft(C[w_dtype], (H,), (1,))
        err = ft(cutlass.Int32, (4,), (1,), align=4)          # code, missing peer, norm?, row
        flg = [ft(cutlass.Int64, (world, MT), (MT, 1), align=8) for _ in range(MAX_WORLD)]  # int64 epochs
        k = LamportArResidualNorm(world, hidden, max_tokens, th, has_addend, has_norm, pdl,
                                  flags_rank, has_residual)
        return (k, data, *flg, gen, row(io_dtype), row(io_dtype), nw, row(io_dtype), row(io_dtype), err,
                Float32(1e-5), Int64(0), compat.fake_stream())

    return key, build
