"""The checkpoint loader refuses corrupt or redirected data (issue 48.6) and never leaves a model half-loaded (issue
53.5): each case is one CheckpointError, one line naming the file, the tensor and what was expected, and nothing
else happens (no file outside the checkpoint opened, no model parameter changed)."""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3fuse.model import K3Model, get_config
from k3fuse.model.checkpoint import CheckpointError, load_checkpoint, load_into, write_checkpoint
from k3fuse.usage_error import UsageError

LAYER = "language_model.model.layers.{}."
INDEX = "model.safetensors.index.json"
SHARD = r"'model-\d{5}-of-\d{5}\.safetensors'"


def tiny(fmt: str, **over):
    return get_config("tiny", **{"n_layers": 4, "expert_format": fmt, **over})


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, Path]:
    """One checkpoint per expert format, in several shards, written once for the module."""
    root = tmp_path_factory.mktemp("checkpoints")
    out = {}
    for fmt in ("mxfp4", "int4", "bf16"):
        write_checkpoint(root / fmt, tiny(fmt), seed=1, max_shard_bytes=300_000)
        out[fmt] = root / fmt
    return out


@pytest.fixture
def ckpt(written, tmp_path):
    """A fresh copy of a written checkpoint: ckpt("mxfp4")."""
    def copy(fmt: str = "mxfp4") -> Path:
        dst = tmp_path / f"copy-{fmt}"
        shutil.copytree(written[fmt], dst)
        return dst
    return copy


def weight_map(path: Path) -> dict[str, str]:
    return json.loads((path / INDEX).read_text())["weight_map"]


def edit_tensors(path: Path, shard: str, edit) -> None:
    """Apply `edit(tensors)` to one shard and keep the index's names of that shard in step."""
    tensors = load_file(str(path / shard))
    edit(tensors)
    save_file(tensors, str(path / shard))
    index = json.loads((path / INDEX).read_text())
    kept = {n: s for n, s in index["weight_map"].items() if s != shard}
    index["weight_map"] = {**kept, **{n: shard for n in tensors}}
    (path / INDEX).write_text(json.dumps(index))


def set_value(path: Path, name: str, at: tuple, value) -> None:
    def edit(tensors):
        tensors[name][at] = value
    edit_tensors(path, weight_map(path)[name], edit)


def edit_json(file: Path, edit) -> None:
    data = json.loads(file.read_text())
    edit(data)
    file.write_text(json.dumps(data))


def refused(path: Path, pattern: str, **kwargs) -> str:
    """The one-line CheckpointError that loading `path` raises, matched against `pattern`."""
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, **kwargs)
    message = str(info.value)
    assert "\n" not in message and isinstance(info.value, UsageError)
    assert re.search(pattern, message), message
    return message


# --- 48.6: values a model must never run with ---------------------------------------------------------------
W1_SCALE = LAYER.format(1) + "block_sparse_moe.experts.3.w1.weight_scale"


@pytest.mark.parametrize("byte,what", [(255, "NaN in OCP MX"), (254, r"2\^127"), (253, r"2\^126")])
def test_e8m0_scale_bytes_that_dequantize_to_nan_or_inf_are_refused(ckpt, byte, what):
    path = ckpt("mxfp4")
    set_value(path, W1_SCALE, (5, 1), byte)
    refused(path, rf"tensor '{re.escape(W1_SCALE)}' in shard {SHARD} holds E8M0 scale byte {byte} \({what}\) at "
                  rf"\[5, 1\]; expected 0\.\.252 \(6 \* 2\^\(s-127\) finite in float32\)")


def test_e8m0_extremes_that_stay_finite_load_and_fp16_has_its_own_bound(ckpt):
    """Byte 252 (6 * 2^125 < the bf16 / fp32 maximum) and byte 0 (2^-127) are finite: kept. An fp16 model's bound is
    140 (6 * 2^13 < 65504)."""
    path = ckpt("mxfp4")
    set_value(path, W1_SCALE, (5, 1), 252)
    set_value(path, W1_SCALE, (6, 0), 0)
    _, model, _ = load_checkpoint(path)
    scale = model.layers[1].mlp.routed.w1_scale[3]
    assert int(scale[5, 1]) == 252 and int(scale[6, 0]) == 0
    assert torch.isfinite(model.layers[1].mlp.routed.expert_weights(torch.float32)[0]).all()
    set_value(path, W1_SCALE, (5, 1), 141)
    load_checkpoint(path, dtype="float32")
    refused(path, r"E8M0 scale byte 141 \(2\^14\) at \[5, 1\]; expected 0\.\.140 \(6 \* 2\^\(s-127\) finite in "
                  r"float16\)", dtype="float16")


@pytest.mark.parametrize("value,shown", [(float("nan"), "nan"), (float("inf"), "inf"), (-float("inf"), "-inf")])
def test_non_finite_int4_scales_are_refused(ckpt, value, shown):
    path = ckpt("int4")
    name = LAYER.format(2) + "block_sparse_moe.experts.0.w2.weight_scale"
    set_value(path, name, (7, 0), value)
    refused(path, rf"tensor '{re.escape(name)}' in shard {SHARD} holds {shown} at \[7, 0\]; expected finite values")


def test_negative_int4_scales_are_refused_and_zero_is_kept(ckpt):
    path = ckpt("int4")
    name = LAYER.format(2) + "block_sparse_moe.experts.0.w2.weight_scale"
    set_value(path, name, (7, 0), 0.0)
    _, model, _ = load_checkpoint(path)
    assert float(model.layers[2].mlp.routed.w2_scale[0, 7, 0]) == 0.0
    set_value(path, name, (7, 0), -0.25)
    refused(path, rf"tensor '{re.escape(name)}' in shard {SHARD} holds int4 scale -0\.25 at \[7, 0\]; expected "
                  r"finite scales in \[0, ")


@pytest.mark.parametrize("name,at,value", [(LAYER.format(0) + "self_attn.q_proj.weight", (3, 4), float("nan")),
                                           ("language_model.model.embed_tokens.weight", (9, 0), float("inf")),
                                           (LAYER.format(3) + "self_attn.kv_b_proj.weight", (0, 0), float("nan"))])
def test_non_finite_float_weights_are_refused(ckpt, name, at, value):
    path = ckpt("bf16")
    set_value(path, name, at, value)
    refused(path, rf"tensor '{re.escape(name)}' in shard {SHARD} holds {value} at \[{at[0]}, {at[1]}\]; expected "
                  "finite values")


# --- 48.6: the index may not redirect reads, and names each tensor once ----------------------------------------
@pytest.mark.parametrize("target", ["../other/evil.safetensors", "ABSOLUTE", "sub/x.safetensors", "..", "x.bin"])
def test_index_naming_anything_but_a_shard_beside_it_is_refused_before_anything_is_opened(ckpt, target, tmp_path,
                                                                                          monkeypatch):
    path = ckpt("mxfp4")
    name = LAYER.format(0) + "self_attn.q_proj.weight"
    (tmp_path / "other").mkdir()
    evil = tmp_path / "other" / "evil.safetensors"
    save_file({name: torch.zeros(128, 128)}, str(evil))  # a well-formed file the old loader opened and used
    target = str(evil) if target == "ABSOLUTE" else target
    edit_json(path / INDEX, lambda index: index["weight_map"].update({name: target}))
    opened = []
    import safetensors
    real = safetensors.safe_open
    monkeypatch.setattr(safetensors, "safe_open", lambda p, *a, **k: opened.append(p) or real(p, *a, **k))
    refused(path, rf"{INDEX}: weight_map\['{re.escape(name)}'\] names '{re.escape(target)}', not a \*\.safetensors "
                  "file in the checkpoint directory")
    assert opened == []


def test_index_values_and_shapes_of_the_wrong_type_are_refused(ckpt):
    path = ckpt("mxfp4")
    edit_json(path / INDEX, lambda index: index["weight_map"].update({"x": ["a.safetensors"]}))
    refused(path, r"weight_map\['x'\] is a list, expected a shard file name")
    (path / INDEX).write_text(json.dumps({"weight_map": [["x", "a.safetensors"]]}))
    refused(path, r"weight_map is a list, expected an object of tensor name -> shard file")
    (path / INDEX).write_text("[1, 2]")
    refused(path, r"weight_map is a list, expected an object")
    (path / INDEX).write_text(json.dumps({"weight_map": {"x": 3}}))
    refused(path, r"weight_map\['x'\] is an integer 3, expected a shard file name")


def test_a_tensor_in_two_shards_is_refused_naming_both(ckpt):
    """The index places each tensor in one shard; a second copy elsewhere (which the old loader let win) is an
    error, so which copy is meant is never a guess."""
    path = ckpt("mxfp4")
    wm = weight_map(path)
    name = LAYER.format(0) + "self_attn.q_proj.weight"
    other = next(s for s in sorted(set(wm.values())) if s != wm[name])
    copy = load_file(str(path / wm[name]))[name] * 2

    def add(tensors):
        tensors[name] = copy
    tensors = load_file(str(path / other))
    add(tensors)
    save_file(tensors, str(path / other))  # the index still places it in its own shard
    refused(path, rf"tensor '{re.escape(name)}' is held twice: as '{re.escape(name)}' in shard '{wm[name]}' "
                  rf"and as '{re.escape(name)}' in shard '{other}'")


def test_a_tensor_spelled_twice_is_refused(ckpt):
    path = ckpt("mxfp4")
    name = LAYER.format(1) + "input_layernorm.weight"
    old = name.replace("language_model.model.layers.", "language_model.layers.")
    edit_tensors(path, weight_map(path)[name], lambda t: t.__setitem__(old, t[name].clone()))
    refused(path, rf"tensor '{re.escape(name)}' is held twice: as '{re.escape(name)}' in shard {SHARD} and as "
                  rf"'{re.escape(old)}' in shard {SHARD}|tensor '{re.escape(name)}' is held twice")


def test_index_and_shards_must_agree(ckpt):
    path = ckpt("mxfp4")
    wm = weight_map(path)
    name = LAYER.format(2) + "post_attention_layernorm.weight"
    tensors = load_file(str(path / wm[name]))
    del tensors[name]
    save_file(tensors, str(path / wm[name]))
    refused(path, rf"{INDEX} places tensor '{re.escape(name)}' in shard '{wm[name]}', which does not hold it")
    path = ckpt("bf16")
    shard = weight_map(path)[name]
    edit_json(path / INDEX, lambda index: index["weight_map"].update({name: "model-99999-of-99999.safetensors"}))
    refused(path, r"shard 'model-99999-of-99999\.safetensors' named by model\.safetensors\.index\.json: .* does not "
                  "exist")
    assert shard


# --- 48.6: config.json and the index are data, checked ----------------------------------------------------------
@pytest.mark.parametrize("where", ["", "text_config", "text_config.linear_attn_config", "quantization_config",
                                   "quantization_config.config_groups", "quantization_config.config_groups.group_0",
                                   "quantization_config.config_groups.group_0.weights"])
def test_a_list_where_an_object_belongs_is_a_checkpoint_error(ckpt, where):
    path = ckpt("mxfp4")
    config = json.loads((path / "config.json").read_text())
    if where:
        *parents, leaf = where.split(".")
        node = config
        for p in parents:
            node = node[p]
        node[leaf] = [node[leaf]] if leaf != "config_groups" else [node[leaf]["group_0"]]
    else:
        config = [config]
    (path / "config.json").write_text(json.dumps(config))
    refused(path, r"config\.json(: [a-z_0-9.]+ is a list, expected an object| holds a list, expected an object)$")


@pytest.mark.parametrize("depth", [40, 200_000])
def test_deeply_nested_config_json_is_a_checkpoint_error(ckpt, depth):
    path = ckpt("mxfp4")
    config = (path / "config.json").read_text()
    nested = "[" * depth + "]" * depth
    (path / "config.json").write_text(config[:-1].rstrip() + f', "extra": {nested}}}')
    refused(path, r"config\.json nests deeper than 32 levels, which no config\.json does")


def _paths(node, path=()):
    """Every place in a JSON value: objects, lists and leaves alike."""
    yield path
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in children:
        yield from _paths(child, path + (key,))


def test_any_value_of_any_type_anywhere_in_config_json_is_a_model_or_a_checkpoint_error():
    """Every place of a K3 config.json replaced by a value of every JSON type (a list where an object belongs, an
    object where a number does, null, a huge number...): the config is read as a K3Config, or refused with one
    CheckpointError line; never AttributeError, TypeError, KeyError or a hang."""
    import copy

    from k3fuse.model.hf_config import hf_config, k3_config

    config = hf_config(tiny("mxfp4", residual="attnres"))
    refusals = 0
    for path in _paths(config):
        for value in ([], {}, None, "x", 10**12, -1, 0, 1.5, True, [[1]], {"a": [1]}, ["kimi_k3"]):
            mutated = copy.deepcopy(config)
            if path:
                node = mutated
                for key in path[:-1]:
                    node = node[key]
                node[path[-1]] = value
            else:
                mutated = value
            try:
                k3_config(mutated)
            except CheckpointError as exc:
                assert "\n" not in str(exc)
                refusals += 1
    assert refusals > 500


@pytest.mark.parametrize("key,value,pattern", [
    ("strategy", "channel", r"weights\.strategy is 'channel', expected 'group' for mxfp4-pack-quantized"),
    ("group_size", None, r"weights\.group_size is missing; mxfp4-pack-quantized needs group_size 32"),
    ("group_size", 128, r"weights\.group_size is 128, expected 32"),
    ("num_bits", 8, r"weights\.num_bits is 8, expected 4"),
    ("type", "int", r"weights\.type is 'int', expected 'float'"),
    ("symmetric", False, r"weights\.symmetric is False, expected True"),
    ("scale_dtype", "torch.float8_e4m3fn", r"weights\.scale_dtype is 'torch\.float8_e4m3fn', expected 'torch\.uint8'"),
])
def test_quantization_args_the_loader_cannot_read_are_refused(ckpt, key, value, pattern):
    path = ckpt("mxfp4")

    def edit(config):
        weights = config["quantization_config"]["config_groups"]["group_0"]["weights"]
        if value is None:
            del weights[key]
        else:
            weights[key] = value
    edit_json(path / "config.json", edit)
    refused(path, r"config\.json: quantization_config\.config_groups\.group_0\." + pattern)


@pytest.mark.parametrize("edit,pattern", [
    (lambda c: c.update(model_type="deepseek_v3"), r"describes model_type 'deepseek_v3', .*: not Kimi K3; expected "
                                                   "model_type 'kimi_k3'"),
    (lambda c: c.update(architectures=["LlamaForCausalLM"]), r"architectures \['LlamaForCausalLM'\]: not Kimi K3"),
    (lambda c: c["text_config"].pop("hidden_size"), r"text_config\.hidden_size is missing"),
    (lambda c: c["text_config"].update(hidden_size="128"), r"text_config\.hidden_size is a string '128', expected an "
                                                           "integer"),
    (lambda c: c["text_config"].update(num_experts=True), r"text_config\.num_experts is true or false True, expected "
                                                          "an integer"),
    (lambda c: c["text_config"].update(hidden_act="silu"), r"text_config\.hidden_act is 'silu', but the model builds "
                                                           "only 'situ'"),
    (lambda c: c["text_config"].pop("mla_use_output_gate"), r"mla_use_output_gate is False \(absent\), but the model "
                                                            "builds only True"),
    (lambda c: c["text_config"].update(rms_norm_eps=-1), r"describes a model K3Config refuses: K3Config\.rms_eps must "
                                                         "be positive"),
    (lambda c: c["text_config"]["linear_attn_config"].update(full_attn_layers=[1, 4], kda_layers=[2, 3]),
     r"full_attn_layers is \[1, 4\], which is not K3's layer pattern"),
    (lambda c: c["quantization_config"].update(quant_method="gptq"), r"quant_method is 'gptq', expected "
                                                                     "'compressed-tensors'"),
    (lambda c: c["text_config"].update(num_experts=10**9), r"describes a model of at least \d+ tensors but the shards "
                                                           r"hold \d+"),
])
def test_a_config_of_another_model_is_one_clear_error(ckpt, edit, pattern):
    path = ckpt("mxfp4")
    edit_json(path / "config.json", edit)
    refused(path, pattern)


@pytest.mark.parametrize("text,pattern", [
    ('{"model_type": "kimi_k3", "x": NaN}', r"not valid JSON: NaN is not a JSON number"),
    ('{"model_type": "kimi_k3", "model_type": "kimi_k3"}', r"not valid JSON: key 'model_type' appears twice"),
    ('{"model_type": "kimi_k3"', r"not valid JSON"),
    (b'{"model_type": "\xff"}', r"not valid JSON: 'utf-8' codec can't decode"),
])
def test_malformed_config_json_is_one_clear_error(ckpt, text, pattern):
    path = ckpt("mxfp4")
    (path / "config.json").write_bytes(text if isinstance(text, bytes) else text.encode())
    refused(path, r"config\.json is " + pattern)


def test_special_or_missing_files_are_refused_without_reading_them(ckpt):
    path = ckpt("mxfp4")
    (path / "config.json").unlink()
    refused(path, r"config\.json .*config\.json does not exist")
    if hasattr(os, "mkfifo"):
        os.mkfifo(path / "config.json")  # reading a FIFO would block forever
        refused(path, r"config\.json is not a regular file")
    refused(path / "nosuch", r"nosuch is not a directory")


# --- 48.6: safetensors errors name the shard --------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["truncated", "garbage", "header"])
def test_unreadable_shards_are_named(ckpt, damage):
    path = ckpt("mxfp4")
    shard = sorted(set(weight_map(path).values()))[2]
    data = (path / shard).read_bytes()
    if damage == "truncated":
        data = data[:len(data) // 2]
    elif damage == "garbage":
        data = os.urandom(4096)
    else:
        data = (10**12).to_bytes(8, "little") + data[8:]
    (path / shard).write_bytes(data)
    refused(path, rf"shard '{shard}' is not a readable safetensors file: ")


def test_a_shard_that_is_a_directory_is_refused(ckpt):
    path = ckpt("mxfp4")
    shard = sorted(set(weight_map(path).values()))[1]
    (path / shard).unlink()
    (path / shard).mkdir()
    refused(path, rf"shard '{shard}' named by model.safetensors.index.json: .* is not a regular file")


# --- 48.6: tensors that do not fit -----------------------------------------------------------------------------
def test_shape_dtype_and_name_errors_name_the_tensor_shard_and_expectation(ckpt):
    path = ckpt("mxfp4")
    name = LAYER.format(1) + "block_sparse_moe.experts.3.w2.weight_packed"
    shard = weight_map(path)[name]
    edit_tensors(path, shard, lambda t: t.__setitem__(name, torch.zeros(64, 32, dtype=torch.uint8)))
    refused(path, rf"tensor '{re.escape(name)}' in shard '{shard}' is U8 \[64, 32\], expected U8 \[64, 16\]")
    edit_tensors(path, shard, lambda t: t.__setitem__(name, torch.zeros(64, 16, dtype=torch.int32)))
    refused(path, rf"tensor '{re.escape(name)}' in shard '{shard}' is I32 \[64, 16\], expected U8 \[64, 16\]")
    edit_tensors(path, shard, lambda t: t.__setitem__(name, torch.zeros(64, 16, dtype=torch.uint8)))
    typo = name.replace("weight_packed", "weight_pack")
    edit_tensors(path, shard, lambda t: t.__setitem__(typo, t.pop(name)))
    refused(path, rf"missing tensor '{re.escape(name)}': expected U8 \[64, 16\]; no shard holds it")
    edit_tensors(path, shard, lambda t: t.__setitem__(name, t[typo].clone()))
    refused(path, rf"unexpected tensor '{re.escape(typo)}' in shard '{shard}': not a parameter of the K3 model")
    edit_tensors(path, shard, lambda t: t.pop(typo))
    extra = name.replace("experts.3.", "experts.16.")
    edit_tensors(path, shard, lambda t: t.__setitem__(extra, t[name].clone()))
    refused(path, rf"unexpected tensor '{re.escape(extra)}' in shard '{shard}': it names expert 16 but config\.json "
                  "has num_experts=16")


def test_names_from_files_print_as_one_short_line(ckpt):
    path = ckpt("mxfp4")
    shard = sorted(set(weight_map(path).values()))[0]
    odd = "language_model.model.layers.0.\n\x1b[31mred" + "x" * 10_000
    edit_tensors(path, shard, lambda t: t.__setitem__(odd, torch.zeros(1)))
    message = refused(path, r"unexpected tensor 'language_model\.model\.layers\.0\.\\n\\x1b\[31mredx+\.\.\.\(10\d\d\d "
                            r"chars\) in shard ")
    assert len(message) < 400 and "\x1b" not in message


# --- 53.5: never a half-loaded model ------------------------------------------------------------------------------
def snapshot(model: K3Model) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}


def untouched(model: K3Model, before: dict[str, torch.Tensor]) -> bool:
    now = dict([*model.named_parameters(), *model.named_buffers()])
    return now.keys() == before.keys() and all(torch.equal(now[n], before[n]) for n in before)


def last_shard_tensor(path: Path, part: str) -> tuple[str, str]:
    wm = weight_map(path)
    last = max(wm.values())
    return next(n for n in sorted(wm) if wm[n] == last and part in n), last


def test_a_missing_tensor_in_the_last_shard_leaves_the_model_untouched(ckpt):
    path = ckpt("mxfp4")
    name, shard = last_shard_tensor(path, "")
    edit_tensors(path, shard, lambda t: t.pop(name))
    model = K3Model(tiny("mxfp4"), seed=2)
    before = snapshot(model)
    with pytest.raises(CheckpointError, match=rf"missing tensor '{re.escape(name)}'"):
        load_into(model, path)
    assert untouched(model, before)


def test_a_shard_missing_what_its_index_lists_leaves_the_model_untouched(ckpt):
    path = ckpt("mxfp4")
    name, shard = last_shard_tensor(path, "")
    tensors = load_file(str(path / shard))
    del tensors[name]
    save_file(tensors, str(path / shard))
    model = K3Model(tiny("mxfp4"), seed=2)
    before = snapshot(model)
    with pytest.raises(CheckpointError, match=rf"places tensor '{re.escape(name)}' in shard '{shard}', which does not "
                                              "hold it"):
        load_into(model, path)
    assert untouched(model, before)


def test_a_bad_value_read_last_leaves_the_model_untouched(ckpt):
    """Every value is read and checked before the first is copied: a NaN scale in the last layer's last expert fails
    the load after all the others were read, and the model still holds its own weights."""
    path = ckpt("mxfp4")
    name = LAYER.format(3) + "block_sparse_moe.experts.15.w2.weight_scale"
    set_value(path, name, (63, 0), 255)
    model = K3Model(tiny("mxfp4"), seed=2)
    before = snapshot(model)
    with pytest.raises(CheckpointError, match="E8M0 scale byte 255"):
        load_into(model, path)
    assert untouched(model, before)
    set_value(path, name, (63, 0), 127)
    load_into(model, path)
    assert not untouched(model, before)
    assert torch.equal(model.layers[0].attn.w_q, K3Model(tiny("mxfp4"), seed=1).layers[0].attn.w_q)


@pytest.mark.parametrize("layers,pattern", [
    ([0, 1, 2], r"layers= maps 3 checkpoint layers onto a model of 4"),
    ([0, 1, 2, 9], r"layers\[3\]=9 is not a layer of the checkpoint \(0\.\.3\)"),
    ([0, 1, 2, 1], r"layers\[3\]=1: checkpoint layer 1 is kda\+moe but model layer 3 is mla\+moe"),
    ([0, 1, 2, "3"], r"layers\[3\]='3' is not a layer of the checkpoint"),
    ([0, True, 2, 3], r"layers\[1\]=True is not a layer of the checkpoint"),
    ("0123", r"layers='0123' is not a non-empty list"),
    ([], r"layers=\[\] is not a non-empty list"),
])
def test_a_bad_layers_list_leaves_the_model_untouched(ckpt, layers, pattern):
    path = ckpt("mxfp4")
    model = K3Model(tiny("mxfp4"), seed=2)
    before = snapshot(model)
    with pytest.raises(CheckpointError, match=pattern):
        load_into(model, path, layers=layers)
    assert untouched(model, before)
