"""A checkpoint directory's files, opened defensively: config.json and the index as data, the shards' headers as an
inventory of where each tensor is, and reads of one rank's slice of a tensor with its values checked.

What is refused, each as one `CheckpointError` naming the file and the tensor:

* JSON that is not a regular file, is larger than its bound, is not UTF-8, nests deeper than MAX_JSON_DEPTH,
  holds NaN / Infinity or repeats a key; an index whose weight_map is not an object of names to file names;
* an index `weight_map` naming anything but a plain ``*.safetensors`` file name inside the directory (``../x``,
  ``/abs``, ``a/b`` are refused before anything is opened); a shard that is missing or not a regular file (a
  symlink to one is followed, as Hugging Face's cache links shards into its blob store);
* a shard safetensors cannot open (the error names the shard);
* a tensor held by two shards, a tensor the index places in a shard that does not hold it, a tensor a shard holds
  that the index does not list there: the index and the shards must agree, each tensor once;
* values a model must never run with (`check_values`): NaN or Inf in a float tensor; an E8M0 scale byte whose
  largest scaled value, 6 * 2^(s - 127), is not finite in the model's dtype (255 is NaN in OCP MX; 253 and 254
  overflow bf16 and fp32, everything from 141 overflows fp16); an int4 scale that is negative, NaN or Inf, or whose
  8 * |s| overflows. Small extremes (E8M0 byte 0, 2^-127; int4 scale 0) are finite and kept: they are what a
  quantizer writes for a group of zeros or tiny values.

Names under ``language_model.layers.`` are read as ``language_model.model.layers.`` (the engines' mapping of the
older K3 layout); a checkpoint holding both spellings of one tensor holds it twice.
"""
from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import quant
from .checkpoint_error import CheckpointError, shown
from .checkpoint_layout import Stored
from .hf_config import described

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
#: the largest config.json and index read (K3's index, 500k tensors, is about 40 MB)
MAX_CONFIG_BYTES = 16 << 20
MAX_INDEX_BYTES = 512 << 20
#: the deepest nesting of lists and objects read (K3's config.json nests 4 deep)
MAX_JSON_DEPTH = 32
#: the older spelling of the decoder layers' prefix, and the one it is read as
LAYER_ALIAS = ("language_model.layers.", "language_model.model.layers.")


def canonical(name: str) -> str:
    old, new = LAYER_ALIAS
    return new + name[len(old):] if name.startswith(old) else name


def _regular_file(path: Path, what: str) -> os.stat_result:
    try:
        st = path.stat()
    except FileNotFoundError:
        raise CheckpointError(f"{what} {path} does not exist") from None
    except OSError as exc:
        raise CheckpointError(f"{what} {path} cannot be read: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{what} {path} is not a regular file", "point at a checkpoint directory of files")
    return st


def _refuse_constant(token: str) -> Any:
    raise ValueError(f"{token} is not a JSON number")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {shown(key)} appears twice")
        out[key] = value
    return out


def _depth(value: Any) -> int:
    """How deeply `value` nests lists and objects (iteratively: no recursion on what a file holds)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            todo.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def read_json(path: Path, limit: int) -> Any:
    """The JSON value in `path` (a regular file of at most `limit` bytes, nesting at most MAX_JSON_DEPTH deep);
    CheckpointError naming the file."""
    st = _regular_file(path, path.name)
    if st.st_size > limit:
        raise CheckpointError(f"{path} is {st.st_size} bytes, more than the {limit} a {path.name} may be")
    too_deep = CheckpointError(f"{path} nests deeper than {MAX_JSON_DEPTH} levels, which no {path.name} does")
    try:
        with path.open("rb") as f:
            text = f.read(limit + 1).decode("utf-8")
        value = json.loads(text, parse_constant=_refuse_constant, object_pairs_hook=_unique_keys)
    except RecursionError:  # past the interpreter's limit while parsing
        raise too_deep from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise CheckpointError(f"{path} is not valid JSON: {str(exc).splitlines()[0][:200]}") from None
    if _depth(value) > MAX_JSON_DEPTH:
        raise too_deep
    return value


@dataclass(frozen=True, slots=True)
class Located:
    """Where a tensor is: its shard, its name there (before `canonical`), dtype and shape from the header."""

    shard: str
    name: str
    dtype: str
    shape: tuple[int, ...]


def _shard_name(value: Any, key: str) -> str:
    if not isinstance(value, str):
        raise CheckpointError(f"{INDEX_FILE}: weight_map[{shown(key)}] is {described(value)}, expected a shard "
                              "file name")
    bad = (not value.endswith(".safetensors") or value in (".", "..") or "\0" in value or "/" in value
           or (os.altsep is not None and os.altsep in value) or os.sep in value or os.path.isabs(value))
    if bad:
        raise CheckpointError(f"{INDEX_FILE}: weight_map[{shown(key)}] names {shown(value)}, not a *.safetensors "
                              "file in the checkpoint directory", "a shard is a plain file name beside the index")
    return value


class CheckpointFiles:
    """The shards of a checkpoint directory, opened: `tensors` maps each (canonical) tensor name to where it is;
    `read` returns this rank's slice of one, its values checked; `bytes_read` counts what was read."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        self.path = path
        self.bytes_read = 0
        index_path = path / INDEX_FILE
        if index_path.exists() or index_path.is_symlink():
            index = read_json(index_path, MAX_INDEX_BYTES)
            if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
                got = described(index.get("weight_map") if isinstance(index, dict) else index)
                raise CheckpointError(f"{index_path}: weight_map is {got}, expected an object of tensor name -> "
                                      "shard file")
            weight_map = {key: _shard_name(value, key) for key, value in index["weight_map"].items()}
            shards = sorted(set(weight_map.values()))
        else:
            if not (path / SINGLE_FILE).exists():
                raise CheckpointError(f"{path} has neither {INDEX_FILE} nor {SINGLE_FILE}",
                                      "point at a Hugging Face checkpoint directory")
            weight_map, shards = None, [SINGLE_FILE]
        for shard in shards:  # every shard there before any is opened
            _regular_file(path / shard, f"shard {shard!r} named by {INDEX_FILE}:" if weight_map else "shard")
        self._handles: dict[str, Any] = {}
        self.tensors: dict[str, Located] = {}
        for shard in shards:
            try:
                handle = safe_open(str(path / shard), framework="pt", device="cpu")
                names = list(handle.keys())
                headers = [(n, handle.get_slice(n)) for n in names]
                entries = [(n, s.get_dtype(), tuple(s.get_shape())) for n, s in headers]
            except Exception as exc:  # safetensors raises its own SafetensorError, OSError, ...
                raise CheckpointError(f"shard {shard!r} is not a readable safetensors file: "
                                      f"{str(exc).splitlines()[0][:200]}") from None
            self._handles[shard] = handle
            for name, dtype, shape in entries:
                key = canonical(name)
                if key in self.tensors:
                    first = self.tensors[key]
                    raise CheckpointError(f"tensor {shown(key)} is held twice: as {shown(first.name)} in shard "
                                          f"{first.shard!r} and as {shown(name)} in shard {shard!r}",
                                          "a checkpoint holds each tensor once")
                if weight_map is not None and weight_map.get(name) != shard:
                    where = (f"the index places it in {weight_map[name]!r}" if name in weight_map
                             else "the index does not list it")
                    raise CheckpointError(f"tensor {shown(name)} is in shard {shard!r} but {where}",
                                          f"{INDEX_FILE} and the shards must agree")
                self.tensors[key] = Located(shard, name, dtype, shape)
        if weight_map is not None:
            for name, shard in weight_map.items():
                if canonical(name) not in self.tensors:
                    raise CheckpointError(f"{INDEX_FILE} places tensor {shown(name)} in shard {shard!r}, which does "
                                          "not hold it")

    def form(self, stored: Stored) -> tuple[tuple[int, ...], int | None]:
        """The (shape, split dim) of `stored.forms` that the file's tensor has (checked: shape and dtype)."""
        at = self.tensors[stored.name]
        for shape, split in stored.forms:
            if at.shape == shape:
                break
        else:
            want = " or ".join(str(list(s)) for s, _ in stored.forms)
            raise CheckpointError(f"tensor {shown(stored.name)} in shard {at.shard!r} is {at.dtype} {list(at.shape)}, "
                                  f"expected {'/'.join(stored.dtypes)} {want}")
        if at.dtype not in stored.dtypes:
            raise CheckpointError(f"tensor {shown(stored.name)} in shard {at.shard!r} is {at.dtype} {list(at.shape)}, "
                                  f"expected {'/'.join(stored.dtypes)} {list(at.shape)}")
        return shape, split

    def read(self, stored: Stored, rank: int, tp: int, dequant_dtype: torch.dtype) -> torch.Tensor:
        """Rank `rank` of `tp`'s slice of `stored` (the whole tensor where it is not split), values checked."""
        at = self.tensors[stored.name]
        shape, split = self.form(stored)
        index = tuple(slice(rank * (n // tp), (rank + 1) * (n // tp)) if d == split else slice(None)
                      for d, n in enumerate(shape))
        try:
            value = self._handles[at.shard].get_slice(at.name)[index]
        except Exception as exc:
            raise CheckpointError(f"tensor {shown(at.name)} in shard {at.shard!r} could not be read: "
                                  f"{str(exc).splitlines()[0][:200]}") from None
        self.bytes_read += value.numel() * value.element_size()
        offset = [0] * len(shape)
        if split is not None:
            offset[split] = rank * (shape[split] // tp)
        check_values(stored, value, at.shard, dequant_dtype, offset)
        return value


def e8m0_limit(dtype: torch.dtype) -> int:
    """The largest E8M0 byte s whose largest scaled E2M1 value, 6 * 2^(s - 127), is finite in `dtype`."""
    return quant.E8M0_BIAS + math.floor(math.log2(torch.finfo(dtype).max / max(quant.E2M1_MAGNITUDES)))


def _first(bad: torch.Tensor, offset: list[int]) -> list[int]:
    at = [int(i) for i in torch.nonzero(bad)[0]]
    return [i + o for i, o in zip(at, offset)]


def check_values(stored: Stored, value: torch.Tensor, shard: str, dequant_dtype: torch.dtype,
                 offset: list[int]) -> None:
    """CheckpointError where `value` (a slice of `stored` starting at `offset`) holds what a model must not run
    with (the module docstring's list)."""
    where = f"tensor {shown(stored.name)} in shard {shard!r}"
    if stored.values == "float" or stored.values == "int4_scale":
        finite = torch.isfinite(value)
        if not bool(finite.all()):
            at = _first(~finite, offset)
            raise CheckpointError(f"{where} holds {float(value[tuple(i - o for i, o in zip(at, offset))])} at {at}; "
                                  "expected finite values")
    if stored.values == "int4_scale":
        fmax = torch.finfo(dequant_dtype).max / (quant.INT4_MAX + 1)
        bad = (value < 0) | (value.float().abs() > fmax)
        if bool(bad.any()):
            at = _first(bad, offset)
            got = float(value[tuple(i - o for i, o in zip(at, offset))])
            raise CheckpointError(f"{where} holds int4 scale {got} at {at}; expected finite scales in [0, {fmax:.3g}] "
                                  f"(8 * scale finite in {str(dequant_dtype).removeprefix('torch.')})")
    elif stored.values == "e8m0":
        limit = e8m0_limit(dequant_dtype)
        bad = value > limit
        if bool(bad.any()):
            at = _first(bad, offset)
            byte = int(value[tuple(i - o for i, o in zip(at, offset))])
            what = "NaN in OCP MX" if byte == quant.E8M0_NAN else f"2^{byte - quant.E8M0_BIAS}"
            raise CheckpointError(f"{where} holds E8M0 scale byte {byte} ({what}) at {at}; expected 0..{limit} "
                                  f"(6 * 2^(s-127) finite in {str(dequant_dtype).removeprefix('torch.')})")
    elif stored.values == "shape":
        got = [int(v) for v in value.tolist()]
        if got != list(stored.expect):
            raise CheckpointError(f"{where} says the weight is {got}, expected {list(stored.expect)}")


__all__ = ["CheckpointFiles", "Located", "read_json", "check_values", "e8m0_limit", "canonical", "INDEX_FILE",
           "SINGLE_FILE", "MAX_CONFIG_BYTES", "MAX_INDEX_BYTES"]
