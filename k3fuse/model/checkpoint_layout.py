"""The checkpoint tensors behind each parameter of the model, and how a rank's parameter is built from their slices.

`param_layouts(cfg)` gives, for every entry of params.model_table(cfg), the tensors a K3 checkpoint stores for it
(`Stored`: name, full shape, accepted dtypes, the dimension TP splits, what its values must satisfy), how a rank's
parameter is assembled from this rank's slices of them (`ParamLayout.assemble`), and how a full (TP 1) parameter
is split into them (`ParamLayout.split`, the writer's side). Four forms, chosen from the table's specs:

* one tensor as the model holds it (most weights); ``A_log`` also as the older [1, 1, h, 1];
* the KDA short-conv weight, stacked from ``{q,k,v}_conv1d.weight`` ([P, 1, K] each, or [P, K]), each split by
  rows, then concatenated (rank r holds [q_r; k_r; v_r]);
* an AttnRes query, folded from ``*_res_norm.weight`` [H] and ``*_res_proj.weight`` [1, H] (their product in fp32;
  the writer stores the query as the projection and a norm of ones, which folds back bit for bit);
* the routed experts, one tensor (bf16: ``weight``) or pair (``weight_packed`` / ``weight_scale``, with an
  optional ``weight_shape``) per expert and projection, stacked [E, ...] and held in the config's expert_layout.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

from .. import quant
from .config import K3Config
from .params import HF_LAYER_PREFIX, TableEntry, model_table
from .weights import ParamSpec

#: safetensors names of the float dtypes a non-expert tensor may be stored in (the loader casts to the model's)
FLOAT_DTYPES = ("BF16", "F32", "F16")
ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.uint8: "U8",
             torch.int32: "I32", torch.int64: "I64"}
#: what a stored tensor's values must satisfy: finite floats; E8M0 bytes whose scaled values stay finite; finite
#: non-negative int4 scales; any bits (packed codes); the unpacked [out, in] of a `weight_shape`
Values = Literal["float", "e8m0", "int4_scale", "bits", "shape"]


class Stored(NamedTuple):
    """One checkpoint tensor: `forms` are the (shape, TP-split dim) layouts it may have, the first the one the
    writer stores; `optional` ones may be absent. (A NamedTuple: K3 has 740k of them, built on every load.)"""

    name: str
    forms: tuple[tuple[tuple[int, ...], int | None], ...]
    dtypes: tuple[str, ...]
    values: Values
    optional: bool = False
    expect: tuple[int, ...] = ()  # a weight_shape's value

    @property
    def shape(self) -> tuple[int, ...]:
        return self.forms[0][0]


Read = Callable[[Stored], "torch.Tensor | None"]


@dataclass(frozen=True)
class ParamLayout:
    """The stored tensors of one model parameter (`entry`), named as the checkpoint layer it reads holds them."""

    entry: TableEntry
    form: Literal["one", "stacked", "fold", "experts"]
    stored: tuple[Stored, ...]
    cfg: K3Config

    def params(self) -> tuple[str, ...]:
        """The model parameters this entry fills (quantized experts: `<proj>_packed` and `<proj>_scale`)."""
        if self.form == "experts" and self.cfg.quantized_experts:
            return f"{self.entry.param}_packed", f"{self.entry.param}_scale"
        return (self.entry.param,)

    def assemble(self, read: Read, tp: int, dtypes: dict[str, torch.dtype],
                 out: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """This rank's parameter(s), built from `read(stored)` (this rank's slice of a stored tensor, None for an
        absent optional one) in `dtypes[param]`; written into `out[param]` where given (experts one at a time)."""
        spec, param = self.entry.spec, self.entry.param
        if self.form == "experts":
            return self._assemble_experts(read, tp, dtypes, out)
        if self.form == "stacked":
            local = spec.local_shape(tp)
            pieces = [read(s).reshape(local[0] // len(self.stored), *local[1:]) for s in self.stored]
            value = torch.cat(pieces, 0)
        elif self.form == "fold":
            norm, proj = (read(s) for s in self.stored)
            value = norm.float() * proj.float().reshape(-1)
        else:
            value = read(self.stored[0]).reshape(spec.local_shape(tp))
        return _put(out, param, value.to(dtypes[param]))

    def _assemble_experts(self, read: Read, tp: int, dtypes: dict[str, torch.dtype],
                          out: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        cfg, names = self.cfg, self.params()
        E = cfg.n_experts
        per_expert = len(self.stored) // E
        # the checkpoint's row-major tables of this rank, filled expert by expert, then held in the config's layout
        tables = [torch.empty((E, *shape), dtype=dtypes[n])
                  for n, shape in zip(names, _expert_local_shapes(cfg, self.entry.spec, tp))]
        for e in range(E):
            stored = self.stored[e * per_expert:(e + 1) * per_expert]
            for table, s in zip(tables, (s for s in stored if s.values != "shape")):
                table[e].copy_(read(s))
            for s in stored:
                if s.values == "shape":
                    read(s)  # checked by the reader, not kept
        held = quant.to_layout(tables[0], tables[1], cfg.expert_layout) if cfg.quantized_experts else tables
        result: dict[str, torch.Tensor] = {}
        for name, value in zip(names, held):
            result.update(_put(out, name, value))
        return result

    def split(self, full: dict[str, torch.Tensor]) -> Iterator[tuple[Stored, torch.Tensor]]:
        """The stored tensors of the full (TP 1) parameter(s) `full[param]` (experts in the checkpoint's rows)."""
        if self.form == "experts":
            yield from self._split_experts(full)
            return
        value = full[self.entry.param]
        if self.form == "stacked":
            for s, piece in zip(self.stored, value.chunk(len(self.stored), 0)):
                yield s, piece.reshape(s.shape)
        elif self.form == "fold":
            norm, proj = self.stored
            yield norm, torch.ones(norm.shape, dtype=value.dtype, device=value.device)
            yield proj, value.reshape(proj.shape)
        else:
            yield self.stored[0], value.reshape(self.stored[0].shape)

    def _split_experts(self, full: dict[str, torch.Tensor]) -> Iterator[tuple[Stored, torch.Tensor]]:
        tables = [full[n] for n in self.params()]
        per_expert = len(self.stored) // self.cfg.n_experts
        for e in range(self.cfg.n_experts):
            stored = self.stored[e * per_expert:(e + 1) * per_expert]
            yield from zip((s for s in stored if s.values != "shape"), (t[e] for t in tables))
            if self.cfg.expert_format == "int4":  # compressed-tensors' pack-quantized writes the unpacked shape
                yield from ((s, torch.tensor(s.expect, dtype=torch.int32)) for s in stored if s.values == "shape")


def _put(out: dict[str, torch.Tensor] | None, name: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    if out is None:
        return {name: value}
    with torch.no_grad():
        out[name].copy_(value)
    return {name: out[name]}


def _expert_local_shapes(cfg: K3Config, spec: ParamSpec, tp: int) -> list[tuple[int, ...]]:
    """One expert's tables at TP `tp` (packed and scale, or the bf16 weight)."""
    rows, cols = spec.shape[1:]
    dim = spec.shard_dim - 1
    if not cfg.quantized_experts:
        shapes = [[rows, cols]]
    else:
        shapes = [list(quant.packed_shape(cfg.expert_format, rows, cols)),
                  list(quant.scale_shape(cfg.expert_format, rows, cols))]
    for s in shapes:
        s[dim] //= tp
    return [tuple(s) for s in shapes]


def _expand(pattern: str) -> list[str]:
    """`a.{x,y}.b` -> [`a.x.b`, `a.y.b`]: the table's brace notation for a parameter of several tensors."""
    m = re.search(r"\{([^{}]*,[^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [pattern[:m.start()] + alt + pattern[m.end():] for alt in m.group(1).split(",")]


def param_layout(cfg: K3Config, entry: TableEntry, ckpt_layer: int | None = None) -> ParamLayout:
    """The stored tensors of `entry` as checkpoint layer `ckpt_layer` (default: the entry's own) holds them."""
    spec = entry.spec
    hf = entry.hf
    if entry.layer >= 0 and ckpt_layer is not None and ckpt_layer != entry.layer:
        hf = HF_LAYER_PREFIX.format(layer=ckpt_layer) + spec.hf
    dim = spec.shard_dim
    if spec.dtype == "expert":
        return ParamLayout(entry, "experts", _expert_stored(cfg, entry, hf), cfg)
    names = _expand(hf)
    if spec.parts:  # stacked: each [P, 1, K] (or [P, K]) split by rows
        P, K = spec.shape[0] // len(spec.parts), spec.shape[1]
        stored = tuple(Stored(n, (((P, 1, K), 0), ((P, K), 0)), FLOAT_DTYPES, "float") for n in names)
        return ParamLayout(entry, "stacked", stored, cfg)
    if len(names) == 2:  # an AttnRes query: [norm weight H | proj weight 1 x H], replicated
        (H,) = spec.shape
        norm, proj = sorted(names, key=lambda n: "_proj." in n)
        stored = (Stored(norm, (((H,), None),), FLOAT_DTYPES, "float"),
                  Stored(proj, (((1, H), None),), FLOAT_DTYPES, "float"))
        return ParamLayout(entry, "fold", stored, cfg)
    forms: tuple[tuple[tuple[int, ...], int | None], ...] = ((spec.shape, dim),)
    if spec.name == "A_log":  # the older [1, 1, h, 1]
        forms += (((1, 1, spec.shape[0], 1), 2),)
    return ParamLayout(entry, "one", (Stored(names[0], forms, FLOAT_DTYPES, "float"),), cfg)


def _expert_stored(cfg: K3Config, entry: TableEntry, hf: str) -> tuple[Stored, ...]:
    spec = entry.spec
    rows, cols = spec.shape[1:]
    dim = spec.shard_dim - 1
    fmt = cfg.expert_format
    per_expert: list[tuple[str, tuple[int, ...], tuple[str, ...], Values, bool, tuple[int, ...]]]
    if not cfg.quantized_experts:
        per_expert = [("weight", (rows, cols), FLOAT_DTYPES, "float", False, ())]
    else:
        scale_dtypes = ("U8",) if fmt == "mxfp4" else FLOAT_DTYPES
        per_expert = [("weight_packed", quant.packed_shape(fmt, rows, cols), (ST_DTYPES[quant.packed_dtype(fmt)],),
                       "bits", False, ()),
                      ("weight_scale", quant.scale_shape(fmt, rows, cols), scale_dtypes,
                       "e8m0" if fmt == "mxfp4" else "int4_scale", False, ()),
                      ("weight_shape", (2,), ("I32", "I64"), "shape", True, (rows, cols))]
    # "<layer>.block_sparse_moe.experts.{e}.w1.<part>": the text around {e}, once (K3 has 740k of these names)
    head, tail = _expand(hf)[0].rsplit(".", 1)[0].split("{e}")
    return tuple(Stored(f"{head}{e}{tail}.{part}", ((tuple(shape), None if values == "shape" else dim),), dtypes,
                        values, optional, expect)
                 for e in range(cfg.n_experts) for part, shape, dtypes, values, optional, expect in per_expert)


def param_layouts(cfg: K3Config, layers: list[int] | None = None) -> list[ParamLayout]:
    """Every parameter of K3Model(cfg) with its stored tensors; model layer i reads checkpoint layer layers[i]."""
    return [param_layout(cfg, e, None if e.layer < 0 or layers is None else layers[e.layer])
            for e in model_table(cfg)]


__all__ = ["Stored", "ParamLayout", "param_layout", "param_layouts", "FLOAT_DTYPES", "ST_DTYPES"]
