"""Random weights for the reference model: what each parameter is (`ParamSpec`) and how a rank draws its slice.

A `ParamSpec` is one parameter as the full (TP 1) model defines it: its full shape, how tensor parallelism
splits it, its dtype class, its random initialisation and the checkpoint tensor it corresponds to. The tables
in params.py list every parameter of every layer type; the modules build their parameters from them with
`WeightSource.build`, and a checkpoint loader iterates the same tables.

Two ways to draw, both the same function of (seed, layer, name, element index) at every TP size, so a TP N
model's rank r holds exactly rank r's slice of the TP 1 model:

* ``randn`` (the default on the host): the full tensor from a `torch.Generator` seeded by (seed, layer, name),
  then sliced. Fine for CPU-sized models; the full tensor is a float32 temporary.
* ``hash`` (the default where weights are drawn on a CUDA device): every element is a counter-based hash of
  its global index, so only this rank's slice is ever computed, directly on the device and in chunks of
  rows (no full float32 temporary, whatever the tensor's size: K3's 163840 x 7168 embedding at TP 16 is
  10240 rows of it). Other numbers than ``randn`` for the same seed.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from .. import quant

#: how tensor parallelism splits a parameter: "column" (dim 0: output rows, e.g. q/k/v, gate/up),
#: "row" (dim 1: input columns, the row-parallel out/down projections), "vocab" (dim 0 of the vocabulary:
#: the embedding and the LM head), "replicated" (whole on every rank); routed experts: "experts_column"
#: (w1/w3 [E, I, L] by I) and "experts_row" (w2 [E, L, I] by I)
SHARDINGS = ("replicated", "column", "row", "vocab", "experts_column", "experts_row")
Sharding = Literal["replicated", "column", "row", "vocab", "experts_column", "experts_row"]


@dataclass(frozen=True)
class Init:
    """A random initialisation: normal(mean=a, std=b) or uniform(low=a, high=b)."""

    kind: Literal["normal", "uniform"]
    a: float
    b: float


def normal(std: float, mean: float = 0.0) -> Init:
    return Init("normal", mean, std)


def uniform(low: float, high: float) -> Init:
    return Init("uniform", low, high)


#: an RMSNorm weight: 1 + small noise, so a wrong weight shows up in tests
NORM_INIT = normal(0.1, 1.0)


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of a module, as the full model (TP 1) defines it.

    name   the attribute inside its module ("w_q"; "attn_norm.weight" for a norm module's weight)
    hf     the checkpoint tensor(s), relative to the module's checkpoint prefix ({e} is the expert id)
    shape  the full shape; `local_shape(tp)` is one rank's
    shard  one of SHARDINGS
    dtype  "trunk" (the model dtype), "float32", or "expert" (the trunk dtype, or packed + scale where the
           config's expert_format is quantized)
    init   how a random model draws it; `key` names its draw (the generator's or the hash's key)
    parts  for a parameter stacked from several checkpoint tensors (the KDA conv over [q; k; v]): each part's
           draw key, each split like the whole and concatenated along dim 0
    note   what a loader must know beyond the name (a fold, a padding, an older layout)
    """

    name: str
    hf: str
    shape: tuple[int, ...]
    shard: Sharding
    init: Init
    key: str
    dtype: Literal["trunk", "float32", "expert"] = "trunk"
    parts: tuple[str, ...] = ()
    note: str = ""

    def __post_init__(self) -> None:
        if self.shard not in SHARDINGS:
            raise ValueError(f"ParamSpec {self.name}: shard must be one of {SHARDINGS}, got {self.shard!r}")

    @property
    def shard_dim(self) -> int | None:
        """The dimension TP splits (of the full shape), None when replicated."""
        return {"replicated": None, "column": 0, "vocab": 0, "row": 1, "experts_column": 1,
                "experts_row": 2}[self.shard]

    def local_shape(self, tp: int) -> tuple[int, ...]:
        dim = self.shard_dim
        if dim is None:
            return self.shape
        if self.shape[dim] % tp:
            raise ValueError(f"TP={tp} does not divide dim {dim} ({self.shape[dim]}) of {self.name} {self.shape}")
        return tuple(s // tp if i == dim else s for i, s in enumerate(self.shape))


def shard(t: torch.Tensor, dim: int, tp_size: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s contiguous 1/tp_size slice of `t` along `dim`."""
    size = t.shape[dim] // tp_size
    return t.narrow(dim, rank * size, size)


# --- counter-based hashing (the "hash" draw) -------------------------------------------------------
_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32), without a product past 2^48 (no signed overflow)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser on int64 tensors holding values in [0, 2^32)."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def hash32(index: torch.Tensor, key: int) -> torch.Tensor:
    """A 32-bit hash (int64 in [0, 2^32)) of each non-negative int64 index under a 32-bit key."""
    h = fmix32((index & _M32) ^ (key & _M32))
    return fmix32(h ^ (index >> 32) ^ ((key * 0x9E3779B9) & _M32))


def hash_uniform(index: torch.Tensor, key: int) -> torch.Tensor:
    """fp32 values in (0, 1): the hash's top 24 bits, centred in their bucket."""
    return ((hash32(index, key) >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def hash_normal(index: torch.Tensor, key: int) -> torch.Tensor:
    """fp32 standard normal values (Box-Muller over two independent hashes of each index)."""
    u1, u2 = hash_uniform(index, key), hash_uniform(index, key ^ 0x5BD1E995)
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * math.pi) * u2)


#: elements per chunk of a hash draw (fp32 temporaries of this size, never of a whole tensor)
HASH_CHUNK = 1 << 22


class WeightSource:
    """Deterministic random weights: each tensor is a function of (seed, layer, name, element index), and each
    rank keeps its slice. `draw` is "randn" (full tensor from a generator, then sliced; the host default) or
    "hash" (only the slice, on the model's device; the default with `on_device=True` on CUDA)."""

    def __init__(self, seed: int, dtype: torch.dtype, device: torch.device | str, on_device: bool = False,
                 draw: Literal["randn", "hash"] | None = None):
        self.seed = int(seed)
        self.dtype = dtype
        self.device = torch.device(device)
        self.draw_device = self.device if on_device and self.device.type == "cuda" else torch.device("cpu")
        self.draw = draw or ("hash" if self.draw_device.type == "cuda" else "randn")
        if self.draw not in ("randn", "hash"):
            raise ValueError(f"draw must be 'randn' or 'hash', got {self.draw!r}")

    def _key(self, layer: int, name: str) -> int:
        return zlib.crc32(f"k3fuse/{self.seed}/{layer}/{name}".encode())

    def _generator(self, layer: int, name: str) -> torch.Generator:
        key = self._key(layer, name)
        return torch.Generator(self.draw_device).manual_seed((self.seed * 1_000_003 + key) % (2**63))

    def normal(self, layer: int, name: str, shape: tuple[int, ...], std: float,
               mean: float = 0.0) -> torch.Tensor:
        """Full fp32 tensor on the draw device (or an empty meta tensor on the meta device)."""
        if self.device.type == "meta":
            return torch.empty(shape, device="meta")
        t = torch.randn(shape, generator=self._generator(layer, name), dtype=torch.float32,
                        device=self.draw_device)
        return t * std + mean

    def uniform(self, layer: int, name: str, shape: tuple[int, ...], low: float,
                high: float) -> torch.Tensor:
        if self.device.type == "meta":
            return torch.empty(shape, device="meta")
        t = torch.rand(shape, generator=self._generator(layer, name), dtype=torch.float32,
                       device=self.draw_device)
        return low + (high - low) * t

    def param(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> nn.Parameter:
        """A frozen parameter in `dtype` (the model dtype unless told, e.g. fp32 vectors)."""
        # clone: a shard must not keep the full tensor's storage alive
        t = t.to(device=self.device, dtype=dtype or self.dtype).clone(memory_format=torch.contiguous_format)
        return nn.Parameter(t, requires_grad=False)

    # --- one parameter of a table ----------------------------------------------------------------
    def build(self, spec: ParamSpec, layer: int, tp: int, rank: int) -> nn.Parameter:
        """Rank `rank`'s slice of `spec` at TP `tp`, in its dtype, on the model's device."""
        dtype = torch.float32 if spec.dtype == "float32" else self.dtype
        if spec.parts:  # stacked parts: each split like the whole, then concatenated
            part_shape = (spec.shape[0] // len(spec.parts), *spec.shape[1:])
            pieces = [self._draw(ParamSpec(spec.name, spec.hf, part_shape, spec.shard, spec.init, key), layer, tp,
                                 rank, dtype) for key in spec.parts]
            return nn.Parameter(torch.cat(pieces, 0), requires_grad=False)
        return nn.Parameter(self._draw(spec, layer, tp, rank, dtype), requires_grad=False)

    def _draw(self, spec: ParamSpec, layer: int, tp: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
        local = spec.local_shape(tp)
        if self.device.type == "meta":
            return torch.empty(local, dtype=dtype, device="meta")
        dim = spec.shard_dim
        if self.draw == "randn":
            full = (self.normal(layer, spec.key, spec.shape, spec.init.b, spec.init.a) if spec.init.kind == "normal"
                    else self.uniform(layer, spec.key, spec.shape, spec.init.a, spec.init.b))
            return self.param(full if dim is None else shard(full, dim, tp, rank), dtype).data
        out = torch.empty(local, dtype=dtype, device=self.device)
        offsets = [0] * len(spec.shape)
        if dim is not None:
            offsets[dim] = rank * local[dim]
        self._hash_fill(out, spec.shape, offsets, self._key(layer, spec.key), spec.init)
        return out

    def _hash_fill(self, out: torch.Tensor, full: tuple[int, ...], offsets: list[int], key: int, init: Init) -> None:
        """out = init applied to the hash of each element's index in the full tensor; out is the block of the
        full tensor starting at `offsets`. Filled in chunks of rows of the leading dims (HASH_CHUNK elements)."""
        if out.numel() == 0:
            return
        flat = out.view(-1, out.shape[-1]) if out.dim() > 1 else out.view(1, -1)
        cols = flat.shape[-1]
        strides = [math.prod(full[i + 1:]) for i in range(len(full))]
        col_index = torch.arange(offsets[-1], offsets[-1] + cols, device=out.device, dtype=torch.int64)
        lead = out.shape[:-1]
        rows_per = max(1, HASH_CHUNK // cols)
        for start in range(0, flat.shape[0], rows_per):
            rows = torch.arange(start, min(start + rows_per, flat.shape[0]), device=out.device, dtype=torch.int64)
            base = torch.zeros_like(rows)
            rem = rows
            for d in reversed(range(len(lead))):  # the row's index in each leading dim, then in the full tensor
                base = base + (rem % lead[d] + offsets[d]) * strides[d]
                rem = rem // lead[d]
            index = base[:, None] + col_index[None, :]
            if init.kind == "normal":
                values = hash_normal(index, key) * init.b + init.a
            else:
                values = init.a + (init.b - init.a) * hash_uniform(index, key)
            flat[start:start + rows.shape[0]].copy_(values)

    # --- routed experts --------------------------------------------------------------------------
    def experts_normal(self, layer: int, name: str, n_experts: int, shape: tuple[int, int], std: float,
                       shard_dim: int, tp_size: int, rank: int) -> nn.Parameter:
        """Experts [E, *shape] in the model dtype, sharded along `shard_dim` of each expert's shape.

        randn: drawn one expert at a time from the tensor's generator (fp32 temporaries of one expert, never
        of the whole table); hash: only the slice, in chunks."""
        local = list(shape)
        local[shard_dim] //= tp_size
        out = torch.empty((n_experts, *local), dtype=self.dtype, device=self.device)
        if self.device.type == "meta":
            pass
        elif self.draw == "hash":
            offsets = [0, 0, 0]
            offsets[1 + shard_dim] = rank * local[shard_dim]
            self._hash_fill(out, (n_experts, *shape), offsets, self._key(layer, name), normal(std))
        else:
            g = self._generator(layer, name)
            for e in range(n_experts):
                full = torch.randn(shape, generator=g, dtype=torch.float32, device=self.draw_device)
                out[e].copy_(shard(full * std, shard_dim, tp_size, rank))
        return nn.Parameter(out, requires_grad=False)

    def experts_quantized(self, layer: int, name: str, fmt: str, n_experts: int, shape: tuple[int, int],
                          std: float, shard_dim: int, tp_size: int, rank: int, layout: str = "rows"
                          ) -> tuple[nn.Parameter, nn.Parameter]:
        """(weight_packed, weight_scale) of E experts of `shape` [out, in] in `fmt`, the layout of
        k3fuse/quant.py, each sharded along `shard_dim` (0: rows; 1: the input width, in whole groups),
        then held in `layout` (quant.to_layout: the same draws, repacked in block order for "blocks").

        Drawn directly in the packed layout: uniform codes (random bytes or int32 words) and scales around the
        power of two (MXFP4) or the value (int4) that gives the dequantized weights an RMS near `std`. No float
        temporary of the weights is ever built (randn: one expert at a time on the draw device; hash: only this
        rank's slice, in chunks of experts, on the model's device).
        """
        rows, cols = shape
        p_shape, s_shape = quant.packed_shape(fmt, rows, cols), quant.scale_shape(fmt, rows, cols)
        p_dtype, s_dtype = quant.packed_dtype(fmt), quant.scale_dtype(fmt)

        def local(full: tuple[int, int]) -> tuple[int, ...]:
            dims = list(full)
            dims[shard_dim] //= tp_size
            return (n_experts, *dims)

        packed = torch.empty(local(p_shape), dtype=p_dtype, device=self.device)
        scale = torch.empty(local(s_shape), dtype=s_dtype, device=self.device)
        if self.device.type == "meta":
            return nn.Parameter(packed, requires_grad=False), nn.Parameter(scale, requires_grad=False)
        if self.draw == "hash":
            self._experts_quantized_hash(packed, scale, layer, name, fmt, p_shape, s_shape, std, shard_dim, rank,
                                        layout)
        else:
            g_packed = self._generator(layer, f"{name}.weight_packed")
            g_scale = self._generator(layer, f"{name}.weight_scale")
            draw = {"dtype": p_dtype, "device": self.draw_device, "generator": g_packed}
            for e in range(n_experts):
                if fmt == "mxfp4":
                    codes = torch.randint(0, 256, p_shape, **draw)
                    centre = quant.E8M0_BIAS + round(math.log2(std / _MXFP4_CODE_RMS))
                    s = torch.randint(centre - _EXPONENT_SPREAD, centre + _EXPONENT_SPREAD + 1, s_shape,
                                      generator=g_scale, dtype=torch.int32, device=self.draw_device).to(s_dtype)
                else:
                    codes = torch.randint(-2 ** 31, 2 ** 31, p_shape, **draw)
                    u = torch.rand(s_shape, generator=g_scale, dtype=torch.float32, device=self.draw_device)
                    s = (std / _INT4_CODE_RMS * (1 + _INT4_SCALE_SPREAD * (2 * u - 1))).to(s_dtype)
                held = quant.to_layout(shard(codes, shard_dim, tp_size, rank)[None],
                                       shard(s, shard_dim, tp_size, rank)[None], layout)
                packed[e].copy_(held[0][0])
                scale[e].copy_(held[1][0])
        return nn.Parameter(packed, requires_grad=False), nn.Parameter(scale, requires_grad=False)

    def _experts_quantized_hash(self, packed: torch.Tensor, scale: torch.Tensor, layer: int, name: str, fmt: str,
                                p_shape: tuple[int, int], s_shape: tuple[int, int], std: float, shard_dim: int,
                                rank: int, layout: str) -> None:
        n_experts = packed.shape[0]
        p_local, s_local = tuple(packed.shape[1:]), tuple(scale.shape[1:])
        p_off, s_off = [0, 0], [0, 0]
        p_off[shard_dim], s_off[shard_dim] = rank * p_local[shard_dim], rank * s_local[shard_dim]
        key_p, key_s = self._key(layer, f"{name}.weight_packed"), self._key(layer, f"{name}.weight_scale")
        per = max(1, HASH_CHUNK // max(1, math.prod(p_local)))
        for e0 in range(0, n_experts, per):
            e1 = min(n_experts, e0 + per)
            codes = self._hash_block((e1 - e0, *p_local), (n_experts, *p_shape), [e0, *p_off], key_p)
            hs = self._hash_block((e1 - e0, *s_local), (n_experts, *s_shape), [e0, *s_off], key_s)
            if fmt == "mxfp4":
                codes = (codes & 0xFF).to(torch.uint8)
                centre = quant.E8M0_BIAS + round(math.log2(std / _MXFP4_CODE_RMS))
                s = (centre - _EXPONENT_SPREAD + hs % (2 * _EXPONENT_SPREAD + 1)).to(scale.dtype)
            else:  # int32 words: the hash's 32 bits, two's complement
                codes = torch.where(codes >= 2 ** 31, codes - 2 ** 32, codes).to(torch.int32)
                u = ((hs >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
                s = (std / _INT4_CODE_RMS * (1 + _INT4_SCALE_SPREAD * (2 * u - 1))).to(scale.dtype)
            held = quant.to_layout(codes, s, layout)
            packed[e0:e1].copy_(held[0])
            scale[e0:e1].copy_(held[1])

    def _hash_block(self, local: tuple[int, ...], full: tuple[int, ...], offsets: list[int], key: int) -> torch.Tensor:
        """Raw 32-bit hashes (int64) of the block of the full tensor at `offsets` of shape `local`."""
        index = torch.zeros(local, dtype=torch.int64, device=self.device)
        strides = [math.prod(full[i + 1:]) for i in range(len(full))]
        for d, (size, off) in enumerate(zip(local, offsets)):
            shape = [1] * len(local)
            shape[d] = size
            index = index + (torch.arange(off, off + size, device=self.device, dtype=torch.int64) * strides[d]
                             ).view(shape)
        return hash32(index, key)


#: the spread of the drawn E8M0 exponents around their centre (-1, 0, +1) and of int4 scales (x0.5 to x1.5)
_EXPONENT_SPREAD = 1
_INT4_SCALE_SPREAD = 0.5
#: RMS of a uniformly drawn code: E2M1 (mean square of the 16 values 8.5625) times the exponent spread
#: (mean square of 2^-1, 1, 2: 1.75); int4 q in [-8, 7] (mean square 21.5) times the scale spread (13/12)
_MXFP4_CODE_RMS = (8.5625 * 1.75) ** 0.5
_INT4_CODE_RMS = (21.5 * 13 / 12) ** 0.5


__all__ = ["Init", "ParamSpec", "SHARDINGS", "WeightSource", "shard", "normal", "uniform", "NORM_INIT",
           "hash32", "hash_uniform", "hash_normal", "fmix32"]
