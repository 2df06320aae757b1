"""Kimi K3 checkpoints as they ship: load a rank's slice of one into K3Model, write random ones of any preset.

A checkpoint is a Hugging Face directory:

* ``config.json``: model_type ``kimi_k3``, the language model's fields under ``text_config`` (hf_config.py maps
  them to a preset-free `K3Config`), compressed-tensors' ``quantization_config`` for the routed experts
  (``mxfp4-pack-quantized``, K3's; ``pack-quantized`` int4, K2.x's; none: bf16 experts);
* ``model.safetensors.index.json`` and its shards (or one ``model.safetensors``), with K3's tensor names as vLLM's
  and SGLang's K3 loaders read them: ``language_model.model.layers.{i}.self_attn.q_proj.weight``, ...,
  ``...block_sparse_moe.experts.{e}.w1.weight_packed`` / ``.weight_scale`` (params.py lists every name and
  checkpoint_layout.py how each becomes a parameter). Everything but the routed experts is a float tensor (BF16 as
  K3 ships it; F32 and F16 are read too and cast to the model's dtype). Tensors outside ``language_model.`` (the
  vision tower, the projector) and the MTP layers past ``num_hidden_layers`` are skipped.

The API (for `k3fuse generate --checkpoint / --write-checkpoint` and the tests)::

    cfg, model, report = load_checkpoint(path, rank=r, tp_size=n, device="cuda", group=g)   # or standin=True
    cfg, state, report = load_state_dict(path, rank=r, tp_size=n)     # the same slices as CPU tensors
    report = load_into(model, path, layers=[0, 1, 2, 3])              # into an existing K3Model
    files = write_checkpoint(path, "small", seed=0)                   # a preset, a K3Config or a TP 1 K3Model
    cfg = read_config(path)                                            # config.json alone

Each rank reads only its slice of every tensor (``safe_open(...).get_slice``; `LoadReport.bytes_read` counts
them). ``layers[i]`` is the checkpoint layer that model layer i reads (default: all, in order); each must be of
the model layer's kind (KDA or MLA attention, dense or MoE MLP).

**Trust.** A checkpoint is data, never code (safetensors and JSON only; nothing is unpickled), and it is checked
before it is used: the config (hf_config.py), the files and the values (checkpoint_files.py: path-escaping or
duplicate tensors, unreadable shards, non-finite weights, E8M0 scale bytes past 252 for a bf16 model, negative or
non-finite int4 scales), every tensor's presence, shape and dtype. Each problem is one `CheckpointError` (a
UsageError: one line naming the file, the tensor and what was expected). **Never half-loaded**: every name,
shape and dtype is checked before any value is read; `load_into` reads every value into fresh host tensors and
copies them into the model only when all passed, so a failed load leaves the model bit for bit as it was;
`load_checkpoint` fills a model it builds (drawn first as K3Model draws it, on the device where that is CUDA, then
overwritten) and returns it only when every tensor loaded. Under a process group
every rank learns whether any rank failed, so one rank's bad slice is an error on all of them, not a hang.

`write_checkpoint` writes the same layout (sharded by `max_shard_bytes`, with its index) from a TP 1 model or by
drawing the weights parameter by parameter (the draws of `K3Model(cfg, seed=seed)`, bit for bit), so writing a
big preset holds one parameter and one shard in memory, never the model. It writes into a fresh directory beside
`path` and renames it into place at the end: a failed write leaves nothing half-written.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import re
import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from .. import quant
from .checkpoint_error import CheckpointError, shown
from .checkpoint_files import INDEX_FILE, MAX_CONFIG_BYTES, CheckpointFiles, read_json
from .checkpoint_layout import ParamLayout, Stored, param_layouts
from .config import DTYPES, K3Config, get_config
from .hf_config import CONFIG_FILE, differences, hf_config, k3_config
from .model import K3Model
from .params import HF_MODEL_PREFIX
from .sampling import SamplingConfig
from .weights import WeightSource

#: a shard's size bound when writing (Hugging Face's default "5GB")
DEFAULT_SHARD_BYTES = 5 * 10**9


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """What a load read: the checkpoint's config, the checkpoint layer behind each model layer, this rank's
    stored tensors and bytes, the shards, and the tensors skipped (outside the language model, MTP layers)."""

    path: str
    checkpoint_config: K3Config
    layers: tuple[int, ...]
    rank: int
    tp_size: int
    tensors: int
    bytes_read: int
    shards: tuple[str, ...]
    skipped: tuple[str, ...]


class Loaded(NamedTuple):
    """What a load returns: the model's config (the checkpoint's, n_layers = len(layers)), the model (or state
    dict) and the report."""

    config: K3Config
    model: Any  # K3Model, or the state dict of `load_state_dict`
    report: LoadReport


# --- reading ---------------------------------------------------------------------------------------------------
def read_config(path: str | Path, *, expert_layout: str = "rows") -> K3Config:
    """The K3Config of checkpoint directory `path` (its config.json)."""
    return k3_config(read_json(Path(path) / CONFIG_FILE, MAX_CONFIG_BYTES), name=Path(path).name,
                     expert_layout=expert_layout)


@contextlib.contextmanager
def _bulk():
    """The cyclic garbage collector paused while K3's hundreds of thousands of (acyclic) tensor records are built:
    its passes over them took 4 of 5 seconds."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class _Checkpoint:
    """A checkpoint directory checked against its config: every expected tensor present with its shape and dtype,
    nothing unexpected under the language model. Nothing is read but headers."""

    def __init__(self, path: str | Path, expert_layout: str):
        with _bulk():
            self._open(path, expert_layout)

    def _open(self, path: str | Path, expert_layout: str) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path} is not a directory", "pass a checkpoint directory")
        raw = read_json(self.path / CONFIG_FILE, MAX_CONFIG_BYTES)
        self.config = k3_config(raw, name=self.path.name, expert_layout=expert_layout)
        mtp = raw["text_config"].get("num_nextn_predict_layers", 0)
        if type(mtp) is not int or mtp < 0:
            raise CheckpointError(f"{CONFIG_FILE}: text_config.num_nextn_predict_layers is {shown(mtp)}, expected "
                                  "an int >= 0")
        self.files = CheckpointFiles(self.path)
        self._check_size()
        expected: dict[str, Stored] = {s.name: s for layout in param_layouts(self.config) for s in layout.stored}
        for name, stored in expected.items():
            if name in self.files.tensors:
                self.files.form(stored)
            elif not stored.optional:
                raise CheckpointError(f"missing tensor {shown(name)}: expected {'/'.join(stored.dtypes)} "
                                      f"{list(stored.shape)}; no shard holds it", "the checkpoint is incomplete")
        n = self.config.n_layers
        mtp_layers = re.compile(r"language_model\.model\.layers\.(\d+)\.")
        skipped = []
        for name, at in self.files.tensors.items():
            if name in expected:
                continue
            m = mtp_layers.match(name)
            if not name.startswith(HF_MODEL_PREFIX) or (m and n <= int(m.group(1)) < n + mtp):
                skipped.append(name)
                continue
            expert = re.search(r"\.experts\.(\d+)\.", name)
            hint = (f"it names expert {expert.group(1)} but {CONFIG_FILE} has num_experts={self.config.n_experts}"
                    if expert and int(expert.group(1)) >= self.config.n_experts else
                    "not a parameter of the K3 model config.json describes")
            raise CheckpointError(f"unexpected tensor {shown(at.name)} in shard {at.shard!r}: {hint}")
        self.skipped = tuple(skipped)

    def _check_size(self) -> None:
        """Refuse a config.json describing more tensors than the shards hold, before listing them (a config of a
        billion layers or experts must not cost a billion names)."""
        cfg, held = self.config, len(self.files.tensors)
        least = cfg.n_layers  # a tensor a layer at least
        if least <= held:  # then the layer kinds are cheap to list: the routed experts' tensors
            moe_layers = sum(1 for k in cfg.layer_kinds() if k.mlp == "moe")
            least = max(least, moe_layers * cfg.n_experts * 3 * (2 if cfg.quantized_experts else 1))
        if least > held:
            raise CheckpointError(f"{CONFIG_FILE} describes a model of at least {least} tensors but the shards hold "
                                  f"{held}", "the config and the shards are of different models")

    def layers(self, layers: Sequence[int] | None) -> list[int]:
        """`layers` checked against the checkpoint (ints in range, at least one)."""
        n = self.config.n_layers
        if layers is None:
            return list(range(n))
        if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence) or not layers:
            raise CheckpointError(f"layers={shown(layers)} is not a non-empty list of checkpoint layer indices")
        for i, c in enumerate(layers):
            if type(c) is not int or not 0 <= c < n:
                raise CheckpointError(f"layers[{i}]={shown(c)} is not a layer of the checkpoint (0..{n - 1})")
        return list(layers)

    def check_kinds(self, model_cfg: K3Config, layers: list[int]) -> None:
        if len(layers) != model_cfg.n_layers:
            raise CheckpointError(f"layers= maps {len(layers)} checkpoint layers onto a model of "
                                  f"{model_cfg.n_layers}", f"pass {model_cfg.n_layers} checkpoint layer indices")
        ckpt, model = self.config.layer_kinds(), model_cfg.layer_kinds()
        for i, c in enumerate(layers):
            if ckpt[c] != model[i]:
                raise CheckpointError(f"layers[{i}]={c}: checkpoint layer {c} is {ckpt[c].name} but model layer {i} "
                                      f"is {model[i].name}", "map each model layer to a checkpoint layer of its kind")

    def read(self, model_cfg: K3Config, layers: list[int], rank: int, tp: int, dtypes: dict[str, torch.dtype],
             dequant_dtype: torch.dtype, out: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """Rank `rank`'s parameters of a model of `model_cfg`, each from its checkpoint layer, in `dtypes`."""
        files = self.files
        self.tensors_read = 0

        def read(stored: Stored) -> torch.Tensor | None:
            if stored.optional and stored.name not in files.tensors:
                return None
            self.tensors_read += 1
            return files.read(stored, rank, tp, dequant_dtype)

        with _bulk():
            layouts = param_layouts(model_cfg, layers)
        result: dict[str, torch.Tensor] = {}
        for layout in layouts:
            result.update(layout.assemble(read, tp, dtypes, out))
        return result

    def report(self, layers: list[int], rank: int, tp: int) -> LoadReport:
        return LoadReport(str(self.path), self.config, tuple(layers), rank, tp, self.tensors_read,
                          self.files.bytes_read, tuple(sorted({t.shard for t in self.files.tensors.values()})),
                          self.skipped)


def _model_config(ckpt: K3Config, layers: list[int]) -> K3Config:
    if len(layers) == ckpt.n_layers:
        return ckpt
    return dataclasses.replace(ckpt, n_layers=len(layers), dense_layers=min(ckpt.dense_layers, len(layers)))


def _dtype(dtype: torch.dtype | str | None, cfg: K3Config) -> torch.dtype:
    if dtype is None:
        return cfg.torch_dtype
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)}")
        return DTYPES[dtype]
    return dtype


def _agree(collective: bool, group: dist.ProcessGroup | None, failure: BaseException | None) -> None:
    """With `collective`, every rank of `group` (None: the default group) raises when any rank failed (the lowest
    failed rank's message) and none hangs; without, this rank raises its own failure."""
    if not collective:
        if failure is not None:
            raise failure
        return
    got: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(got, None if failure is None else f"{type(failure).__name__}: {failure}", group=group)
    if failure is not None:
        raise failure
    failed = [(r, m) for r, m in enumerate(got) if m is not None]
    if failed:
        rank, message = failed[0]
        raise CheckpointError(f"rank {rank} failed to load the checkpoint ({message.splitlines()[0][:300]})")


def load_checkpoint(path: str | Path, *, rank: int = 0, tp_size: int = 1, device: torch.device | str = "cpu",
                    layers: Sequence[int] | None = None, group: dist.ProcessGroup | None = None,
                    standin: bool = False, expert_layout: str = "rows", dtype: torch.dtype | str | None = None,
                    sampling: SamplingConfig | None = None) -> Loaded:
    """A K3Model for rank `rank` of TP `tp_size` (its process group `group`, or `standin=True` to run the slice
    alone), its weights from checkpoint `path`; model layer i is checkpoint layer `layers[i]`. The model holds its
    experts in `expert_layout` and computes in `dtype` (default: config.json's). Returns (config, model, report)."""
    collective = tp_size > 1 and not standin and dist.is_available() and dist.is_initialized()
    failure: BaseException | None = None
    try:  # each rank checks its own copy of the files and its own slices: all agree on the outcome below
        ckpt = _Checkpoint(path, expert_layout)
        chosen = ckpt.layers(layers)
        cfg = _model_config(ckpt.config, chosen)
        ckpt.check_kinds(cfg, chosen)
        model_dtype = _dtype(dtype, cfg)
        model = K3Model(cfg, tp_size=tp_size, rank=rank, group=group, dtype=model_dtype, device=device,
                        init_on_device=torch.device(device).type == "cuda", standin=standin, sampling=sampling)
        params = dict(model.named_parameters())
        ckpt.read(cfg, chosen, rank, tp_size, {n: p.dtype for n, p in params.items()}, model_dtype, params)
    except Exception as exc:  # every rank must reach the agreement, whatever this one hit
        failure = exc
    _agree(collective, group, failure)
    return Loaded(cfg, model, ckpt.report(chosen, rank, tp_size))


def load_state_dict(path: str | Path, *, rank: int = 0, tp_size: int = 1, layers: Sequence[int] | None = None,
                    expert_layout: str = "rows", dtype: torch.dtype | str | None = None) -> Loaded:
    """Rank `rank` of TP `tp_size`'s slice of every parameter (CPU tensors named as in K3Model.named_parameters(),
    in the model's dtypes and expert layout), without building the model. Returns (config, state dict, report)."""
    ckpt = _Checkpoint(path, expert_layout)
    chosen = ckpt.layers(layers)
    cfg = _model_config(ckpt.config, chosen)
    ckpt.check_kinds(cfg, chosen)
    model_dtype = _dtype(dtype, cfg)
    shapes = K3Model(cfg, tp_size=tp_size, rank=rank, dtype=model_dtype, device="meta", standin=tp_size > 1)
    dtypes = {n: p.dtype for n, p in shapes.named_parameters()}
    state = ckpt.read(cfg, chosen, rank, tp_size, dtypes, model_dtype, None)
    return Loaded(cfg, state, ckpt.report(chosen, rank, tp_size))


def load_into(model: K3Model, path: str | Path, *, layers: Sequence[int] | None = None) -> LoadReport:
    """Copy checkpoint `path` into `model` (a K3Model, its rank's slice; model layer i from checkpoint layer
    `layers[i]`), all or nothing: every value is read and checked into host tensors first, then copied (under the
    model's process group, only once every rank's staging succeeded)."""
    if not isinstance(model, K3Model):
        raise TypeError(f"load_into fills a K3Model, got {type(model).__name__}")
    cfg = model.config
    params = dict(model.named_parameters())
    failure: BaseException | None = None
    try:
        ckpt = _Checkpoint(path, cfg.expert_layout)
        chosen = ckpt.layers(list(range(cfg.n_layers)) if layers is None else layers)
        # the model's layers are checked one by one against the checkpoint's below; its dtype is its own
        differ = differences(ckpt.config, cfg, skip=("n_layers", "dense_layers", "mla_every", "dtype"))
        if differ:
            raise CheckpointError(f"the checkpoint's config.json does not describe this model (checkpoint vs model): "
                                  f"{'; '.join(differ)}", "build the model from read_config(path)")
        ckpt.check_kinds(cfg, chosen)
        staged = ckpt.read(cfg, chosen, model.rank, model.tp_size, {n: p.dtype for n, p in params.items()},
                           model.dtype, None)
    except Exception as exc:
        failure = exc
    _agree(model.tp_size > 1 and model.group is not None, model.group, failure)
    assert staged.keys() == params.keys() and all(staged[n].shape == params[n].shape for n in params)
    with torch.no_grad():
        for name, value in staged.items():
            params[name].copy_(value)
    return ckpt.report(chosen, model.rank, model.tp_size)


# --- writing ---------------------------------------------------------------------------------------------------
def _full_from_model(params: dict[str, torch.Tensor], cfg: K3Config, layout: ParamLayout) -> dict[str, torch.Tensor]:
    """A TP 1 model's parameter(s) of `layout`, the experts in the checkpoint's row-major layout."""
    names = layout.params()
    if layout.form == "experts" and cfg.quantized_experts:
        packed, scale = quant.from_layout(params[names[0]].detach(), params[names[1]].detach(), cfg.expert_layout)
        return {names[0]: packed, names[1]: scale}
    return {n: params[n].detach() for n in names}


def _full_drawn(src: WeightSource, cfg: K3Config, layout: ParamLayout) -> dict[str, torch.Tensor]:
    """A parameter's full (TP 1) value as K3Model(cfg, seed) draws it (layers.LatentMoE for the experts)."""
    entry = layout.entry
    spec = entry.spec
    if layout.form != "experts":
        return {entry.param: src.build(spec, entry.layer, 1, 0).data}
    shape, std, dim = spec.shape[1:], spec.init.b, spec.shard_dim - 1
    if cfg.quantized_experts:
        packed, scale = src.experts_quantized(entry.layer, spec.key, cfg.expert_format, cfg.n_experts, shape, std,
                                              dim, 1, 0, "rows")
        names = layout.params()
        return {names[0]: packed.data, names[1]: scale.data}
    return {entry.param: src.experts_normal(entry.layer, spec.key, cfg.n_experts, shape, std, dim, 1, 0).data}


class _ShardWriter:
    """Tensors written in order into shards of at most `limit` bytes (a tensor larger than that alone), named
    model-NNNNN-of-MMMMM.safetensors once the count is known."""

    def __init__(self, directory: Path, limit: int):
        self.directory, self.limit = directory, limit
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.written: list[tuple[Path, list[str]]] = []
        self.total = 0

    def add(self, name: str, value: torch.Tensor) -> None:
        size = value.numel() * value.element_size()
        if self.pending and self.pending_bytes + size > self.limit:
            self.flush()
        # a copy of its own: the shard must not keep a whole drawn table alive through a view
        self.pending[name] = value.detach().to("cpu", copy=True).contiguous()
        self.pending_bytes += size
        self.total += size

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        path = self.directory / f"shard-{len(self.written):05d}.tmp"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.written.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> tuple[list[Path], dict[str, str]]:
        self.flush()
        files, weight_map = [], {}
        for i, (tmp, names) in enumerate(self.written):
            final = self.directory / f"model-{i + 1:05d}-of-{len(self.written):05d}.safetensors"
            tmp.rename(final)
            files.append(final)
            weight_map.update({n: final.name for n in names})
        return files, weight_map


def _writable(path: Path) -> None:
    if not path.parent.is_dir():
        raise CheckpointError(f"{path.parent} does not exist", "create the parent directory first")
    if path.is_symlink() or (path.exists() and (not path.is_dir() or any(path.iterdir()))):
        raise CheckpointError(f"{path} exists and is not an empty directory", "choose a new checkpoint directory")


def write_checkpoint(path: str | Path, source: K3Model | K3Config | str, *, seed: int = 0,
                     max_shard_bytes: int = DEFAULT_SHARD_BYTES, device: torch.device | str = "cpu") -> list[Path]:
    """Write a checkpoint of `source` into directory `path` (new, or empty) in K3's shipped layout; returns the
    shard files. `source`: a TP 1 K3Model (its weights), or a K3Config or preset name whose weights are drawn
    parameter by parameter as K3Model(cfg, seed=seed) draws them (on `device`: a CUDA device draws the hash
    weights of K3Model(..., init_on_device=True))."""
    path = Path(path)
    if isinstance(source, K3Model):
        if source.tp_size != 1:
            raise ValueError(f"write_checkpoint writes full tensors: a TP 1 model, not tp_size={source.tp_size}")
        dtype_name = next(k for k, v in DTYPES.items() if v == source.dtype)
        cfg = dataclasses.replace(source.config, dtype=dtype_name)
        held = dict(source.named_parameters())
        full = lambda layout: _full_from_model(held, cfg, layout)  # noqa: E731
    else:
        cfg = get_config(source) if isinstance(source, str) else source
        if not isinstance(cfg, K3Config):
            raise TypeError(f"write_checkpoint writes a K3Model, a K3Config or a preset name, got "
                            f"{type(source).__name__}")
        on_device = torch.device(device).type == "cuda"
        src = WeightSource(seed, cfg.torch_dtype, device, on_device=on_device)
        full = lambda layout: _full_drawn(src, cfg, layout)  # noqa: E731
    config = hf_config(cfg)
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    _writable(path)
    staging = path.parent / f".{path.name}.writing-{uuid.uuid4().hex[:12]}"
    staging.mkdir()
    try:
        shards = _ShardWriter(staging, max_shard_bytes)
        for layout in param_layouts(cfg):
            for stored, value in layout.split(full(layout)):
                shards.add(stored.name, value)
        files, weight_map = shards.finish()
        index = {"metadata": {"total_size": shards.total}, "weight_map": weight_map}
        (staging / INDEX_FILE).write_text(json.dumps(index, indent=1))
        (staging / CONFIG_FILE).write_text(json.dumps(config, indent=1))
        if path.exists():
            path.rmdir()  # empty (checked above): the rename takes its place
        os.rename(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return [path / f.name for f in files]


__all__ = ["CheckpointError", "LoadReport", "Loaded", "read_config", "load_checkpoint", "load_state_dict",
           "load_into", "write_checkpoint", "DEFAULT_SHARD_BYTES"]
