"""Triton W4A16 routed experts for decode: 4-bit expert weights read once, dequantized in registers.

The op `routed_experts_w4a16` (kernels/ops/routed_experts_w4a16.py) is `routed_experts` (lib/triton/routed_experts.py) over the
checkpoint's packed weights (k3fuse/quant.py): `mxfp4` (uint8 E2M1 nibbles, E8M0 scale per 32) or
`int4` (int32 words of q + 8 nibbles, a 16-bit scale per 32). At decode the per-expert row count is
one or two, so the work is a GEMV per expert: it is the packed bytes that cost, and each touched
expert's rows are streamed once, by many programs, whatever the number of pairs that picked it.

Launches (grouping and pairwise modes as the BF16 kernel, `_group_kernel` and `_group` shared):
1. `_group_kernel` (grouped mode only): the pairs sorted by expert, the groups listed.
2. `_gate_up_kernel`, programs (group, block of BLOCK_N rows of w1 or of w3, K split): the group's
   token rows against the block, fp32 partial sums over its share of L into gu32 [SPLIT_K, P, 2I].
   The split over L gives a one-token decode enough programs at the narrow widths.
3. `_act_kernel`: g and u summed over the splits, rounded to the trunk dtype (the grouped GEMMs'
   outputs), SiTU-GLU in fp32, rounded: act [P, I]. Once per element, not once per down program.
4. `_down_kernel`, programs (group, N_TILES blocks of BLOCK_N latent rows of w2): act rows against
   the block, rounded to the trunk dtype into z [P, L] in pair order.

Dequantization, BLOCK_K elements (BLOCK_K / 32 groups) of each row a step, into the operands' dtype
(a's) with the group's scale folded in, so that each step is one dot (tl.dot, fp32 accumulation) and
each weight is exactly the model's dequantized one (quant.dequantize to a's dtype: the exact product,
rounded once). An MXFP4 row's bytes are read as little-endian int32 words, so nibble j of word w is
element 8w + j in both formats; nibbles j and j + 4 of a word travel together in the two 16-bit halves
of an integer, two weights an instruction:
- bf16 (PACKED, the default on GPU): mxfp4's sign to bit 15 and magnitude bits to bits 6-8 is the
  E2M1 value times 2^-126 as bf16 (0.5 on the smallest subnormal), times 2^126 and times 2^(s - 127)
  (bits s << 7) in bf16x2 multiplies; int4's nibble | 0x4300 is bf16 128 + nibble, minus 136, times
  the bf16 scale. Two multiplies, because 2^(s - 1) has no bf16 form for s > 128.
- otherwise (fp16 activations, int4 with fp16/fp32 scales, and Triton's interpreter, which has no bf16
  arithmetic): the fp16 patterns of the same trick (E2M1 * 2^-14, 1024 + nibble) to fp32, the scale
  applied there, rounded to the operands' dtype.
Two dot orientations (WGMMA in the launch config): the weights as the A operand [BLOCK_N, BLOCK_K]
(Hopper's wgmma, the default) or the pairs as a 16-row A operand (mma.sync).

Numerics: the model's rounding points (g, u, act and z in the trunk dtype), the model's weights, the
activations as they are; the result matches a float64 product on the dequantized weights to the trunk
dtype's rounding. Expert ids outside [0, E) are left out of every group, their rows of z unspecified,
as in the BF16 kernel.

a [T, L]; experts int64 [T*k]; mxfp4: w1/w3 uint8 [E, I, L/2] with uint8 scales [E, I, L/32], w2
uint8 [E, L, I/2] with [E, L, I/32]; int4: int32 [E, I, L/8] / [E, L, I/8] with scales in a 16-bit
float dtype; all contiguous -> z [T*k, L] new, contiguous, a's dtype. The tables row-major (the
checkpoint's layout) or, `layout` "blocks", in quant.block_order's (I and L whole steps of
quant.BLOCK_STEP): the loads take the same words and scales from where block order puts them.
"""
from __future__ import annotations

import functools

import torch

from k3fuse import quant

from . import HAVE_TRITON
from . import routed_experts as bf16_kernel

if HAVE_TRITON:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents

FORMATS = ("mxfp4", "int4")
GROUP = 32  # elements per scale (both formats)
MAX_TOKENS = bf16_kernel.MAX_TOKENS
MAX_EXPERTS = bf16_kernel.MAX_EXPERTS
MAX_PAIRS = bf16_kernel.MAX_PAIRS
BLOCK_M = bf16_kernel.BLOCK_M
DTYPES = bf16_kernel.DTYPES
INT4_SCALE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

if HAVE_TRITON:
    # quant.block_order's layout, as the jit functions read it (they read constexpr globals only)
    _BLOCK_ROWS = tl.constexpr(quant.BLOCK_ROWS)
    _WORDS_A_STEP = tl.constexpr(quant.BLOCK_STEP // 8)  # int32 words of a row's step, both formats
    _SCALES_A_STEP = tl.constexpr(quant.BLOCK_STEP // GROUP)

    _group_kernel = bf16_kernel._group_kernel
    _group_pairs_into = bf16_kernel._group_pairs_into
    _group = bf16_kernel._group
    _group_pairs = bf16_kernel._group_pairs
    _tanh = bf16_kernel._tanh

    @triton.jit
    def _pair_bits(words, j: tl.constexpr, MXFP4: tl.constexpr, BF16: tl.constexpr):
        """Nibbles j (low half) and j + 4 (high half) of each int32 word as two 16-bit float bit
        patterns: mxfp4 the E2M1 value * 2^-126 as bf16 / * 2^-14 as fp16 (sign bit 3 -> 15, the
        magnitude bits to the exponent's low bits and the mantissa's top bit; E2M1's 0.5 lands on the
        smallest subnormal), int4 128 + nibble as bf16 / 1024 + nibble as fp16 (or'ed into 0x4300 / 0x6400)."""
        if MXFP4:
            signs: tl.constexpr = -2147450880  # 0x80008000
            q = words << (12 - 4 * j)  # nibble j at bits 12-15 of each half
            if BF16:
                return (q & signs) | ((q >> 6) & 0x01C001C0)  # the arithmetic shift's fill is masked off
            else:
                return (q & signs) | ((q >> 3) & 0x0E000E00)
        else:
            nib = (words >> (4 * j)) & 0x000F000F
            if BF16:
                return nib | 0x43004300
            else:
                return nib | 0x64006400

    @triton.jit
    def _per_word(x):
        """[R, G] -> [R, 4G]: each group's value for its four words (word 4g + i), in registers."""
        return tl.reshape(tl.join(tl.join(x, x), tl.join(x, x)), (x.shape[0], 4 * x.shape[1]))

    @triton.jit
    def _fold_bf16x2(t, scale2, MXFP4: tl.constexpr):
        """Two bf16 weights an int32, scale folded: (E2M1 * 2^-126) * 2^126 * 2^(s - 127), or
        (128 + nibble - 136) * scale; bf16x2 instructions, each result rounded once (the first exact)."""
        if MXFP4:
            asm: tl.constexpr = ("{ .reg .b32 c; mov.b32 c, 0x7E807E80; mul.rn.bf16x2 $0, $1, c; "
                                 "mul.rn.bf16x2 $0, $0, $2; }")
        else:
            asm: tl.constexpr = ("{ .reg .b32 c; mov.b32 c, 0x43084308; sub.rn.bf16x2 $0, $1, c; "
                                 "mul.rn.bf16x2 $0, $0, $2; }")
        return tl.inline_asm_elementwise(asm, "=r,r,r", [t, scale2], dtype=tl.int32, is_pure=True, pack=1)

    @triton.jit
    def _word_scales(scales, MXFP4: tl.constexpr, PACKED: tl.constexpr):
        """The groups' scales [R, G] -> per word [R, 4G]: PACKED, the bf16 scale in both halves of an
        int32 (mxfp4 2^(s - 127): bits s << 7, s = 0 the subnormal 0x0040); else the fp32 scale."""
        if MXFP4:
            sb = scales.to(tl.int32)
            if PACKED:
                s16 = tl.where(sb == 0, 0x0040, sb << 7)
                scale = s16 | (s16 << 16)
            else:
                scale = tl.where(sb == 0, 0x00400000, sb << 23).to(tl.float32, bitcast=True)
        else:
            if PACKED:
                s16 = scales.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
                scale = s16 | (s16 << 16)
            else:
                scale = scales.to(tl.float32)
        return _per_word(scale)

    @triton.jit
    def _pair_weights(words, j: tl.constexpr, scale, MXFP4: tl.constexpr, PACKED: tl.constexpr,
                      DTYPE: tl.constexpr):
        """Elements j and j + 4 of each word [R, W] as DTYPE weights, the scale folded in."""
        t = _pair_bits(words, j, MXFP4, PACKED)
        if PACKED:
            t = _fold_bf16x2(t, scale, MXFP4)
            lo = t.to(tl.int16).to(tl.bfloat16, bitcast=True)
            hi = (t >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
        else:
            lo = t.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            hi = (t >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            if MXFP4:
                lo = ((lo * 16384.0) * scale).to(DTYPE)
                hi = ((hi * 16384.0) * scale).to(DTYPE)
            else:
                lo = ((lo - 1032.0) * scale).to(DTYPE)
                hi = ((hi - 1032.0) * scale).to(DTYPE)
        return lo, hi

    @triton.jit
    def _dequant(words, scales, MXFP4: tl.constexpr, PACKED: tl.constexpr, DTYPE: tl.constexpr,
                 WORD_ORDER: tl.constexpr):
        """Packed int32 words [R, W] and their groups' scales [R, W / 4] -> [R, 8W] weights in DTYPE,
        element 8 * word + nibble (WORD_ORDER: position 8w + 2j + h holds element 8w + j + 4h), the scale
        folded in: each weight is the model's dequantized value (quant.dequantize to DTYPE: the exact
        product, rounded once).
        PACKED (bf16; not under Triton's interpreter, which has no bf16 arithmetic): bf16x2 multiplies
        on the bit patterns, two weights an instruction. Else in fp32: the fp16 pattern * 2^14 * 2^(s - 127)
        (two multiplies: 2^(14 + s - 127) overflows fp32 for s > 240), or (1024 + nibble - 1032) * scale."""
        scale = _word_scales(scales, MXFP4, PACKED)
        l0, h0 = _pair_weights(words, 0, scale, MXFP4, PACKED, DTYPE)
        l1, h1 = _pair_weights(words, 1, scale, MXFP4, PACKED, DTYPE)
        l2, h2 = _pair_weights(words, 2, scale, MXFP4, PACKED, DTYPE)
        l3, h3 = _pair_weights(words, 3, scale, MXFP4, PACKED, DTYPE)
        # a join's new dim is the fastest, in the index and in registers
        if WORD_ORDER:  # over j1, j0, then h: [R, word, j1, j0, h], each register's halves side by side
            lo = tl.join(tl.join(l0, l2), tl.join(l1, l3))
            hi = tl.join(tl.join(h0, h2), tl.join(h1, h3))
            return tl.reshape(tl.join(lo, hi), (words.shape[0], 8 * words.shape[1]))
        else:  # over h, j1, then j0: [R, word, h, j1, j0], element 8w + 4h + 2j1 + j0 in place
            even = tl.join(tl.join(l0, h0), tl.join(l2, h2))  # j0 = 0: nibbles 0, 4, 2, 6
            odd = tl.join(tl.join(l1, h1), tl.join(l3, h3))  # j0 = 1
            return tl.reshape(tl.join(even, odd), (words.shape[0], 8 * words.shape[1]))

    @triton.jit
    def _table_at(row, unit, UNITS: tl.constexpr, A_STEP: tl.constexpr, BLOCKED: tl.constexpr):
        """The index of unit `unit` (a word or a scale) of table row `row` (int64, e * rows + r), in a table of
        UNITS a row: row-major, or in block order (BLOCKED), where a 64-row block's step (A_STEP units a row)
        is one piece, row by row. Rows are whole blocks there, so a row's block starts at row - row % 64."""
        if BLOCKED:
            r = row % _BLOCK_ROWS
            return (row - r) * UNITS + (unit // A_STEP) * (_BLOCK_ROWS * A_STEP) + r * A_STEP + unit % A_STEP
        else:
            return row * UNITS + unit

    @triton.jit
    def _w4_rows_dot(x_ptr, w_ptr, s_ptr, out_ptr, rows_ptr, first, size, e, n0, k_begin,
                     N: tl.constexpr, K: tl.constexpr, K_SPAN: tl.constexpr, TOP_K: tl.constexpr, TILES: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, OUT_STRIDE: tl.constexpr,
                     OUT_FP32: tl.constexpr, MXFP4: tl.constexpr, PACKED: tl.constexpr, PAIRWISE: tl.constexpr,
                     STAGES: tl.constexpr, WGMMA: tl.constexpr, WORD_ORDER: tl.constexpr, BLOCKED: tl.constexpr):
        """out[pair, n] = sum over k in [k_begin, k_begin + K_SPAN) of x[pair // TOP_K, k] * w[e, n, k],
        for the group's pairs and TILES blocks of BLOCK_N rows from n0: fp32 partials (OUT_FP32) or
        rounded to out's dtype. BLOCK_K elements (several groups of 32) a step, one dot each; the tiles'
        steps are one loop, so the loads stay STAGES deep across tiles (a tile of a short K would
        otherwise refill the pipeline each time). Row blocks of BLOCK_M pairs loop at run time (a crowded
        expert's re-reads of its rows hit L2)."""
        m = tl.arange(0, BLOCK_M)
        kk = tl.arange(0, BLOCK_K)
        ww = tl.arange(0, BLOCK_K // 8)
        gg = tl.arange(0, BLOCK_K // 32)
        WORDS: tl.constexpr = K // 8
        GROUPS: tl.constexpr = K // 32
        STEPS: tl.constexpr = K_SPAN // BLOCK_K
        m0 = 0
        while m0 < size:  # a while: the interpreter's program ids and loads are arrays, not range bounds
            m_ok = m0 + m < size
            pair = _group_pairs(rows_ptr, first, m0, m, m_ok, PAIRWISE)
            x_rows = (pair // TOP_K).to(tl.int64)[:, None] * K
            if WGMMA:  # the weights as the A operand: M = BLOCK_N rows, Hopper's wgmma
                acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            else:  # the pairs as the A operand: a 16-row mma.sync tile, operands through registers
                acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for it in tl.range(0, TILES * STEPS, num_stages=STAGES):
                n = n0 + (it // STEPS) * BLOCK_N + tl.arange(0, BLOCK_N)
                n_ok = n < N
                row = e * N + n[:, None].to(tl.int64)
                k0 = k_begin + (it % STEPS) * BLOCK_K
                words = tl.load(w_ptr + _table_at(row, k0 // 8 + ww[None, :], WORDS, _WORDS_A_STEP, BLOCKED),
                                mask=n_ok[:, None], other=0)
                scales = tl.load(s_ptr + _table_at(row, k0 // 32 + gg[None, :], GROUPS, _SCALES_A_STEP, BLOCKED),
                                 mask=n_ok[:, None], other=0)
                x = tl.load(x_ptr + x_rows + k0 + kk[None, :], mask=m_ok[:, None], other=0.0)
                wq = _dequant(words, scales, MXFP4, PACKED, x_ptr.dtype.element_ty, WORD_ORDER)
                if WGMMA:
                    acc = tl.dot(wq, tl.trans(x), acc)
                else:
                    acc = tl.dot(x, tl.trans(wq), acc)
                if it % STEPS == STEPS - 1:  # the tile's last step: write it, start the next
                    if WGMMA:
                        res = tl.trans(acc)
                    else:
                        res = acc
                    out = out_ptr + pair.to(tl.int64)[:, None] * OUT_STRIDE + n[None, :]
                    if OUT_FP32:
                        tl.store(out, res, mask=m_ok[:, None] & n_ok[None, :])
                    else:
                        tl.store(out, res.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
                    acc = tl.zeros_like(acc)
            m0 += BLOCK_M

    @triton.jit
    def _gate_up_kernel(a_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, gu_ptr, experts_ptr, rows_ptr, groups_ptr, P, E,
                        I: tl.constexpr, L: tl.constexpr, SPLIT_K: tl.constexpr, TOP_K: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MXFP4: tl.constexpr,
                        PACKED: tl.constexpr, PAIRWISE: tl.constexpr, STAGES: tl.constexpr, WGMMA: tl.constexpr,
                        WORD_ORDER: tl.constexpr, BLOCKED: tl.constexpr):
        """gu32 [SPLIT_K, P, 2I] fp32: split s's partial sums of g = a . w1[e] (columns [0, I)) and
        u = a . w3[e] ([I, 2I)) over its share of L. Programs (group, row block of w1 or w3, split)."""
        gid = tl.program_id(0)
        if PAIRWISE or gid < tl.load(groups_ptr):
            e, first, size = _group(gid, experts_ptr, groups_ptr, P, E, PAIRWISE)
            blocks: tl.constexpr = (I + BLOCK_N - 1) // BLOCK_N
            col = tl.program_id(1)
            split = tl.program_id(2)
            n0 = (col % blocks) * BLOCK_N
            span: tl.constexpr = L // SPLIT_K
            out = gu_ptr + split.to(tl.int64) * P * (2 * I)
            if col < blocks:
                _w4_rows_dot(a_ptr, w1_ptr, s1_ptr, out, rows_ptr, first, size, e, n0, split * span, I, L, span,
                             TOP_K, 1, BLOCK_M, BLOCK_N, BLOCK_K, 2 * I, True, MXFP4, PACKED, PAIRWISE, STAGES, WGMMA,
                             WORD_ORDER, BLOCKED)
            else:
                _w4_rows_dot(a_ptr, w3_ptr, s3_ptr, out + I, rows_ptr, first, size, e, n0, split * span, I, L, span,
                             TOP_K, 1, BLOCK_M, BLOCK_N, BLOCK_K, 2 * I, True, MXFP4, PACKED, PAIRWISE, STAGES, WGMMA,
                             WORD_ORDER, BLOCKED)

    @triton.jit
    def _act_kernel(gu_ptr, act_ptr, P, beta, linear_beta, I: tl.constexpr, SPLIT_K: tl.constexpr,
                    BLOCK: tl.constexpr, WORD_ORDER: tl.constexpr, QUADS: tl.constexpr,
                    LAUNCH_DEPENDENTS: tl.constexpr):
        """act [P, I] = situ_glu(g, u): the splits summed, g and u rounded to act's dtype, SiTU in fp32;
        WORD_ORDER: each 8 columns in the dequantized weights' order, QUADS: and each 128 columns' words
        in quad order (word_order). LAUNCH_DEPENDENTS: the next launch, a programmatic dependent, may start
        at once (it waits for this grid before it reads act)."""
        if LAUNCH_DEPENDENTS:
            gdc_launch_dependents()
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < P * I
        pair = offs // I
        col = offs % I
        g = tl.zeros([BLOCK], dtype=tl.float32)
        u = tl.zeros([BLOCK], dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            base = gu_ptr + (s * P + pair) * (2 * I) + col
            g += tl.load(base, mask=ok, other=0.0)
            u += tl.load(base + I, mask=ok, other=0.0)
        dtype = act_ptr.dtype.element_ty
        g = g.to(dtype).to(tl.float32)
        u = u.to(dtype).to(tl.float32)
        act = beta * _tanh(g / beta) * tl.sigmoid(g) * (linear_beta * _tanh(u / linear_beta))
        if WORD_ORDER:
            tl.store(act_ptr + pair * I + _word_position(col, QUADS), act.to(dtype), mask=ok)
        else:
            tl.store(act_ptr + offs, act.to(dtype), mask=ok)

    @triton.jit
    def _word_position(col, QUADS: tl.constexpr):
        """Where word_order puts column `col` of a row: element 8w + j + 4h at 8w + 2j + h; QUADS, and word
        4t + i of a 128-column step at 4i + t."""
        word = col // 8
        if QUADS:
            word = (word // 16) * 16 + (word % 4) * 4 + (word % 16) // 4
        return word * 8 + 2 * (col % 4) + (col % 8) // 4

    @triton.jit
    def _group_in_word_order_kernel(experts_ptr, rows_ptr, groups_ptr, scratch_ptr, a_ptr, x_ptr, P, E, N,
                                    K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK: tl.constexpr,
                                    QUADS: tl.constexpr):
        """Grouped mode's two preparations in one launch: program 0 groups the pairs (`_group_pairs_into`),
        the others copy a [N / K, K] into x in word order (QUADS: quad order too), BLOCK elements each."""
        pid = tl.program_id(0)
        if pid == 0:
            _group_pairs_into(experts_ptr, rows_ptr, groups_ptr, scratch_ptr, P, E, BLOCK_P)
        else:
            offs = (pid - 1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            ok = offs < N
            col = offs % K
            tl.store(x_ptr + offs - col + _word_position(col, QUADS), tl.load(a_ptr + offs, mask=ok), mask=ok)

    @triton.jit
    def _down_kernel(act_ptr, w2_ptr, s2_ptr, z_ptr, experts_ptr, rows_ptr, groups_ptr, P, E,
                     I: tl.constexpr, L: tl.constexpr, N_TILES: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MXFP4: tl.constexpr, PACKED: tl.constexpr,
                     PAIRWISE: tl.constexpr, STAGES: tl.constexpr, WGMMA: tl.constexpr, WORD_ORDER: tl.constexpr,
                     BLOCKED: tl.constexpr):
        """z[pair, block] = act[pair] . w2[e, block], rounded to z's dtype; N_TILES blocks a program."""
        gid = tl.program_id(0)
        if PAIRWISE or gid < tl.load(groups_ptr):
            e, first, size = _group(gid, experts_ptr, groups_ptr, P, E, PAIRWISE)
            # act's rows are pairs: TOP_K = 1 maps a pair to its own row
            n0 = tl.program_id(1) * N_TILES * BLOCK_N
            _w4_rows_dot(act_ptr, w2_ptr, s2_ptr, z_ptr, rows_ptr, first, size, e, n0, 0, L, I, I, 1, N_TILES, BLOCK_M,
                         BLOCK_N, BLOCK_K, L, False, MXFP4, PACKED, PAIRWISE, STAGES, WGMMA, WORD_ORDER, BLOCKED)


TARGET_PROGRAMS = 528  # ~4 per SM on H200 (132 SMs)
MAX_N_TILES = 8
MAX_SPLIT_K = 8
PAIRWISE_MAX_PAIRS = bf16_kernel.PAIRWISE_MAX_PAIRS
expected_groups = bf16_kernel.expected_groups
#: launch configurations: BLOCK_N rows of the weights by BLOCK_K elements (BLOCK_K / 32 groups) a
#: step, each step one dot; WGMMA True puts the weights in wgmma's A operand, False makes the pairs
#: mma.sync's 16-row A operand; PACKED (None: wherever it applies) the bf16x2 dequantization;
#: WORD_ORDER the activations in the dequantized registers' order (word_order), which saves the loop
#: its byte permutes.
#: bench/bench_routed_experts.py --formats ... --sweep times the alternatives (docs/perf/2026-12-02-w4a16-triton.md)
GATE_UP = {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "STAGES": 4, "WGMMA": True, "PACKED": None,
           "WORD_ORDER": False}
DOWN = {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "STAGES": 4, "WGMMA": True, "PACKED": None, "WORD_ORDER": False}
ACT_BLOCK = 1024
WORD_ORDER_BLOCK = 1024  # elements of a each copy program of group_in_word_order moves


def block_k(span: int, want: int) -> int:
    """The largest of want, want / 2, ... down to one group that divides a K span of whole groups."""
    k = want
    while k > GROUP and span % k:
        k //= 2
    return k


def pick_config(T: int, E: int, I: int, L: int, top_k: int, overrides: dict | None = None) -> dict:
    """Modes and block sizes. Grids: gate/up (groups, 2 * I / BLOCK_N, SPLIT_K), down (groups,
    L / (BLOCK_N * N_TILES)); groups = T*k pairwise, else min(E, T*k) (programs past the number of
    groups return at once). SPLIT_K (a power of two dividing L into whole groups of 32) and N_TILES
    follow the expected number of groups, so that each launch has about TARGET_PROGRAMS programs. A
    group's row count is a run-time loop bound, so few variants compile per width and format.
    `overrides`: {"pairwise": bool, "gate_up": {...}, "down": {...}} (the benchmark's arms)."""
    P = T * top_k
    overrides = overrides or {}
    pairwise = bool(overrides.get("pairwise", P <= PAIRWISE_MAX_PAIRS))
    gate_up, down = dict(GATE_UP), dict(DOWN)
    gate_up.update(overrides.get("gate_up", {}))
    down.update(overrides.get("down", {}))
    groups = expected_groups(T, E, top_k, pairwise)
    gu_programs = groups * 2 * -(-I // gate_up["BLOCK_N"])
    split = 1
    while (split < MAX_SPLIT_K and gu_programs * split < TARGET_PROGRAMS
           and L % (2 * split * GROUP) == 0):
        split *= 2
    gate_up.setdefault("SPLIT_K", split)
    gate_up["BLOCK_K"] = block_k(L // gate_up["SPLIT_K"], gate_up["BLOCK_K"])
    down["BLOCK_K"] = block_k(I, down["BLOCK_K"])
    blocks = -(-L // down["BLOCK_N"])
    per_program = max(1.0, groups * blocks / TARGET_PROGRAMS)
    down.setdefault("N_TILES", min(MAX_N_TILES, 1 << (int(per_program).bit_length() - 1)))
    return {"pairwise": pairwise, "gate_up": gate_up, "down": down,
            "groups": P if pairwise else min(E, P)}


@functools.lru_cache(maxsize=None)
def _cached_config(T: int, E: int, I: int, L: int, top_k: int) -> dict:
    return pick_config(T, E, I, L, top_k)


def missing_features() -> str | None:
    """What this triton lacks for the kernels (the grouping's tl.sort / tl.cumsum), or None."""
    return bf16_kernel.missing_features()


def packed_shapes(fmt: str, E: int, I: int, L: int) -> dict[str, tuple[int, ...]]:
    per = 2 if fmt == "mxfp4" else 8
    return {"w1": (E, I, L // per), "s1": (E, I, L // GROUP), "w3": (E, I, L // per), "s3": (E, I, L // GROUP),
            "w2": (E, L, I // per), "s2": (E, L, I // GROUP)}


#: (data_ptr, version, device, dtype) of E2M1 tables already compared with the kernel's decoding
_E2M1_CHECKED: dict[tuple, bool] = {}


def table_decodes(table: torch.Tensor) -> bool:
    """The kernel decodes E2M1 itself: does `table` hold exactly k3fuse.quant's 16 values? Compared
    once per table and version (a buffer never changes, so a graph capture never syncs here)."""
    key = (table.data_ptr(), table._version, str(table.device), table.dtype)
    if key not in _E2M1_CHECKED:
        want = quant.e2m1_table(table.device)
        _E2M1_CHECKED[key] = tuple(table.shape) == (16,) and bool(torch.equal(table.to(want.dtype), want))
    return _E2M1_CHECKED[key]


def packs(dtype: torch.dtype, fmt: str, scale_dtype: torch.dtype) -> bool:
    """Whether the bf16x2 dequantization applies: bf16 activations (the dot's operand dtype), mxfp4 or
    int4 with bf16 scales, and a compiled kernel (Triton's interpreter has no bf16 arithmetic)."""
    return (dtype == torch.bfloat16 and (fmt == "mxfp4" or scale_dtype == torch.bfloat16)
            and not bf16_kernel.INTERPRET)


def word_order(x: torch.Tensor, quads: bool = False) -> torch.Tensor:
    """[..., K] -> a copy with each 8 columns in the dequantized weights' WORD_ORDER: position 8w + 2j + h
    holds element 8w + j + 4h (the dot's sum is the same; the weights' registers need no reordering).
    `quads`: also each 128 columns' 16 words in quad order, word 4t + i at 4i + t, so that the 4 threads
    reading words i of groups t = 0..3 read 64 contiguous bytes (K a multiple of 128)."""
    if quads:  # [..., step, t, i, h, j] -> [..., step, i, t, j, h]
        return x.unflatten(-1, (x.shape[-1] // 128, 4, 4, 2, 4)).transpose(-4, -3).transpose(-1, -2).flatten(-5)
    return x.unflatten(-1, (x.shape[-1] // 8, 2, 4)).transpose(-1, -2).flatten(-3)


def _words(t: torch.Tensor) -> torch.Tensor:
    """The packed weights as int32 words (an MXFP4 row's bytes read little-endian)."""
    return t if t.dtype == torch.int32 else t.view(torch.int32)


def group(experts: torch.Tensor, E: int, pairwise: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(rows, groups) from `_group_kernel` for grouped mode; (None, None) pairwise (the kernels read
    the experts directly)."""
    if pairwise:
        return None, None
    rows, groups, scratch, block_p = _grouping_buffers(experts)
    _group_kernel[(1,)](experts, rows, groups, scratch, experts.shape[0], E, BLOCK_P=block_p, num_warps=4)
    return rows, groups


def _grouping_buffers(experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """rows [P], groups [1 + 3P] and the sort's scratch in one int32 allocation, and the sort's block."""
    P = experts.shape[0]
    block_p = bf16_kernel._pow2(P)
    work = torch.empty(P + 1 + 3 * P + block_p, dtype=torch.int32, device=experts.device)
    return work[:P], work[P:4 * P + 1], work[4 * P + 1:], block_p


def group_in_word_order(a: torch.Tensor, experts: torch.Tensor, E: int,
                        quads: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Grouped mode's (rows, groups) as `group` and x = word_order(a, quads), in one launch
    (`_group_in_word_order_kernel`): the copy's programs run beside the grouping's one, which a launch of
    its own would follow with a gap (docs/perf/2026-12-06-w4a16-grouped-launches.md 0z). a [T, K] contiguous,
    K whole words (quads: whole steps of 128)."""
    T, K = a.shape
    if not a.is_contiguous() or K % (128 if quads else 8):
        raise ValueError(f"group_in_word_order: a contiguous [T, K] with K a multiple of {128 if quads else 8}, "
                         f"got {tuple(a.shape)} (contiguous {a.is_contiguous()})")
    rows, groups, scratch, block_p = _grouping_buffers(experts)
    x = torch.empty_like(a)
    _group_in_word_order_kernel[(1 + triton.cdiv(T * K, WORD_ORDER_BLOCK),)](
        experts, rows, groups, scratch, a, x, experts.shape[0], E, T * K, K=K, BLOCK_P=block_p,
        BLOCK=WORD_ORDER_BLOCK, QUADS=quads, num_warps=4)
    return rows, groups, x


def act(gu: torch.Tensor, dtype: torch.dtype, situ_beta: float, situ_linear_beta: float,
        word_ordered: bool, quads: bool = False, launch_dependents: bool = False) -> torch.Tensor:
    """act [P, I] in `dtype` from the fp32 partials gu [SPLIT_K, P, 2I] (`_act_kernel`), its columns
    as word_order(act, quads) puts them when word_ordered; `launch_dependents`: the next launch is its
    programmatic dependent (PDL), let start at once."""
    split, P, I = gu.shape[0], gu.shape[1], gu.shape[2] // 2
    out = torch.empty((P, I), dtype=dtype, device=gu.device)
    _act_kernel[(triton.cdiv(P * I, ACT_BLOCK),)](gu, out, P, float(situ_beta), float(situ_linear_beta), I=I,
                                                  SPLIT_K=split, BLOCK=ACT_BLOCK, WORD_ORDER=word_ordered,
                                                  QUADS=quads, LAUNCH_DEPENDENTS=launch_dependents,
                                                  num_warps=4)
    return out


def run(a, experts, w1, s1, w3, s3, w2, s2, top_k, situ_beta, situ_linear_beta, fmt, table=None, layout="rows",
        out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """z [T*k, L]; `layout`: the tables' (quant.EXPERT_LAYOUTS); `out`: a contiguous [T*k, L] buffer of a's dtype
    to write instead (tests poison it); `config`: pick_config overrides (the benchmark's arms)."""
    T, L = a.shape
    E, I = w1.shape[0], w1.shape[1]
    P = T * top_k
    cfg = pick_config(T, E, I, L, top_k, config) if config else _cached_config(T, E, I, L, int(top_k))
    z = torch.empty((P, L), dtype=a.dtype, device=a.device) if out is None else out
    assert z.is_contiguous() and tuple(z.shape) == (P, L) and z.dtype == a.dtype
    quant.check_layout(layout)
    blocked = layout == "blocks"
    if blocked and (I % quant.BLOCK_STEP or L % quant.BLOCK_STEP):
        raise ValueError(f"block-ordered tables need I and L in whole steps of {quant.BLOCK_STEP}, got I={I}, L={L}")
    if P == 0:
        return z
    gu_cfg, dn = cfg["gate_up"], cfg["down"]
    split = gu_cfg["SPLIT_K"]
    gu = torch.empty((split, P, 2 * I), dtype=torch.float32, device=a.device)
    rows, groups = group(experts, E, cfg["pairwise"])
    mxfp4 = fmt == "mxfp4"
    packable = packs(a.dtype, fmt, s1.dtype)
    packed = {n: packable and cfg[n]["PACKED"] in (None, True) for n in ("gate_up", "down")}
    x = word_order(a) if gu_cfg["WORD_ORDER"] else a
    _gate_up_kernel[(cfg["groups"], 2 * triton.cdiv(I, gu_cfg["BLOCK_N"]), split)](
        x, _words(w1), s1, _words(w3), s3, gu, experts, rows, groups, P, E, I=I, L=L, SPLIT_K=split,
        TOP_K=int(top_k), BLOCK_M=BLOCK_M, BLOCK_N=gu_cfg["BLOCK_N"], BLOCK_K=gu_cfg["BLOCK_K"], MXFP4=mxfp4,
        PACKED=packed["gate_up"], PAIRWISE=cfg["pairwise"], STAGES=gu_cfg["STAGES"], WGMMA=gu_cfg["WGMMA"],
        WORD_ORDER=gu_cfg["WORD_ORDER"], BLOCKED=blocked, num_warps=gu_cfg["num_warps"])
    h = act(gu, a.dtype, situ_beta, situ_linear_beta, dn["WORD_ORDER"])
    _down_kernel[(cfg["groups"], triton.cdiv(triton.cdiv(L, dn["BLOCK_N"]), dn["N_TILES"]))](
        h, _words(w2), s2, z, experts, rows, groups, P, E, I=I, L=L, N_TILES=dn["N_TILES"], BLOCK_M=BLOCK_M,
        BLOCK_N=dn["BLOCK_N"], BLOCK_K=dn["BLOCK_K"], MXFP4=mxfp4, PACKED=packed["down"], PAIRWISE=cfg["pairwise"],
        STAGES=dn["STAGES"], WGMMA=dn["WGMMA"], WORD_ORDER=dn["WORD_ORDER"], BLOCKED=blocked,
        num_warps=dn["num_warps"])
    return z


def packed_bytes(fmt: str, n_experts: float, I: int, L: int) -> float:
    """Bytes of packed weights and scales of `n_experts` experts (w1, w3 and w2)."""
    per_param = 0.5 + (1 if fmt == "mxfp4" else 2) / GROUP
    return n_experts * 3 * I * L * per_param


__all__ = ["FORMATS", "GROUP", "GATE_UP", "DOWN", "pick_config", "missing_features", "table_decodes", "packed_shapes",
           "run", "packed_bytes"]
