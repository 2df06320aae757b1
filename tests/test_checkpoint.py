"""The compressed-tensors checkpoint loader: per-expert safetensors tensors into the reference model's
packed experts (a rank's TP slice), and a clear error for every tensor or config that does not fit."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3fuse.dist import launch
from k3fuse.model import K3DecodeStack, get_config
from k3fuse.model.checkpoint import CheckpointError, load_routed_experts, save_routed_experts

PREFIX = "model.layers.{layer}.mlp"


def _model(fmt: str, seed: int, preset: str = "tiny", **kwargs) -> K3DecodeStack:
    return K3DecodeStack(get_config(preset, n_layers=2, expert_format=fmt), seed=seed, **kwargs)


def _experts(model: K3DecodeStack) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if "_packed" in n or "_scale" in n}


@pytest.mark.parametrize("fmt", ["mxfp4", "int4"])
def test_round_trip_through_sharded_checkpoint(fmt, tmp_path):
    source = _model(fmt, seed=1)
    files = save_routed_experts(source, tmp_path, experts_per_shard=5)
    assert len(files) == 2 * 4  # 16 experts in shards of 5, per layer
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"]["format"] == {"mxfp4": "mxfp4-pack-quantized", "int4": "pack-quantized"}[fmt]
    # the compressed-tensors layout, one tensor per expert
    first = load_file(str(files[0]))
    packed = first["model.layers.0.mlp.experts.0.w2.weight_packed"]
    assert packed.dtype == (torch.uint8 if fmt == "mxfp4" else torch.int32)
    assert packed.shape == (64, 32 // (2 if fmt == "mxfp4" else 8))  # w2 [L, I] packed along I
    assert first["model.layers.0.mlp.experts.0.w1.weight_scale"].shape == (32, 64 // 32)
    assert first["model.layers.0.mlp.experts.0.w1.weight_shape"].tolist() == [32, 64]

    target = _model(fmt, seed=2)
    assert not torch.equal(target.layers[0].moe.routed.w1_packed, source.layers[0].moe.routed.w1_packed)
    report = load_routed_experts(target, tmp_path)
    assert report["format"] == fmt and report["tensors"] == 2 * 3 * 16 * 2
    for (name, p), q in zip(_experts(source).items(), _experts(target).values()):
        assert torch.equal(p, q), name
    # the rest of the model is not in the checkpoint: take it from the source, then the step is the same
    rest = {k: v for k, v in source.state_dict().items() if k not in _experts(source)}
    target.load_state_dict(rest, strict=False)
    x = torch.randn(3, 128)
    assert torch.equal(source(x, source.init_state(3))[0], target(x, target.init_state(3))[0])


@pytest.mark.parametrize("fmt", ["mxfp4", "int4"])
def test_block_ordered_model_saves_and_loads_the_checkpoint_layout(fmt, tmp_path):
    """A model holding its experts in block order writes the checkpoint's row-major tensors (the files a
    row-major model of the same draws writes), and loading repacks them as they come: the loaded tables are
    the blocked model's own, and the row-major model loads the same files to its own."""
    def model(layout: str, seed: int) -> K3DecodeStack:
        return K3DecodeStack(get_config("tiny", n_layers=1, latent=256, moe_inter=256, expert_format=fmt,
                                        expert_layout=layout), seed=seed)

    blocks, rows = model("blocks", 1), model("rows", 1)
    save_routed_experts(blocks, tmp_path / "blocks")
    save_routed_experts(rows, tmp_path / "rows")
    (from_blocks,), (from_rows,) = (sorted((tmp_path / d).glob("*.safetensors")) for d in ("blocks", "rows"))
    written, want = load_file(str(from_blocks)), load_file(str(from_rows))
    assert written.keys() == want.keys() and all(torch.equal(written[k], want[k]) for k in want)
    for source, layout in ((blocks, "blocks"), (rows, "rows")):
        target = model(layout, 2)
        load_routed_experts(target, tmp_path / "blocks")
        for (name, p), q in zip(_experts(source).items(), _experts(target).values()):
            assert torch.equal(p, q), (layout, name)


def test_layer_map_and_prefix(tmp_path):
    source = _model("mxfp4", seed=1)
    save_routed_experts(source, tmp_path, layers=[7, 9], layer_prefix="language_model.model.layers.{layer}.mlp")
    target = _model("mxfp4", seed=2)
    load_routed_experts(target, tmp_path, layers=[9, 7], layer_prefix="language_model.model.layers.{layer}.mlp")
    assert torch.equal(target.layers[0].moe.routed.w3_scale, source.layers[1].moe.routed.w3_scale)
    assert torch.equal(target.layers[1].moe.routed.w3_packed, source.layers[0].moe.routed.w3_packed)
    with pytest.raises(CheckpointError, match="missing tensor 'model.layers.0.mlp.experts.0.w1.weight_packed'"):
        load_routed_experts(target, tmp_path)


def _rewrite(tmp_path, edit) -> None:
    """Apply `edit(tensors)` to layer 0's shard (the writer's first)."""
    shard = sorted(tmp_path.glob("*.safetensors"))[0]
    tensors = load_file(str(shard))
    edit(tensors)
    save_file(tensors, str(shard))
    index = tmp_path / "model.safetensors.index.json"
    weight_map = {k: v for k, v in json.loads(index.read_text())["weight_map"].items() if v != shard.name}
    index.write_text(json.dumps({"weight_map": {**weight_map, **{k: shard.name for k in tensors}}}))


def test_errors_name_the_tensor_and_the_expected_shape(tmp_path):
    save_routed_experts(_model("mxfp4", seed=1), tmp_path)
    target = _model("mxfp4", seed=2)
    name = "model.layers.0.mlp.experts.3.w2.weight_packed"

    def drop(t):
        del t[name]
    _rewrite(tmp_path, drop)
    with pytest.raises(CheckpointError, match=rf"missing tensor '{name}': expected U8 \[64, 16\] "
                                              r"\(w2 is \[64, 32\] in mxfp4\)"):
        load_routed_experts(target, tmp_path)

    def wrong_shape(t):
        t[name] = torch.zeros(64, 32, dtype=torch.uint8)  # unpacked width
    _rewrite(tmp_path, wrong_shape)
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' is U8 \[64, 32\], expected U8 \[64, 16\]"):
        load_routed_experts(target, tmp_path)

    def wrong_dtype(t):
        t[name] = torch.zeros(64, 16, dtype=torch.int32)
    _rewrite(tmp_path, wrong_dtype)
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' is I32 \[64, 16\], expected U8 \[64, 16\]"):
        load_routed_experts(target, tmp_path)

    def misnamed(t):
        t[name] = torch.zeros(64, 16, dtype=torch.uint8)
        t["model.layers.0.mlp.experts.3.w2.weight_pack"] = t.pop("model.layers.0.mlp.experts.3.w2.weight_scale")
    _rewrite(tmp_path, misnamed)
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model.layers.0.mlp.experts.3.w2.weight_pack' "
                                              r"under the routed experts: expected 'model.layers.0.mlp.experts.<e>"):
        load_routed_experts(target, tmp_path)

    def extra_expert(t):
        t["model.layers.0.mlp.experts.3.w2.weight_scale"] = t.pop("model.layers.0.mlp.experts.3.w2.weight_pack")
        t["model.layers.0.mlp.experts.16.w1.weight_packed"] = torch.zeros(32, 32, dtype=torch.uint8)
    _rewrite(tmp_path, extra_expert)
    with pytest.raises(CheckpointError, match="names expert 16 but the model has n_experts=16"):
        load_routed_experts(target, tmp_path)

    def bad_shape_record(t):
        del t["model.layers.0.mlp.experts.16.w1.weight_packed"]
        t["model.layers.0.mlp.experts.2.w1.weight_shape"] = torch.tensor([32, 128], dtype=torch.int32)
    _rewrite(tmp_path, bad_shape_record)
    with pytest.raises(CheckpointError, match=r"experts.2.w1.weight_shape' says the weight is \[32, 128\], "
                                              r"expected \[32, 64\]"):
        load_routed_experts(target, tmp_path)


def test_config_errors(tmp_path):
    save_routed_experts(_model("int4", seed=1), tmp_path)
    with pytest.raises(CheckpointError, match="experts are int4 \\(pack-quantized\\) but the model stores mxfp4"):
        load_routed_experts(_model("mxfp4", seed=2), tmp_path)
    config_path = tmp_path / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 128
    config_path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="weights.group_size is 128, expected 32 for pack-quantized"):
        load_routed_experts(_model("int4", seed=2), tmp_path)
    config["quantization_config"] = {"quant_method": "gptq"}
    config_path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="quant_method is 'gptq', expected 'compressed-tensors'"):
        load_routed_experts(_model("int4", seed=2), tmp_path)
    config_path.unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_routed_experts(_model("int4", seed=2), tmp_path)


def _tp_load(rank: int, world: int, path: str, fmt: str) -> dict:
    model = K3DecodeStack(get_config("small", n_layers=1, expert_format=fmt), tp_size=world, rank=rank, seed=3)
    load_routed_experts(model, path)
    r = model.layers[0].moe.routed
    return {n: getattr(r, n).clone() for n in ("w1_packed", "w1_scale", "w2_packed", "w2_scale")}


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["mxfp4", "int4"])
def test_each_rank_loads_its_slice(fmt, tmp_path):
    full = K3DecodeStack(get_config("small", n_layers=1, expert_format=fmt), seed=9)
    save_routed_experts(full, tmp_path)
    results = launch(_tp_load, 2, backend="gloo", args=(str(tmp_path), fmt), timeout_s=240)
    r = full.layers[0].moe.routed
    for rank, got in enumerate(results):
        for name in ("w1_packed", "w1_scale"):
            rows = getattr(r, name).shape[1] // 2
            assert torch.equal(got[name], getattr(r, name)[:, rank * rows:(rank + 1) * rows]), name
        for name in ("w2_packed", "w2_scale"):
            cols = getattr(r, name).shape[2] // 2
            assert torch.equal(got[name], getattr(r, name)[:, :, rank * cols:(rank + 1) * cols]), name
