"""CuTe DSL W4A16 expert GEMMs for decode (MXFP4, int4): each warp streams 16 weight rows, mma.sync on registers.

The two weight-streaming launches of the routed experts over MXFP4 weights (K3's) or int4 ones with bf16
group scales (compressed-tensors pack-quantized, Kimi K2.x's); lib/composite/routed_experts_w4a16.py puts
them in sequence with the Triton grouping and SiTU-GLU (lib/triton/routed_experts_w4a16.py), whose numerics
this matches. Why not Triton: there the dequantized weights reach the MMA through layout conversions and a
wait on every wgmma (docs/perf/2026-12-02-w4a16-triton.md 0g); here a thread's packed bytes are its own MMA
fragment and nothing else runs in the loop.

Per warp, 16 rows of W (rows r and r + 8, r = lane / 4) by a group's pairs, 8 at a time (the mma's N):
- a thread (r, t = lane % 4) loads 16 bytes of each of its two rows a step of 128 elements: elements
  32t .. 32t + 31, one group, so one scale a row a step (MXFP4 an E8M0 byte, int4 a bf16);
- each int32 word (8 nibbles, both formats element m at bits 4m) dequantizes to four bf16x2 registers,
  register j holding elements j and j + 4; MXFP4: mask, multiply, mask (the E2M1 value * 2^-126 as a
  bf16 pattern), then a bf16x2 multiply by 2^(s - 1), or two for a scale of 2^1 and more; int4: shift,
  mask | 0x4300 (bf16 128 + nibble), minus 136, times the scale. Each exact: the model's dequantized
  weight bit for bit. Word i feeds mmas 2i and 2i + 1;
- the activations come in `word_order` (position 8w + 2j + h holds element 8w + j + 4h), so a 32-bit
  load is the B fragment that register j meets: the dot's sum over k is the same, in another order;
- m16n8k16 bf16 mma.sync, fp32 accumulation.

The weights in flight: the CTA's work is a stream of spans (a tile's rows by a chunk of 8 pairs), and
each thread keeps `stages - 1` steps of its own weight and scale bytes in flight by cp.async into its
own shared-memory slots, across span boundaries (a ring); it reads back only what it copied, so no
barrier is needed, and the loads do not wait on the mmas. With `blocked`, the tables are
k3fuse.quant.block_order's (a row block's step one contiguous piece): the same copies at other
addresses, a warp's copy of a step 512 contiguous bytes rather than 8 rows' 64
(docs/perf/2026-12-06-w4a16-block-order.md 0x).

Launches (`GateUp`, `Down`): grid (row blocks, groups, K splits), a group's row blocks side by side. The
gate/up streams w1's row blocks then w3's into fp32 partials gu [split, P, 2I]; the down n_tiles row
blocks of w2 a CTA, rounded to bf16 into z [P, L]. Expert ids outside [0, E) are left out.
- Pairwise (each pair its own group, at few tokens): each CTA stages its pair's activation row in shared
  memory, in word order, with its first weight stages in flight: the gate/up a's row (natural order),
  the down h = the SiTU-GLU of the gate/up's partials, so that the op is these two launches alone
  (docs/perf/2026-12-05-w4a16-staged-launches.md 0q).
- Grouped (`rows` / `groups` from the Triton grouping): the activations in global memory in quad order
  too (word 4t + i of a step at 4i + t: a quad's 16-byte loads of word i are 64 contiguous bytes,
  docs/perf/2026-12-04-w4a16-one-launch-quad-order.md 0n); the down is the Triton SiTU-GLU launch's
  programmatic dependent, its first weight stages and scales in flight before it waits for that grid, h
  read after (docs/perf/2026-12-06-w4a16-grouped-launches.md 0z).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from k3fuse import quant

from .compat import SELF as compat

Format = Literal["mxfp4", "int4"]
LOG2E = 1.4426950408889634
STEP = 128  # elements of a row a thread quad covers per step (4 threads x 32: one group each)
ROWS_PER_WARP = 16
PAIRS_PER_MMA = 8
GROUPS_PER_STEP = STEP // 32  # a quad's groups a step: a row's scales of a step are one copy
#: the formats and their scale's bytes (a group of 32): MXFP4's E8M0 byte, int4's bf16
SCALE_BYTES = {"mxfp4": 1, "int4": 2}
WARPS = 4
BLOCK_ROWS = ROWS_PER_WARP * WARPS  # rows of W a CTA streams per tile
THREADS = 32 * WARPS
# block order's row block and step are a CTA's: a warp's copy of a step is one contiguous piece
assert BLOCK_ROWS == quant.BLOCK_ROWS and STEP == quant.BLOCK_STEP


@dataclass(frozen=True, kw_only=True)
class Situ:
    """The pairwise down's activations, h = situ_glu(g, u), computed by each CTA from the gate/up's fp32
    partials (`splits` of them summed), SiTU's betas fixed where the kernel is compiled."""

    beta: float
    linear_beta: float
    splits: int


@dataclass(frozen=True, kw_only=True)
class GateUp:
    """g and u = a's rows against w1 and w3 [E, I, L] in `fmt`: fp32 partial sums over `split` K spans into
    gu [split, P, 2I]. `pairwise`: a CTA's one pair, its row of a [T, L] staged in shared memory; else a
    group's pairs, x = word_order(a, quads=True) read from global memory. `stages`: the copy ring's depth."""

    fmt: Format
    I: int  # noqa: E741 (the model's name)
    L: int
    top_k: int
    split: int
    pairwise: bool
    stages: int
    blocked: bool = False

    def __post_init__(self):
        span = self.L // self.split
        if self.L % (self.split * STEP) or self.I % BLOCK_ROWS or not 2 <= self.stages <= span // STEP + 1:
            raise ValueError(f"gate/up at I={self.I}, L={self.L}: split {self.split} and ring {self.stages} need "
                             f"whole {STEP}-element steps a span, {BLOCK_ROWS}-row blocks and 2 .. steps + 1 stages")


@dataclass(frozen=True, kw_only=True)
class Down:
    """z = h's rows against w2 [E, L, I] in `fmt`, rounded to bf16 into z [P, L], `n_tiles` row blocks a CTA.
    `situ`: pairwise, each CTA computes its pair's h from the gate/up's partials; None: grouped, h [P, I] in
    quad word order from the Triton SiTU-GLU launch, whose programmatic dependent this launch is."""

    fmt: Format
    I: int  # noqa: E741
    L: int
    n_tiles: int
    situ: Situ | None
    stages: int
    blocked: bool = False

    def __post_init__(self):
        if self.I % STEP or self.L % (self.n_tiles * BLOCK_ROWS) or not 2 <= self.stages <= self.I // STEP + 1:
            raise ValueError(f"down at I={self.I}, L={self.L}: n_tiles {self.n_tiles} and ring {self.stages} need "
                             f"whole {STEP}-element steps, {BLOCK_ROWS}-row blocks a tile and 2 .. steps + 1 stages")


def e8m0_ptx(one_multiply: bool) -> str:
    """E8M0 byte $1 -> a bf16 factor in both halves of $0: one_multiply, 2^(s - 1) = 2^(s - 127) * 2^126
    (bits (s + 126) << 7, for s < 128: one multiply-add, both halves at once); else 2^(s - 127) (bits
    s << 7; s = 0 the subnormal 0x0040)."""
    if one_multiply:
        return "{\nmad.lo.u32 $0, $1, 0x00800080, 0x3F003F00;\n}"  # (s + 126) * (2^7 + 2^23)
    return ("{\n.reg .pred z;\nshl.b32 $0, $1, 7;\nsetp.eq.u32 z, $1, 0;\n@z mov.b32 $0, 0x40;\n"
            "prmt.b32 $0, $0, $0, 0x1010;\n}")


def e2m1x8_ptx(one_multiply: bool) -> str:
    """Eight E2M1 nibbles ($4) -> four bf16x2 registers ($0-$3), register j = (element j, element j + 4),
    scaled by the factor $5 (e8m0_ptx's): (sign << 15 | magnitude << 6) is E2M1 * 2^-126 as a bf16
    pattern; one_multiply, * 2^(s - 1); else * 2^126 (exact), then * 2^(s - 127).

    The pattern: the nibble pair isolated, one integer multiply (the FMA pipe) by 2^6 + 2^12 (or
    2^2 + 2^8) whose two copies put the magnitude at bits 6-8 and the sign at bit 15, a mask: 3
    integer instructions a register, 2 of them on the ALU pipe, which bounds the loop with the
    issue rate (docs/perf/2026-12-04-w4a16-cute-few-tokens.md 0l: two shifts and two masks ran 4-10%
    slower)."""
    lines = [".reg .b32 q, c, w8;", "mov.b32 c, 0x7E807E80;",
             "shr.u32 w8, $4, 8;"]  # elements 2, 3, 6, 7 where 0, 1, 4, 5 are
    for j in range(4):
        lines += [f"and.b32 q, {'$4' if j < 2 else 'w8'}, {0x000F000F << 4 * (j % 2):#010x};",
                  f"mul.lo.u32 q, q, {260 if j % 2 else 4160};", "and.b32 q, q, 0x81C081C0;"]
        lines += [f"mul.rn.bf16x2 ${j}, q, $5;"] if one_multiply else [
            "mul.rn.bf16x2 q, q, c;", f"mul.rn.bf16x2 ${j}, q, $5;"]
    return "{\n" + "\n".join(lines) + "\n}"


def int4x8_ptx() -> str:
    """Eight int4 nibbles ($4, each q + 8) -> four bf16x2 registers ($0-$3), register j = (element j,
    element j + 4), times the bf16 scale in both halves of $5: nibble | 0x4300 is bf16 128 + nibble,
    minus 136 is q exactly, one multiply rounds q * scale once (the Triton kernel's sequence: a shift,
    a mask-or (one LOP3), a subtract and a multiply a register; bf16's 7 mantissa bits leave no room
    for fp16's unshifted high-nibble trick)."""
    lines = [".reg .b32 q, c;", "mov.b32 c, 0x43084308;"]
    for j in range(4):
        lines += [f"shr.u32 q, $4, {4 * j};"] if j else []
        # (q & 0x000F000F) | 0x43004300 as one LOP3 (ptxas leaves an and and an or apart here)
        lines += [f"lop3.b32 q, {'q' if j else '$4'}, 0x000F000F, 0x43004300, 0xEA;",
                  "sub.rn.bf16x2 q, q, c;", f"mul.rn.bf16x2 ${j}, q, $5;"]
    return "{\n" + "\n".join(lines) + "\n}"



if compat.HAVE_CUTE:
    import cutlass
    from cutlass import Float32, Int32, Int64, const_expr
    from cutlass.cutlass_dsl import T, dsl_user_op

    cute = compat.cute

    @dsl_user_op
    def e8m0_bf16x2(s, one_multiply: bool, *, loc=None, ip=None) -> Int32:
        """E8M0 byte s -> its bf16 factor in both halves (e8m0_ptx)."""
        return Int32(compat.asm_pure(T.i32(), [Int32(s).ir_value(loc=loc, ip=ip)], e8m0_ptx(one_multiply), "=r,r"))

    @dsl_user_op
    def dequant_x8_bf16x2(word, factor2, text: str, *, loc=None, ip=None):
        """One int32 word's eight weights as four bf16x2 registers by `text` (e2m1x8_ptx, int4x8_ptx)."""
        st = compat.asm_pure(compat.struct_type(4, "i32"),
                             [Int32(word).ir_value(loc=loc, ip=ip), Int32(factor2).ir_value(loc=loc, ip=ip)],
                             text, "=r,=r,=r,=r,r,r")
        return compat.unpack(st, 4, Int32, loc, ip)

    def word_order_x8(v) -> tuple:
        """A 16-byte word of 8 bf16 elements (four 32-bit words) in word_order: register j holds elements
        (j, j + 4)."""
        return (compat.prmt(v[0], v[2], 0x5410), compat.prmt(v[0], v[2], 0x7632),
                compat.prmt(v[1], v[3], 0x5410), compat.prmt(v[1], v[3], 0x7632))

    def _exp(x):
        return compat.exp2(x * LOG2E)

    def _tanh(x):
        return Float32(2.0) / (Float32(1.0) + _exp(x * -2.0)) - Float32(1.0)

    def situ_glu_x8(gu_base, pair, P, w, I: int, situ: Situ) -> tuple:
        """Elements 8w .. 8w + 7 of h[pair] = situ_glu(g, u) from the fp32 partials gu [splits, P, 2I], in
        word_order (four bf16x2 words): the splits summed, g and u rounded to bf16, SiTU in fp32, each
        rounded to bf16 (the Triton SiTU-GLU's numerics)."""
        g = [Float32(0.0)] * 8
        u = [Float32(0.0)] * 8
        for s in range(situ.splits):
            at = gu_base + ((Int64(s) * P + pair) * (2 * I) + 8 * w) * 4
            for half in range(2):
                gv = compat.ld_nc_v4(at + 16 * half)
                uv = compat.ld_nc_v4(at + I * 4 + 16 * half)
                for j in range(4):
                    g[4 * half + j] = g[4 * half + j] + compat.b32_as_f32(gv[j])
                    u[4 * half + j] = u[4 * half + j] + compat.b32_as_f32(uv[j])
        act = []
        for j in range(8):
            gr = compat.round_bf16(g[j])
            ur = compat.round_bf16(u[j])
            sigmoid = Float32(1.0) / (Float32(1.0) + _exp(-gr))
            act.append(situ.beta * _tanh(gr / situ.beta) * sigmoid * (situ.linear_beta * _tanh(ur / situ.linear_beta)))
        return tuple(compat.bf16x2(act[j], act[j + 4]) for j in range(4))

    class W4A16RowsDot:
        """out[pair, n] = sum_k x[xrow(pair), k] * W[e, n, k] over one K span, W in `fmt` (MXFP4, int4 with
        bf16 scales), bf16 x in word order: one launch, a `GateUp` or a `Down`."""

        def __init__(self, launch: GateUp | Down):
            self.fmt, self.stages, self.blocked = launch.fmt, launch.stages, launch.blocked
            self.gate_up = isinstance(launch, GateUp)
            if self.gate_up:  # blocks of w1, then of w3, into gu's columns [0, I) and [I, 2I)
                self.N, self.K, self.k_span = launch.I, launch.L, launch.L // launch.split
                self.top_k, self.n_tiles, self.pairwise, self.situ = launch.top_k, 1, launch.pairwise, None
                self.col_b, self.out_stride = launch.I, 2 * launch.I
            else:  # (the activations' rows are pairs)
                self.N, self.K, self.k_span = launch.L, launch.I, launch.I
                self.top_k, self.n_tiles, self.situ = 1, launch.n_tiles, launch.situ
                self.pairwise = launch.situ is not None
                self.col_b, self.out_stride = 0, launch.L
            self.scale_row = self.K // 32 * SCALE_BYTES[self.fmt]  # bytes of a row's scales
            self.scale_step = GROUPS_PER_STEP * SCALE_BYTES[self.fmt]  # bytes of a row's scales a step, one copy
            self.blocks_a = self.N // BLOCK_ROWS
            self.grid_y = (2 if self.gate_up else 1) * self.blocks_a // self.n_tiles
            # grouped, the down reads h after the SiTU-GLU launch's grid (PDL): plain loads, never read-only
            # ones, which may move above the wait
            self.after_grid = not (self.gate_up or self.pairwise)

        @cute.jit
        def __call__(self, mX: cute.Tensor, mWa: cute.Tensor, mSa: cute.Tensor, mWb: cute.Tensor,
                     mSb: cute.Tensor, mOut: cute.Tensor, mExperts: cute.Tensor, mRows: cute.Tensor,
                     mGroups: cute.Tensor, stream):
            P = mExperts.shape[0]
            E = mSa.shape[0] // self.N
            groups = P
            if const_expr(not self.pairwise):
                groups = cutlass.min(P, E)
            self.kernel(mX, mWa, mSa, mWb, mSb, mOut, mExperts, mRows, mGroups).launch(
                grid=(self.grid_y, groups, self.K // self.k_span), block=(THREADS, 1, 1), stream=stream,
                use_pdl=self.after_grid)

        @cute.kernel
        def kernel(self, mX: cute.Tensor, mWa: cute.Tensor, mSa: cute.Tensor, mWb: cute.Tensor,
                   mSb: cute.Tensor, mOut: cute.Tensor, mExperts: cute.Tensor, mRows: cute.Tensor,
                   mGroups: cute.Tensor):
            """One CTA: row blocks `col` of group `gid` over K span `split` (a group's row blocks launched side
            by side, docs/perf/2026-12-04-w4a16-ncu-combine-conv.md 0m); the group's size 0 (an expert id
            outside [0, E)): nothing done."""
            tidx, _, _ = cute.arch.thread_idx()
            smem = compat.SmemAllocator()
            # the staged row (pairwise) right after the ring, whose bytes are whole 16-byte words
            ring = compat.smem_address(smem.allocate_array(cutlass.Uint8, self.smem_bytes() + self.x_stage_bytes()))
            x_smem = ring + self.smem_bytes()
            col, gid, split = cute.arch.block_idx()
            P = mExperts.shape[0]
            E = mSa.shape[0] // self.N

            e = Int64(0)
            first = Int32(0)
            size = Int32(0)
            if const_expr(self.pairwise):
                e = Int64(mExperts[gid])
                first = gid
                if e >= 0:
                    if e < E:
                        size = Int32(1)
            else:
                if gid < mGroups[0]:
                    e = Int64(mGroups[1 + gid])
                    first = mGroups[1 + P + gid]
                    size = mGroups[1 + 2 * P + gid]

            # which matrix (gate/up: w1's blocks, then w3's) and its output columns
            w_base = compat.address(mWa.iterator)
            s_base = compat.address(mSa.iterator)
            block = col * self.n_tiles
            col_off = Int32(0)
            if const_expr(self.gate_up):
                if col >= self.blocks_a // self.n_tiles:
                    w_base = compat.address(mWb.iterator)
                    s_base = compat.address(mSb.iterator)
                    block = (col - self.blocks_a // self.n_tiles) * self.n_tiles
                    col_off = Int32(self.col_b)
            x_base = compat.address(mX.iterator)
            o_base = compat.address(mOut.iterator)
            k_begin = split * self.k_span

            acc = cute.make_rmem_tensor((4,), Float32)
            if size > 0:
                self._ring(acc, w_base, s_base, x_base, o_base, block, col_off, k_begin, e, first, size, split, P,
                           mRows, tidx, ring, x_smem)

        @cute.jit
        def _ring(self, acc, w_base, s_base, x_base, o_base, block, col_off, k_begin, e, first, size, split, P,
                  mRows, tidx, ring, x_smem):
            """The CTA's work as a stream of spans (a tile's rows by a chunk of 8 pairs, K steps each), the
            weights and scales `stages - 1` steps ahead in flight by cp.async, across span boundaries:
            each thread copies its own bytes into its own shared-memory slots and reads them back, so no
            barrier is needed."""
            D: cutlass.Constexpr = self.stages
            N: cutlass.Constexpr = self.N
            K: cutlass.Constexpr = self.K
            SLOT: cutlass.Constexpr = self._slot()
            lane = tidx % 32
            t = lane % 4
            row_a = block * BLOCK_ROWS + (tidx // 32) * ROWS_PER_WARP + lane // 4
            # this thread's bytes of row a at the span's first step (row b is 8 rows on): its row block's, then
            # its row's in the block, its span's first step's and its own 16 bytes
            local = row_a - block * BLOCK_ROWS
            block_at = e * N + block * BLOCK_ROWS
            w_at = w_base + block_at * (K // 2) + local * self._w_row() + k_begin // STEP * self._w_step() + 16 * t
            s_at = s_base + block_at * self.scale_row + local * self._s_row() + k_begin // STEP * self._s_step()
            for i in cutlass.range_constexpr(D - 1):  # the first span's first steps (D - 1 <= its steps)
                self._issue(ring + i * SLOT, tidx, w_at + i * self._w_step(), s_at + i * self._s_step())
                compat.cp_async_commit()
            if const_expr(self.pairwise):  # the weights above in flight while the row is staged
                self._stage_x(x_base, x_smem, first, P, k_begin, tidx)
                x_base = Int64(x_smem)

            # MXFP4: one bf16 multiply a register unless a scale of the CTA's rows is 2^1 or more (real
            # checkpoints' are far below): read while the first stages land, a warp-uniform choice of loop
            bits = Int32(0)
            if const_expr(self.fmt == "mxfp4"):
                for row_tile in cutlass.range(self.n_tiles, unroll=1):
                    bits = bits | self._scale_bits(s_at + row_tile * self._block_scales(), t)
            if const_expr(self.after_grid):  # the weights above in flight; h only after the SiTU-GLU's grid
                compat.griddep_wait()
            if const_expr(self.fmt == "int4"):  # one multiply a register at every scale
                self._stream(acc, x_base, o_base, col_off, k_begin, first, size, split, P, mRows, tidx, row_a,
                             ring, w_at, s_at, True)
            elif compat.warp_any(bits & -2139062144) == 0:  # 0x80808080: bit 7 of each byte
                self._stream(acc, x_base, o_base, col_off, k_begin, first, size, split, P, mRows, tidx, row_a,
                             ring, w_at, s_at, True)
            else:
                self._stream(acc, x_base, o_base, col_off, k_begin, first, size, split, P, mRows, tidx, row_a,
                             ring, w_at, s_at, False)

        @cute.jit
        def _stream(self, acc, x_base, o_base, col_off, k_begin, first, size, split, P, mRows, tidx, row_a, ring,
                    w_at, s_at, one_multiply: cutlass.Constexpr):
            """Span by span: its B column and zeroed accumulators, its steps (each issuing the step
            `stages - 1` ahead: of this span, then of the next), its outputs."""
            D: cutlass.Constexpr = self.stages
            S: cutlass.Constexpr = self.k_span // STEP
            SLOT: cutlass.Constexpr = self._slot()
            lane = tidx % 32
            r = lane // 4
            t = lane % 4
            chunks = (size + PAIRS_PER_MMA - 1) // PAIRS_PER_MMA
            spans = self.n_tiles * chunks
            chunk = Int32(0)
            row = row_a
            p_slot = Int32((D - 1) * SLOT)
            c_slot = Int32(0)
            for g in cutlass.range(spans, unroll=1):
                m0 = chunk * PAIRS_PER_MMA
                # lanes past the group read its last pair: their column is computed, never stored
                n = first + cutlass.min(m0 + r, size - 1)
                pair = n
                if const_expr(not self.pairwise):
                    pair = mRows[n]
                x_at = self._x_at(x_base, pair, k_begin, t)
                for i in cutlass.range_constexpr(4):
                    acc[i] = Float32(0.0)
                # the next span: the same rows for the next chunk, else the next tile's
                next_chunk = chunk + 1
                next_w = w_at
                next_s = s_at
                next_row = row
                if next_chunk == chunks:
                    next_chunk = Int32(0)
                    next_w = w_at + self._block_bytes()
                    next_s = s_at + self._block_scales()
                    next_row = row + BLOCK_ROWS
                has_next = g + 1 < spans
                for s in cutlass.range(S - (D - 1), unroll=1):  # issuing this span's later steps
                    self._issue_step(ring + p_slot, tidx, w_at, s_at, s + D - 1)
                    p_slot, c_slot = self._step(acc, x_at + s * (STEP * 2), ring, tidx, t, p_slot, c_slot,
                                                one_multiply)
                for s in cutlass.range(S - (D - 1), S, unroll=1):  # issuing the next span's first steps
                    if has_next:
                        self._issue_step(ring + p_slot, tidx, next_w, next_s, s - (S - (D - 1)))
                    p_slot, c_slot = self._step(acc, x_at + s * (STEP * 2), ring, tidx, t, p_slot, c_slot,
                                                one_multiply)
                self._store(acc, o_base, split, P, col_off, row, first, m0, size, t, mRows)
                chunk = next_chunk
                w_at = next_w
                s_at = next_s
                row = next_row

        def _x_at(self, x_base, pair, k_begin, t):
            """This thread's word 0 of a span's first step (group t's first 8 elements, in word order): in the
            staged row (shared memory) the span's words from 0, else in pair's row of x (quad order)."""
            if self.pairwise:
                return x_base + 64 * t
            return x_base + (Int64(pair // self.top_k) * self.K + k_begin + 8 * t) * 2

        def _block_bytes(self) -> int:
            """A row block's packed bytes: from a row's step 0 to the next block's."""
            return BLOCK_ROWS * (self.K // 2)

        def _block_scales(self) -> int:
            """A row block's scale bytes."""
            return BLOCK_ROWS * self.scale_row

        def _w_step(self) -> int:
            """Bytes from a row's weights of one step to the next step's: the next 64 in its row, or blocked,
            past the block's step (every row's 64)."""
            return (BLOCK_ROWS if self.blocked else 1) * (STEP // 2)

        def _w_row(self) -> int:
            """Bytes from a row's weights of a step to the next row's: a table row, or blocked, 64."""
            return STEP // 2 if self.blocked else self.K // 2

        def _s_step(self) -> int:
            """Bytes from a row's scales of one step to the next step's (as _w_step)."""
            return (BLOCK_ROWS if self.blocked else 1) * self.scale_step

        def _s_row(self) -> int:
            """Bytes from a row's scales of a step to the next row's (as _w_row)."""
            return self.scale_step if self.blocked else self.scale_row

        @cute.jit
        def _step(self, acc, x_at, ring, tidx, t, p_slot, c_slot, one_multiply: cutlass.Constexpr):
            """_consume the stage at c_slot; the slots move on."""
            D: cutlass.Constexpr = self.stages
            SLOT: cutlass.Constexpr = self._slot()
            self._consume(acc, x_at, ring + c_slot, tidx, t, one_multiply)
            p_slot = p_slot + SLOT
            if p_slot == D * SLOT:
                p_slot = Int32(0)
            c_slot = c_slot + SLOT
            if c_slot == D * SLOT:
                c_slot = Int32(0)
            return p_slot, c_slot

        @cute.jit
        def _consume(self, acc, x_at, slot, tidx, t, one_multiply: cutlass.Constexpr):
            """Commit what was issued, load the step's activations (at x_at), wait for its stage (at shared
            address slot), its 8 mmas."""
            D: cutlass.Constexpr = self.stages
            compat.cp_async_commit()
            if const_expr(self.pairwise):  # the staged row, word order
                xs = [compat.ld_shared_v4(Int32(x_at) + 16 * q) for q in range(4)]
            elif const_expr(self.after_grid):  # h, written while this grid ran: kept below the wait
                xs = [compat.ld_v4(x_at + 64 * q) for q in range(4)]
            else:  # a quad's words i, 64 bytes apart (quad order)
                xs = [compat.ld_nc_v4(x_at + 64 * q) for q in range(4)]
            compat.cp_async_wait(D - 1)  # this step's group has landed
            wa = compat.ld_shared_v4(slot + tidx * 16)
            wb = compat.ld_shared_v4(slot + THREADS * 16 + tidx * 16)
            if const_expr(self.fmt == "int4"):  # row a's 8 bytes, then row b's, in the stage; this thread's bf16
                sa = compat.ld_shared_u16(slot + THREADS * 32 + (tidx * 8 + 2 * t))
                sb = compat.ld_shared_u16(slot + THREADS * 40 + (tidx * 8 + 2 * t))
            else:  # row a's word, then row b's, in the stage
                sa = compat.ld_shared_u8(slot + THREADS * 32 + (tidx * 4 + t))
                sb = compat.ld_shared_u8(slot + THREADS * 36 + (tidx * 4 + t))
            self._mmas(acc, wa, wb, sa, sb, xs, one_multiply)

        @cute.jit
        def _stage_x(self, x_base, x_smem, pair, P, k_begin, tidx):
            """The CTA's activation row over its K span into shared memory at x_smem, in word order: a's row of
            the pair (gate/up), or h's from the gate/up's partials at x_base (down); then a barrier (other
            threads' words are read). Unrolled, so that a thread's loads are in flight together (a rolled loop
            waits for each); threads past the row's words redo its last one."""
            WORDS: cutlass.Constexpr = self.k_span // 8
            for i in cutlass.range_constexpr((WORDS + THREADS - 1) // THREADS):
                w = tidx + i * THREADS
                if const_expr((i + 1) * THREADS > WORDS):
                    w = cutlass.min(w, WORDS - 1)
                if const_expr(self.gate_up):
                    words = word_order_x8(compat.ld_nc_v4(x_base + (Int64(pair // self.top_k) * self.K + k_begin
                                                                    + 8 * w) * 2))
                else:
                    words = situ_glu_x8(x_base, pair, P, w, self.K, self.situ)
                compat.st_shared_v4(x_smem + 16 * w, words[0], words[1], words[2], words[3])
            cute.arch.sync_threads()

        def x_stage_bytes(self) -> int:
            """The staged activation row's shared memory (pairwise): the K span in bf16."""
            return 2 * self.k_span if self.pairwise else 0

        def smem_bytes(self) -> int:
            """The ring's shared memory: `stages` stages (whole 16-byte words: the staged row follows)."""
            return self.stages * self._slot()

        def _slot(self) -> int:
            """Bytes of a ring stage: every thread's 16 bytes of row a, then of row b, then its rows' scales of
            the step (4 groups)."""
            return THREADS * (2 * 16 + 2 * self.scale_step)

        @cute.jit
        def _issue_step(self, slot, tidx, w_at, s_at, u):
            """Issue step u of the span whose first step's bytes are at w_at / s_at into the stage at slot."""
            self._issue(slot, tidx, w_at + u * self._w_step(), s_at + u * self._s_step())

        @cute.jit
        def _issue(self, slot, tidx, w_at, s_at):
            """cp.async of one step into this thread's part of a stage at slot: 16 weight bytes of rows a and
            a + 8 (at w_at), and each row's scales of the quad's 4 groups (at s_at; MXFP4 a 4-byte word, this
            thread's at byte t; int4 8 bytes, its bf16 at 2t)."""
            SW: cutlass.Constexpr = self.scale_step
            compat.cp_async(slot + tidx * 16, w_at, 16)
            compat.cp_async(slot + THREADS * 16 + tidx * 16, w_at + 8 * self._w_row(), 16)
            compat.cp_async(slot + THREADS * 32 + tidx * SW, s_at, SW)
            compat.cp_async(slot + THREADS * (32 + SW) + tidx * SW, s_at + 8 * self._s_row(), SW)

        @cute.jit
        def _store(self, acc, o_base, split, P, col_off, row_a, first, m0, size, t, mRows):
            """c0, c1: row_a x pairs m0 + 2t, m0 + 2t + 1; c2, c3: row_a + 8, same pairs: the gate/up's fp32
            partials, the down's bf16."""
            o_size: cutlass.Constexpr = 4 if self.gate_up else 2
            for j in cutlass.range_constexpr(2):
                if m0 + 2 * t + j < size:
                    pair = first + m0 + 2 * t + j
                    if const_expr(not self.pairwise):
                        pair = mRows[first + m0 + 2 * t + j]
                    at = o_base + ((Int64(split) * P + pair) * self.out_stride + col_off + row_a) * o_size
                    if const_expr(self.gate_up):
                        compat.st_f32(at, acc[j])
                        compat.st_f32(at + 8 * o_size, acc[2 + j])
                    else:
                        compat.st_bf16(at, acc[j])
                        compat.st_bf16(at + 8 * o_size, acc[2 + j])

        @cute.jit
        def _scale_bits(self, s_row, t):
            """The OR of the E8M0 bytes of this lane's rows (s_row: its row a's first step, and row b) over the
            span, the quad reading each row's 32-bit words (a step's 4 scales), lane t every fourth: bit 7 of a
            byte set for a scale >= 2^1."""
            words: cutlass.Constexpr = self.k_span // STEP  # a row's scale words: one a step
            bits = Int32(0)
            for w in cutlass.range(t, words, 4):
                at = s_row + w * self._s_step()
                bits = bits | compat.ld_nc_b32(at) | compat.ld_nc_b32(at + 8 * self._s_row())
            return bits

        @cute.jit
        def _mmas(self, acc, wa, wb, sa, sb, xs, one_multiply: cutlass.Constexpr):
            """One step's 8 mmas: rows a and b's four words each, dequantized, against the x words."""
            if const_expr(self.fmt == "int4"):  # the bf16 scale in both halves
                factor_a = compat.prmt(sa, sa, 0x1010)
                factor_b = compat.prmt(sb, sb, 0x1010)
                text = int4x8_ptx()
            else:
                factor_a = e8m0_bf16x2(sa, one_multiply)
                factor_b = e8m0_bf16x2(sb, one_multiply)
                text = e2m1x8_ptx(one_multiply)
            for i in cutlass.range_constexpr(4):
                ra = dequant_x8_bf16x2(wa[i], factor_a, text)
                rb = dequant_x8_bf16x2(wb[i], factor_b, text)
                for h in cutlass.range_constexpr(2):
                    # register j = 2h, 2h + 1 meets x words 4i + 2h, 4i + 2h + 1 of the thread's 16
                    c = compat.mma_m16n8k16_bf16((ra[2 * h], rb[2 * h], ra[2 * h + 1], rb[2 * h + 1]),
                                                 (xs[i][2 * h], xs[i][2 * h + 1]),
                                                 (acc[0], acc[1], acc[2], acc[3]))
                    for q in cutlass.range_constexpr(4):
                        acc[q] = c[q]


def table_fakes(fmt: str, K: int) -> tuple:
    """Compile-time stand-ins for a packed table and its scales as the kernels take them (table_views)."""
    w = compat.fake_tensor(cutlass.Uint8, (cute.sym_int(), K // 2), (K // 2, 1))
    if fmt == "int4":
        s = compat.fake_tensor(cutlass.BFloat16, (cute.sym_int(), K // 32), (K // 32, 1), align=2)
    else:
        s = compat.fake_tensor(cutlass.Uint8, (cute.sym_int(), K // 32), (K // 32, 1), align=1)
    return w, s


def table_views(w, s, K: int) -> tuple:
    """A packed table (uint8 or int32 words: the same bytes) and its scales as [E * rows, K / 2] bytes and
    [E * rows, K / 32]: a flat extent passes 2^31 at K3's widths, and the FFI holds each dynamic extent to
    int32 (the kernels read only the base addresses)."""
    return w.view(torch.uint8).view(-1, K // 2), s.view(-1, K // 32)


def builder(kernel: GateUp | Down):
    """(key, build) for compat.compiled / compat.compile_to_ptx_on_cpu; E and the pair count are dynamic.
    The activations: bf16 [T, K] (a, natural or in quad word order; grouped, h in quad word order), or the
    pairwise down's, the gate/up's fp32 partials, flat."""

    def build():
        sym = cute.sym_int
        rows_dot = W4A16RowsDot(kernel)
        if isinstance(kernel, Down) and kernel.situ is not None:
            x = compat.fake_tensor(cutlass.Float32, (sym(),), (1,))
        else:
            x = compat.fake_tensor(cutlass.BFloat16, (sym(), rows_dot.K), (rows_dot.K, 1))
        (wa, sa), (wb, sb) = table_fakes(kernel.fmt, rows_dot.K), table_fakes(kernel.fmt, rows_dot.K)
        out = compat.fake_tensor(cutlass.Float32 if rows_dot.gate_up else cutlass.BFloat16, (sym(),), (1,), align=4)
        experts = compat.fake_tensor(cutlass.Int64, (sym(),), (1,), align=8)
        rows = compat.fake_tensor(cutlass.Int32, (sym(),), (1,), align=4)
        groups = compat.fake_tensor(cutlass.Int32, (sym(),), (1,), align=4)
        return (rows_dot, x, wa, sa, wb, sb, out, experts, rows, groups, compat.fake_stream())

    return ("w4a16_rows_dot", kernel), build


def launch(kernel: GateUp | Down, x, wa, sa, wb, sb, out, experts, rows, groups) -> None:
    """One compiled launch (CUDA tensors, contiguous; rows/groups any int32 tensor in pairwise mode; x
    16-byte aligned; the pairwise down's x the gate/up's partials gu). wb / sb: w3's for the gate/up, any
    table for the down (unread)."""
    K = kernel.L if isinstance(kernel, GateUp) else kernel.I
    if isinstance(kernel, Down) and kernel.situ is not None:
        x = x.view(-1)
    compat.compiled(*builder(kernel))(x, *table_views(wa, sa, K), *table_views(wb, sb, K), out.view(-1), experts,
                                      rows, groups)


__all__ = ["Format", "STEP", "ROWS_PER_WARP", "WARPS", "BLOCK_ROWS", "GROUPS_PER_STEP", "SCALE_BYTES", "Situ",
           "GateUp", "Down", "e8m0_ptx", "e2m1x8_ptx", "int4x8_ptx", "table_fakes", "table_views", "builder", "launch"]
