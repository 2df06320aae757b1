"""The reference model with quantized routed experts (K3Config.expert_format mxfp4 / int4): stored as the
checkpoint stores them, dequantized by the step's spelling, the same function as bf16 experts holding the
dequantized weights, sharded like them, traceable, and initialised without whole-table float temporaries."""
from __future__ import annotations

import pytest
import torch

from k3fuse import quant, spelling
from k3fuse.dist import launch
from k3fuse.model import K3DecodeStack, get_config
from k3fuse.model.layers import LatentMoE, TensorParallel, WeightSource

QUANTIZED = ("mxfp4", "int4")
BATCH = 3


def _steps(model: K3DecodeStack, steps: int = 3, batch: int = BATCH, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    state, ys = model.init_state(batch), []
    for _ in range(steps):
        y, state = model(torch.randn(batch, model.config.hidden, generator=g).to(model.dtype), state)
        ys.append(y)
    return ys


def _with_dequantized_experts(quantized: K3DecodeStack, **kwargs) -> K3DecodeStack:
    """The same model with bf16-format experts holding the quantized model's dequantized weights."""
    cfg = get_config(quantized.config.name, n_layers=quantized.config.n_layers, expert_format="bf16")
    plain = K3DecodeStack(cfg, **kwargs)
    for q_layer, p_layer in zip(quantized.layers, plain.layers):
        for name, w in zip(("w1", "w3", "w2"), q_layer.moe.routed.expert_weights()):
            getattr(p_layer.moe.routed, name).copy_(w)
    return plain


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_quantized_model_is_the_bf16_model_on_the_dequantized_weights(fmt):
    model = K3DecodeStack(get_config("tiny", n_layers=2, expert_format=fmt), seed=4)
    routed = model.layers[0].moe.routed
    assert routed.w1_packed.dtype == (torch.uint8 if fmt == "mxfp4" else torch.int32)
    assert routed.w1_scale.dtype == (torch.uint8 if fmt == "mxfp4" else torch.bfloat16)
    names = {n for n, _ in model.named_parameters()}
    assert {"layers.0.moe.routed.w1_packed", "layers.0.moe.routed.w2_scale"} <= names
    assert "layers.0.moe.routed.e2m1_table" not in model.state_dict()  # not a checkpoint tensor
    plain = _with_dequantized_experts(model, seed=4)
    for y_q, y_p in zip(_steps(model), _steps(plain)):
        torch.testing.assert_close(y_q, y_p, rtol=1e-6, atol=1e-6)


def test_expert_slots_are_the_distinct_experts_in_static_shapes():
    g = torch.Generator().manual_seed(0)
    for pairs, n_experts in ((4, 16), (16, 16), (12, 8), (64, 16)):
        experts = torch.randint(0, n_experts, (pairs,), generator=g)
        experts[:3] = 5  # a crowded expert
        slot_experts, pair_slots = spelling.expert_slots(experts, n_experts)
        distinct = torch.unique(experts)
        assert slot_experts.shape == (min(pairs, n_experts),) and pair_slots.shape == (pairs,)
        assert torch.equal(slot_experts[:len(distinct)], distinct)
        assert slot_experts[len(distinct):].eq(0).all()  # unused slots hold expert 0 and no pair
        assert torch.equal(slot_experts[pair_slots], experts)
        assert int(pair_slots.max()) == len(distinct) - 1
    one = torch.full((7,), 3)
    slot_experts, pair_slots = spelling.expert_slots(one, 16)
    assert slot_experts.tolist() == [3] + [0] * 6 and pair_slots.eq(0).all()


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_expert_slots_trace_in_one_graph_at_a_static_and_a_dynamic_token_count(dynamic):
    """torch 2.11's dynamo broke the graph at torch.sym_min of two ints, which split the T = 1 decode
    graph around the experts so the routed_experts rule saw no quantized spelling there."""
    torch._dynamo.reset()
    traced = torch.compile(lambda e: spelling.expert_slots(e, 896), fullgraph=True, dynamic=dynamic,
                           backend="eager")
    for pairs in (16, 128):
        experts = torch.randint(0, 896, (pairs,), generator=torch.Generator().manual_seed(pairs))
        slot_experts, pair_slots = traced(experts)
        assert slot_experts.shape == (pairs,) and torch.equal(slot_experts[pair_slots], experts)


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_grouped_quantized_spelling_computes_what_the_gathered_one_does(fmt):
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no torch._grouped_mm")
    cfg = get_config("tiny", n_layers=1, dtype="bfloat16", expert_format=fmt)
    moe = LatentMoE(cfg, 0, WeightSource(3, torch.bfloat16, "cpu"), TensorParallel(1, 0, None))
    args = (moe.w1_packed, moe.w1_scale, moe.w3_packed, moe.w3_scale, moe.w2_packed, moe.w2_scale, cfg.top_k,
            cfg.situ_beta, cfg.situ_linear_beta, fmt, moe.e2m1_table)
    w1, w3, w2 = moe.expert_weights()
    for T in (1, 3, 8):
        a = torch.randn(T, cfg.latent, dtype=torch.bfloat16)
        experts = torch.randint(0, cfg.n_experts, (T * cfg.top_k,))
        experts[: cfg.top_k] = 5
        ref = spelling.routed_experts_gathered(a, experts, w1, w3, w2, cfg.top_k, cfg.situ_beta,
                                               cfg.situ_linear_beta).float()
        gathered = spelling.routed_experts_quantized_gathered(a, experts, *args).float()
        assert torch.equal(gathered, ref)
        try:
            grouped = spelling.routed_experts_quantized_grouped(a, experts, *args).float()
        except RuntimeError as exc:  # a CPU build without the grouped kernel
            pytest.skip(f"torch._grouped_mm does not run on this CPU build: {exc}")
        assert (grouped - ref).norm() / ref.norm() < 2e-2, T


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_quantized_model_compiles_and_exports_with_a_dynamic_token_count(fmt):
    model = K3DecodeStack(get_config("tiny", n_layers=1, expert_format=fmt), seed=2)
    x, state = torch.randn(5, model.config.hidden), model.init_state(5)
    y, _ = model(x, state)
    torch._dynamo.reset()
    y_c, _ = torch.compile(model, fullgraph=True, backend="aot_eager")(x, state)
    torch.testing.assert_close(y_c, y, rtol=1e-5, atol=1e-5)
    ep = torch.export.export(model, (x, state), dynamic_shapes=model.export_dynamic_shapes())
    for T in (1, 2, 9):  # fewer pairs than experts (slots = pairs) and more (slots = experts)
        x_t, s_t = torch.randn(T, model.config.hidden), model.init_state(T)
        torch.testing.assert_close(ep.module()(x_t, s_t)[0], model(x_t, s_t)[0], rtol=1e-5, atol=1e-5)


def test_config_names_quantized_width_errors():
    assert get_config("k3").expert_format == "mxfp4"
    assert get_config("tiny").expert_format == "bf16"
    with pytest.raises(ValueError, match="expert_format must be one of"):
        get_config("tiny", expert_format="fp8")
    with pytest.raises(ValueError, match="moe_inter=48 must be a multiple of the mxfp4 group size 32"):
        get_config("tiny", moe_inter=48, expert_format="mxfp4")
    with pytest.raises(ValueError, match="TP=2 leaves moe_inter/tp=16 .* group size 32"):
        get_config("tiny", expert_format="int4").validate_for_tp(2)
    get_config("small", expert_format="mxfp4").validate_for_tp(2)
    get_config("k3").validate_for_tp(8)  # I / 8 = 384 = 12 groups
    # the k3 preset holds its experts in block order (repacked where they load); rows is the default elsewhere
    assert get_config("k3").expert_layout == "blocks" and get_config("tiny").expert_layout == "rows"
    assert get_config("k3_moe_inter128").expert_layout == "rows"
    with pytest.raises(ValueError, match="expert_layout must be one of"):
        get_config("k3", expert_layout="columns")
    with pytest.raises(ValueError, match="'blocks' repacks packed experts: it needs expert_format mxfp4 or int4.*"
                                         "set expert_layout='rows'"):
        get_config("k3", expert_format="bf16")
    with pytest.raises(ValueError, match="latent=64 must be a multiple of 128 for expert_layout='blocks'"):
        get_config("tiny", expert_format="mxfp4", expert_layout="blocks")
    for tp in (1, 2, 4, 8):  # I / 8 = 384 = 3 steps
        get_config("k3").check_expert_layout(tp)
    get_config("k3").validate_for_tp(16)  # TP 16's GEMMs need no layout, its experts do:
    src, tp16 = WeightSource(0, torch.bfloat16, "meta"), TensorParallel(16, 0, None)
    with pytest.raises(ValueError, match="TP=16 leaves moe_inter/tp=192 .* multiple of 128, which expert_layout="
                                         "'blocks' needs per rank: build it with expert_layout='rows'"):
        LatentMoE(get_config("k3", n_layers=1), 0, src, tp16)
    rows = LatentMoE(get_config("k3", n_layers=1, expert_layout="rows"), 0, src, tp16)
    assert rows.w2_packed.shape == (896, 3584, 192 // 2)


def _block_ordered_tiny(fmt: str, layout: str, **over) -> K3DecodeStack:
    """tiny at widths of two 128-element steps (latent, moe_inter: one step a row would be block order too), its
    experts held in `layout`."""
    return K3DecodeStack(get_config("tiny", n_layers=2, latent=256, moe_inter=256, expert_format=fmt,
                                    expert_layout=layout), seed=4, **over)


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_block_ordered_model_holds_the_same_draws_and_computes_the_same_steps(fmt):
    """expert_layout='blocks' holds the row-major model's tables repacked by quant.block_order (the same draws,
    never a float temporary), hands them back in the checkpoint's layout (quantized_weight), and its spelling,
    which un-blocks the step's experts, computes the row-major model's steps bit for bit."""
    rows, blocks = _block_ordered_tiny(fmt, "rows"), _block_ordered_tiny(fmt, "blocks")
    for r, b in zip(rows.layers, blocks.layers):
        for proj in ("w1", "w3", "w2"):
            tables = (getattr(r.moe.routed, f"{proj}_packed"), getattr(r.moe.routed, f"{proj}_scale"))
            held = (getattr(b.moe.routed, f"{proj}_packed"), getattr(b.moe.routed, f"{proj}_scale"))
            assert all(torch.equal(h, w) for h, w in zip(held, quant.block_order(*tables))), proj
            assert not torch.equal(held[0], tables[0])
            back = b.moe.routed.quantized_weight(proj)
            assert torch.equal(back.packed, tables[0]) and torch.equal(back.scale, tables[1])
    for y_rows, y_blocks in zip(_steps(rows), _steps(blocks)):
        assert torch.equal(y_rows, y_blocks)


def test_k3_widths_on_meta_device_in_every_format():
    for fmt, packed_cols in (("mxfp4", 3584 // 2), ("int4", 3584 // 8)):
        routed = K3DecodeStack(get_config("k3", n_layers=1, expert_format=fmt), device="meta",
                               tp_size=1).layers[0].moe.routed
        assert routed.w1_packed.shape == (896, 3072, packed_cols) and routed.w1_packed.is_meta
        assert routed.w2_scale.shape == (896, 3584, 3072 // 32)


@pytest.mark.parametrize("fmt", ("bf16", "mxfp4", "int4"))
def test_initialisation_draws_one_expert_at_a_time(fmt, monkeypatch):
    """No float tensor as large as a whole expert table is ever drawn (K3's would be 37 GB)."""
    cfg = get_config("tiny", n_layers=1, n_experts=64, moe_inter=64, expert_format=fmt)
    table = cfg.n_experts * cfg.moe_inter * cfg.latent  # 8x the largest other weight (W_q's 128 x 128)
    drawn: list[int] = []
    for name in ("randn", "rand", "randint"):
        real = getattr(torch, name)

        def recording(*args, _real=real, **kwargs):
            out = _real(*args, **kwargs)
            drawn.append(out.numel())
            return out
        monkeypatch.setattr(torch, name, recording)
    K3DecodeStack(cfg)
    assert drawn and max(drawn) < table // 8
    assert drawn.count(cfg.moe_inter * cfg.latent // {"bf16": 1, "mxfp4": 2, "int4": 8}[fmt]) >= cfg.n_experts


def _tp_worker(rank: int, world_size: int, fmt: str) -> dict:
    cfg = get_config("small", n_layers=1, expert_format=fmt)
    model = K3DecodeStack(cfg, tp_size=world_size, rank=rank, seed=7)
    routed = model.layers[0].moe.routed
    return {"ys": _steps(model, steps=2), "w1_packed": routed.w1_packed, "w2_packed": routed.w2_packed,
            "w2_scale": routed.w2_scale}


@pytest.mark.slow
@pytest.mark.parametrize("fmt", QUANTIZED)
def test_tensor_parallel_quantized_experts_are_slices_and_match_tp1(fmt):
    results = launch(_tp_worker, 2, backend="gloo", args=(fmt,), timeout_s=240)
    cfg = get_config("small", n_layers=1, expert_format=fmt)
    full = K3DecodeStack(cfg, seed=7)
    routed = full.layers[0].moe.routed
    ys = _steps(full, steps=2)
    I = cfg.moe_inter
    for rank, res in enumerate(results):
        for y_tp, y in zip(res["ys"], ys):
            torch.testing.assert_close(y_tp, y, rtol=1e-4, atol=1e-4)
        rows = slice(rank * I // 2, (rank + 1) * I // 2)
        assert torch.equal(res["w1_packed"], routed.w1_packed[:, rows])
        cols = routed.w2_packed.shape[-1] // 2
        assert torch.equal(res["w2_packed"], routed.w2_packed[:, :, rank * cols:(rank + 1) * cols])
        groups = routed.w2_scale.shape[-1] // 2
        assert torch.equal(res["w2_scale"], routed.w2_scale[:, :, rank * groups:(rank + 1) * groups])
