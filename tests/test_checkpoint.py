"""K3 checkpoints as they ship (config.json + index + safetensors shards with K3's names): written from a model or
drawn directly, loaded whole or as each rank's slice, bit for bit, the loaded model stepping as its source does;
each rank reads only its slices. The refusals of corrupt files are tests/test_checkpoint_trust.py's."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from k3fuse.dist import launch
from k3fuse.model import K3Config, K3Model, get_config
from k3fuse.model import checkpoint as ckpt_module
from k3fuse.model.checkpoint import (CheckpointError, load_checkpoint, load_into, load_state_dict, read_config,
                                     write_checkpoint)
from k3fuse.model.hf_config import differences

FORMATS = ("bf16", "mxfp4", "int4")
LAYER = "language_model.model.layers.{}."


def tiny(fmt: str = "mxfp4", **over) -> K3Config:
    """tiny with every layer kind: dense, KDA + MoE, MLA + MoE (layer 3)."""
    return get_config("tiny", **{"n_layers": 4, "expert_format": fmt, **over})


def params(model: K3Model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def steps(model: K3Model, n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A few greedy decode steps of 3 sequences from fixed tokens: (tokens, logits) each."""
    state, tokens, out = model.new_state(3, 16), torch.tensor([5, 17, 200]), []
    for _ in range(n):
        tokens, logits = model(tokens, state)
        out.append((tokens.clone(), logits.clone()))
    return out


def shard_of(path: Path, name: str) -> str:
    return json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][name]


# --- the shipped layout --------------------------------------------------------------------------------------
def test_writer_stores_k3s_names_dtypes_and_config(tmp_path):
    cfg = tiny("mxfp4", residual="attnres")
    files = write_checkpoint(tmp_path / "c", cfg, seed=1, max_shard_bytes=300_000)
    path = tmp_path / "c"
    assert len(files) > 3 and sorted(p.name for p in path.iterdir()) == sorted(
        ["config.json", "model.safetensors.index.json"] + [f.name for f in files])
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "kimi_k3" and config["architectures"] == ["KimiK3ForConditionalGeneration"]
    text = config["text_config"]
    assert (text["hidden_size"], text["num_experts"], text["routed_expert_hidden_size"]) == (128, 16, 64)
    assert text["linear_attn_config"]["full_attn_layers"] == [4] and text["attn_res_block_size"] == 2
    qc = config["quantization_config"]
    assert qc["format"] == "mxfp4-pack-quantized" and qc["config_groups"]["group_0"]["weights"]["group_size"] == 32
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    every = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            every.update({n: h.get_slice(n) for n in h.keys()})
    assert set(index) == set(every)
    expert = LAYER.format(1) + "block_sparse_moe.experts.3."
    packed, scale = every[expert + "w2.weight_packed"], every[expert + "w1.weight_scale"]
    assert (packed.get_dtype(), packed.get_shape()) == ("U8", [64, 16])  # w2 [L, I] packed along I
    assert (scale.get_dtype(), scale.get_shape()) == ("U8", [32, 2])  # w1 [I, L]: L / 32 groups
    conv = every[LAYER.format(0) + "self_attn.q_conv1d.weight"]
    assert conv.get_shape() == [128, 1, 4] and conv.get_dtype() == "F32"
    assert every["language_model.model.embed_tokens.weight"].get_shape() == [256, 128]
    assert every["language_model.lm_head.weight"].get_dtype() == "F32"  # tiny's trunk dtype
    assert every[LAYER.format(3) + "self_attn.kv_b_proj.weight"].get_shape() == [8 * (16 + 16), 32]
    assert every[LAYER.format(2) + "mlp_res_proj.weight"].get_shape() == [1, 128]
    assert every["language_model.model.output_attn_res_norm.weight"].get_shape() == [128]
    assert not any("weight_shape" in n for n in every)  # compressed-tensors' mxfp4 writes none
    assert read_config(path) == dataclasses.replace(cfg, name="c")  # AttnRes: every field expressed


def test_k3_preset_config_round_trips_through_config_json(tmp_path):
    from k3fuse.model.hf_config import hf_config, k3_config

    for preset in ("k3", "small", "k3_moe_inter128"):
        cfg = get_config(preset)
        back = k3_config(json.loads(json.dumps(hf_config(cfg))), name=cfg.name, expert_layout=cfg.expert_layout)
        assert differences(back, cfg) == []
    k3 = hf_config(get_config("k3"))["text_config"]
    assert k3["linear_attn_config"]["full_attn_layers"] == list(range(4, 93, 4)) + [93]
    assert (k3["num_shared_experts"], k3["intermediate_size"], k3["first_k_dense_replace"]) == (2, 33792, 1)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("residual", ["plain", "attnres"])
def test_drawn_checkpoint_loads_as_the_seeded_model_and_steps_like_it(fmt, residual, tmp_path):
    """write_checkpoint(cfg, seed) draws what K3Model(cfg, seed) draws; loading it gives that model's parameters bit
    for bit, and its decode steps give the same tokens and logits."""
    cfg = tiny(fmt, residual=residual)
    write_checkpoint(tmp_path / "c", cfg, seed=3, max_shard_bytes=250_000)
    source = K3Model(cfg, seed=3)
    loaded_cfg, model, report = load_checkpoint(tmp_path / "c")
    assert differences(loaded_cfg, cfg) == []
    assert_same(params(source), params(model))
    for (t0, l0), (t1, l1) in zip(steps(source), steps(model)):
        assert torch.equal(t0, t1) and torch.equal(l0, l1)
    assert report.layers == (0, 1, 2, 3) and report.tp_size == 1 and report.skipped == ()
    assert report.bytes_read == sum(f.stat().st_size for f in (tmp_path / "c").glob("*.safetensors")) - sum(
        8 + int.from_bytes(f.read_bytes()[:8], "little") for f in (tmp_path / "c").glob("*.safetensors"))


def test_model_written_checkpoint_is_the_drawn_one(tmp_path):
    cfg = tiny("int4")
    write_checkpoint(tmp_path / "drawn", cfg, seed=7, max_shard_bytes=400_000)
    write_checkpoint(tmp_path / "model", K3Model(cfg, seed=7), max_shard_bytes=400_000)
    for f in sorted((tmp_path / "drawn").glob("*.safetensors")):
        a, b = load_file(str(f)), load_file(str(tmp_path / "model" / f.name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "drawn" / "model.safetensors.index.json").read_text() == \
        (tmp_path / "model" / "model.safetensors.index.json").read_text()


def test_bf16_trunk_and_a_model_of_another_dtype(tmp_path):
    """A bf16 model writes BF16 tensors (fp32 vectors stay F32); a float32 model loads them exactly widened."""
    cfg = tiny("mxfp4", dtype="bfloat16")
    source = K3Model(cfg, seed=2)
    write_checkpoint(tmp_path / "c", source)
    with safe_open(str(next((tmp_path / "c").glob("*.safetensors"))), framework="pt") as h:
        assert h.get_slice(LAYER.format(0) + "self_attn.q_proj.weight").get_dtype() == "BF16"
        assert h.get_slice(LAYER.format(0) + "self_attn.A_log").get_dtype() == "F32"
    _, wide, _ = load_checkpoint(tmp_path / "c", dtype="float32")
    ref = params(source)
    for name, p in wide.named_parameters():
        assert torch.equal(p, ref[name].to(p.dtype)), name


@pytest.mark.parametrize("fmt", ["mxfp4", "int4"])
def test_block_ordered_model_writes_the_checkpoint_layout_and_loads_either_layout(fmt, tmp_path):
    """A model holding its experts in block order writes the checkpoint's row-major tensors (the files a row-major
    model of the same draws writes); loading repacks them as the loading model holds them."""
    def cfg(layout: str):
        return get_config("tiny", n_layers=2, latent=256, moe_inter=256, shared_inter=256, expert_format=fmt,
                          expert_layout=layout)

    blocks, rows = K3Model(cfg("blocks"), seed=1), K3Model(cfg("rows"), seed=1)
    write_checkpoint(tmp_path / "blocks", blocks)
    write_checkpoint(tmp_path / "rows", rows)
    (a,), (b,) = (sorted((tmp_path / d).glob("*.safetensors")) for d in ("blocks", "rows"))
    written, want = load_file(str(a)), load_file(str(b))
    assert written.keys() == want.keys() and all(torch.equal(written[k], want[k]) for k in want)
    for source, layout in ((blocks, "blocks"), (rows, "rows")):
        _, model, _ = load_checkpoint(tmp_path / "blocks", expert_layout=layout)
        assert_same(params(source), params(model))
    target = K3Model(cfg("blocks"), seed=5)
    load_into(target, tmp_path / "rows")
    assert_same(params(blocks), params(target))


def test_layers_map_model_layers_to_checkpoint_layers_of_their_kind(tmp_path):
    cfg = tiny("mxfp4", n_layers=8)
    write_checkpoint(tmp_path / "c", cfg, seed=4)
    source = params(K3Model(cfg, seed=4))
    # model of 4 layers: kda+dense, kda+moe, kda+moe, mla+moe; checkpoint layers 5 and 4 are kda+moe, 7 is mla+moe
    loaded_cfg, model, report = load_checkpoint(tmp_path / "c", layers=[0, 5, 4, 7])
    assert loaded_cfg.n_layers == 4 and report.layers == (0, 5, 4, 7)
    got = params(model)
    for i, c in enumerate([0, 5, 4, 7]):
        layer = {n.split(".", 2)[2]: t for n, t in got.items() if n.startswith(f"layers.{i}.")}
        assert layer and all(torch.equal(t, source[f"layers.{c}.{n}"]) for n, t in layer.items()), (i, c)
    assert torch.equal(got["embed.weight"], source["embed.weight"])
    _, state, _ = load_state_dict(tmp_path / "c", layers=[0, 1, 2, 3])
    assert torch.equal(state["layers.2.mlp.routed.w3_packed"], source["layers.2.mlp.routed.w3_packed"])
    with pytest.raises(CheckpointError, match=r"layers\[3\]=4: checkpoint layer 4 is kda\+moe but model layer 3 is "
                                              r"mla\+moe"):
        load_checkpoint(tmp_path / "c", layers=[0, 1, 2, 4])
    with pytest.raises(CheckpointError, match=r"layers\[0\]=1: checkpoint layer 1 is kda\+moe but model layer 0 is "
                                              r"kda\+dense"):
        load_checkpoint(tmp_path / "c", layers=[1, 1, 2, 3])


def test_older_layer_prefix_reads_as_the_released_one(tmp_path):
    """Both engines map language_model.layers.{i}. onto language_model.model.layers.{i}.: so does the loader."""
    cfg = tiny("bf16")
    write_checkpoint(tmp_path / "c", cfg, seed=1)
    path = tmp_path / "c"
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for shard in path.glob("*.safetensors"):
        tensors = {n.replace("language_model.model.layers.", "language_model.layers."): t
                   for n, t in load_file(str(shard)).items()}
        save_file(tensors, str(shard))
    index["weight_map"] = {n.replace("language_model.model.layers.", "language_model.layers."): s
                           for n, s in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))
    _, model, _ = load_checkpoint(path)
    assert_same(params(K3Model(cfg, seed=1)), params(model))


def test_other_stored_forms_the_engines_read(tmp_path):
    """A_log as the older [1, 1, h, 1], a conv weight as [P, K] (vLLM's loaders take both), a BF16 copy of an F32
    vector: read as the model holds them."""
    cfg = tiny("bf16")
    write_checkpoint(tmp_path / "c", cfg, seed=1)
    path = tmp_path / "c"
    a_log, conv = LAYER.format(1) + "self_attn.A_log", LAYER.format(2) + "self_attn.v_conv1d.weight"
    bias = LAYER.format(1) + "block_sparse_moe.gate.e_score_correction_bias"
    for shard in path.glob("*.safetensors"):
        tensors = load_file(str(shard))
        if a_log in tensors:
            tensors[a_log] = tensors[a_log].view(1, 1, -1, 1)
        if conv in tensors:
            tensors[conv] = tensors[conv].squeeze(1)
        if bias in tensors:
            tensors[bias] = tensors[bias].bfloat16()
        save_file(tensors, str(shard))
    source = params(K3Model(cfg, seed=1))
    for rank in range(2):  # the 4-D A_log is split along its heads
        _, state, _ = load_state_dict(path, rank=rank, tp_size=2)
        heads = source["layers.1.attn.A_log"].chunk(2)[rank]
        assert torch.equal(state["layers.1.attn.A_log"], heads)
    _, model, _ = load_checkpoint(path)
    got = params(model)
    assert torch.equal(got["layers.2.attn.conv_weight"], source["layers.2.attn.conv_weight"])
    bias_name = "layers.1.mlp.routed.router.b_corr"
    assert got[bias_name].dtype == torch.float32 and torch.equal(got[bias_name], source[bias_name].bfloat16().float())


def test_tensors_outside_the_language_model_are_skipped(tmp_path):
    cfg = tiny("bf16")
    write_checkpoint(tmp_path / "c", cfg, seed=1)
    path = tmp_path / "c"
    save_file({"vision_tower.patch_embed.proj.weight": torch.zeros(4, 4),
               "mm_projector.proj.0.weight": torch.zeros(2, 2)}, str(path / "vision.safetensors"))
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"].update({"vision_tower.patch_embed.proj.weight": "vision.safetensors",
                                "mm_projector.proj.0.weight": "vision.safetensors"})
    index_path.write_text(json.dumps(index))
    _, _, report = load_checkpoint(path)
    assert sorted(report.skipped) == ["mm_projector.proj.0.weight", "vision_tower.patch_embed.proj.weight"]


def test_single_file_checkpoint_without_an_index(tmp_path):
    cfg = tiny("mxfp4")
    write_checkpoint(tmp_path / "c", cfg, seed=2)
    path = tmp_path / "c"
    (path / "model.safetensors.index.json").unlink()
    next(path.glob("model-*.safetensors")).rename(path / "model.safetensors")
    _, model, _ = load_checkpoint(path)
    assert_same(params(K3Model(cfg, seed=2)), params(model))


def test_int4_weight_shape_records_are_checked(tmp_path):
    write_checkpoint(tmp_path / "c", tiny("int4"), seed=1)
    path = tmp_path / "c"
    name = LAYER.format(1) + "block_sparse_moe.experts.2.w1.weight_shape"
    shard = path / shard_of(path, name)
    tensors = load_file(str(shard))
    assert tensors[name].tolist() == [32, 64]  # compressed-tensors' pack-quantized records [out, in]
    tensors[name] = torch.tensor([32, 128], dtype=torch.int32)
    save_file(tensors, str(shard))
    with pytest.raises(CheckpointError, match=r"experts.2.w1.weight_shape' in shard 'model-\d+-of-\d+.safetensors' "
                                              r"says the weight is \[32, 128\], expected \[32, 64\]"):
        load_checkpoint(path)


# --- the model's config against the file's ---------------------------------------------------------------
def test_load_into_refuses_a_model_the_config_does_not_describe(tmp_path):
    write_checkpoint(tmp_path / "c", tiny("int4"), seed=1)
    with pytest.raises(CheckpointError, match=r"does not describe this model \(checkpoint vs model\): expert_format "
                                              r"'int4' vs 'mxfp4'"):
        load_into(K3Model(tiny("mxfp4")), tmp_path / "c")
    with pytest.raises(CheckpointError, match=r"hidden 128 vs 256"):
        load_into(K3Model(tiny("int4", hidden=256)), tmp_path / "c")


# --- tensor parallel: each rank its slices ---------------------------------------------------------------
class _RecordingOpen:
    """safe_open as the loader sees it, recording every slice read (name, index) and refusing whole reads."""

    reads: list[tuple[str, str, tuple]] = []

    def __init__(self, path, framework, device="cpu"):
        self._path, self._h = Path(path).name, safe_open(path, framework=framework, device=device)

    def keys(self):
        return self._h.keys()

    def get_tensor(self, name):
        raise AssertionError(f"whole-tensor read of {name}")

    def get_slice(self, name):
        inner, shard = self._h.get_slice(name), self._path

        class Slice:
            def get_shape(self):
                return inner.get_shape()

            def get_dtype(self):
                return inner.get_dtype()

            def __getitem__(self, index):
                index = index if isinstance(index, tuple) else (index,)
                _RecordingOpen.reads.append((shard, name, tuple((s.start, s.stop) for s in index)))
                return inner[index]
        return Slice()


def test_each_rank_reads_only_its_slice_and_holds_the_tp_models_parameters(tmp_path, monkeypatch):
    cfg = get_config("small", expert_format="mxfp4", residual="attnres")
    write_checkpoint(tmp_path / "c", cfg, seed=5, max_shard_bytes=2_000_000)
    import safetensors
    monkeypatch.setattr(safetensors, "safe_open", _RecordingOpen)
    reads, sizes = {}, {}
    for rank in range(2):
        _RecordingOpen.reads = []
        _, state, report = load_state_dict(tmp_path / "c", rank=rank, tp_size=2)
        reads[rank] = {(n): idx for _, n, idx in _RecordingOpen.reads}
        assert len(_RecordingOpen.reads) == len(reads[rank]) == report.tensors  # each tensor read once
        reference = K3Model(cfg, seed=5, tp_size=2, rank=rank, standin=True)
        assert_same(params(reference), state)
        sizes[rank] = report.bytes_read
    monkeypatch.undo()
    shapes = {}
    for f in (tmp_path / "c").glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as h:
            shapes.update({n: h.get_slice(n).get_shape() for n in h.keys()})
    whole, halves = set(), set()
    for name, shape in shapes.items():
        a, b = reads[0][name], reads[1][name]
        full = [(None, None)] * len(shape)
        if a == b == tuple(full):
            whole.add(name)
            continue
        dims = [d for d in range(len(shape)) if a[d] != (None, None)]
        assert len(dims) == 1, name
        d, n = dims[0], shape[dims[0]]
        assert a[d] == (0, n // 2) and b[d] == (n // 2, n), name
        halves.add(name)
    layer = LAYER.format(1)
    assert {layer + "self_attn.q_proj.weight", layer + "self_attn.o_proj.weight", layer + "self_attn.A_log",
            layer + "block_sparse_moe.experts.0.w2.weight_scale", "language_model.lm_head.weight",
            LAYER.format(3) + "self_attn.kv_b_proj.weight"} <= halves
    assert {layer + "self_attn.f_a_proj.weight", layer + "block_sparse_moe.gate.weight",
            layer + "block_sparse_moe.routed_expert_down_proj.weight", layer + "mlp_res_norm.weight",
            LAYER.format(3) + "self_attn.q_a_proj.weight"} <= whole
    total = sum(torch.Size(s).numel() * (1 if "weight_packed" in n or "weight_scale" in n else 4)
                for n, s in shapes.items())
    replicated = sum(torch.Size(shapes[n]).numel() * 4 for n in whole)
    assert sizes[0] == sizes[1] and sizes[0] + sizes[1] == total + replicated and sizes[0] < 0.7 * total


def _tp_rank(rank: int, world: int, path: str, seed: int) -> dict:
    group = torch.distributed.group.WORLD
    cfg, model, report = load_checkpoint(path, rank=rank, tp_size=world, group=group)
    reference = K3Model(cfg, seed=seed, tp_size=world, rank=rank, group=group)
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
    return {"same": same, "steps": steps(model), "reference": steps(reference), "bytes": report.bytes_read}


@pytest.mark.slow
def test_gloo_ranks_load_their_slices_and_decode_like_the_tp1_model(tmp_path):
    cfg = get_config("small", expert_format="mxfp4")
    write_checkpoint(tmp_path / "c", cfg, seed=6, max_shard_bytes=1_500_000)
    results = launch(_tp_rank, 2, backend="gloo", args=(str(tmp_path / "c"), 6), timeout_s=240)
    tp1 = steps(K3Model(cfg, seed=6))
    for res in results:
        assert res["same"]
        for (t, l), (tr, lr), (t1, l1) in zip(res["steps"], res["reference"], tp1):
            assert torch.equal(t, tr) and torch.equal(l, lr)  # the TP 2 model built from the same draws
            torch.testing.assert_close(l, l1, rtol=1e-4, atol=1e-4)  # and the TP 1 model, up to the sums' order
    assert results[0]["bytes"] == results[1]["bytes"]


def _tp_rank_fails(rank: int, world: int, path: str) -> tuple[str, str, bool]:
    group = torch.distributed.group.WORLD
    messages = []
    try:
        load_checkpoint(path, rank=rank, tp_size=world, group=group)
    except CheckpointError as exc:
        messages.append(str(exc))
    model = K3Model(read_config(path), seed=9, tp_size=world, rank=rank, group=group)
    before = params(model)
    try:
        load_into(model, path)
    except CheckpointError as exc:
        messages.append(str(exc))
    after = params(model)
    return messages[0], messages[1], all(torch.equal(before[n], after[n]) for n in before)


@pytest.mark.slow
def test_one_ranks_bad_slice_is_an_error_on_every_rank_not_a_hang(tmp_path):
    """Rank 1's slice holds a NaN scale: both ranks raise (rank 0 naming rank 1), loading a new model or into an
    existing one, and rank 0 does not commit its clean slice."""
    write_checkpoint(tmp_path / "c", get_config("small", expert_format="mxfp4"), seed=6)
    path = tmp_path / "c"
    name = LAYER.format(1) + "block_sparse_moe.experts.0.w1.weight_scale"
    shard = path / shard_of(path, name)
    tensors = load_file(str(shard))
    tensors[name][40, 1] = 255  # w1's rows 32..63 are rank 1's
    save_file(tensors, str(shard))
    results = launch(_tp_rank_fails, 2, backend="gloo", args=(str(path),), timeout_s=180)
    for loaded, filled in ((results[0][0], results[0][1]), (results[1][0], results[1][1])):
        assert loaded == filled  # load_checkpoint and load_into say the same
    assert "E8M0 scale byte 255 (NaN in OCP MX) at [40, 1]" in results[1][0]
    assert results[0][0].startswith("rank 1 failed to load the checkpoint (CheckpointError: tensor ")
    assert all("\n" not in m for r in results for m in r[:2])
    assert results[0][2] and results[1][2]  # neither rank's model took a value: rank 0's slice was clean


# --- writing ---------------------------------------------------------------------------------------------
def test_writer_streams_parameters_into_shards(tmp_path, monkeypatch):
    """A parameter is drawn, split and handed to the shard writer before the next is drawn, and shards are written
    as they fill: a big preset never holds the whole model."""
    events: list[str] = []
    draw, flush = ckpt_module._full_drawn, ckpt_module._ShardWriter.flush
    monkeypatch.setattr(ckpt_module, "_full_drawn", lambda *a: events.append("draw") or draw(*a))
    monkeypatch.setattr(ckpt_module._ShardWriter, "flush", lambda self: events.append("flush") or flush(self))
    limit = 100_000
    added: list[int] = []
    add = ckpt_module._ShardWriter.add
    monkeypatch.setattr(ckpt_module._ShardWriter, "add",
                        lambda self, n, v: (add(self, n, v), added.append(self.pending_bytes)))
    files = write_checkpoint(tmp_path / "c", tiny("mxfp4"), max_shard_bytes=limit)
    assert events.index("flush") < len(events) // 4 and events[-1] == "flush" and len(files) > 10
    assert max(added) <= limit + max(f.stat().st_size for f in files)
    assert all(f.stat().st_size <= 2 * limit for f in files)


def test_writer_refuses_to_overwrite_and_leaves_nothing_half_written(tmp_path, monkeypatch):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    with pytest.raises(CheckpointError, match="exists and is not an empty directory"):
        write_checkpoint(tmp_path / "full", "tiny")
    with pytest.raises(CheckpointError, match="does not exist"):
        write_checkpoint(tmp_path / "no" / "such", "tiny")
    assert not (tmp_path / "no").exists()
    calls = []

    def failing(*args):
        calls.append(1)
        if len(calls) == 30:
            raise RuntimeError("disk full")
        return draw(*args)
    draw = ckpt_module._full_drawn
    monkeypatch.setattr(ckpt_module, "_full_drawn", failing)
    with pytest.raises(RuntimeError, match="disk full"):
        write_checkpoint(tmp_path / "new", tiny("mxfp4"), max_shard_bytes=50_000)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]
    (tmp_path / "empty").mkdir()
    monkeypatch.undo()
    write_checkpoint(tmp_path / "empty", "tiny")
    assert (tmp_path / "empty" / "config.json").exists()
    with pytest.raises(ValueError, match="a TP 1 model, not tp_size=2"):
        write_checkpoint(tmp_path / "tp2", K3Model(get_config("tiny"), tp_size=2, standin=True))


def test_config_json_cannot_express_every_k3config(tmp_path):
    with pytest.raises(ValueError, match="shared_inter=64 is not a multiple of moe_inter=256"):
        write_checkpoint(tmp_path / "c", get_config("tiny", moe_inter=256))
    with pytest.raises(ValueError, match="gate_rank=8 differs from head_dim=16"):
        write_checkpoint(tmp_path / "c", get_config("tiny", gate_rank=8))
    assert not (tmp_path / "c").exists()


def test_copy_of_a_checkpoint_directory_loads(tmp_path):
    """Nothing depends on the directory's name or place (the index names plain files beside it)."""
    write_checkpoint(tmp_path / "c", tiny("mxfp4"), seed=1)
    shutil.copytree(tmp_path / "c", tmp_path / "d")
    assert_same(params(load_checkpoint(tmp_path / "d").model), params(K3Model(tiny("mxfp4"), seed=1)))
