"""k3fuse.quant: the compressed-tensors MXFP4 and int4 layouts, byte for byte, and exact dequantization."""
from __future__ import annotations

import math

import pytest
import torch

from k3fuse import quant
from k3fuse.quant import (E8M0_BIAS, GROUP_SIZE, QuantizedWeight, dequantize_int4, dequantize_mxfp4, e2m1_table,
                          packed_shape, quantize, quantize_int4, quantize_mxfp4, scale_shape)


def _row(values: list[float], width: int = GROUP_SIZE) -> torch.Tensor:
    return torch.tensor(values + [0.0] * (width - len(values)), dtype=torch.float32).unsqueeze(0)


# --- MXFP4 ------------------------------------------------------------------------------------------
def test_mxfp4_known_bytes_low_nibble_first_and_negative_zero():
    # amax 6 -> shared exponent floor(log2 6) - 2 = 0 -> E8M0 byte 127
    w = _row([1.0, -0.5, 6.0, -0.0, 0.0, 1.5, -6.0, 4.0])
    packed, scale = quantize_mxfp4(w)
    assert packed.dtype == torch.uint8 and packed.shape == (1, 16)
    assert scale.dtype == torch.uint8 and scale.shape == (1, 1)
    assert scale.item() == 127
    # codes: 1.0=2, -0.5=9 | 6=7, -0=8 | 0=0, 1.5=3 | -6=15, 4=6; byte = low | high << 4
    assert packed[0, :4].tolist() == [0x92, 0x87, 0x30, 0x6F]
    assert packed[0, 4:].eq(0).all()
    back = dequantize_mxfp4(packed, scale, torch.float32)
    assert torch.equal(back, w)
    assert math.copysign(1.0, back[0, 3].item()) == -1.0  # -0.0 survives
    assert math.copysign(1.0, dequantize_mxfp4(packed, scale, torch.bfloat16)[0, 3].item()) == -1.0


def test_mxfp4_rounds_to_nearest_ties_to_even_code_and_saturates():
    # scale byte 127 (amax 7 in [4, 8)); ties: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4
    w = _row([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 0.3, 2.6])
    packed, scale = quantize_mxfp4(w)
    assert scale.item() == 127
    expected = _row([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 0.5, 3.0])
    assert torch.equal(dequantize_mxfp4(packed, scale, torch.float32), expected)


def test_mxfp4_shared_exponent_per_group_of_32():
    w = torch.cat([_row([3.0]), _row([0.375]), _row([-96.0])], dim=1)  # three groups in one row
    packed, scale = quantize_mxfp4(w)
    # floor(log2 3) - 2 = -1; floor(log2 0.375) - 2 = -4; floor(log2 96) - 2 = 4
    assert scale[0].tolist() == [126, 123, 131]
    # 3 / 2^-1 = 6 -> code 7; 0.375 / 2^-4 = 6 -> code 7; -96 / 2^4 = -6 -> code 15
    assert packed[0, [0, 16, 32]].tolist() == [0x07, 0x07, 0x0F]
    assert torch.equal(dequantize_mxfp4(packed, scale, torch.float32), w)


def test_mxfp4_largest_scale():
    # the largest finite fp32 group: amax = 3 * 2^126 -> exponent 125 -> byte 252, element code 7
    w = _row([3.0 * 2.0 ** 126, -1.5 * 2.0 ** 126])
    packed, scale = quantize_mxfp4(w)
    assert scale.item() == 125 + E8M0_BIAS == 252
    assert packed[0, 0].item() == 0x07 | (0x0D << 4)  # 6 and -3 (x 2^125)
    assert torch.equal(dequantize_mxfp4(packed, scale, torch.float32), w)
    # byte 254, E8M0's largest finite scale 2^127: 0.5, 1 and 1.5 times it are finite, 2 overflows fp32
    top = dequantize_mxfp4(torch.tensor([[0x21, 0x43] + [0] * 14], dtype=torch.uint8),
                           torch.tensor([[254]], dtype=torch.uint8), torch.float32)
    assert top[0, :3].tolist() == [2.0 ** 126, 2.0 ** 127, 1.5 * 2.0 ** 127]
    assert top[0, 3].item() == math.inf


def test_mxfp4_smallest_scale():
    # byte 0 is 2^-127 (a subnormal in fp32 and bf16): every magnitude times it is exact
    packed = torch.tensor([[0x10, 0x32, 0x54, 0x76, 0xA9] + [0] * 11], dtype=torch.uint8)
    scale = torch.tensor([[0]], dtype=torch.uint8)
    expected = [m * 2.0 ** -127 for m in (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -1.0)]
    assert dequantize_mxfp4(packed, scale, torch.float32)[0, :10].tolist() == expected
    assert dequantize_mxfp4(packed, scale, torch.bfloat16)[0, :10].float().tolist() == expected
    # quantizing: the exponent clamps at -127; 2^-126 is 2 * 2^-127 (code 4), a tiny group becomes 0
    tiny = _row([2.0 ** -126])
    p, s = quantize_mxfp4(tiny)
    assert s.item() == 0 and p[0, 0].item() == 0x04
    assert torch.equal(dequantize_mxfp4(p, s, torch.float32), tiny)
    p, s = quantize_mxfp4(_row([2.0 ** -140]))
    assert s.item() == 0 and p.eq(0).all()
    p, s = quantize_mxfp4(torch.zeros(1, 32))  # an all-zero group takes the smallest scale
    assert s.item() == 0 and p.eq(0).all()


def test_mxfp4_odd_rows_and_batched_experts():
    torch.manual_seed(0)
    for shape in [(3, 32), (1, 64), (5, 96), (3, 7, 64)]:
        w = torch.randn(shape) * 3
        packed, scale = quantize_mxfp4(w)
        rows, cols = math.prod(shape[:-1]), shape[-1]
        assert packed.shape == (*shape[:-1], cols // 2) and scale.shape == (*shape[:-1], cols // 32)
        assert packed_shape("mxfp4", rows, cols) == (rows, cols // 2)
        assert scale_shape("mxfp4", rows, cols) == (rows, cols // 32)
        back = dequantize_mxfp4(packed, scale, torch.float32)
        # the error is at most the widest gap's half (1, between 4 and 6) times 2^exponent, except in
        # (6, 8) x 2^exponent, which saturates to 6 (OCP's shared exponent): below 2 x 2^exponent there
        step = torch.exp2(scale.float() - E8M0_BIAS).repeat_interleave(32, -1)
        err = (back - w).abs()
        assert (err <= torch.where(w.abs() > 6 * step, 2 * step, step)).all()
        # the dequantized values are on the grid: quantizing them again gives the same bytes
        p2, s2 = quantize_mxfp4(back)
        assert torch.equal(p2, packed) and torch.equal(s2, scale)
        # a batched call is the per-row call
        flat_p, flat_s = quantize_mxfp4(w.reshape(rows, cols))
        assert torch.equal(flat_p.reshape(packed.shape), packed) and torch.equal(flat_s.reshape(scale.shape), scale)


def test_mxfp4_every_byte_dequantizes_exactly_in_bf16():
    packed = torch.arange(256, dtype=torch.uint8).reshape(16, 16)  # every byte once, 16 rows of 32 elements
    scale = torch.tensor([[120], [127], [130], [1], [200], [60], [127], [127], [0], [127], [127], [127], [127],
                          [127], [127], [250]], dtype=torch.uint8)
    table = e2m1_table().tolist()
    f32 = dequantize_mxfp4(packed, scale, torch.float32)
    bf16 = dequantize_mxfp4(packed, scale, torch.bfloat16)
    for r in range(16):
        for j in range(16):
            byte = int(packed[r, j])
            for half, code in enumerate((byte & 0xF, byte >> 4)):
                want = math.ldexp(table[code], int(scale[r, 0]) - 127)
                assert f32[r, 2 * j + half].item() == want
                assert bf16[r, 2 * j + half].float().item() == want


def test_mxfp4_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="multiple of the group size 32, got 48"):
        quantize_mxfp4(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize_mxfp4(torch.full((1, 32), math.inf))
    with pytest.raises(ValueError, match=r"\[\.\.\., out, in\]"):
        quantize_mxfp4(torch.zeros(32))


# --- int4 pack-quantized ------------------------------------------------------------------------------
def test_int4_known_words_least_significant_first():
    # amax 7.5 -> scale 7.5 / 7.5 = 1; q = round(w) with -7.5 -> -8 (ties to even)
    w = _row([-7.5, -1.0, 0.0, 1.0, 7.0, 3.0, -3.0, 2.0, 5.0])
    packed, scale = quantize_int4(w)
    assert packed.dtype == torch.int32 and packed.shape == (1, 4)
    assert scale.dtype == torch.bfloat16 and scale.shape == (1, 1) and scale.item() == 1.0
    # stored nibbles q + 8: [0, 7, 8, 9, 15, 11, 5, 10] -> word 0xA5BF9870 (bit 31 set: negative int32)
    assert packed[0, 0].item() == 0xA5BF9870 - 2 ** 32
    assert packed[0, 1].item() == 0x8888888D - 2 ** 32  # 5 -> 13, then zeros -> 8
    expected = _row([-8.0, -1.0, 0.0, 1.0, 7.0, 3.0, -3.0, 2.0, 5.0])
    assert torch.equal(dequantize_int4(packed, scale, torch.float32), expected)


def test_int4_odd_width_pads_words_and_groups():
    torch.manual_seed(1)
    w = torch.randn(3, 70)  # 9 words (the last one half padding), 3 groups (the last one partial)
    packed, scale = quantize_int4(w)
    assert packed.shape == (3, 9) == packed_shape("int4", 3, 70)
    assert scale.shape == (3, 3) == scale_shape("int4", 3, 70)
    assert (packed[:, -1] >> 24).eq(0).all()  # the two padding nibbles of the last word are zero
    back = dequantize_int4(packed, scale, torch.float32, columns=70)
    assert back.shape == (3, 70)
    step = scale.float().repeat_interleave(32, -1)[:, :70]
    assert ((back - w).abs() <= step / 2 + 1e-6).all()


def test_int4_exact_in_fp32_and_batched():
    torch.manual_seed(2)
    q = torch.randint(-8, 8, (2, 5, 64), dtype=torch.int32)
    scale = (torch.rand(2, 5, 2) + 0.5).to(torch.bfloat16)
    nibbles = (q + 8).reshape(2, 5, 8, 8)
    packed = torch.zeros(2, 5, 8, dtype=torch.int32)
    for k in range(8):
        packed |= nibbles[..., k] << (4 * k)
    want = (q.double().reshape(2, 5, 2, 32) * scale.double().unsqueeze(-1)).reshape(2, 5, 64)
    assert torch.equal(dequantize_int4(packed, scale, torch.float64), want)
    assert torch.equal(dequantize_int4(packed, scale, torch.float32).double(), want)
    assert torch.equal(dequantize_int4(packed, scale, torch.bfloat16), want.to(torch.bfloat16))


def test_quantized_weight_round_trip_both_formats():
    torch.manual_seed(3)
    w = torch.randn(4, 3, 64)
    for fmt, tol in (("mxfp4", 0.6), ("int4", 0.25)):
        q = quantize(w, fmt)
        assert isinstance(q, QuantizedWeight) and q.columns == 64
        back = q.dequantize(torch.float32)
        assert back.shape == w.shape
        assert (back - w).abs().max() < tol * w.abs().max()
    with pytest.raises(ValueError, match="unknown quantized expert format 'fp8'"):
        quantize(w, "fp8")


def test_block_order_puts_each_blocks_step_in_one_piece_and_inverts_exactly():
    """block_order: for an expert e, block b (rows 64b..64b+63), step s (elements 128s..128s+127), the piece at
    ((e * rows + 64 b) * in/2 + s * 64 * 64) holds row 64b + r's 64 bytes of step s at r * 64, its scale bytes
    likewise (4 a row and step for MXFP4, 8 for int4's bf16); from_block_order gives the checkpoint's back,
    bit for bit; shapes and dtypes unchanged; rows or widths that are not whole blocks and steps are refused."""
    gen = torch.Generator().manual_seed(3)
    E, rows, cols = 3, 128, 384  # 2 blocks, 3 steps
    for fmt in ("mxfp4", "int4"):
        w = torch.randn(E, rows, cols, generator=gen) * 0.02
        packed, scale = (torch.stack(t) for t in zip(*[(q.packed, q.scale) for q in
                                                       (quant.quantize(w[e], fmt) for e in range(E))]))
        bp, bs = quant.block_order(packed, scale)
        assert (bp.shape, bp.dtype, bs.shape, bs.dtype) == (packed.shape, packed.dtype, scale.shape, scale.dtype)
        raw, braw = packed.view(torch.uint8).reshape(E, rows, -1), bp.view(torch.uint8).reshape(-1)
        sraw, bsraw = scale.view(torch.uint8).reshape(E, rows, -1), bs.view(torch.uint8).reshape(-1)
        sb = sraw.shape[-1] // 3  # scale bytes a row and step
        for e, b, s, r in ((0, 0, 0, 0), (2, 1, 2, 63), (1, 1, 0, 5), (2, 0, 1, 40)):
            at = (e * rows + 64 * b) * (cols // 2) + s * 64 * 64 + r * 64
            assert torch.equal(braw[at:at + 64], raw[e, 64 * b + r, 64 * s:64 * s + 64]), (fmt, e, b, s, r)
            at = (e * rows + 64 * b) * sraw.shape[-1] + s * 64 * sb + r * sb
            assert torch.equal(bsraw[at:at + sb], sraw[e, 64 * b + r, sb * s:sb * s + sb]), (fmt, e, b, s, r)
        back = quant.from_block_order(bp, bs)
        assert torch.equal(back[0], packed) and torch.equal(back[1].view(torch.uint8), scale.view(torch.uint8))
        assert torch.equal(quant.dequantize(*back, fmt, torch.float32), quant.dequantize(packed, scale, fmt,
                                                                                          torch.float32))
    with pytest.raises(ValueError, match="whole blocks of 64"):
        quant.block_order(packed[:, :96], scale[:, :96])
    for width in (64, 192):  # less than a step; not whole steps
        q = quant.quantize(torch.randn(64, width, generator=gen), "mxfp4")
        with pytest.raises(ValueError, match=f"rows of {width} elements"):
            quant.from_block_order(q.packed.unsqueeze(0), q.scale.unsqueeze(0))


def test_layouts_and_the_graph_op_that_un_blocks():
    """to_layout / from_layout: rows as they are, blocks by block_order and back; an unknown layout named.
    torch.ops.k3fuse.from_block_order is from_block_order as one node: the same bytes, always a new tensor (a
    table of one step is its own block order), shapes kept under FakeTensor, one node in an exported graph."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    gen = torch.Generator().manual_seed(5)
    q = quant.quantize(torch.randn(2, 128, 256, generator=gen), "mxfp4")
    assert quant.to_layout(q.packed, q.scale, "rows") == (q.packed, q.scale)
    blocked = quant.to_layout(q.packed, q.scale, "blocks")
    assert all(torch.equal(a, b) for a, b in zip(blocked, quant.block_order(q.packed, q.scale)))
    assert all(torch.equal(a, b) for a, b in zip(quant.from_layout(*blocked, "blocks"), (q.packed, q.scale)))
    for convert in (quant.to_layout, quant.from_layout):
        with pytest.raises(ValueError, match="expert layout 'columns' is not one of"):
            convert(q.packed, q.scale, "columns")
    op = torch.ops.k3fuse.from_block_order
    assert all(torch.equal(a, b) for a, b in zip(op(*blocked), (q.packed, q.scale)))
    one_step = quant.quantize(torch.randn(1, 64, 128, generator=gen), "int4", torch.bfloat16)
    out = op(one_step.packed, one_step.scale)
    assert torch.equal(out[0], one_step.packed) and out[0].data_ptr() != one_step.packed.data_ptr()
    with FakeTensorMode() as mode:
        fake = op(mode.from_tensor(blocked[0]), mode.from_tensor(blocked[1]))
        assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in blocked]

    class Unblock(torch.nn.Module):
        def forward(self, packed, scale):
            return op(packed, scale)

    ep = torch.export.export(Unblock(), blocked)
    assert [n.target for n in ep.graph.nodes if n.op == "call_function"].count(op.default) == 1
    assert torch.equal(ep.module()(*blocked)[0], q.packed)


@pytest.mark.parametrize("fmt", ["mxfp4", "int4"])
def test_random_experts_are_checkpoint_layout_at_the_target_rms(fmt):
    """quant.random_experts (the benchmarks' and GPU tests' experts): the checkpoint's shapes and dtypes,
    reproducible from the generator, dequantizing to an RMS near columns^-0.5."""
    rows, cols = 64, 256
    packed, scale = quant.random_experts(fmt, 3, rows, cols, torch.Generator().manual_seed(0), "cpu")
    assert packed.shape == (3, *quant.packed_shape(fmt, rows, cols)) and packed.dtype == quant.packed_dtype(fmt)
    assert scale.shape == (3, *quant.scale_shape(fmt, rows, cols)) and scale.dtype == quant.scale_dtype(fmt)
    again = quant.random_experts(fmt, 3, rows, cols, torch.Generator().manual_seed(0), "cpu")
    assert torch.equal(packed, again[0]) and torch.equal(scale, again[1])
    rms = quant.dequantize(packed, scale, fmt, torch.float32).pow(2).mean().sqrt().item()
    assert 0.8 < rms * math.sqrt(cols) < 1.25, rms
