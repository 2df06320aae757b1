"""CuTe DSL W4A16 expert GEMMs for decode (MXFP4, int4): each warp streams 16 weight rows, mma.sync on registers.

The two weight-streaming launches of `routed_experts_w4a16` (kernels/ops/routed_experts_w4a16.py) over
MXFP4 weights (K3's) or int4 ones with bf16 group scales (compressed-tensors pack-quantized, Kimi
K2.x's); the op puts the Triton module's grouping and SiTU-GLU around them
(lib/triton/routed_experts_w4a16.py), whose launch and numerics this matches. Why not Triton: there
the dequantized weights reach the MMA through layout conversions and a wait on every wgmma
(docs/perf.md 0g); here a thread's packed bytes are its own MMA fragment and nothing else runs in
the loop.

Per warp, 16 rows of W (rows r and r + 8, r = lane / 4) by a group's pairs, 8 at a time (the mma's N):
- a thread (r, t = lane % 4) loads 16 bytes of each of its two rows a step of 128 elements: elements
  32t .. 32t + 31, one group, so one scale a row a step (MXFP4 an E8M0 byte, int4 a bf16);
- each int32 word (8 nibbles, both formats element m at bits 4m) dequantizes to four bf16x2 registers,
  register j holding elements j and j + 4; MXFP4: mask, multiply, mask (the E2M1 value * 2^-126 as a
  bf16 pattern), then a bf16x2 multiply by 2^(s - 1), or two for a scale of 2^1 and more; int4: shift,
  mask | 0x4300 (bf16 128 + nibble), minus 136, times the scale. Each exact: the model's dequantized
  weight bit for bit. Word i feeds mmas 2i and 2i + 1;
- the activations come in `word_order` (lib/triton/routed_experts_w4a16.py: position 8w + 2j + h holds
  element 8w + j + 4h), so a 32-bit load is the B fragment that register j meets: the dot's sum over
  k is the same, in another order; with `x_quads`, each step's words also in quad order (word 4t + i
  at 4i + t), so that a quad's 16-byte loads of word i are 64 contiguous bytes: half the L1 sectors
  of four 64-byte-strided loads, where L1 bandwidth bounds the loop (docs/perf.md 0n);
- m16n8k16 bf16 mma.sync, fp32 accumulation.

The weights in flight: the CTA's work is a stream of spans (a tile's rows by a chunk of 8 pairs), and
each thread keeps `stages - 1` steps of its own weight and scale bytes in flight by cp.async into its
own shared-memory slots, across span boundaries (a ring); it reads back only what it copied, so no
barrier is needed, and the loads do not wait on the mmas. A step's scales are each row's 4 (int4: 8)
bytes, the quad's 4 groups; MXFP4 with `scale_steps` 4, one 16-byte copy brings 4 steps' words into a
ring of two such blocks beside the weights' (a quarter of the scale copies, each a 16-byte sector piece).
With `blocked`, the tables are k3fuse.quant.block_order's (a row block's step one contiguous piece): the
same copies at other addresses, a warp's copy of a step 512 contiguous bytes rather than 8 rows' 64
(docs/perf.md 0x).

Launch (one class, both projections): grid (row blocks, groups, SPLIT_K), a group's row blocks side by
side (or, `rows_first` off, (groups, row blocks, SPLIT_K)). gate/up: blocks of w1 then of
w3 (`blocks_a` of each), fp32 partials over a K span into gu [SPLIT_K, P, 2I]; down: N_TILES row
blocks of w2 a CTA, rounded to bf16 into z [P, L]. Pairwise (each pair its own group) or grouped
(`rows` / `groups` from the Triton grouping kernel). Expert ids outside [0, E) are left out. Pairwise,
`x_stage` has each CTA stage its pair's activation row in shared memory (with its first weight stages
in flight): the gate/up from a in natural order, the down h through the SiTU-GLU of the gate/up's
partials, so that the op is these two launches alone; with `x_quads`, the row is staged in quad order
and only lanes 0-3 read it (the pair is the mma's column 0; the other lanes' B words are zeros): a
step's activations cost 4 shared-memory wavefronts a warp rather than 32 (docs/perf.md 0u). Without
x_stage (grouped mode), the down is launched as the Triton SiTU-GLU launch's programmatic dependent
(`pdl` "wait"): its first weight stages and scales in flight before it waits for that grid, h read after.
`tile()` is one CTA's work; the pairwise one-launch form (routed_experts_w4a16_one_launch.py) runs both
projections' tiles in one kernel through it, `waits` on: the activations after a flag, through L2.
"""
from __future__ import annotations

import torch

from k3fuse import quant

from .compat import SELF as compat

LOG2E = 1.4426950408889634
STEP = 128  # elements of a row a thread quad covers per step (4 threads x 32: one group each)
ROWS_PER_WARP = 16
PAIRS_PER_MMA = 8
GROUPS_PER_STEP = STEP // 32  # a quad's groups a step: a row's scales of a step are one copy
#: the formats and their scale's bytes (a group of 32): MXFP4's E8M0 byte, int4's bf16
SCALE_BYTES = {"mxfp4": 1, "int4": 2}


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
    issue rate (docs/perf.md 0l: two shifts and two masks ran 4-10% slower)."""
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


def staged_word(w):
    """Where a staged activation row (x_stage with x_quads) keeps its word w (16 bytes: 8 elements in word
    order), in words: each step's 16 words in quad order, word 4t + i at 4i + t, so that a quad's 16-byte
    reads of word i are 64 contiguous bytes (one wavefront; 64 bytes apart, lanes t and t + 2 share banks).
    Plain integer arithmetic, the same in the kernel (DSL integers) and on the host."""
    return w // 16 * 16 + w % 4 * 4 + w % 16 // 4


def scale_blocks_fit(K: int, k_span: int) -> bool:
    """16-byte copies of 4 steps' scale words need 16-byte aligned rows (K / 32 bytes) and block
    starts (a span of whole blocks: k_span a multiple of 4 steps; then every k_begin is too)."""
    return K % (4 * STEP) == 0 and k_span % (4 * STEP) == 0


def share_start(c, steps: int, shares: int):
    """The first step of CTA c's share when `shares` CTAs split `steps` (balanced mode: a pair's row
    blocks end to end, K steps each): shares differ by one step at most. Plain integer arithmetic, the
    same in the kernel (DSL integers) and on the host."""
    return c * steps // shares


def first_share(step, steps: int, shares: int):
    """The CTA whose share holds `step`: the last c with share_start(c) <= step."""
    return ((step + 1) * shares - 1) // steps


def share_slots(blocks: int, block_steps: int, shares: int) -> int:
    """The partial slots balanced mode writes: the most CTAs whose shares one block's steps are split among
    (each part of a block its own slot: its CTA's index among them)."""
    steps = blocks * block_steps
    return max(first_share((b + 1) * block_steps - 1, steps, shares) - first_share(b * block_steps, steps, shares) + 1
               for b in range(blocks))


if compat.HAVE_CUTE:
    import cutlass
    from cutlass import Float32, Int32, Int64, const_expr
    from cutlass.cutlass_dsl import T, dsl_user_op

    cute = compat.cute

    #: a group's E8M0 byte below this folds into one bf16 multiply: 2^(s - 1) is a normal bf16
    ONE_MULTIPLY_BELOW = 128

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

    #: a flag wait longer than this traps the launch (a CUDA error, not a hang): the one-launch form's
    #: waits end within the launch's own run time, microseconds to milliseconds
    WAIT_TIMEOUT_NS = 2_000_000_000

    @cute.jit
    def wait_flag(flag, tidx):
        """The CTA waits until the int32 at address `flag` is nonzero: thread 0 polls it (acquire), a
        barrier passes what it saw to the others."""
        if tidx == 0:  # (the loop's form is the collectives' spin, which every supported DSL version compiles)
            start = compat.globaltimer_ns()
            waiting = Int32(1)
            while waiting != 0:
                if compat.ld_acquire_gpu_s32(flag) != 0:
                    waiting = Int32(0)
                else:
                    compat.nanosleep(Int32(32))
                    if compat.globaltimer_ns() - start > WAIT_TIMEOUT_NS:
                        compat.trap()
        cute.arch.sync_threads()

    def word_order_x8(v) -> tuple:
        """A 16-byte word of 8 bf16 elements (four 32-bit words) in word_order: register j holds elements
        (j, j + 4)."""
        return (compat.prmt(v[0], v[2], 0x5410), compat.prmt(v[0], v[2], 0x7632),
                compat.prmt(v[1], v[3], 0x5410), compat.prmt(v[1], v[3], 0x7632))

    def _exp(x):
        return compat.exp2(x * LOG2E)

    def _tanh(x):
        return Float32(2.0) / (Float32(1.0) + _exp(x * -2.0)) - Float32(1.0)

    def situ_glu_x8(gu_base, pair, P, w, I: int, splits: int, beta: float, linear_beta: float,
                    through_l2: bool) -> tuple:
        """Elements 8w .. 8w + 7 of h[pair] = situ_glu(g, u) from the fp32 partials gu [splits, P, 2I], in
        word_order (four bf16x2 words): the splits summed, g and u rounded to bf16, SiTU in fp32, each
        rounded to bf16 (the Triton SiTU-GLU's numerics). `through_l2`: gu written in this launch."""
        load = compat.ld_cg_v4 if through_l2 else compat.ld_nc_v4
        g = [Float32(0.0)] * 8
        u = [Float32(0.0)] * 8
        for s in range(splits):
            at = gu_base + ((Int64(s) * P + pair) * (2 * I) + 8 * w) * 4
            for half in range(2):
                gv = load(at + 16 * half)
                uv = load(at + I * 4 + 16 * half)
                for j in range(4):
                    g[4 * half + j] = g[4 * half + j] + compat.b32_as_f32(gv[j])
                    u[4 * half + j] = u[4 * half + j] + compat.b32_as_f32(uv[j])
        act = []
        for j in range(8):
            gr = compat.round_bf16(g[j])
            ur = compat.round_bf16(u[j])
            sigmoid = Float32(1.0) / (Float32(1.0) + _exp(-gr))
            act.append(beta * _tanh(gr / beta) * sigmoid * (linear_beta * _tanh(ur / linear_beta)))
        return tuple(compat.bf16x2(act[j], act[j + 4]) for j in range(4))

    class W4A16RowsDot:
        """out[pair, n] = sum_k x[xrow(pair), k] * W[e, n, k] over one K span, W in `fmt` (MXFP4, int4 with
        bf16 scales), bf16 x (word order)."""

        def __init__(self, *, N: int, K: int, k_span: int, top_k: int, out_fp32: bool, out_stride: int,
                     blocks_a: int, col_b: int, pairwise: bool, warps: int, n_tiles: int, stages: int,
                     rows_first: bool, x_quads: bool, scale_steps: int, fmt: str, waits: bool = False,
                     x_stage: str = "", gu_splits: int = 1, beta: float = 0.0, linear_beta: float = 0.0,
                     shares: int = 0, slots: int = 1, pdl: str = "", rounds: bool = False, blocked: bool = False):
            assert K % STEP == 0 and k_span % STEP == 0 and N % (ROWS_PER_WARP * warps) == 0
            self.fmt = fmt
            self.scale_row = K // 32 * SCALE_BYTES[fmt]  # bytes of a row's scales
            self.scale_step = GROUPS_PER_STEP * SCALE_BYTES[fmt]  # bytes of a row's scales a step, one copy
            assert 2 <= stages <= k_span // STEP + 1  # the prologue fills stages - 1 steps of one span
            self.N, self.K, self.k_span, self.top_k = N, K, k_span, top_k
            self.out_fp32, self.out_stride, self.blocks_a, self.col_b = out_fp32, out_stride, blocks_a, col_b
            self.pairwise, self.warps, self.n_tiles = pairwise, warps, n_tiles
            self.stages = stages
            self.rows_first = rows_first
            self.x_quads = x_quads
            self.scale_steps = scale_steps
            # the activations are written in this launch, by other CTAs (the one-launch form): each CTA
            # issues its first weights, then waits for a flag, then reads them through L2, never by the
            # read-only path (ld.global.nc is for bytes no one writes while the kernel runs)
            self.waits = waits
            # pairwise (a CTA's one pair), its activations' row staged in shared memory in word order by
            # the CTA first: "natural", from a in natural order (the gate/up, no word-order copy before
            # it); "situ", h = situ_glu of the gate/up's gu_splits fp32 partials (the down, no SiTU-GLU
            # launch before it; SiTU's betas then fixed here); x_quads, each step's words in quad order
            # (staged_word), read by lanes 0-3 alone
            assert x_stage in ("", "natural", "situ")
            assert not x_stage or pairwise and not waits
            assert x_stage != "situ" or k_span == K and top_k == 1
            self.x_stage, self.gu_splits, self.beta, self.linear_beta = x_stage, gu_splits, beta, linear_beta
            # programmatic dependent launch into the down: "trigger", each staged gate/up CTA lets the down
            # launch once all have started; "wait", the down (launched as a dependent: of the staged gate/up,
            # or without x_stage of the SiTU-GLU launch) issues its first weight stages and reads its scales,
            # then waits for the preceding grid before it reads h (the weight-only rule: static weights cross
            # the sync point, activations never): staged, the partials through L2; else h by side-effecting
            # loads. A read-only (.nc) load is free to move above the wait and is not for bytes written while
            # the kernel runs
            assert pdl in ("", "trigger", "wait") and (pdl != "trigger" or x_stage)
            assert pdl != "wait" or x_stage == "situ" or (not x_stage and top_k == 1 and k_span == K and not waits)
            self.pdl = pdl
            self.stage_early = bool(x_stage) and pdl != "wait"  # staged with the first weights in flight
            # 16-byte scale copies: aligned rows and block starts, blocks that never straddle a span, and
            # block b + 2 issued (at step 4b + 8 - (stages - 1)) after block b's last read (4b + 3)
            assert scale_steps == 1 or (scale_steps == 4 and scale_blocks_fit(K, k_span) and stages <= 5
                                        and fmt == "mxfp4")
            # gate/up: n_tiles blocks of w1 a CTA, then of w3; down: n_tiles blocks of w2 a CTA
            assert blocks_a % n_tiles == 0
            self.grid_y = (2 if col_b > 0 else 1) * blocks_a // n_tiles
            assert self.smem_bytes() % 16 == 0  # the staged row's 16-byte words follow the ring
            # balanced (pairwise fp32 partials): `shares` CTAs a pair and table (w1, w3), each streaming an
            # equal share of the table's row blocks' K steps end to end (share_start), so that the grid is
            # as many CTAs as fit at once and all run the same steps (no partial last wave); a block split
            # between CTAs leaves each part in its own partial slot, and its last part zeros the `slots`
            # (the launch's partials) no part takes, so that every slot is written once a launch
            self.shares, self.slots = shares, slots
            # pairwise, the step loop in rounds of `stages` steps: a CTA's spans are its row tiles of one
            # pair, so each step's ring slot and byte offsets are constants where the kernel is compiled
            # (no slot arithmetic, no address arithmetic a step); one scale copy a step
            assert not rounds or (pairwise and scale_steps == 1 and not shares and not waits)
            self.rounds = rounds
            # the tables in block order (k3fuse.quant.block_order): a row block's step is one contiguous piece,
            # its rows' 64 weight bytes (and scale bytes) each, so a warp's copy of a step is 512 contiguous bytes
            assert not blocked or (self._block_rows() == quant.BLOCK_ROWS and STEP == quant.BLOCK_STEP)
            assert not blocked or (scale_steps == 1 and not shares and not waits)
            self.blocked = blocked
            if shares:
                assert pairwise and n_tiles == 1 and k_span == K and out_fp32 and scale_steps == 1
                assert not waits and not x_quads
                self.share_steps = blocks_a * (K // STEP)  # a table's steps for the pair
                assert self.share_steps // shares >= stages - 1  # every share fills the prologue
                assert slots == share_slots(blocks_a, K // STEP, shares)

        @cute.jit
        def __call__(self, mX: cute.Tensor, mWa: cute.Tensor, mSa: cute.Tensor, mWb: cute.Tensor,
                     mSb: cute.Tensor, mOut: cute.Tensor, mExperts: cute.Tensor, mRows: cute.Tensor,
                     mGroups: cute.Tensor, stream):
            P = mExperts.shape[0]
            E = mSa.shape[0] // self.N
            groups = P
            if const_expr(not self.pairwise):
                groups = cutlass.min(P, E)
            grid = (self.grid_y, groups, self.K // self.k_span) if const_expr(self.rows_first) else (
                groups, self.grid_y, self.K // self.k_span)
            if const_expr(self.shares):  # a pair's shares of w1's blocks, then of w3's
                grid = ((2 if self.col_b > 0 else 1) * self.shares, P, 1)
            self.kernel(mX, mWa, mSa, mWb, mSb, mOut, mExperts, mRows, mGroups).launch(
                grid=grid, block=(32 * self.warps, 1, 1), stream=stream, use_pdl=self.pdl == "wait")

        @cute.kernel
        def kernel(self, mX: cute.Tensor, mWa: cute.Tensor, mSa: cute.Tensor, mWb: cute.Tensor,
                   mSb: cute.Tensor, mOut: cute.Tensor, mExperts: cute.Tensor, mRows: cute.Tensor,
                   mGroups: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            if const_expr(self.pdl == "trigger"):
                compat.griddep_launch_dependents()
            smem = compat.SmemAllocator()
            # the staged row (x_stage) right after the ring, whose bytes are whole 16-byte words
            ring = compat.smem_address(smem.allocate_array(cutlass.Uint8, self.smem_bytes() + self.x_stage_bytes()))
            x_smem = ring + self.smem_bytes()
            if const_expr(self.shares):
                c, pair, _ = cute.arch.block_idx()
                self.share(c, pair, tidx, ring, mX, mWa, mSa, mWb, mSb, mOut, mExperts, mRows, x_smem)
            else:
                gid, col, split = cute.arch.block_idx()
                if const_expr(self.rows_first):  # a group's row blocks launched side by side (docs/perf.md 0m)
                    col, gid, split = cute.arch.block_idx()
                self.tile(gid, col, split, tidx, ring, Int64(0), mX, mWa, mSa, mWb, mSb, mOut, mExperts, mRows,
                          mGroups, x_smem)

        @cute.jit
        def tile(self, gid, col, split, tidx, ring, flag, mX: cute.Tensor, mWa: cute.Tensor, mSa: cute.Tensor,
                 mWb: cute.Tensor, mSb: cute.Tensor, mOut: cute.Tensor, mExperts: cute.Tensor, mRows: cute.Tensor,
                 mGroups: cute.Tensor, x_smem):
            """One CTA's work: row blocks `col` of group `gid` over K span `split`, its ring at shared address
            `ring` (smem_bytes()); with `waits`, the activations once the int32 at `flag` is nonzero; with
            `x_stage`, the activations staged at shared address `x_smem` (x_stage_bytes()). The group's
            size (0: an expert id outside [0, E), nothing done)."""
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
            if const_expr(self.col_b > 0):
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
                           mRows, tidx, ring, flag, x_smem)
            return size

        @cute.jit
        def _ring(self, acc, w_base, s_base, x_base, o_base, block, col_off, k_begin, e, first, size, split, P,
                  mRows, tidx, ring, flag, x_smem):
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
            row_a = block * self._block_rows() + (tidx // 32) * ROWS_PER_WARP + lane // 4
            scale_ring = ring + D * SLOT  # the 16-byte scale copies' two blocks (scale_steps 4), 16 B aligned
            # this thread's bytes of row a at the span's first step (row b is 8 rows on): its row block's, then
            # its row's in the block, its span's first step's and its own 16 bytes
            local = row_a - block * self._block_rows()
            block_at = e * N + block * self._block_rows()
            w_at = w_base + block_at * (K // 2) + local * self._w_row() + k_begin // STEP * self._w_step() + 16 * t
            s_at = s_base + block_at * self.scale_row + local * self._s_row() + k_begin // STEP * self._s_step()
            for i in cutlass.range_constexpr(D - 1):  # the first span's first steps (D - 1 <= its steps)
                self._issue(ring + i * SLOT, tidx, w_at + i * self._w_step(), s_at + i * self._s_step())
                if const_expr(self.scale_steps > 1 and i % self.scale_steps == 0):
                    self._issue_scales(scale_ring + (i // self.scale_steps) * self._scale_block(), tidx,
                                       s_at + i * (STEP // 32))
                compat.cp_async_commit()
            if const_expr(self.stage_early):  # the weights above in flight while the row is staged
                self._stage_x(x_base, x_smem, first, P, k_begin, tidx)
                x_base = Int64(x_smem)

            # MXFP4: one bf16 multiply a register unless a scale of the CTA's rows is 2^1 or more (real
            # checkpoints' are far below): read while the first stages land, a warp-uniform choice of loop
            bits = Int32(0)
            if const_expr(self.fmt == "mxfp4"):
                for row_tile in cutlass.range(self.n_tiles, unroll=1):
                    bits = bits | self._scale_bits(s_at + row_tile * self._block_scales(), t)
            if const_expr(self.waits):  # the weights above are in flight; the activations only after the flag
                wait_flag(flag, tidx)
            if const_expr(self.pdl == "wait"):  # likewise, after the preceding grid (PDL)
                compat.griddep_wait()
                if const_expr(bool(self.x_stage)):
                    self._stage_x(x_base, x_smem, first, P, k_begin, tidx)
                    x_base = Int64(x_smem)
            stream = self._stream_rounds if const_expr(self.rounds) else self._stream
            if const_expr(self.fmt == "int4"):  # one multiply a register at every scale
                stream(acc, x_base, o_base, col_off, k_begin, first, size, split, P, mRows, tidx, row_a,
                       ring, scale_ring, w_at, s_at, True)
            elif compat.warp_any(bits & -2139062144) == 0:  # 0x80808080: bit 7 of each byte
                stream(acc, x_base, o_base, col_off, k_begin, first, size, split, P, mRows, tidx, row_a,
                       ring, scale_ring, w_at, s_at, True)
            else:
                stream(acc, x_base, o_base, col_off, k_begin, first, size, split, P, mRows, tidx, row_a,
                       ring, scale_ring, w_at, s_at, False)

        @cute.jit
        def _stream(self, acc, x_base, o_base, col_off, k_begin, first, size, split, P, mRows, tidx, row_a, ring,
                    scale_ring, w_at, s_at, one_multiply: cutlass.Constexpr):
            """Span by span: its B column and zeroed accumulators, its steps (each issuing the step
            `stages - 1` ahead: of this span, then of the next; with scale_steps 4, each block's first
            also the block's scales), its outputs."""
            D: cutlass.Constexpr = self.stages
            BLOCK: cutlass.Constexpr = self._scale_block()
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
            p_block = Int32(((D - 2) // self.scale_steps + 1) % 2 * BLOCK)  # the scale block the next issue fills
            c_block = Int32(0)  # the one the steps read
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
                    next_row = row + self._block_rows()
                has_next = g + 1 < spans
                for s in cutlass.range(S - (D - 1), unroll=1):  # issuing this span's later steps
                    p_block = self._issue_step(ring + p_slot, scale_ring, p_block, tidx, w_at, s_at, s + D - 1)
                    p_slot, c_slot, c_block = self._step(acc, x_at + s * (STEP * 2), ring, scale_ring, s, tidx, t,
                                                         p_slot, c_slot, c_block, one_multiply)
                for s in cutlass.range(S - (D - 1), S, unroll=1):  # issuing the next span's first steps
                    if has_next:
                        p_block = self._issue_step(ring + p_slot, scale_ring, p_block, tidx, next_w, next_s,
                                                   s - (S - (D - 1)))
                    p_slot, c_slot, c_block = self._step(acc, x_at + s * (STEP * 2), ring, scale_ring, s, tidx, t,
                                                         p_slot, c_slot, c_block, one_multiply)
                self._store(acc, o_base, split, P, col_off, row, first, m0, size, t, mRows)
                chunk = next_chunk
                w_at = next_w
                s_at = next_s
                row = next_row

        def _x_at(self, x_base, pair, k_begin, t):
            """This thread's word 0 of a span's first step (group t's first 8 elements, in word order, quads
            or not): in the staged row (shared memory) the span's words from 0, else in pair's row of x."""
            if self.x_stage:
                return x_base + (16 if self.x_quads else 64) * t
            return x_base + (Int64(pair // self.top_k) * self.K + k_begin + (8 if self.x_quads else 32) * t) * 2

        @cute.jit
        def _stream_rounds(self, acc, x_base, o_base, col_off, k_begin, first, size, split, P, mRows, tidx, row_a,
                           ring, scale_ring, w_at, s_at, one_multiply: cutlass.Constexpr):
            """_stream's steps (rounds: pairwise, one scale copy a step) with constant slots and offsets: the
            CTA's spans are its n_tiles row tiles of its one pair, so step s of span g is step g * S + s of
            its stream, in ring slot (g * S + s) % stages. Each span's steps that issue one of its own run
            as a loop of rounds of `stages` steps (one address update a round), the rest unrolled."""
            D: cutlass.Constexpr = self.stages
            S: cutlass.Constexpr = self.k_span // STEP
            M: cutlass.Constexpr = S - (D - 1)  # a span's steps that issue a later step of the same span
            SLOT: cutlass.Constexpr = self._slot()
            W: cutlass.Constexpr = self._w_step()  # from a row's weight bytes of a step to the next step's
            X: cutlass.Constexpr = STEP * 2  # a step's activation bytes
            SW: cutlass.Constexpr = self._s_step()
            t = tidx % 32 % 4
            x_at = self._x_at(x_base, first, k_begin, t)
            row = row_a
            for g in cutlass.range_constexpr(self.n_tiles):
                q = g * S % D  # the span's first slot
                for i in cutlass.range_constexpr(4):
                    acc[i] = Float32(0.0)
                if const_expr(M // D > 0):
                    w_r, s_r, x_r = w_at, s_at, x_at
                    for r in cutlass.range(M // D, unroll=1):  # round r: its bases move on in w_r, s_r, x_r
                        for i in cutlass.range_constexpr(D):
                            self._issue(ring, tidx, w_r, s_r, (q + i + D - 1) % D * SLOT, (i + D - 1) * W,
                                        (i + D - 1) * SW)
                            self._consume(acc, x_r, ring, ring, 0, tidx, t, one_multiply, i * X, (q + i) % D * SLOT)
                        w_r, s_r, x_r = w_r + D * W, s_r + D * SW, x_r + D * X
                for s in cutlass.range_constexpr(M // D * D, S):
                    if const_expr(s < M):  # a later step of this span
                        self._issue(ring, tidx, w_at, s_at, (q + s + D - 1) % D * SLOT, (s + D - 1) * W,
                                    (s + D - 1) * SW)
                    elif const_expr(g + 1 < self.n_tiles):  # the next span's first steps
                        self._issue(ring, tidx, w_at, s_at, (q + s + D - 1) % D * SLOT,
                                    self._block_bytes() + (s - M) * W, self._block_scales() + (s - M) * SW)
                    self._consume(acc, x_at, ring, ring, 0, tidx, t, one_multiply, s * X, (q + s) % D * SLOT)
                self._store(acc, o_base, split, P, col_off, row, first, Int32(0), size, t, mRows)
                w_at = w_at + self._block_bytes()
                s_at = s_at + self._block_scales()
                row = row + self._block_rows()

        @cute.jit
        def share(self, c, pair, tidx, ring, mX: cute.Tensor, mWa: cute.Tensor, mSa: cute.Tensor, mWb: cute.Tensor,
                  mSb: cute.Tensor, mOut: cute.Tensor, mExperts: cute.Tensor, mRows: cute.Tensor, x_smem):
            """Balanced mode, CTA c of pair `pair`: CTAs 0 .. shares - 1 take w1's row blocks, the next w3's
            (a share never changes tables), each steps [share_start(c), share_start(c + 1)) of its table's
            blocks end to end, by the ring; each block's part into its slot. An expert id outside [0, E):
            nothing done."""
            P = mExperts.shape[0]
            E = mSa.shape[0] // self.N
            e = Int64(mExperts[pair])
            size = Int32(0)
            if e >= 0:
                if e < E:
                    size = Int32(1)
            w_base = compat.address(mWa.iterator)
            s_base = compat.address(mSa.iterator)
            col_off = Int32(0)
            share = c
            if const_expr(self.col_b > 0):
                if c >= self.shares:
                    w_base = compat.address(mWb.iterator)
                    s_base = compat.address(mSb.iterator)
                    col_off = Int32(self.col_b)
                    share = c - self.shares
            acc = cute.make_rmem_tensor((4,), Float32)
            if size > 0:
                self._share_ring(acc, e, share, pair, P, tidx, ring, compat.address(mX.iterator), w_base, s_base,
                                 col_off, compat.address(mOut.iterator), mRows, x_smem)

        @cute.jit
        def _share_ring(self, acc, e, c, pair, P, tidx, ring, x_base, w_base, s_base, col_off, o_base, mRows, x_smem):
            """_ring for share c of a table: its first `stages - 1` steps issued (into the next block where
            the share crosses one), the row staged, the scale bytes of every block it touches read; then
            its steps."""
            D: cutlass.Constexpr = self.stages
            B: cutlass.Constexpr = self.K // STEP
            SLOT: cutlass.Constexpr = self._slot()
            lane = tidx % 32
            t = lane % 4
            row = (tidx // 32) * ROWS_PER_WARP + lane // 4  # this thread's row a in a block
            start = share_start(c, self.share_steps, self.shares)
            end = share_start(c + 1, self.share_steps, self.shares)
            blk = start // B
            k = start - blk * B
            at = e * self.N + row  # row a of block 0
            w_row = w_base + at * (self.K // 2) + 16 * t
            s_row = s_base + at * self.scale_row
            for i in cutlass.range_constexpr(D - 1):  # (D - 1 <= every share's steps)
                u = k + i
                if u >= B:  # the next block's
                    u = u + (self._block_rows() - 1) * B
                self._issue(ring + i * SLOT, tidx, w_row + blk * self._block_bytes() + u * (STEP // 2),
                            s_row + blk * self._block_scales() + u * self.scale_step)
                compat.cp_async_commit()
            if const_expr(self.x_stage):  # the weights above in flight while the row is staged
                self._stage_x(x_base, x_smem, pair, P, Int32(0), tidx)
                x_at = Int64(x_smem) + 64 * t
            else:
                x_at = x_base + (Int64(pair // self.top_k) * self.K + 32 * t) * 2
            bits = Int32(0)
            if const_expr(self.fmt == "mxfp4"):  # the one-multiply choice over the rows of every block touched
                for b in cutlass.range(blk, (end - 1) // B + 1, unroll=1):
                    bits = bits | self._scale_bits(s_row + b * self._block_scales(), t)
            if const_expr(self.fmt == "int4"):
                self._share_stream(acc, x_at, o_base, c, pair, P, mRows, tidx, row, t, ring, blk, k, end, w_row,
                                   s_row, col_off, True)
            elif compat.warp_any(bits & -2139062144) == 0:  # 0x80808080: bit 7 of each byte
                self._share_stream(acc, x_at, o_base, c, pair, P, mRows, tidx, row, t, ring, blk, k, end, w_row,
                                   s_row, col_off, True)
            else:
                self._share_stream(acc, x_at, o_base, c, pair, P, mRows, tidx, row, t, ring, blk, k, end, w_row,
                                   s_row, col_off, False)

        @cute.jit
        def _share_stream(self, acc, x_at, o_base, c, pair, P, mRows, tidx, row, t, ring, first_blk, first_k, end,
                          w_row, s_row, col_off, one_multiply: cutlass.Constexpr):
            """Block by block from block first_blk's step first_k to the share's end (w_row, s_row: this
            thread's bytes of block 0): the block's steps, each issuing the share's step `stages - 1` ahead
            while it has one (the block's, then the next block's first), as _stream's two loops; the block's
            part stored."""
            D: cutlass.Constexpr = self.stages
            B: cutlass.Constexpr = self.K // STEP
            AHEAD: cutlass.Constexpr = B - (D - 1)  # the block's steps that issue one of the same block
            p_slot = Int32((D - 1) * self._slot())
            c_slot = Int32(0)
            c_block = Int32(0)
            blk = first_blk
            k_begin = first_k
            for _ in cutlass.range((end - 1) // B - first_blk + 1, unroll=1):
                k_end = cutlass.min(B, end - blk * B)
                issues_below = end - (D - 1) - blk * B  # the block's steps whose issue is in the share
                w_at = w_row + blk * self._block_bytes()
                s_at = s_row + blk * self._block_scales()
                for i in cutlass.range_constexpr(4):
                    acc[i] = Float32(0.0)
                for k in cutlass.range(k_begin, cutlass.min(k_end, AHEAD), unroll=1):  # issuing k + D - 1
                    if k < issues_below:
                        self._issue(ring + p_slot, tidx, w_at + (k + D - 1) * (STEP // 2),
                                    s_at + (k + D - 1) * self.scale_step)
                    p_slot, c_slot, c_block = self._step(acc, x_at + k * (STEP * 2), ring, ring, k, tidx, t, p_slot,
                                                         c_slot, c_block, one_multiply)
                for k in cutlass.range(cutlass.max(k_begin, AHEAD), k_end, unroll=1):  # the next block's first
                    if k < issues_below:
                        self._issue(ring + p_slot, tidx, w_at + self._block_bytes() + (k - AHEAD) * (STEP // 2),
                                    s_at + self._block_scales() + (k - AHEAD) * self.scale_step)
                    p_slot, c_slot, c_block = self._step(acc, x_at + k * (STEP * 2), ring, ring, k, tidx, t, p_slot,
                                                         c_slot, c_block, one_multiply)
                self._share_store(acc, o_base, c, blk, k_end == B, pair, P, mRows, row, t, col_off)
                blk = blk + 1
                k_begin = Int32(0)

        def _block_rows(self) -> int:
            """A row block's rows: a CTA's warps' 16 each."""
            return ROWS_PER_WARP * self.warps

        def _block_bytes(self) -> int:
            """A row block's packed bytes: from a row's step 0 to the next block's."""
            return self._block_rows() * (self.K // 2)

        def _block_scales(self) -> int:
            """A row block's scale bytes."""
            return self._block_rows() * self.scale_row

        def _w_step(self) -> int:
            """Bytes from a row's weights of one step to the next step's: the next 64 in its row, or blocked,
            past the block's step (every row's 64)."""
            return (self._block_rows() if self.blocked else 1) * (STEP // 2)

        def _w_row(self) -> int:
            """Bytes from a row's weights of a step to the next row's: a table row, or blocked, 64."""
            return STEP // 2 if self.blocked else self.K // 2

        def _s_step(self) -> int:
            """Bytes from a row's scales of one step to the next step's (as _w_step)."""
            return (self._block_rows() if self.blocked else 1) * self.scale_step

        def _s_row(self) -> int:
            """Bytes from a row's scales of a step to the next row's (as _w_row)."""
            return self.scale_step if self.blocked else self.scale_row

        @cute.jit
        def _share_store(self, acc, o_base, c, blk, closes, pair, P, mRows, row, t, col_off):
            """Block blk's part of share c into its slot (c's index among the shares the block is split
            between); the accumulators zeroed; where the part `closes` the block, zeros into the slots after
            its own."""
            B: cutlass.Constexpr = self.K // STEP
            slot = c - first_share(blk * B, self.share_steps, self.shares)
            out_row = blk * self._block_rows() + row
            self._store(acc, o_base, slot, P, col_off, out_row, pair, Int32(0), Int32(1), t, mRows)
            for i in cutlass.range_constexpr(4):
                acc[i] = Float32(0.0)
            if closes:
                for z in cutlass.range(slot + 1, self.slots, unroll=1):
                    self._store(acc, o_base, z, P, col_off, out_row, pair, Int32(0), Int32(1), t, mRows)

        @cute.jit
        def _step(self, acc, x_at, ring, scale_ring, s, tidx, t, p_slot, c_slot, c_block,
                  one_multiply: cutlass.Constexpr):
            """_consume the stage at c_slot (and, scale_steps 4, the scale block at c_block); the slots move
            on."""
            D: cutlass.Constexpr = self.stages
            SLOT: cutlass.Constexpr = self._slot()
            self._consume(acc, x_at, ring + c_slot, scale_ring + c_block, s, tidx, t, one_multiply)
            if const_expr(self.scale_steps > 1):
                if s % self.scale_steps == self.scale_steps - 1:
                    c_block = self._scale_block() - c_block
            p_slot = p_slot + SLOT
            if p_slot == D * SLOT:
                p_slot = Int32(0)
            c_slot = c_slot + SLOT
            if c_slot == D * SLOT:
                c_slot = Int32(0)
            return p_slot, c_slot, c_block

        @cute.jit
        def _consume(self, acc, x_at, slot, block, s, tidx, t, one_multiply: cutlass.Constexpr,
                     x_off: cutlass.Constexpr = 0, slot_off: cutlass.Constexpr = 0):
            """Commit what was issued, load step s's activations (at x_at + x_off), wait for its stage (at
            shared address slot + slot_off; and, scale_steps 4, its scale block at `block`: issued with the
            block's first step), its 8 mmas. The offsets are the instructions' own (rounds: constants on a
            round's base registers)."""
            D: cutlass.Constexpr = self.stages
            THREADS: cutlass.Constexpr = 32 * self.warps
            compat.cp_async_commit()
            x_step = 64 if self.x_quads else 16  # a quad's words' bytes apart
            if const_expr(bool(self.x_stage) and self.x_quads):  # the pair is the mma's column 0: lanes 0-3's B words
                reads = Int32(tidx % 32 < 4)
                xs = [compat.ld_shared_v4_if(*self._fold(Int32(x_at), x_off + 64 * q), pred=reads) for q in range(4)]
            elif const_expr(self.x_stage):
                xs = [compat.ld_shared_v4(*self._fold(Int32(x_at), x_off + 16 * q)) for q in range(4)]
            elif const_expr(self.waits):
                xs = [compat.ld_cg_v4(*self._fold(x_at, x_off + x_step * q)) for q in range(4)]
            elif const_expr(self.pdl == "wait"):  # h, written while this grid ran: kept below the wait
                xs = [compat.ld_v4(*self._fold(x_at, x_off + x_step * q)) for q in range(4)]
            else:
                xs = [compat.ld_nc_v4(*self._fold(x_at, x_off + x_step * q)) for q in range(4)]
            compat.cp_async_wait(D - 1)  # this step's group has landed
            wa = compat.ld_shared_v4(*self._fold(slot, slot_off, tidx * 16))
            wb = compat.ld_shared_v4(*self._fold(slot, slot_off + THREADS * 16, tidx * 16))
            if const_expr(self.fmt == "int4"):  # row a's 8 bytes, then row b's, in the stage; this thread's bf16
                sa = compat.ld_shared_u16(*self._fold(slot, slot_off + THREADS * 32, tidx * 8 + 2 * t))
                sb = compat.ld_shared_u16(*self._fold(slot, slot_off + THREADS * 40, tidx * 8 + 2 * t))
            elif const_expr(self.scale_steps > 1):  # this step's word in the block's 16 bytes
                scales = block + tidx * 16 + (s % self.scale_steps) * 4 + t
                sa = compat.ld_shared_u8(scales)
                sb = compat.ld_shared_u8(scales + THREADS * 16)
            else:  # row a's word, then row b's, in the stage
                sa = compat.ld_shared_u8(*self._fold(slot, slot_off + THREADS * 32, tidx * 4 + t))
                sb = compat.ld_shared_u8(*self._fold(slot, slot_off + THREADS * 36, tidx * 4 + t))
            self._mmas(acc, wa, wb, sa, sb, xs, one_multiply)

        def _fold(self, base, offset: int, lane=None):
            """An address base + offset (+ lane, this thread's bytes) as (register, immediate): with rounds the
            offset in the instruction itself (a round's steps share base registers), else added to the
            register, in the loop's own order (base + offset + lane)."""
            if self.rounds:
                return (base if lane is None else base + lane), offset
            at = base + offset if offset else base
            return (at if lane is None else at + lane), 0

        @cute.jit
        def _stage_x(self, x_base, x_smem, pair, P, k_begin, tidx):
            """The CTA's activation row over its K span into shared memory at x_smem, in word order (x_quads,
            each step's words in quad order: staged_word): a's row of the pair ("natural"), or h's from the
            gate/up's partials at x_base ("situ"); then a barrier (other threads' words are read).
            Unrolled, so that a thread's loads are in flight together (a rolled loop waits for each);
            threads past the row's words redo its last one."""
            THREADS: cutlass.Constexpr = 32 * self.warps
            WORDS: cutlass.Constexpr = self.k_span // 8
            for i in cutlass.range_constexpr((WORDS + THREADS - 1) // THREADS):
                w = tidx + i * THREADS
                if const_expr((i + 1) * THREADS > WORDS):
                    w = cutlass.min(w, WORDS - 1)
                if const_expr(self.x_stage == "natural"):
                    words = word_order_x8(compat.ld_nc_v4(x_base + (Int64(pair // self.top_k) * self.K + k_begin
                                                                    + 8 * w) * 2))
                else:
                    words = situ_glu_x8(x_base, pair, P, w, self.K, self.gu_splits, self.beta, self.linear_beta,
                                        self.pdl == "wait")
                at = x_smem + 16 * (staged_word(w) if self.x_quads else w)
                compat.st_shared_v4(at, words[0], words[1], words[2], words[3])
            cute.arch.sync_threads()

        def x_stage_bytes(self) -> int:
            """The staged activation row's shared memory (x_stage): the K span in bf16."""
            return 2 * self.k_span if self.x_stage else 0

        def smem_bytes(self) -> int:
            """The ring's shared memory: `stages` stages and, scale_steps 4, two scale blocks (16-byte words)."""
            return self.stages * self._slot() + 2 * self._scale_block()

        def _slot(self) -> int:
            """Bytes of a ring stage: every thread's 16 bytes of row a, then of row b, then (scale_steps 1)
            its rows' scales of the step (4 groups)."""
            return 32 * self.warps * (2 * 16 + (2 * self.scale_step if self.scale_steps == 1 else 0))

        def _scale_block(self) -> int:
            """Bytes of a scale block (scale_steps 4): every thread's 16 bytes of row a's scales, then of
            row b's; 0 for scale_steps 1."""
            return 0 if self.scale_steps == 1 else 32 * self.warps * 2 * 16

        @cute.jit
        def _issue_step(self, slot, scale_ring, p_block, tidx, w_at, s_at, u):
            """Issue step u of the span whose first step's bytes are at w_at / s_at into the stage at slot,
            and with scale_steps 4, at a block's first step, the block's scales; the next block to fill."""
            self._issue(slot, tidx, w_at + u * self._w_step(), s_at + u * self._s_step())
            if const_expr(self.scale_steps > 1):
                if u % self.scale_steps == 0:
                    self._issue_scales(scale_ring + p_block, tidx, s_at + u * (STEP // 32))
                    p_block = self._scale_block() - p_block
            return p_block

        @cute.jit
        def _issue(self, slot, tidx, w_at, s_at, slot_off: cutlass.Constexpr = 0, w_off: cutlass.Constexpr = 0,
                   s_off: cutlass.Constexpr = 0):
            """cp.async of one step into this thread's part of a stage (at slot + slot_off): 16 weight bytes of
            rows a and a + 8 (at w_at + w_off), and each row's scales of the quad's 4 groups (at s_at + s_off;
            MXFP4 a 4-byte word, this thread's at byte t; int4 8 bytes, its bf16 at 2t). The offsets are the
            instructions' own (rounds: constants on a round's base registers)."""
            K: cutlass.Constexpr = self.K
            THREADS: cutlass.Constexpr = 32 * self.warps
            SW: cutlass.Constexpr = self.scale_step
            for row, w_row in ((0, 0), (THREADS * 16, 8 * self._w_row())):  # rows a and a + 8
                smem, smem_off = self._fold(slot, slot_off + row, tidx * 16)
                addr, addr_off = self._fold(w_at, w_off + w_row)
                compat.cp_async(smem, addr, 16, smem_offset=smem_off, offset=addr_off)
            if const_expr(self.scale_steps == 1):
                for row, s_row in ((THREADS * 32, 0), (THREADS * (32 + SW), 8 * self._s_row())):
                    smem, smem_off = self._fold(slot, slot_off + row, tidx * SW)
                    addr, addr_off = self._fold(s_at, s_off + s_row)
                    compat.cp_async(smem, addr, SW, smem_offset=smem_off, offset=addr_off)

        @cute.jit
        def _issue_scales(self, block, tidx, s_at):
            """cp.async of a scale block: rows a's and a + 8's words of the 4 steps from s_at, 16 bytes
            each (the quad's 4 threads copy the same bytes, each into its own slot)."""
            K: cutlass.Constexpr = self.K
            THREADS: cutlass.Constexpr = 32 * self.warps
            compat.cp_async(block + tidx * 16, s_at, 16, cache="ca")
            compat.cp_async(block + THREADS * 16 + tidx * 16, s_at + 8 * (K // 32), 16, cache="ca")

        @cute.jit
        def _store(self, acc, o_base, split, P, col_off, row_a, first, m0, size, t, mRows):
            """c0, c1: row_a x pairs m0 + 2t, m0 + 2t + 1; c2, c3: row_a + 8, same pairs."""
            o_size: cutlass.Constexpr = 4 if self.out_fp32 else 2
            for j in cutlass.range_constexpr(2):
                if m0 + 2 * t + j < size:
                    pair = first + m0 + 2 * t + j
                    if const_expr(not self.pairwise):
                        pair = mRows[first + m0 + 2 * t + j]
                    at = o_base + ((Int64(split) * P + pair) * self.out_stride + col_off + row_a) * o_size
                    if const_expr(self.out_fp32):
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


def builder(*, N: int, K: int, k_span: int, top_k: int, out_fp32: bool, out_stride: int, blocks_a: int,
            col_b: int, pairwise: bool, warps: int, n_tiles: int, stages: int, rows_first: bool, x_quads: bool,
            scale_steps: int, fmt: str, x_stage: str = "", gu_splits: int = 1, beta: float = 0.0,
            linear_beta: float = 0.0, shares: int = 0, slots: int = 1, pdl: str = "", rounds: bool = False,
            blocked: bool = False):
    """(key, build) for compat.compiled / compat.compile_to_ptx_on_cpu; E and the pair count are dynamic.
    The activations: bf16 [T, K] (word order, or natural with x_stage "natural"), or with x_stage "situ"
    the gate/up's fp32 partials, flat."""
    params = dict(N=N, K=K, k_span=k_span, top_k=top_k, out_fp32=out_fp32, out_stride=out_stride,
                  blocks_a=blocks_a, col_b=col_b, pairwise=pairwise, warps=warps, n_tiles=n_tiles, stages=stages,
                  rows_first=rows_first, x_quads=x_quads, scale_steps=scale_steps, fmt=fmt)
    if x_stage:  # (the key of a launch without it unchanged)
        params.update(x_stage=x_stage, gu_splits=gu_splits, beta=float(beta), linear_beta=float(linear_beta))
    if shares:  # (likewise)
        params.update(shares=shares, slots=slots)
    if pdl:
        params.update(pdl=pdl)
    if rounds:
        params.update(rounds=True)
    if blocked:
        params.update(blocked=True)
    key = ("w4a16_rows_dot", tuple(sorted(params.items())))

    def build():
        sym = cute.sym_int
        if x_stage == "situ":
            x = compat.fake_tensor(cutlass.Float32, (sym(),), (1,))
        else:
            x = compat.fake_tensor(cutlass.BFloat16, (sym(), K), (K, 1))
        (wa, sa), (wb, sb) = table_fakes(fmt, K), table_fakes(fmt, K)
        out = compat.fake_tensor(cutlass.Float32 if out_fp32 else cutlass.BFloat16, (sym(),), (1,), align=4)
        experts = compat.fake_tensor(cutlass.Int64, (sym(),), (1,), align=8)
        rows = compat.fake_tensor(cutlass.Int32, (sym(),), (1,), align=4)
        groups = compat.fake_tensor(cutlass.Int32, (sym(),), (1,), align=4)
        k = W4A16RowsDot(**params)
        return (k, x, wa, sa, wb, sb, out, experts, rows, groups, compat.fake_stream())

    return key, build


def launch(x, wa, sa, wb, sb, out, experts, rows, groups, **params) -> None:
    """One compiled launch (CUDA tensors, contiguous; rows/groups any int32 tensor in pairwise mode; x
    16-byte aligned, with x_stage "situ" the gate/up's partials gu). Scale tables off 16-byte alignment
    (views; the op asks 4) take the 4-byte scale copies."""
    if params["scale_steps"] > 1 and (sa.data_ptr() % 16 or sb.data_ptr() % 16):
        params = {**params, "scale_steps": 1}
    if params.get("x_stage") == "situ":
        x = x.view(-1)
    key, build = builder(**params)
    K = params["K"]
    compat.compiled(key, build)(x, *table_views(wa, sa, K), *table_views(wb, sb, K), out.view(-1), experts, rows,
                                groups)


WARPS = 4
BLOCK_ROWS = ROWS_PER_WARP * WARPS  # rows of W a CTA streams per tile
TARGET_CTAS = 1056  # ~8 per SM on H200 (132 SMs): each CTA keeps 4 warps' loads in flight
MAX_N_TILES = 8


#: ring stages: a thread keeps STAGES - 1 steps of weights in flight (5 KB of shared memory a stage);
#: 3 was the fastest depth on the H200 at all but one width and token count, and within 4% there
#: (docs/perf.md 0j): its CTAs still fit 8 an SM, deeper rings cost CTAs
STAGES = 3
#: the grid's order: a group's row blocks launched side by side (rows first) rather than each row
#: block over every group; the faster of the two at every measured point (docs/perf.md 0m)
ROWS_FIRST = True
#: the activations' words in quad order (word_order(x, quads=True)), a quad's loads 64 contiguous
#: bytes, in grouped mode, where a load's 8 lanes read up to 8 tokens' rows and the L1 sectors count;
#: pairwise every lane reads one token's row, and the word order measured as fast (docs/perf.md 0n).
#: With x_stage, quad order stages the row so and has lanes 0-3 alone read it (a step's shared reads 4
#: wavefronts a warp, not 32); off while no A/B shows the saved wavefronts bound the op (docs/perf.md 0u)
X_QUADS_GROUPED, X_QUADS_PAIRWISE = True, False
#: steps whose scale words one copy brings: 4 is a quarter of the scale copies and their L1 lookups
#: (where the widths and the split allow: scale_blocks_fit) for 14 more instructions a step; 1 until
#: an A/B shows the trade pays (docs/perf.md 0n)
SCALE_STEPS = 1
#: pairwise, the whole MLP in one launch of ticketed tiles (lib/cute/routed_experts_w4a16_one_launch.py)
#: rather than four launches; off until an A/B shows it pays (docs/perf.md 0o); K3FUSE_W4A16_ONE_LAUNCH
#: overrides it
ONE_LAUNCH = False
#: pairwise, each CTA stages its pair's activation row in shared memory: the gate/up from a in natural
#: order, the down h from the gate/up's partials (its SiTU-GLU), so that 1-2 tokens take two launches
#: instead of four (no word-order copy, no SiTU-GLU launch, no gaps between them), whose launch costs
#: weigh most at few tokens (docs/perf.md 0q); K3FUSE_W4A16_X_STAGE overrides it
X_STAGE = True
#: pairwise, the gate/up balanced: as many CTAs as fit at once (TARGET_CTAS), each an equal share of a
#: pair's table steps, rather than one CTA a row block and K split, whose last wave can leave SMs part
#: empty; off until an A/B shows it pays (docs/perf.md 0r); K3FUSE_W4A16_BALANCED overrides it
BALANCED = False
#: with x_stage, the down launched as the gate/up's programmatic dependent (its first weights and scales
#: read while the gate/up drains); off until an A/B shows it pays (docs/perf.md 0q, 0r);
#: K3FUSE_W4A16_PDL overrides it
PDL = False
#: without x_stage (grouped mode; pairwise in four launches), the down launched as the SiTU-GLU launch's
#: programmatic dependent: its first weights and scales read while that launch runs, its launch gap hidden
#: (docs/perf.md 0z)
ACT_PDL = True
#: pairwise, the step loop in rounds of `stages` steps with its ring slots and byte offsets constants: no slot
#: or address arithmetic a step, for more registers (fewer CTAs an SM); off until an A/B on the H200, where the
#: few-token op is bound by its issue rate, shows it pays (docs/perf.md 0v)
ROUNDS = False
#: int4 tables (bf16 scales) on this kernel rather than the Triton one, which it outran at every measured
#: width and token count (docs/perf.md 0p); K3FUSE_W4A16_CUTE_INT4 overrides it
INT4 = True
#: grouped mode, the grouping and the activations' word order in one Triton launch
#: (group_in_word_order), not a launch each: the copy rides beside the one-program sort (docs/perf.md 0z)
ONE_PREP = True


def runs_int4() -> bool:
    """Whether int4 tables go to this kernel: K3FUSE_W4A16_CUTE_INT4 where set, else INT4."""
    from k3fuse import settings

    chosen = settings.get("K3FUSE_W4A16_CUTE_INT4")
    return INT4 if chosen is None else chosen


def _stages(steps: int, stages: int) -> int:
    if stages < 2:
        raise ValueError(f"a ring of {stages} stages (needs 2 or more: stages - 1 steps in flight)")
    return min(stages, steps + 1)  # the prologue fills stages - 1 steps of one span


def pick_config(groups: float, I: int, L: int, stages: int = STAGES, *, pairwise: bool = False,
                split: int | None = None, n_tiles: int | None = None, down_stages: int | None = None,
                rows_first: bool = ROWS_FIRST, x_quads: bool | None = None, scale_steps: int = SCALE_STEPS,
                one_launch: bool | None = None, x_stage: bool | None = None,
                gate_up_tiles: int | None = None, balanced: bool | None = None,
                gate_up_shares: int | None = None, pdl: bool | None = None, rounds: bool | None = None,
                blocked: bool = False, one_prep: bool | None = None, act_pdl: bool | None = None) -> dict:
    """The gate/up K split and the down's row tiles a CTA for the expected number of groups: enough
    CTAs to cover the SMs, no more; `stages` for the ring; the grid's order; the activations' order
    for the mode (`pairwise`); the scale copies' steps (a launch whose widths do not fit takes 1);
    pairwise, one launch or four, the activations staged by each CTA or not (`x_stage`), and the gate/up
    balanced or not (`balanced`: "gate_up_shares" CTAs a pair and table, 0 off), and with x_stage the down
    launched as the gate/up's programmatic dependent or not (`pdl`), and pairwise the step loop in rounds
    or not (`rounds`); `blocked`: the tables are quant.block_order's (the caller's to say: the kernels read
    whichever layout they are told); grouped, the grouping and the word-order copy in one launch or two
    (`one_prep`); without x_stage, the down launched as the SiTU-GLU launch's dependent or not (`act_pdl`).
    I and L whole 128-element steps (the op's predicate). `split`, `n_tiles`, `gate_up_tiles` (a gate/up
    CTA's row blocks), `down_stages` (the down's ring depth; default `stages`), `rows_first`, `x_quads`,
    `scale_steps`, `one_launch`, `x_stage`, `balanced`, `gate_up_shares` (balanced, with that many CTAs a
    pair), `pdl`, `rounds`, `one_prep` and `act_pdl` impose a choice instead (the benchmark's A/B arms).
    "partials": the gate/up's fp32 partial slots (its split, or balanced, share_slots)."""
    from k3fuse import settings

    if scale_steps not in (1, 4):
        raise ValueError(f"scale_steps {scale_steps} (1 or 4: a 4-byte or a 16-byte copy of a row's scale words)")
    if one_launch and not pairwise:
        raise ValueError("one_launch runs pairwise mode only (its tiles wait on a group's gate/up: a pair's)")
    if x_stage and not pairwise:
        raise ValueError("x_stage runs pairwise mode only (a CTA stages its one pair's activation row)")
    if one_launch is None:
        chosen = settings.get("K3FUSE_W4A16_ONE_LAUNCH")
        one_launch = pairwise and (ONE_LAUNCH if chosen is None else chosen)
    if x_stage is None:
        chosen = settings.get("K3FUSE_W4A16_X_STAGE")
        x_stage = pairwise and not one_launch and (X_STAGE if chosen is None else chosen)
    if x_stage and one_launch:
        raise ValueError("x_stage and one_launch are two forms of the pairwise MLP: choose one")
    if pdl and not x_stage:
        raise ValueError("pdl launches the staged down as the staged gate/up's dependent: it needs x_stage")
    if pdl is None:
        chosen = settings.get("K3FUSE_W4A16_PDL")
        pdl = PDL if chosen is None else chosen
    pdl = bool(x_stage) and pdl
    if x_quads is None:
        x_quads = X_QUADS_PAIRWISE if pairwise else X_QUADS_GROUPED
    if rounds and not (pairwise and scale_steps == 1 and not one_launch):
        raise ValueError("rounds runs pairwise mode's two- or four-launch forms with one scale copy a step (a "
                         "CTA's steps known where it is compiled): no grouped mode, one_launch or scale_steps 4")
    rounds = pairwise and not one_launch and scale_steps == 1 and (ROUNDS if rounds is None else rounds)
    if blocked and (one_launch or scale_steps != 1 or balanced or gate_up_shares):
        raise ValueError("blocked tables are read a step at a time by the two- or four-launch forms with one scale "
                         "copy a step: no one_launch, scale_steps 4 or balanced beside it")
    if one_prep and pairwise:
        raise ValueError("one_prep runs grouped mode only (pairwise has no grouping launch)")
    one_prep = not pairwise and (ONE_PREP if one_prep is None else one_prep)
    if act_pdl and (x_stage or one_launch):
        raise ValueError("act_pdl launches the down after the SiTU-GLU launch: none with x_stage or one_launch")
    act_pdl = not (x_stage or one_launch) and (ACT_PDL if act_pdl is None else act_pdl)
    gate_up_tiles = 1 if gate_up_tiles is None else gate_up_tiles
    if gate_up_tiles < 1 or (I // BLOCK_ROWS) % gate_up_tiles:
        raise ValueError(f"gate_up_tiles {gate_up_tiles} does not divide the {I // BLOCK_ROWS} row blocks of w1 / w3")
    steps = L // STEP
    # balanced streams whole rows a row block at a time, one scale copy a step, in word order
    fits = (not one_launch and gate_up_tiles == 1 and split in (None, 1) and scale_steps == 1 and not x_quads
            and not rounds and not blocked)
    shares = _gate_up_shares(groups, I, steps, stages, pairwise, fits, balanced, gate_up_shares)
    if shares:
        split = 1
    if split is None:
        split = 1
        for cand in range(1, steps + 1):  # the smallest divisor of the steps that reaches the target
            if steps % cand == 0:
                split = cand
                if groups * 2 * (I // BLOCK_ROWS) // gate_up_tiles * cand >= TARGET_CTAS or cand >= 8:
                    break
    blocks = L // BLOCK_ROWS
    if n_tiles is None:
        n_tiles = 1
        while (n_tiles * 2 <= MAX_N_TILES and blocks % (n_tiles * 2) == 0
               and groups * blocks / (n_tiles * 2) >= TARGET_CTAS):
            n_tiles *= 2
    if steps % split or blocks % n_tiles:
        raise ValueError(f"split {split} / n_tiles {n_tiles} do not divide the {steps} steps / {blocks} row blocks")
    down_stages = stages if down_stages is None else down_stages
    return {"split": split, "n_tiles": n_tiles, "gate_up_stages": _stages(steps // split, stages),
            "down_stages": _stages(I // STEP, down_stages), "rows_first": rows_first, "x_quads": x_quads,
            "scale_steps": scale_steps, "one_launch": one_launch, "x_stage": bool(x_stage),
            "gate_up_tiles": gate_up_tiles, "gate_up_shares": shares, "pdl": pdl, "rounds": rounds,
            "one_prep": one_prep, "act_pdl": act_pdl, "blocked": bool(blocked),
            "partials": share_slots(I // BLOCK_ROWS, steps, shares) if shares else split}


def _gate_up_shares(groups: float, I: int, steps: int, stages: int, pairwise: bool, fits: bool,
                    balanced: bool | None, imposed: int | None) -> int:
    """Balanced mode's CTAs a pair and table (0: off): TARGET_CTAS over the pairs' two tables, each share
    at least a ring's prologue of steps (`stages - 1`); `imposed` that many. Imposed (`balanced` or
    `imposed`), pairwise with the choices it `fits`; the default (K3FUSE_W4A16_BALANCED where set, else
    BALANCED) gives way to choices it does not fit."""
    from k3fuse import settings

    if imposed is not None or balanced:
        if not pairwise:
            raise ValueError("balanced runs pairwise mode only (a CTA's share is one pair's steps)")
        if not fits:
            raise ValueError("balanced streams whole rows, a row block at a time, with one scale copy a step in "
                             "word order: no one_launch, gate_up_tiles, split, scale_steps 4, x_quads or rounds "
                             "beside it")
    elif balanced is None:
        chosen = settings.get("K3FUSE_W4A16_BALANCED")
        balanced = pairwise and fits and (BALANCED if chosen is None else chosen)
    if not (balanced or imposed):
        return 0
    table_steps = (I // BLOCK_ROWS) * steps
    most = table_steps // max(1, _stages(steps, stages) - 1)
    if imposed is None:
        return min(most, max(1, TARGET_CTAS // (2 * max(1, round(groups)))))
    if not 1 <= imposed <= most:
        raise ValueError(f"gate_up_shares {imposed}: 1 to {most} (each share at least the ring's {stages - 1} "
                         f"steps of a table's {table_steps} for the pair)")
    return imposed


def _scale_steps(K: int, k_span: int, config: dict, fmt: str) -> int:
    """The config's scale copies where they apply: MXFP4 at whole 4-step blocks (int4's 8-byte step
    scales take one copy a step)."""
    return config["scale_steps"] if fmt == "mxfp4" and scale_blocks_fit(K, k_span) else 1


def gate_up_params(I: int, L: int, top_k: int, config: dict, fmt: str) -> dict:
    """builder's parameters for w1 and w3 at once: fp32 partials into gu [partials, P, 2I] (a K split's, or
    balanced, a row block's parts). `config`: pick_config's keys and the grouping's "pairwise"; `fmt`: the
    tables' format."""
    params = dict(N=I, K=L, k_span=L // config["split"], top_k=top_k, out_fp32=True, out_stride=2 * I,
                  blocks_a=I // BLOCK_ROWS, col_b=I, pairwise=config["pairwise"], warps=WARPS,
                  n_tiles=config["gate_up_tiles"], stages=config["gate_up_stages"], rows_first=config["rows_first"],
                  x_quads=config["x_quads"], scale_steps=_scale_steps(L, L // config["split"], config, fmt),
                  fmt=fmt, x_stage="natural" if config["x_stage"] else "", pdl="trigger" if config["pdl"] else "",
                  rounds=config["rounds"], blocked=config.get("blocked", False))
    if config["gate_up_shares"]:
        params.update(shares=config["gate_up_shares"], slots=config["partials"])
    return params


def down_params(I: int, L: int, config: dict, fmt: str, betas: tuple[float, float] | None = None) -> dict:
    """builder's parameters for w2: bf16 into z [P, L] (`config`, `fmt` as gate_up_params); with the config's
    x_stage, from the gate/up's partials through SiTU's `betas` (beta, linear beta)."""
    params = dict(N=L, K=I, k_span=I, top_k=1, out_fp32=False, out_stride=L, blocks_a=L // BLOCK_ROWS, col_b=0,
                  pairwise=config["pairwise"], warps=WARPS, n_tiles=config["n_tiles"], stages=config["down_stages"],
                  rows_first=config["rows_first"], x_quads=config["x_quads"],
                  scale_steps=_scale_steps(I, I, config, fmt), fmt=fmt, rounds=config["rounds"],
                  blocked=config.get("blocked", False))
    if config["x_stage"]:
        if betas is None:
            raise ValueError("x_stage: the down computes the SiTU-GLU, so it needs SiTU's betas")
        params.update(x_stage="situ", gu_splits=config["partials"], beta=float(betas[0]),
                      linear_beta=float(betas[1]), pdl="wait" if config["pdl"] else "")
    elif config.get("act_pdl"):
        params.update(pdl="wait")
    return params


__all__ = ["STEP", "ROWS_PER_WARP", "WARPS", "BLOCK_ROWS", "GROUPS_PER_STEP", "SCALE_BYTES", "e8m0_ptx", "e2m1x8_ptx",
           "int4x8_ptx", "table_fakes", "table_views", "builder", "launch", "pick_config",
           "gate_up_params", "down_params", "runs_int4", "share_start", "first_share", "share_slots", "staged_word"]
