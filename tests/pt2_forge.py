"""Malicious and damaged .pt2 archives, forged from a good one the way an attacker would: every
payload writes a marker file when (and only when) something executes it, so a test can prove that
nothing ran."""
from __future__ import annotations

import io
import json
import re
import zipfile
from collections.abc import Callable
from pathlib import Path

import torch


class Payload:
    """Unpickling this object runs `code` (which writes the marker) and returns what `result`
    evaluates to, so the load carries on as if the entry were genuine."""

    def __init__(self, marker: Path, result: str):
        self.code = f"[open({str(marker)!r}, 'w').write('ran'), {result}][1]"

    def __reduce__(self):
        return (eval, (self.code,))


def pickled(marker: Path, result: str) -> bytes:
    """torch.save's zip format around the payload (what torch.load(weights_only=False) reads)."""
    buf = io.BytesIO()
    torch.save(Payload(marker, result), buf)
    return buf.getvalue()


def rewrite(src: Path, dst: Path, edit: Callable[[str, bytes], bytes | None],
            extra: dict[str, bytes] | None = None) -> Path:
    """Copy the archive `src` to `dst`, each entry's bytes through `edit(name_without_root, data)`
    (None drops the entry), then the `extra` entries (names without the root)."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        root = zin.namelist()[0].split("/", 1)[0]
        for info in zin.infolist():
            name = info.filename.split("/", 1)[1]
            data = edit(name, zin.read(info.filename))
            if data is not None:
                zout.writestr(info.filename, data)
        for name, data in (extra or {}).items():
            zout.writestr(f"{root}/{name}", data)
    return dst


def _edit_json(name: str, target: str, change: Callable[[dict], None]) -> Callable[[str, bytes], bytes | None]:
    def edit(entry: str, data: bytes) -> bytes:
        if entry != target:
            return data
        doc = json.loads(data)
        change(doc)
        return json.dumps(doc).encode()
    return edit


def evil_sample_inputs(src: Path, dst: Path, marker: Path) -> Path:
    """data/sample_inputs/model.pt replaced by a pickle that torch only loads with weights_only=False
    (and that returns empty inputs, so torch.export.load succeeds)."""
    payload = pickled(marker, "((), {})")
    return rewrite(src, dst, lambda n, d: payload if n == "data/sample_inputs/model.pt" else d)


def _pickled_entry(src: Path, dst: Path, marker: Path, kind: str, make: str) -> Path:
    """The first entry of the weights or constants config marked use_pickle, its bytes a pickle that
    returns `make` (a tensor expression, `{shape}` filled in)."""
    config_name = f"data/{kind}/model_{kind}_config.json"
    with zipfile.ZipFile(src) as z:
        config = json.loads(next(z.read(n) for n in z.namelist() if n.endswith(config_name)))
    fqn, meta = next(iter(config["config"].items()))
    payload = pickled(marker, make.format(shape=[s["as_int"] for s in meta["tensor_meta"]["sizes"]]))
    config["config"][fqn]["use_pickle"] = True

    def edit(name: str, data: bytes) -> bytes:
        if name == config_name:
            return json.dumps(config).encode()
        return payload if name == f"data/{kind}/{meta['path_name']}" else data
    return rewrite(src, dst, edit)


def evil_pickled_weight(src: Path, dst: Path, marker: Path) -> Path:
    """The first weight marked use_pickle, its bytes a pickle that returns a parameter of its shape."""
    return _pickled_entry(src, dst, marker, "weights",
                          "__import__('torch').nn.Parameter(__import__('torch').zeros({shape}))")


def evil_pickled_constant(src: Path, dst: Path, marker: Path) -> Path:
    """The first tensor constant marked use_pickle, its bytes a pickle that returns a tensor."""
    return _pickled_entry(src, dst, marker, "constants", "__import__('torch').zeros({shape})")


def evil_opaque_constant(src: Path, dst: Path, marker: Path) -> Path:
    """A constant stored as an "opaque object": torch unpickles it with pickle.loads."""
    import pickle

    with zipfile.ZipFile(src) as z:
        config = json.loads(next(z.read(n) for n in z.namelist()
                                 if n.endswith("data/constants/model_constants_config.json")))
    fqn, meta = next(iter(config["config"].items()))
    old_name = meta["path_name"]
    config["config"][fqn]["path_name"] = "opaque_obj_0"
    config["config"][fqn]["use_pickle"] = True  # as torch.export.save writes an opaque object
    shape = [s["as_int"] for s in meta["tensor_meta"]["sizes"]]
    payload = pickle.dumps(Payload(marker, f"__import__('torch').zeros({shape})"))

    def edit(name: str, data: bytes) -> bytes | None:
        if name == "data/constants/model_constants_config.json":
            return json.dumps(config).encode()
        return None if name == f"data/constants/{old_name}" else data
    return rewrite(src, dst, edit, {"data/constants/opaque_obj_0": payload})


def evil_shape_expression(src: Path, dst: Path, marker: Path) -> Path:
    """A symbolic size whose expression runs Python when sympy parses it (sympify uses eval)."""
    def edit(name: str, data: bytes) -> bytes:
        if name != "models/model.json":
            return data
        text = data.decode()
        found = re.search(r'"expr_str": "(Symbol\([^"]*\))"', text)
        assert found, "the program needs a dynamic dimension"
        sym = found.group(1)
        code = f"[open({str(marker)!r}, 'w').write('ran'), {sym}][1]"
        return text.replace(json.dumps(sym), json.dumps(code)).encode()
    return rewrite(src, dst, edit)


def evil_operator_target(src: Path, dst: Path, marker: Path) -> Path:
    """A node whose target resolves to os.system through torch's namespace (torch.os.system)."""
    def change(doc: dict) -> None:
        node = doc["graph_module"]["graph"]["nodes"][0]
        node["target"] = "torch.os.system"
        node["inputs"] = [{"name": "command", "arg": {"as_string": f"touch {marker}"}, "kind": 1}]
    return rewrite(src, dst, _edit_json("models/model.json", "models/model.json", change))


def with_aoti_library(src: Path, dst: Path, marker: Path) -> Path:
    """An AOTInductor entry: torch would dlopen a compiled library from the archive."""
    return rewrite(src, dst, lambda n, d: d, {"data/aotinductor/model/model.so": b"\x7fELF not really"})


def with_unknown_entry(src: Path, dst: Path, marker: Path) -> Path:
    """A legacy-format pickle next to the program (torch's older loader reads such files)."""
    return rewrite(src, dst, lambda n, d: d, {"serialized_example_inputs.pt": pickled(marker, "((), {})")})


def corrupt_weight(src: Path, dst: Path, zeroed: int = 5000) -> Path:
    """`zeroed` bytes inside the largest weight set to 0, the CRCs left as they were (a damaged
    disk, a truncated copy patched up): what issue 53 carried into an output with exit 0."""
    with zipfile.ZipFile(src) as z:
        info = max((i for i in z.infolist() if "/data/weights/weight_" in i.filename), key=lambda i: i.file_size)
        offset = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
        size = info.file_size
    data = bytearray(src.read_bytes())
    start = offset + max(0, (size - zeroed) // 2)
    n = min(zeroed, size)
    assert any(data[start:start + n]), "the weight is already zero there"
    data[start:start + n] = bytes(n)
    dst.write_bytes(bytes(data))
    return dst


EVIL = {"sample_inputs": (evil_sample_inputs, "data/sample_inputs/model.pt"),
        "pickled_weight": (evil_pickled_weight, "data/weights/weight_0"),
        "pickled_constant": (evil_pickled_constant, "data/constants/tensor_0"),
        "opaque_constant": (evil_opaque_constant, "data/constants/opaque_obj_0"),
        "shape_expression": (evil_shape_expression, "models/model.json"),
        "operator_target": (evil_operator_target, "models/model.json"),
        "aoti_library": (with_aoti_library, "data/aotinductor/model/model.so"),
        "legacy_pickle": (with_unknown_entry, "serialized_example_inputs.pt")}
