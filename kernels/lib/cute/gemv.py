"""CuTe DSL small-matrix decode GEMM (dot-product GEMV) for 1..8 tokens.

Why: at 1-2 tokens a decode GEMM is a pure weight stream (about 1 FLOP per byte); tensor cores
do not help and cuBLAS leaves 20-50 % of the bandwidth unused on skinny shapes. Each CTA owns
`rows` output columns (rows of W), its threads stride over K in 16-byte chunks (8 bf16), all
loads of a thread are issued before its FMAs (K is static, the loop is unrolled), fp32
accumulation, warp shuffle then shared-memory reduction, bias and cast in the epilogue.

y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]);  M, K static per compiled kernel, N dynamic.
"""
from __future__ import annotations

import torch

from .compat import SELF as compat

VEC = 8  # bf16 per 16-byte load

if compat.HAVE_CUTE:
    import cutlass
    from cutlass import Float32, const_expr

    cute = compat.cute

    class DecodeGemv:
        """One CTA computes `rows` outputs for all M tokens; `threads` stride over K/8 chunks."""

        def __init__(self, M: int, K: int, rows: int, threads: int, has_bias: bool,
                     push: tuple[int, int] | None = None):
            assert K % VEC == 0 and (K // VEC) % threads == 0 and threads % 32 == 0
            self.M, self.K, self.rows, self.threads, self.has_bias = M, K, rows, threads, has_bias
            self.iters = (K // VEC) // threads
            self.num_warps = threads // 32
            # push=(world, rank): write fp32 results into slot [rank] of buffer gen%3 of every
            # rank's Lamport buffer (oneshot_epilogue.py) instead of mY; never the sentinel -0.0
            self.push = push

        @cute.jit
        def __call__(self, mX: cute.Tensor, mW: cute.Tensor, mB: cute.Tensor, mY: cute.Tensor,
                     d0: cute.Tensor, d1: cute.Tensor, d2: cute.Tensor, d3: cute.Tensor,
                     d4: cute.Tensor, d5: cute.Tensor, d6: cute.Tensor, d7: cute.Tensor,
                     gen: cute.Tensor, stream):
            n_blocks = mW.shape[0] // self.rows
            self.kernel(mX, mW, mB, mY, d0, d1, d2, d3, d4, d5, d6, d7, gen).launch(
                grid=(n_blocks, 1, 1), block=(self.threads, 1, 1), stream=stream)

        @cute.kernel
        def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mB: cute.Tensor, mY: cute.Tensor,
                   d0: cute.Tensor, d1: cute.Tensor, d2: cute.Tensor, d3: cute.Tensor,
                   d4: cute.Tensor, d5: cute.Tensor, d6: cute.Tensor, d7: cute.Tensor,
                   gen: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            warp = cute.arch.warp_idx()
            lane = cute.arch.lane_idx()
            if const_expr(self.push is not None):
                # the all-reduce epilogue kernel polls its data, so it may start right away (PDL)
                compat.griddep_launch_dependents()
            M: cutlass.Constexpr = self.M
            R: cutlass.Constexpr = self.rows
            n0 = bidx * R

            acc = cute.make_rmem_tensor((R * M,), Float32)
            acc.fill(0.0)
            for i in cutlass.range_constexpr(self.iters):
                c = tidx + i * self.threads
                # weights first: R independent 16-byte loads in flight per thread per step
                wv = []
                for r in cutlass.range_constexpr(R):
                    wr = cute.make_rmem_tensor((VEC,), mW.element_type)
                    cute.autovec_copy(cute.zipped_divide(mW[n0 + r, None], (VEC,))[None, c], wr)
                    wv.append(wr)
                xv = []
                for m in cutlass.range_constexpr(M):
                    a = cute.make_rmem_tensor((VEC,), mX.element_type)
                    cute.autovec_copy(cute.zipped_divide(mX[m, None], (VEC,))[None, c], a)
                    xv.append(a)
                xf = [xv[m].load().to(Float32) for m in range(M)]   # convert x once per chunk
                for r in cutlass.range_constexpr(R):
                    wf = wv[r].load().to(Float32)
                    for m in cutlass.range_constexpr(M):
                        prod = xf[m] * wf
                        acc[r * M + m] = acc[r * M + m] + prod.reduce(
                            cute.ReductionOp.ADD, Float32(0.0), 0)

            smem = compat.SmemAllocator()
            red = smem.allocate_tensor(
                Float32, cute.make_layout((R * M, self.num_warps), stride=(self.num_warps, 1)),
                byte_alignment=16)
            for j in cutlass.range_constexpr(R * M):
                v = cute.arch.warp_reduction_sum(acc[j])
                if lane == 0:
                    red[j, warp] = v
            cute.arch.sync_threads()
            if tidx < R * M:
                tot = Float32(0.0)
                for wi in cutlass.range_constexpr(self.num_warps):
                    tot = tot + red[tidx, wi]
                r = tidx // M
                m = tidx - r * M
                if const_expr(self.has_bias):
                    tot = tot + mB[n0 + r].to(Float32)
                if const_expr(self.push is None):
                    mY[m, n0 + r] = tot.to(mY.element_type)
                else:
                    datas = [d0, d1, d2, d3, d4, d5, d6, d7]
                    b = gen[3]   # buffer index in {0, 1, 2}, rotated by the epilogue (never g % 3)
                    if tot == Float32(0.0):      # -0.0 is the "not written" sentinel
                        tot = Float32(0.0)
                    for dst in cutlass.range_constexpr(self.push[0]):
                        datas[dst][b, self.push[1], m, n0 + r] = tot


def pick_config(M: int, N: int, K: int) -> tuple[int, int] | None:
    """(rows, threads) for this shape, or None when the GEMV does not apply.

    Measured table first (gemv_tuned.py, M rounded up to 1, 2 or 4); otherwise threads divides
    K/8 so the K loop has no tail and rows keeps rows*iters loads per thread modest.
    """
    if K % VEC or M < 1:
        return None
    from .gemv_tuned import TUNED

    for mm in (1, 2, 4, 8):
        if mm >= M:
            cfg = TUNED.get((N, K, mm))
            if cfg is not None and N % cfg[0] == 0 and cfg[0] * M <= 32 and (K // VEC) % cfg[1] == 0:
                return cfg
            break
    chunks = K // VEC
    threads = next((t for t in (128, 256, 192, 224, 160, 96, 64, 32) if chunks % t == 0 and chunks // t <= 12), None)
    if threads is None:
        return None
    iters = chunks // threads
    for rows in ((4, 2, 1) if iters <= 4 else (2, 1)):
        if N % rows == 0 and rows * M <= 32:
            return rows, threads
    return None


def builder(M, K, rows, threads, x_dtype=torch.bfloat16, w_dtype=torch.bfloat16,
            y_dtype=torch.bfloat16, has_bias=False, b_dtype=None, push=None):
    """(key, build) for compat.compiled / compat.compile_to_ptx_on_cpu.

    push=(world, rank, max_tokens, N): compile the Lamport-push epilogue (N static then).
    """
    b_dtype = b_dtype or w_dtype
    key = ("decode_gemv", M, K, rows, threads, x_dtype, w_dtype, b_dtype, y_dtype, has_bias, push)

    def build():
        C = compat.TORCH2CUTE
        n = cute.sym_int() if push is None else push[3]
        x = compat.fake_tensor(C[x_dtype], (M, K), (K, 1))
        w = compat.fake_tensor(C[w_dtype], (n, K), (K, 1))
        b = compat.fake_tensor(C[b_dtype], (cute.sym_int(),), (1,), align=b_dtype.itemsize)
        y = compat.fake_tensor(C[y_dtype], (M if push is None else cute.sym_int(), cute.sym_int()),
                               (cute.sym_int64(), 1), align=y_dtype.itemsize)
        if push is None:
            ds = [compat.fake_tensor(cutlass.Float32, (cute.sym_int(),), (1,), align=4) for _ in range(8)]
        else:
            W, _, MT, N = push
            ds = [compat.fake_tensor(cutlass.Float32, (3, W, MT, N), (W * MT * N, MT * N, N, 1))
                  for _ in range(8)]
        if push is None:   # unused: a 16-byte int32 scratch
            gen = compat.fake_tensor(cutlass.Int32, (cute.sym_int(),), (1,), align=4)
        else:              # the workspace's int64 protocol words (kernels/collective.py)
            gen = compat.fake_tensor(cutlass.Int64, (4,), (1,), align=8)
        k = DecodeGemv(M, K, rows, threads, has_bias, None if push is None else push[:2])
        return (k, x, w, b, y, *ds, gen, compat.fake_stream())

    return key, build


_dummy: dict = {}


def _scratch(device: torch.device) -> torch.Tensor:
    """A 16-byte-aligned int32 scratch tensor for the unused push arguments."""
    t = _dummy.get(device)
    if t is None:
        t = _dummy[device] = torch.zeros(4, dtype=torch.int32, device=device)
    return t


def run(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None,
        config: tuple[int, int] | None = None) -> torch.Tensor:
    """y = x @ weight.T (+ bias) through the compiled GEMV (call `supports` first).

    `config` = (rows, threads) overrides the table (sweeps only).
    """
    out_dtype = out_dtype or x.dtype
    M, K = x.shape
    N = weight.shape[0]
    rows, threads = config or pick_config(M, N, K)
    if out is None:
        out = torch.empty((M, N), dtype=out_dtype, device=x.device)
    if M == 1 and x.stride(0) != K:   # a size-1 dim may carry any stride; the kernel's is static
        x = x.as_strided((1, K), (K, 1))
    has_bias = bias is not None
    b = bias if has_bias else weight[0, :1]
    key, build = builder(M, K, rows, threads, x.dtype, weight.dtype, out.dtype, has_bias, b.dtype)
    sc = _scratch(x.device)
    scf = sc.view(torch.float32)
    compat.compiled(key, build)(x, weight, b, out, *([scf] * 8), sc)
    return out


def run_push(x: torch.Tensor, weight: torch.Tensor, datas: list[torch.Tensor], gen: torch.Tensor,
             rank: int, max_tokens: int) -> None:
    """Lamport push: y = x @ weight.T written (fp32) into slot [rank] of every rank's buffer."""
    M, K = x.shape
    N = weight.shape[0]
    W = len(datas)
    rows, threads = pick_config(M, N, K)
    if M == 1 and x.stride(0) != K:
        x = x.as_strided((1, K), (K, 1))
    scf = _scratch(x.device).view(torch.float32)
    key, build = builder(M, K, rows, threads, x.dtype, weight.dtype, torch.float32, False, weight.dtype,
                         push=(W, rank, max_tokens, N))
    padded = list(datas) + [datas[rank]] * (8 - W)
    compat.compiled(key, build)(x, weight, weight[0, :1], scf.view(1, 4), *padded, gen)
