"""The CuTe W4A16 kernels' dequantization, run on CPU: the PTX text the kernel inlines
(lib/cute/routed_experts_w4a16.py: e8m0_ptx, e2m1x8_ptx, int4x8_ptx), executed by a small interpreter
of the instructions it uses, equals k3fuse.quant's dequantization bit for bit.

For every nibble at every position of a word, and random words: MXFP4 under all 256 E8M0 bytes (the
loop for ordinary scales under the bytes it runs for, below 128; the wide-scale loop under all), int4
under every finite bf16 scale. The bf16x2 arithmetic is IEEE's: the exact result, rounded once to the
nearest even bf16 (subnormals kept, overflow to inf), as PTX defines `.rn` on bf16x2; one wrong
constant in the text is caught. The GPU test (tests/gpu/test_routed_experts_w4a16_gpu.py) checks the
whole op against float64 on the device.
"""
from __future__ import annotations

import re

import pytest
import torch

from k3fuse import quant
from k3fuse.kernels.lib.cute import routed_experts_w4a16 as w4

MASK32 = (1 << 32) - 1


# --- bf16 ------------------------------------------------------------------------------------------
def _bf16_value(bits: torch.Tensor) -> torch.Tensor:
    """16-bit patterns (int64) -> their values in float64 (exact)."""
    return (bits.to(torch.int32) << 16).view(torch.float32).double()


def _round_bf16_bits(x: torch.Tensor) -> torch.Tensor:
    """float64 values (each the exact result of one bf16 operation) -> the bf16 patterns nearest, ties to
    even: 8 significant bits, or the subnormal quantum 2^-133; past the largest finite value, inf."""
    finite = torch.isfinite(x) & (x != 0)
    _, e = torch.frexp(torch.where(finite, x, torch.ones_like(x)))  # |x| in [2^(e-1), 2^e)
    quantum = torch.exp2(torch.clamp(e - 8, min=-133).double())
    r = torch.where(finite, torch.round(x / quantum) * quantum, x)
    r = torch.where(r.abs() >= 2.0 ** 128, torch.copysign(torch.full_like(r, float("inf")), r), r)
    return r.float().to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF  # r is a bf16: exact


def _bf16x2(op, *regs: torch.Tensor) -> torch.Tensor:
    halves = []
    for shift in (0, 16):
        vals = [_bf16_value((r >> shift) & 0xFFFF) for r in regs]
        halves.append(_round_bf16_bits(op(*vals)))
    return halves[0] | (halves[1] << 16)


# --- the interpreter -------------------------------------------------------------------------------
def _lop3(a, b, c, lut: int):
    out = torch.zeros_like(a)
    for i in range(8):
        if lut >> i & 1:
            out |= (a if i & 4 else ~a) & (b if i & 2 else ~b) & (c if i & 1 else ~c)
    return out & MASK32


def _prmt(a, b, sel: int):
    both = a | (b << 32)
    out = torch.zeros_like(a)
    for k in range(4):
        byte = sel >> 4 * k & 0x7
        out |= (both >> 8 * byte & 0xFF) << 8 * k
    return out


OPS = {
    "mov.b32": lambda a: a,
    "shr.u32": lambda a, b: a >> b,
    "shl.b32": lambda a, b: (a << b) & MASK32,
    "and.b32": lambda a, b: a & b,
    "or.b32": lambda a, b: a | b,
    "mul.lo.u32": lambda a, b: (a * b) & MASK32,
    "mad.lo.u32": lambda a, b, c: (a * b + c) & MASK32,
    "lop3.b32": lambda a, b, c, lut: _lop3(a, b, c, int(lut.flatten()[0])),
    "prmt.b32": lambda a, b, sel: _prmt(a, b, int(sel.flatten()[0])),
    "setp.eq.u32": lambda a, b: a == b,
    "mul.rn.bf16x2": lambda a, b: _bf16x2(lambda x, y: x * y, a, b),
    "sub.rn.bf16x2": lambda a, b: _bf16x2(lambda x, y: x - y, a, b),
}


def run_ptx(text: str, inputs: dict[int, torch.Tensor], outputs: int) -> list[torch.Tensor]:
    """Execute an inline-asm body on int64 tensors of 32-bit values: `$n` operands (outputs first, as the
    constraint string orders them), `.reg` names, immediates; `@p` predication. Any instruction not in OPS
    fails the test (the interpreter must not guess)."""
    regs: dict[str, torch.Tensor] = {f"${k}": v & MASK32 for k, v in inputs.items()}
    shape = next(iter(inputs.values())).shape
    for line in re.split(r"[;\n]", text.strip().strip("{}")):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        pred = None
        if line.startswith("@"):
            pred, line = line[1:].split(None, 1)
        op, args = line.split(None, 1)
        dst, *srcs = [s.strip() for s in args.split(",")]
        assert op in OPS, f"the interpreter has no {op!r}"

        def value(s: str) -> torch.Tensor:
            return regs[s] if s in regs else torch.full(shape, int(s, 0), dtype=torch.int64)

        res = OPS[op](*(value(s) for s in srcs))
        regs[dst] = torch.where(regs[pred], res, regs[dst]) if pred else res
    return [regs[f"${k}"] for k in range(outputs)]


def _register_order(values: torch.Tensor) -> torch.Tensor:
    """[N, 8] dequantized bf16 of a word -> the kernel's 4 registers [N, 4] (element j low, j + 4 high)."""
    bits = values.view(torch.int16).to(torch.int64) & 0xFFFF
    return torch.stack([bits[:, j] | (bits[:, j + 4] << 16) for j in range(4)], dim=1)


def _same(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Bit equality, NaN matching any NaN (the E8M0 NaN byte's products)."""
    nan = lambda b: (b & 0x7F80 == 0x7F80) & (b & 0x7F != 0)  # noqa: E731
    halves = [(got >> s & 0xFFFF, want >> s & 0xFFFF) for s in (0, 16)]
    return torch.stack([(g == w) | (nan(g) & nan(w)) for g, w in halves]).all(0)


def _words(n_random: int, alone: bool) -> torch.Tensor:
    """Each nibble value at every position of a word, all positions at once (and each alone, the others
    zero), then random words (int64 values of 32 bits)."""
    ramp = [sum((v + p) % 16 << 4 * p for p in range(8)) for v in range(16)]
    alone = [v << 4 * p for v in range(16) for p in range(8)] if alone else []
    rand = torch.randint(0, 1 << 32, (n_random,), generator=torch.Generator().manual_seed(3), dtype=torch.int64)
    return torch.cat([torch.tensor(ramp + alone, dtype=torch.int64), rand])


# --- the tests -------------------------------------------------------------------------------------
def test_interpreter_knows_ieee_bf16_rounding():
    """The reference arithmetic itself: ties to even, subnormals, overflow."""
    one, tiny = 0x3F80, 0x0001  # 1.0, the smallest subnormal 2^-133
    halfway = _round_bf16_bits(torch.tensor([1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8], dtype=torch.float64))
    assert halfway.tolist() == [one, one + 2]  # 1 + half an ulp -> 1 (even); 1 + 1.5 ulp -> 1 + 2 ulp
    assert _round_bf16_bits(torch.tensor([2.0 ** -134, 2.0 ** -133 * 1.5], dtype=torch.float64)).tolist() == [0, 2]
    assert _bf16x2(lambda x, y: x * y, torch.tensor([tiny]), torch.tensor([one])).item() == tiny
    assert _round_bf16_bits(torch.tensor([2.0 ** 128, -(2.0 ** 127) * 1.999], dtype=torch.float64)).tolist() == [
        0x7F80, 0xFF80]


def _mxfp4_differs(one_multiply: bool, e8m0_text: str, e2m1_text: str) -> str | None:
    """Where the PTX's registers differ from quant's MXFP4 dequantization (None: nowhere): every nibble at
    every position and random words, under the scale bytes the loop runs for."""
    words = _words(4096, alone=True)
    scales = torch.arange(128 if one_multiply else 256, dtype=torch.int64)
    w = words.repeat(len(scales))
    s = scales.repeat_interleave(len(words))
    factor = run_ptx(e8m0_text, {1: s}, 1)[0]
    got = torch.stack(run_ptx(e2m1_text, {4: w, 5: factor}, 4), dim=1)
    packed = torch.zeros(len(w), 16, dtype=torch.uint8)  # one 32-element group, the word its first 8
    packed[:, :4] = torch.stack([(w >> 8 * b) & 0xFF for b in range(4)], dim=1).to(torch.uint8)
    want = _register_order(quant.dequantize_mxfp4(packed, s.to(torch.uint8)[:, None], torch.bfloat16)[:, :8])
    bad = ~_same(got, want).all(1)
    return (f"{bad.sum().item()} words differ, first {w[bad][0].item():#x} under scale {s[bad][0].item()}"
            if bad.any() else None)


def _int4_differs(text: str) -> str | None:
    """Where the PTX's registers differ from quant's int4 dequantization (None: nowhere): every nibble at
    every position and random words, under every finite bf16 scale (both signs, subnormals, zeros)."""
    words = _words(16, alone=False)
    patterns = torch.arange(1 << 16, dtype=torch.int64)
    scales = patterns[(patterns & 0x7F80) != 0x7F80]
    w = words.repeat(len(scales))
    s = scales.repeat_interleave(len(words))
    got = torch.stack(run_ptx(text, {4: w, 5: s | (s << 16)}, 4), dim=1)  # the kernel's prmt 0x1010
    packed = torch.where(w >= 1 << 31, w - (1 << 32), w).to(torch.int32)[:, None]
    scale = (s.to(torch.int32) << 16).view(torch.float32).to(torch.bfloat16)[:, None]  # exact
    want = _register_order(quant.dequantize_int4(packed, scale, torch.bfloat16))
    bad = ~_same(got, want).all(1)
    return (f"{bad.sum().item()} words differ, first {w[bad][0].item():#x} under scale {s[bad][0].item():#06x}"
            if bad.any() else None)


@pytest.mark.parametrize("one_multiply", [True, False], ids=["ordinary_scales", "wide_scales"])
def test_mxfp4_ptx_is_the_dequantization_bit_for_bit(one_multiply):
    assert _mxfp4_differs(one_multiply, w4.e8m0_ptx(one_multiply), w4.e2m1x8_ptx(one_multiply)) is None


def test_int4_ptx_is_the_dequantization_bit_for_bit():
    assert _int4_differs(w4.int4x8_ptx()) is None


@pytest.mark.parametrize("fmt,old,new", [
    ("int4", "0x43084308", "0x43074307"),  # the offset: 135, not 136
    ("int4", "shr.u32 q, $4, 8;", "shr.u32 q, $4, 9;"),
    ("mxfp4", "0x81C081C0", "0x01C001C0"),  # the sign bits dropped
    ("mxfp4", "0x3F003F00", "0x3F803F80"),  # E8M0's bias off by one
])
def test_a_changed_constant_is_caught(fmt, old, new):
    """The comparison has teeth: one wrong constant in the kernel's PTX differs somewhere."""
    if fmt == "int4":
        assert old in w4.int4x8_ptx() and _int4_differs(w4.int4x8_ptx().replace(old, new)) is not None
    else:
        texts = (w4.e8m0_ptx(True), w4.e2m1x8_ptx(True))
        assert any(old in t for t in texts)
        assert _mxfp4_differs(True, *(t.replace(old, new) for t in texts)) is not None


def test_the_interpreter_refuses_what_it_does_not_know():
    with pytest.raises(AssertionError, match="no 'fma.rn.bf16x2'"):
        run_ptx("{\nfma.rn.bf16x2 $0, $1, $1, $1;\n}", {1: torch.zeros(1, dtype=torch.int64)}, 1)
