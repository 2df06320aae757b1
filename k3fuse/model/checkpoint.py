"""The routed experts from a compressed-tensors checkpoint (safetensors shards + config.json).

K3 ships its routed experts as compressed-tensors ``mxfp4-pack-quantized`` and K2.x as int4
``pack-quantized``, one tensor pair per expert and projection (docs/reference/quant-formats.md):

    <layer prefix>.experts.<e>.w1|w2|w3.weight_packed    (w1, w3 [I, L]; w2 [L, I], packed along in)
    <layer prefix>.experts.<e>.w1|w2|w3.weight_scale
    <layer prefix>.experts.<e>.w1|w2|w3.weight_shape     (optional: int32 [2], the unpacked [out, in])

`load_routed_experts` copies this rank's slice of I of every expert into a K3DecodeStack built with
the checkpoint's `expert_format` (reading only that slice from the files), in the model's `expert_layout`
(repacked in block order as it loads where the model holds blocks). Anything that does not fit
is an error naming the tensor and what was expected: a missing tensor, a wrong shape or dtype, a name
under an experts prefix that is not one of the above, an expert id past n_experts, a quantization
config of another format or group size. `save_routed_experts` writes the same layout from a TP 1
model (small test checkpoints).
"""
from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .. import quant

#: where a layer's routed experts live in the checkpoint (K3's Hugging Face layout)
DEFAULT_LAYER_PREFIX = "model.layers.{layer}.mlp"
PROJECTIONS = ("w1", "w2", "w3")
PARTS = ("weight_packed", "weight_scale", "weight_shape")
CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
#: compressed-tensors' quantization method name in config.json
QUANT_METHOD = "compressed-tensors"
#: safetensors dtype names of what each format stores
_ST_DTYPES = {torch.uint8: "U8", torch.int32: "I32", torch.bfloat16: "BF16", torch.float16: "F16",
              torch.float32: "F32", torch.int64: "I64"}


class CheckpointError(ValueError):
    """The checkpoint does not match the model: the message names the tensor or the config field."""


# --- config.json ----------------------------------------------------------------------------------
def checkpoint_format(config: dict[str, Any]) -> str:
    """The expert format ("mxfp4" or "int4") a config.json's `quantization_config` describes.

    Accepts compressed-tensors' top-level `format` or its config groups' (newer versions put the
    format per group); the 4-bit group must be symmetric with group size 32.
    """
    qc = config.get("quantization_config")
    if not isinstance(qc, dict):
        raise CheckpointError(f"{CONFIG_FILE} has no quantization_config (expected compressed-tensors "
                              f"{sorted(quant.CHECKPOINT_FORMATS.values())})")
    if qc.get("quant_method") != QUANT_METHOD:
        raise CheckpointError(f"quantization_config.quant_method is {qc.get('quant_method')!r}, "
                              f"expected {QUANT_METHOD!r}")
    by_name = {v: k for k, v in quant.CHECKPOINT_FORMATS.items()}
    groups = qc.get("config_groups") or {}
    found: dict[str, str] = {}  # format -> where it was named
    if qc.get("format") in by_name:
        found[by_name[qc["format"]]] = "quantization_config.format"
    for gname, group in groups.items():
        fmt = group.get("format", qc.get("format"))
        if fmt not in by_name:
            continue
        found.setdefault(by_name[fmt], f"config_groups.{gname}")
        weights = group.get("weights") or {}
        for key, want in (("num_bits", 4), ("group_size", quant.GROUP_SIZE), ("symmetric", True)):
            if key in weights and weights[key] != want:
                raise CheckpointError(f"quantization_config.config_groups.{gname}.weights.{key} is "
                                      f"{weights[key]!r}, expected {want!r} for {fmt}")
    if not found:
        named = [qc.get("format")] + [g.get("format") for g in groups.values()]
        raise CheckpointError(f"quantization_config names no supported format (found {named}); expected one "
                              f"of {sorted(by_name)}")
    if len(found) > 1:
        raise CheckpointError(f"quantization_config names more than one expert format: {found}")
    return next(iter(found))


def quantization_config(fmt: str) -> dict[str, Any]:
    """The compressed-tensors `quantization_config` of routed experts in `fmt` (what the writer stores)."""
    name = quant.CHECKPOINT_FORMATS[fmt]
    weights = {"num_bits": 4, "type": "float" if fmt == "mxfp4" else "int", "symmetric": True,
               "strategy": "group", "group_size": quant.GROUP_SIZE}
    return {"quant_method": QUANT_METHOD, "format": name,
            "config_groups": {"group_0": {"targets": ["re:.*experts.*"], "weights": weights, "format": name}}}


# --- shards ---------------------------------------------------------------------------------------
def _shard_files(path: Path) -> list[Path]:
    index = path / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({path / f for f in weight_map.values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise CheckpointError(f"{path}: shard file(s) {missing} named by {INDEX_FILE} do not exist")
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors shards")
    return files


def _expected(fmt: str, proj: str, rows_cols: tuple[int, int], part: str) -> tuple[tuple[int, ...], torch.dtype]:
    rows, cols = rows_cols
    if part == "weight_packed":
        return quant.packed_shape(fmt, rows, cols), quant.packed_dtype(fmt)
    if part == "weight_scale":
        return quant.scale_shape(fmt, rows, cols), quant.scale_dtype(fmt)
    return (2,), torch.int32  # compressed-tensors' weight_shape (any integer dtype is read)


def load_routed_experts(model: torch.nn.Module, path: str | Path, *, layers: Sequence[int] | None = None,
                        layer_prefix: str = DEFAULT_LAYER_PREFIX) -> dict[str, Any]:
    """Copy a checkpoint's routed experts into `model` (a K3DecodeStack, this rank's TP slice).

    `layers[i]` is the checkpoint layer that model layer i reads (default: the same index);
    `layer_prefix` is a format string of `layer`. Returns what was loaded (format, layers, tensors).
    """
    from safetensors import safe_open

    path = Path(path)
    config_path = path / CONFIG_FILE
    if not config_path.exists():
        raise CheckpointError(f"{path}: no {CONFIG_FILE} (its quantization_config names the expert format)")
    fmt = checkpoint_format(json.loads(config_path.read_text()))
    cfg = model.config
    if cfg.expert_format != fmt:
        raise CheckpointError(f"the checkpoint's experts are {fmt} ({quant.CHECKPOINT_FORMATS[fmt]}) but the model "
                              f"stores {cfg.expert_format}: build it with expert_format={fmt!r}")
    layers = list(range(cfg.n_layers)) if layers is None else list(layers)
    if len(layers) != cfg.n_layers:
        raise CheckpointError(f"layers={layers} maps {len(layers)} checkpoint layers onto a model of "
                              f"{cfg.n_layers}")
    tp, rank = model.tp_size, model.rank
    E, I, L = cfg.n_experts, cfg.moe_inter, cfg.latent
    full = {"w1": (I, L), "w3": (I, L), "w2": (L, I)}
    shard_dim = {"w1": 0, "w3": 0, "w2": 1}  # rows of w1/w3, the input width of w2 (whole groups)

    files = _shard_files(path)
    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    where = {name: h for h in handles for name in h.keys()}
    prefixes = {layer_prefix.format(layer=c): i for i, c in enumerate(layers)}
    pattern = re.compile(r"(?P<prefix>.+)\.experts\.(?P<expert>\d+)\.(?P<proj>[^.]+)\.(?P<part>[^.]+)")
    experts_re = re.compile(r"(?P<prefix>.+)\.experts\.")
    for name in where:  # misnamed tensors under a loaded layer's experts
        m = experts_re.match(name)
        if not m or m.group("prefix") not in prefixes:
            continue
        full_m = pattern.fullmatch(name)
        if (not full_m or full_m.group("proj") not in PROJECTIONS or full_m.group("part") not in PARTS):
            raise CheckpointError(f"unexpected tensor {name!r} under the routed experts: expected "
                                  f"'{m.group('prefix')}.experts.<e>.<{'|'.join(PROJECTIONS)}>."
                                  f"<{'|'.join(PARTS)}>'")
        if int(full_m.group("expert")) >= E:
            raise CheckpointError(f"tensor {name!r} names expert {full_m.group('expert')} but the model has "
                                  f"n_experts={E}")

    loaded = 0
    for layer_idx, ckpt_layer in enumerate(layers):
        routed = model.layers[layer_idx].moe.routed
        prefix = layer_prefix.format(layer=ckpt_layer)
        for proj in PROJECTIONS:
            for e in range(E):
                read: dict[str, torch.Tensor] = {}  # this rank's slice of each part, stored once both are read
                for part in PARTS:
                    name = f"{prefix}.experts.{e}.{proj}.{part}"
                    shape, dtype = _expected(fmt, proj, full[proj], part)
                    if name not in where:
                        if part == "weight_shape":
                            continue  # optional
                        raise CheckpointError(f"missing tensor {name!r}: expected {_ST_DTYPES[dtype]} "
                                              f"{list(shape)} ({proj} is {list(full[proj])} in {fmt})")
                    sl = where[name].get_slice(name)
                    got_shape, got_dtype = tuple(sl.get_shape()), sl.get_dtype()
                    if part == "weight_shape":
                        if got_shape != (2,):
                            raise CheckpointError(f"tensor {name!r} has shape {list(got_shape)}, expected [2]")
                        value = [int(v) for v in sl[:].tolist()]
                        if value != list(full[proj]):
                            raise CheckpointError(f"tensor {name!r} says the weight is {value}, expected "
                                                  f"{list(full[proj])} ({proj} of this model)")
                        continue
                    if got_shape != shape or got_dtype != _ST_DTYPES[dtype]:
                        raise CheckpointError(f"tensor {name!r} is {got_dtype} {list(got_shape)}, expected "
                                              f"{_ST_DTYPES[dtype]} {list(shape)} ({proj} is {list(full[proj])} "
                                              f"in {fmt})")
                    dim = shard_dim[proj]
                    size = shape[dim] // tp
                    index = (slice(rank * size, (rank + 1) * size), slice(None)) if dim == 0 else \
                        (slice(None), slice(rank * size, (rank + 1) * size))
                    read[part] = sl[index]
                    loaded += 1
                routed.store_expert(proj, e, read["weight_packed"], read["weight_scale"])
    return {"format": fmt, "layers": layers, "tensors": loaded, "files": [f.name for f in files],
            "tp": tp, "rank": rank}


def save_routed_experts(model: torch.nn.Module, path: str | Path, *, layers: Sequence[int] | None = None,
                        layer_prefix: str = DEFAULT_LAYER_PREFIX, experts_per_shard: int | None = None,
                        weight_shape: bool = True) -> list[Path]:
    """Write a TP 1 model's quantized routed experts in the compressed-tensors layout: per-expert
    tensors in safetensors shards (`experts_per_shard` experts of a layer per file, default all),
    `model.safetensors.index.json` and `config.json` with the quantization_config."""
    from safetensors.torch import save_file

    if model.tp_size != 1:
        raise ValueError(f"save_routed_experts writes full experts: a TP 1 model, not tp_size={model.tp_size}")
    cfg = model.config
    if not cfg.quantized_experts:
        raise ValueError("the model's routed experts are bf16: nothing in compressed-tensors' packed layout")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    layers = list(range(cfg.n_layers)) if layers is None else list(layers)
    per_shard = experts_per_shard or cfg.n_experts
    chunks = [(i, start) for i in range(cfg.n_layers) for start in range(0, cfg.n_experts, per_shard)]
    weight_map: dict[str, str] = {}
    files = []
    full = {"w1": (cfg.moe_inter, cfg.latent), "w3": (cfg.moe_inter, cfg.latent), "w2": (cfg.latent, cfg.moe_inter)}
    for n, (i, start) in enumerate(chunks):
        routed = model.layers[i].moe.routed
        prefix = layer_prefix.format(layer=layers[i])
        tensors: dict[str, torch.Tensor] = {}
        for e in range(start, min(start + per_shard, cfg.n_experts)):
            for proj in PROJECTIONS:
                base = f"{prefix}.experts.{e}.{proj}"
                packed, scale = quant.from_layout(getattr(routed, f"{proj}_packed")[e:e + 1].detach(),
                                                  getattr(routed, f"{proj}_scale")[e:e + 1].detach(),
                                                  routed.expert_layout)
                tensors[f"{base}.weight_packed"] = packed[0].cpu().contiguous()
                tensors[f"{base}.weight_scale"] = scale[0].cpu().contiguous()
                if weight_shape:
                    tensors[f"{base}.weight_shape"] = torch.tensor(full[proj], dtype=torch.int32)
        fname = f"model-{n + 1:05d}-of-{len(chunks):05d}.safetensors"
        save_file(tensors, str(path / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in tensors})
        files.append(path / fname)
    (path / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    config = {"model_type": "kimi_k3_reference", "num_experts": cfg.n_experts, "moe_intermediate_size": cfg.moe_inter,
              "quantization_config": quantization_config(cfg.expert_format)}
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=1))
    return files


__all__ = ["CheckpointError", "DEFAULT_LAYER_PREFIX", "checkpoint_format", "quantization_config",
           "load_routed_experts", "save_routed_experts"]
