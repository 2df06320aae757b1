"""CuTe DSL one-shot all-reduce + residual (+ RMSNorm) over unicast peer memory (no multicast).

Why: a decode all-reduce of [T, 7168] is latency-bound; NCCL plus separate add and norm kernels
cost tens of µs. Here each rank's fp32 GEMM partial (in a local staging buffer) is pushed with
plain 16-byte stores into slot [rank] of every rank's symmetric buffer, published with a
system-scope release flag per (source rank, token row); each rank acquires the W flags of its
row, sums the W slots in fixed rank order 0..W-1 in fp32 (so every rank gets bitwise the same
result), adds the residual (and addend), writes `out` and, optionally, RMSNorm of the fp32 sum
times the weight (the reference's rounding points).

Protocol state lives in device memory so CUDA-graph replays stay correct: `gen[0]` (generation)
selects the data parity (gen & 1) and the flag value gen + 1 (flags only grow, compared with a
signed difference, so a fast peer one generation ahead cannot hide a flag); the last CTA to finish
(`gen[1]` arrival counter) advances the generation. Two parities suffice: a rank can reach
generation g + 2 only after every peer has pushed g + 1, which each does after finishing g.
Debug builds bound the spin with %globaltimer and report a timeout in `err[0]` instead of hanging.
"""
from __future__ import annotations

from .compat import SELF as compat

VEC = 4  # fp32 per 16-byte access
MAX_WORLD = 8

if compat.HAVE_CUTE:
    import cutlass
    from cutlass import Float32, Int32, Int64, const_expr

    cute = compat.cute

    class OneShotArResidualNorm:
        """One CTA per token row; `threads` each own H / (4 * threads) float4 chunks of the row."""

        def __init__(self, world: int, rank: int, hidden: int, max_tokens: int, threads: int,
                     has_addend: bool, has_norm: bool, debug_timeout: bool):
            assert 1 <= world <= MAX_WORLD and hidden % (VEC * threads) == 0
            self.world, self.rank, self.H, self.max_t = world, rank, hidden, max_tokens
            self.threads, self.vpt = threads, hidden // (VEC * threads)
            self.has_addend, self.has_norm, self.debug = has_addend, has_norm, debug_timeout
            self.num_warps = threads // 32

        @cute.jit
        def __call__(self, stage: cute.Tensor,
                     d0: cute.Tensor, d1: cute.Tensor, d2: cute.Tensor, d3: cute.Tensor,
                     d4: cute.Tensor, d5: cute.Tensor, d6: cute.Tensor, d7: cute.Tensor,
                     f0: cute.Tensor, f1: cute.Tensor, f2: cute.Tensor, f3: cute.Tensor,
                     f4: cute.Tensor, f5: cute.Tensor, f6: cute.Tensor, f7: cute.Tensor,
                     gen: cute.Tensor, residual: cute.Tensor, addend: cute.Tensor,
                     norm_w: cute.Tensor, out: cute.Tensor, normed: cute.Tensor, err: cute.Tensor,
                     eps: Float32, timeout_ns: Int64, stream):
            self.kernel(stage, d0, d1, d2, d3, d4, d5, d6, d7, f0, f1, f2, f3, f4, f5, f6, f7,
                        gen, residual, addend, norm_w, out, normed, err, eps, timeout_ns).launch(
                grid=(stage.shape[0], 1, 1), block=(self.threads, 1, 1), stream=stream)

        @cute.kernel
        def kernel(self, stage: cute.Tensor,
                   d0: cute.Tensor, d1: cute.Tensor, d2: cute.Tensor, d3: cute.Tensor,
                   d4: cute.Tensor, d5: cute.Tensor, d6: cute.Tensor, d7: cute.Tensor,
                   f0: cute.Tensor, f1: cute.Tensor, f2: cute.Tensor, f3: cute.Tensor,
                   f4: cute.Tensor, f5: cute.Tensor, f6: cute.Tensor, f7: cute.Tensor,
                   gen: cute.Tensor, residual: cute.Tensor, addend: cute.Tensor,
                   norm_w: cute.Tensor, out: cute.Tensor, normed: cute.Tensor, err: cute.Tensor,
                   eps: Float32, timeout_ns: Int64):
            W: cutlass.Constexpr = self.world
            RANK: cutlass.Constexpr = self.rank
            TH: cutlass.Constexpr = self.threads
            VPT: cutlass.Constexpr = self.vpt
            datas = [d0, d1, d2, d3, d4, d5, d6, d7]
            flags = [f0, f1, f2, f3, f4, f5, f6, f7]
            tidx, _, _ = cute.arch.thread_idx()
            t, _, _ = cute.arch.block_idx()
            nblk, _, _ = cute.arch.grid_dim()
            warp = cute.arch.warp_idx()
            lane = cute.arch.lane_idx()

            g = gen[0]
            p = g & 1
            fv = g + 1

            # 1. push this rank's partial row into slot [RANK] of every rank (remote writes)
            srow = cute.zipped_divide(stage[t, None], (VEC,))
            for j in cutlass.range_constexpr(VPT):
                c = tidx + j * TH
                v = cute.make_rmem_tensor((VEC,), Float32)
                cute.autovec_copy(srow[None, c], v)
                for r in cutlass.range_constexpr(W):
                    dst = cute.zipped_divide(datas[r][p, RANK, t, None], (VEC,))
                    cute.autovec_copy(v, dst[None, c])
            compat.fence_acq_rel_sys()
            cute.arch.sync_threads()
            # 2. publish: one release flag per destination rank for (RANK, t)
            for r in cutlass.range_constexpr(W):
                if tidx == r:
                    compat.st_release_sys_s32(flags[r].iterator + (RANK * self.max_t + t), fv)
            # 3. wait: thread r acquires the flag of source rank r for row t
            if tidx < W:
                fptr = flags[RANK].iterator + (tidx * self.max_t + t)
                cur = compat.ld_acquire_sys_s32(fptr)
                waiting = Int32(0)
                if cur - fv < 0:
                    waiting = Int32(1)
                if const_expr(self.debug):
                    start = compat.globaltimer_ns()
                    while waiting != 0:
                        cur = compat.ld_acquire_sys_s32(fptr)
                        if cur - fv >= 0:
                            waiting = Int32(0)
                        if compat.globaltimer_ns() - start > timeout_ns:
                            err[0] = Int32(1) + tidx
                            waiting = Int32(0)
                else:
                    while waiting != 0:
                        cur = compat.ld_acquire_sys_s32(fptr)
                        if cur - fv >= 0:
                            waiting = Int32(0)
            cute.arch.sync_threads()

            # 4. fixed-order fp32 sum + residual (+ addend) -> out; keep the bf16 row for the norm
            local = datas[RANK]
            rrow = cute.zipped_divide(residual[t, None], (VEC,))
            orow = cute.zipped_divide(out[t, None], (VEC,))
            arow = cute.zipped_divide(addend[t, None], (VEC,))
            outs = []
            ss = Float32(0.0)
            for j in cutlass.range_constexpr(VPT):
                c = tidx + j * TH
                acc = cute.make_rmem_tensor((VEC,), Float32)
                cute.autovec_copy(cute.zipped_divide(local[p, 0, t, None], (VEC,))[None, c], acc)
                s = acc.load()
                for r in cutlass.range_constexpr(1, W):
                    nxt = cute.make_rmem_tensor((VEC,), Float32)
                    cute.autovec_copy(cute.zipped_divide(local[p, r, t, None], (VEC,))[None, c], nxt)
                    s = s + nxt.load()
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
                    keep = cute.make_rmem_tensor((VEC,), Float32)
                    keep.store(s)
                    outs.append(keep)

            # 5. RMSNorm of the fp32 row (block reduction of the sum of squares)
            if const_expr(self.has_norm):
                smem = compat.SmemAllocator()
                red = smem.allocate_tensor(Float32, cute.make_layout((self.num_warps,)), byte_alignment=16)
                ws = cute.arch.warp_reduction_sum(ss)
                if lane == 0:
                    red[warp] = ws
                cute.arch.sync_threads()
                tot = Float32(0.0)
                for wi in cutlass.range_constexpr(self.num_warps):
                    tot = tot + red[wi]
                rstd = cute.math.rsqrt(tot / Float32(self.H) + eps)
                wrow = cute.zipped_divide(norm_w, (VEC,))
                nrow = cute.zipped_divide(normed[t, None], (VEC,))
                for j in cutlass.range_constexpr(VPT):
                    c = tidx + j * TH
                    wv = cute.make_rmem_tensor((VEC,), norm_w.element_type)
                    cute.autovec_copy(wrow[None, c], wv)
                    nv = cute.make_rmem_tensor((VEC,), normed.element_type)
                    nv.store(((outs[j].load() * rstd) * wv.load().to(Float32)).to(normed.element_type))
                    cute.autovec_copy(nv, nrow[None, c])

            # 6. the last CTA to finish advances the generation (graph-replay safe)
            cute.arch.sync_threads()
            if tidx == 0:
                old = compat.atom_add_acq_rel_gpu_s32(gen.iterator + 1, Int32(1))
                if old == nblk - 1:
                    gen[1] = Int32(0)
                    gen[0] = g + 1


def pick_threads(hidden: int) -> int | None:
    for th in (256, 224, 192, 128, 512, 96, 64):
        if hidden % (VEC * th) == 0 and hidden // (VEC * th) <= 16:
            return th
    return None


def builder(world, rank, hidden, max_tokens, has_addend, has_norm, debug, io_dtype, w_dtype):
    """(key, build) for compat.compiled / compat.compile_to_ptx_on_cpu."""
    th = pick_threads(hidden)
    key = ("oneshot_ar", world, rank, hidden, max_tokens, th, has_addend, has_norm, debug, io_dtype, w_dtype)

    def build():
        C = compat.TORCH2CUTE
        H, MT = hidden, max_tokens
        ft = compat.fake_tensor
        stage = ft(cutlass.Float32, (cute.sym_int(), H), (H, 1))
        datas = [ft(cutlass.Float32, (2, world, MT, H), (world * MT * H, MT * H, H, 1)) for _ in range(MAX_WORLD)]
        flg = [ft(cutlass.Int32, (world, MT), (MT, 1), align=4) for _ in range(MAX_WORLD)]
        gen = ft(cutlass.Int32, (2,), (1,), align=4)
        row = lambda dt: ft(C[dt], (cute.sym_int(), H), (H, 1))
        nw = ft(C[w_dtype], (H,), (1,))
        err = ft(cutlass.Int32, (1,), (1,), align=4)
        k = OneShotArResidualNorm(world, rank, hidden, max_tokens, th, has_addend, has_norm, debug)
        return (k, stage, *datas, *flg, gen, row(io_dtype), row(io_dtype), nw, row(io_dtype),
                row(io_dtype), err, Float32(1e-5), Int64(0), compat.fake_stream())

    return key, build
