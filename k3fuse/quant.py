"""The routed experts' checkpoint formats: compressed-tensors MXFP4 and int4, packed and unpacked.

Two formats, in exactly the layouts the checkpoints store (docs/reference/quant-formats.md):

* ``mxfp4`` (compressed-tensors ``mxfp4-pack-quantized``, Kimi K3): ``weight_packed`` uint8
  ``[out, in/2]``, element 2j in the low nibble of byte j and 2j+1 in the high nibble; a nibble is
  E2M1 (bit 3 the sign, the low three bits index `E2M1_MAGNITUDES`); ``weight_scale`` uint8 E8M0
  ``[out, in/32]``, value 2^(s - `E8M0_BIAS`), one per `GROUP_SIZE` consecutive elements of a row.
* ``int4`` (compressed-tensors ``pack-quantized``, symmetric, Kimi K2.x): ``weight_packed`` int32
  ``[out, ceil(in/8)]``, element 8w+k in bits 4k..4k+3 of word w, stored as q + `INT4_OFFSET`;
  ``weight_scale`` in the model dtype (bf16) ``[out, ceil(in/32)]``; value (nibble - 8) * scale.

Any leading batch dimensions (``[E, out, in]``) are allowed everywhere. Dequantization is written
with plain traceable ATen ops (bitwise and / shift, a 16-entry lookup table, a power-of-two scale,
a multiply) because the routed-experts rule matches that spelling in the ATen graph: change it here
and the rule changes with it. MXFP4 dequantizes exactly in bf16 and fp32 (e2m1 times a power of
two); int4 exactly in fp32 (a 4-bit integer times a bf16 scale), rounded once to a bf16 result.

A leaf module: it imports torch only, so the model, the spelling and the kernels may import it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: elements per scale, both formats (compressed-tensors' MXFP4 group, K2.x's int4 group size)
GROUP_SIZE = 32
#: E2M1 magnitudes, indexed by a nibble's low three bits (bit 3 is the sign)
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: the E2M1 sign bit within a nibble
E2M1_SIGN = 0x8
#: an E8M0 byte s is 2^(s - E8M0_BIAS); s = 255 is NaN in OCP MX, and `quantize_mxfp4` never writes it
E8M0_BIAS = 127
E8M0_NAN = 255
#: int4 nibbles are stored as q + INT4_OFFSET (q in [-8, 7])
INT4_OFFSET = 8
INT4_MAX = 7
#: int4 nibbles per int32 word, least significant first
INT4_PER_WORD = 8
#: two E2M1 nibbles per uint8 byte, the low one first
FP4_PER_BYTE = 2
NIBBLE_MASK = 0xF
NIBBLE_BITS = 4

#: the expert formats a model may store (bf16: unquantized in the model dtype)
EXPERT_FORMATS = ("bf16", "mxfp4", "int4")
#: compressed-tensors' `quantization_config` format name of each quantized expert format
CHECKPOINT_FORMATS = {"mxfp4": "mxfp4-pack-quantized", "int4": "pack-quantized"}
#: how a model holds its quantized experts: "rows", the checkpoint's row-major tables, or "blocks",
#: `block_order`'s (repacked where they load, for the fused kernel's contiguous copies)
EXPERT_LAYOUTS = ("rows", "blocks")


def e2m1_table(device: torch.device | str | None = None) -> torch.Tensor:
    """The 16 signed E2M1 values in fp32, indexed by the whole nibble (code 8 is -0.0)."""
    values = list(E2M1_MAGNITUDES) + [-m for m in E2M1_MAGNITUDES]
    return torch.tensor(values, dtype=torch.float32, device=device)


# --- shapes ---------------------------------------------------------------------------------------
def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def packed_shape(fmt: str, rows: int, columns: int) -> tuple[int, int]:
    """``weight_packed``'s shape for a [rows, columns] weight in `fmt`."""
    if fmt == "mxfp4":
        return rows, columns // FP4_PER_BYTE
    if fmt == "int4":
        return rows, _ceil_div(columns, INT4_PER_WORD)
    raise ValueError(f"unknown quantized expert format {fmt!r}; known: {sorted(CHECKPOINT_FORMATS)}")


def scale_shape(fmt: str, rows: int, columns: int) -> tuple[int, int]:
    """``weight_scale``'s shape for a [rows, columns] weight in `fmt`."""
    if fmt not in CHECKPOINT_FORMATS:
        raise ValueError(f"unknown quantized expert format {fmt!r}; known: {sorted(CHECKPOINT_FORMATS)}")
    return rows, _ceil_div(columns, GROUP_SIZE)


def packed_dtype(fmt: str) -> torch.dtype:
    """``weight_packed``'s dtype: uint8 for MXFP4, int32 for int4."""
    return {"mxfp4": torch.uint8, "int4": torch.int32}[fmt]


def scale_dtype(fmt: str, model_dtype: torch.dtype = torch.bfloat16) -> torch.dtype:
    """``weight_scale``'s dtype: uint8 E8M0 for MXFP4, the model dtype (bf16 in K2.x) for int4."""
    return torch.uint8 if fmt == "mxfp4" else model_dtype


def check_mxfp4_columns(columns: int, what: str = "weight") -> None:
    """MXFP4 needs whole scale groups along `in` (the layout has no padding)."""
    if columns % GROUP_SIZE:
        raise ValueError(f"MXFP4 {what} needs its input width to be a multiple of the group size "
                         f"{GROUP_SIZE}, got {columns}")


@dataclass(frozen=True)
class QuantizedWeight:
    """One quantized weight as the checkpoint stores it: `packed` and `scale` in `fmt`'s layout,
    leading dims allowed; `columns` is the logical input width (int4 pads to whole words)."""

    packed: torch.Tensor
    scale: torch.Tensor
    fmt: str
    columns: int

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        if self.fmt == "mxfp4":
            return dequantize_mxfp4(self.packed, self.scale, dtype)
        if self.fmt == "int4":
            return dequantize_int4(self.packed, self.scale, dtype, self.columns)
        raise ValueError(f"unknown quantized expert format {self.fmt!r}")


def quantize(w: torch.Tensor, fmt: str, scale_dtype_: torch.dtype = torch.bfloat16) -> QuantizedWeight:
    """`w` [..., out, in] in `fmt` (``mxfp4`` or ``int4``)."""
    if fmt == "mxfp4":
        packed, scale = quantize_mxfp4(w)
    elif fmt == "int4":
        packed, scale = quantize_int4(w, scale_dtype_)
    else:
        raise ValueError(f"unknown quantized expert format {fmt!r}; known: {sorted(CHECKPOINT_FORMATS)}")
    return QuantizedWeight(packed, scale, fmt, w.shape[-1])


def dequantize(packed: torch.Tensor, scale: torch.Tensor, fmt: str, dtype: torch.dtype,
               columns: int | None = None, table: torch.Tensor | None = None) -> torch.Tensor:
    """Either format's dequantization (the spelling the model and the rule share); `table` is
    MXFP4's `e2m1_table` (built when not given; int4 has none)."""
    if fmt == "mxfp4":
        return dequantize_mxfp4(packed, scale, dtype, table)
    if fmt == "int4":
        return dequantize_int4(packed, scale, dtype, columns)
    raise ValueError(f"unknown quantized expert format {fmt!r}; known: {sorted(CHECKPOINT_FORMATS)}")


# --- MXFP4 ----------------------------------------------------------------------------------------
def _check_finite(w: torch.Tensor) -> None:
    if not torch.isfinite(w).all():
        raise ValueError("cannot quantize a weight with inf or NaN entries")


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight_packed uint8 [..., out, in/2], weight_scale uint8 E8M0 [..., out, in/32]).

    OCP MX: the shared exponent is floor(log2(amax)) - 2 (the largest E2M1 magnitude is 1.5 * 2^2),
    clamped to E8M0's finite range; elements round to the nearest E2M1 value, ties to the even code,
    and saturate at 6. The sign bit follows the element's sign, so -0.0 (and a negative that rounds to
    zero) is code 8. An all-zero group gets the smallest scale (byte 0).
    """
    if w.dim() < 2:
        raise ValueError(f"quantize_mxfp4 needs a [..., out, in] weight, got shape {tuple(w.shape)}")
    check_mxfp4_columns(w.shape[-1])
    _check_finite(w)
    lead, cols = w.shape[:-1], w.shape[-1]
    groups = w.float().reshape(*lead, cols // GROUP_SIZE, GROUP_SIZE)
    amax = groups.abs().amax(-1, keepdim=True)
    # floor(log2) of a float32 is exact via frexp (amax = m * 2^e, m in [0.5, 1)): floor(log2) = e - 1
    _, e = torch.frexp(amax)
    exponent = torch.where(amax > 0, e.to(torch.int32) - 1 - 2, torch.full_like(e, -E8M0_BIAS, dtype=torch.int32))
    exponent = exponent.clamp(-E8M0_BIAS, E8M0_NAN - 1 - E8M0_BIAS)
    scaled = groups.abs() * torch.exp2(-exponent.float())  # exact: a power of two in fp32's range
    code = _round_to_e2m1(scaled)
    code = code | (torch.signbit(groups).to(torch.uint8) << 3)
    code = code.reshape(*lead, cols)
    packed = code[..., 0::2] | (code[..., 1::2] << NIBBLE_BITS)
    scale = (exponent + E8M0_BIAS).to(torch.uint8).squeeze(-1)
    return packed.contiguous(), scale.contiguous()


def _round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 magnitude code (uint8, 0..7) of x >= 0, ties to the even code, saturating at 6."""
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for lower, (a, b) in enumerate(zip(E2M1_MAGNITUDES, E2M1_MAGNITUDES[1:])):
        mid = (a + b) / 2
        above = x > mid if lower % 2 == 0 else x >= mid  # a tie goes to the even code
        code += above.to(torch.uint8)
    return code


def dequantize_mxfp4(weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                     dtype: torch.dtype = torch.bfloat16, table: torch.Tensor | None = None) -> torch.Tensor:
    """[..., out, in] in `dtype` from uint8 [..., out, in/2] nibbles and E8M0 [..., out, in/32].

    Spelling: low = packed & 0xF, high = packed >> 4, interleaved; `table` (the fp32 `e2m1_table`,
    built here when not given) indexed by the nibble; times exp2(scale - 127) per group of 32, in
    fp32; one cast to `dtype`. Exact wherever the value is finite in `dtype`: 2^(s-127) * 6 overflows
    fp32 and bf16 for s = 254 and magnitudes from 2 up; E8M0's NaN byte 255 becomes inf (or NaN on a
    zero element) rather than NaN.
    """
    if table is None:
        table = e2m1_table(weight_packed.device)
    lead, nbytes = weight_packed.shape[:-1], weight_packed.shape[-1]
    low = torch.bitwise_and(weight_packed, NIBBLE_MASK)
    high = torch.bitwise_right_shift(weight_packed, NIBBLE_BITS)
    codes = torch.stack([low, high], dim=-1).reshape(*lead, nbytes * FP4_PER_BYTE)
    values = table[codes.long()]  # fp32 [..., out, in]
    scales = torch.exp2(weight_scale.float() - E8M0_BIAS)  # fp32 [..., out, in/32]
    groups = values.reshape(*lead, nbytes * FP4_PER_BYTE // GROUP_SIZE, GROUP_SIZE) * scales.unsqueeze(-1)
    return groups.reshape(*lead, nbytes * FP4_PER_BYTE).to(dtype)


# --- int4 (pack-quantized) ------------------------------------------------------------------------
def quantize_int4(w: torch.Tensor, scale_dtype_: torch.dtype = torch.bfloat16
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight_packed int32 [..., out, ceil(in/8)], weight_scale [..., out, ceil(in/32)]).

    Symmetric, as compressed-tensors: scale = amax / 7.5 (the 4-bit range over two), in
    `scale_dtype_`, at least that dtype's eps; q = clamp(round(w / scale), -8, 7), stored as q + 8;
    a partial last word is padded with zero nibbles.
    """
    if w.dim() < 2:
        raise ValueError(f"quantize_int4 needs a [..., out, in] weight, got shape {tuple(w.shape)}")
    _check_finite(w)
    lead, cols = w.shape[:-1], w.shape[-1]
    n_groups = _ceil_div(cols, GROUP_SIZE)
    wf = torch.nn.functional.pad(w.float(), (0, n_groups * GROUP_SIZE - cols))
    groups = wf.reshape(*lead, n_groups, GROUP_SIZE)
    amax = groups.abs().amax(-1, keepdim=True)
    scale = (amax / ((2 * INT4_MAX + 1) / 2)).to(scale_dtype_)
    scale = scale.clamp(min=torch.finfo(scale_dtype_).eps)
    q = torch.round(groups / scale.float()).clamp(-INT4_OFFSET, INT4_MAX).to(torch.int32) + INT4_OFFSET
    q = q.reshape(*lead, n_groups * GROUP_SIZE)[..., :cols]
    words = _ceil_div(cols, INT4_PER_WORD)
    q = torch.nn.functional.pad(q, (0, words * INT4_PER_WORD - cols)).reshape(*lead, words, INT4_PER_WORD)
    packed = torch.zeros((*lead, words), dtype=torch.int32, device=w.device)
    for k in range(INT4_PER_WORD):
        packed |= q[..., k] << (NIBBLE_BITS * k)  # bit 31 set for k = 7, nibble >= 8: a negative int32
    return packed.contiguous(), scale.squeeze(-1).contiguous()


def dequantize_int4(weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                    dtype: torch.dtype = torch.bfloat16, columns: int | None = None) -> torch.Tensor:
    """[..., out, columns] in `dtype` from int32 words [..., out, ceil(in/8)] and group scales.

    Spelling: nibble k of each word is (packed >> 4k) & 0xF, stacked least significant first;
    (nibble - 8) times the group's scale in fp32 (exact), one cast to `dtype`; `columns` (default:
    every nibble of the words) drops a partial word's padding.
    """
    lead, words = weight_packed.shape[:-1], weight_packed.shape[-1]
    nibbles = torch.stack([torch.bitwise_and(torch.bitwise_right_shift(weight_packed, NIBBLE_BITS * k), NIBBLE_MASK)
                           for k in range(INT4_PER_WORD)], dim=-1)
    q = (nibbles.reshape(*lead, words * INT4_PER_WORD) - INT4_OFFSET).float()
    cols = words * INT4_PER_WORD if columns is None else columns
    n_groups = weight_scale.shape[-1]
    padded = n_groups * GROUP_SIZE
    if padded != q.shape[-1]:  # scale groups and words cover different widths: align on the groups
        q = torch.nn.functional.pad(q, (0, padded - q.shape[-1])) if padded > q.shape[-1] else q[..., :padded]
    groups = q.reshape(*lead, n_groups, GROUP_SIZE) * weight_scale.float().unsqueeze(-1)
    out = groups.reshape(*lead, padded)
    if cols != padded:
        out = out[..., :cols]
    return out.to(dtype)


# --- block order: the fused kernels' load-time layout ------------------------------------------------
#: rows of a block (a CuTe W4A16 CTA's 4 warps of 16) and elements of a step (a thread quad's 4 groups)
BLOCK_ROWS = 64
BLOCK_STEP = 128


def block_order(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Either format's stacked table [E, rows, ...] and its scales [E, rows, in/32] in block order: each block of
    BLOCK_ROWS rows as its steps of BLOCK_STEP elements one after another, a step its rows' bytes of that step
    (weights: 64 bytes a row; scales: 4 groups' bytes), so that the fused kernel's copy of a block's step is one
    contiguous piece (kernels/lib/cute/routed_experts_w4a16.py, `blocked`). Same shapes and dtypes."""
    return _reorder(packed, scale, to_blocks=True)


def from_block_order(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`block_order`'s inverse: the checkpoint's row-major layout back, bit for bit."""
    return _reorder(packed, scale, to_blocks=False)


def to_layout(packed: torch.Tensor, scale: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint (row-major) tables [E, rows, ...] in `layout` (EXPERT_LAYOUTS): as they are, or in block order."""
    check_layout(layout)
    return block_order(packed, scale) if layout == "blocks" else (packed, scale)


def from_layout(packed: torch.Tensor, scale: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`to_layout`'s inverse: tables held in `layout` back in the checkpoint's row-major layout."""
    check_layout(layout)
    return from_block_order(packed, scale) if layout == "blocks" else (packed, scale)


def check_layout(layout: str) -> None:
    """Raise ValueError naming a layout that is not one of EXPERT_LAYOUTS."""
    if layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert layout {layout!r} is not one of {EXPERT_LAYOUTS}")


@torch.library.custom_op("k3fuse::from_block_order", mutates_args=())
def from_block_order_op(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`from_block_order` as one graph node, torch.ops.k3fuse.from_block_order: the model's spelling un-blocks
    the step's selected experts with it, so that the routed-experts rule matches a blocked model's spelling
    without the reshapes' sizes traced into the pattern."""
    return from_block_order(packed, scale)


@from_block_order_op.register_fake
def _from_block_order_fake(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # shapes and dtypes are unchanged; whole blocks and steps are checked where the tables are made
    # (K3Config, the rule's guard) and on every eager call
    return torch.empty_like(packed), torch.empty_like(scale)


def _reorder(packed: torch.Tensor, scale: torch.Tensor, to_blocks: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Either direction on the bytes: [E, blocks, BLOCK_ROWS, steps, bytes a step] <-> [E, blocks, steps,
    BLOCK_ROWS, bytes a step], for the weights and the scales alike."""
    E, rows = packed.shape[0], packed.shape[1]
    raw = [t.reshape(E, rows, -1).view(torch.uint8) for t in (packed, scale)]
    columns = raw[0].shape[-1] * 2  # a row's packed bytes are its elements / 2 in both formats
    steps = columns // BLOCK_STEP
    if rows % BLOCK_ROWS or columns % BLOCK_STEP or not steps or raw[1].shape[-1] % steps:
        raise ValueError(f"block order needs rows in whole blocks of {BLOCK_ROWS} and rows of whole steps of "
                         f"{BLOCK_STEP} elements, got {rows} rows of {columns} elements ({raw[1].shape[-1]} scale "
                         f"bytes)")
    out = []
    for t, like in zip(raw, (packed, scale)):
        split = (BLOCK_ROWS, steps) if to_blocks else (steps, BLOCK_ROWS)
        moved = t.reshape(E, rows // BLOCK_ROWS, *split, -1).transpose(2, 3)
        # clone, not contiguous: a table of one step would come back as a view of its input
        out.append(moved.clone(memory_format=torch.contiguous_format).view(E, rows, -1).view(like.dtype)
                   .view(like.shape))
    return out[0], out[1]


#: RMS of a uniformly drawn code: E2M1's 16 values, int4's q - 8 over the 16 nibbles
E2M1_CODE_RMS = math.sqrt(sum(v * v for v in E2M1_MAGNITUDES) / 8)
INT4_CODE_RMS = math.sqrt(sum((q - INT4_OFFSET) ** 2 for q in range(16)) / 16)


def random_experts(fmt: str, n_experts: int, rows: int, columns: int, generator: torch.Generator,
                   device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed, scale) of `n_experts` random experts [rows, columns] in `fmt` for benchmarks and GPU tests:
    uniform codes, scales giving an RMS near columns^-0.5 (E8M0 exponents centre -1..+1; int4 scales x0.75 to
    x1.25). The model's synthetic weights (k3fuse/model/weights.py) draw theirs per expert and shard."""
    std = columns ** -0.5
    shape = (n_experts, *packed_shape(fmt, rows, columns))
    sshape = (n_experts, *scale_shape(fmt, rows, columns))
    if fmt == "mxfp4":
        packed = torch.randint(0, 256, shape, device=device, dtype=torch.uint8, generator=generator)
        centre = E8M0_BIAS + round(math.log2(std / E2M1_CODE_RMS))
        scale = torch.randint(centre - 1, centre + 2, sshape, device=device, dtype=torch.int32, generator=generator)
        return packed, scale.to(torch.uint8)
    packed = torch.randint(-2 ** 31, 2 ** 31 - 1, shape, device=device, dtype=torch.int32, generator=generator)
    scale = std / INT4_CODE_RMS * (0.75 + 0.5 * torch.rand(sshape, device=device, generator=generator))
    return packed, scale.to(torch.bfloat16)


__all__ = ["GROUP_SIZE", "E2M1_MAGNITUDES", "E2M1_SIGN", "E8M0_BIAS", "E8M0_NAN", "INT4_OFFSET", "INT4_MAX",
           "INT4_PER_WORD", "FP4_PER_BYTE", "EXPERT_FORMATS", "CHECKPOINT_FORMATS", "QuantizedWeight",
           "e2m1_table", "packed_shape", "scale_shape", "packed_dtype", "scale_dtype", "check_mxfp4_columns",
           "quantize", "dequantize", "quantize_mxfp4", "dequantize_mxfp4", "quantize_int4", "dequantize_int4",
           "BLOCK_ROWS", "BLOCK_STEP", "block_order", "from_block_order", "EXPERT_LAYOUTS", "to_layout",
           "from_layout", "check_layout", "from_block_order_op", "E2M1_CODE_RMS", "INT4_CODE_RMS", "random_experts"]
