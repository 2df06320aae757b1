"""The whole K3 model on one GPU: a real deployment's rank (K3's published widths, fewer layers, K3's layer pattern),
drawn on the device without full float32 temporaries, decoding under CUDA graphs, stock against k3fuse (strict),
MLA over a paged bf16/fp8 cache against float64, and `validate --model` on the per-rank slice.

    scripts/gpu_check.sh test-model        (or: python -m pytest -m gpu tests/gpu/test_model_gpu.py)
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

DEV = torch.device("cuda", 0)
#: K3 rank 0 of TP 16 with K3's first four layer kinds (KDA + dense, KDA + MoE x 2, MLA + MoE): ~5 GB a rank
LAYERS = 4


def _rank_model(of: int = 16, layers: int = LAYERS, **kw):
    from k3fuse.model import K3Model
    from k3fuse.tools.model_args import ModelArgs, check_model_args

    ma = check_model_args(ModelArgs(preset="k3", layers=layers, as_rank=0, of=of, device="cuda"))
    return K3Model(ma.config(), tp_size=of, rank=0, standin=True, device=DEV, init_on_device=True, **kw).eval()


def test_rank_slice_is_drawn_on_the_device_without_full_float32_temporaries():
    torch.cuda.init()  # the allocator's statistics exist once CUDA is initialised
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(DEV)
    base = torch.cuda.memory_allocated(DEV)
    model = _rank_model()
    held = torch.cuda.memory_allocated(DEV) - base
    peak = torch.cuda.max_memory_allocated(DEV) - base
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert held >= weights
    # the largest full float32 tensor (the embedding, 163840 x 7168 x 4 B = 4.7 GB) never existed: the draw's
    # temporaries are chunks of 2^24 elements (a few hundred MB at most)
    assert peak - held < 1.0e9, (peak, held)
    emb = model.embed.weight
    assert emb.shape == (163840 // 16, 7168) and emb.dtype == torch.bfloat16
    assert model.layers[1].mlp.routed.w1_packed.shape == (896, 192, 3584 // 2)  # I/16 = 192 rows, row order
    assert model.layers[3].attn.w_kv_b.shape == (6 * 256, 512)
    assert 0.9 < float(emb.float().std()) < 1.1 and float(emb.float().abs().max()) < 8


def test_generate_under_cuda_graphs_stock_and_k3fuse():
    """Greedy decode of 16 steps in graphs of 8: the k3fuse graph replays give the tokens its eager compiled step
    gives; stock and k3fuse logits agree to bf16 rounding; no fallback in strict mode."""
    import k3fuse
    from k3fuse.tools.model_run import GraphedSteps, compile_step, fill_context

    model = _rank_model()
    logits, tokens = {}, {}
    for arm in ("stock", "k3fuse"):
        torch._dynamo.reset()
        step = compile_step(model, arm)
        state = model.new_state(8, 4096, block_size=64)
        fill_context(model, state, [4000 - 300 * b for b in range(8)], seed=0)
        start = torch.arange(8, device=DEV)
        k3fuse.reset_stats()
        with torch.no_grad(), k3fuse.strict(arm == "k3fuse"):
            graphed = GraphedSteps(step, state, start, 8)
            out = torch.cat([graphed.replay().clone(), graphed.replay().clone()])
            logits[arm] = graphed.logits.float().clone()
        tokens[arm] = out
        if arm == "k3fuse":
            assert k3fuse.runtime.fallbacks() == {}
            assert "kda_delta_rule" in k3fuse.stats() and "routed_experts_w4a16" in k3fuse.stats()
    rel = float((logits["k3fuse"] - logits["stock"]).norm() / logits["stock"].norm())
    assert rel < 5e-2, rel
    agree = float((tokens["k3fuse"] == tokens["stock"]).float().mean())
    assert agree > 0.8, (agree, tokens)  # greedy flips only at near ties (validate --model measures them)


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_mla_on_gpu_matches_float64(kv_dtype):
    from test_model_k3 import _fill_history, mla_reference  # tests/ is on the path (its conftest.py)

    model = _rank_model(layers=4)
    cfg, mla = model.config, model.layers[3].attn
    W = {n: p.detach().float().cpu() for n, p in mla.named_parameters()}
    state = model.new_state(3, 600, block_size=64, kv_dtype=kv_dtype, kv_scale=0.25)
    gen = torch.Generator().manual_seed(1)
    lengths = [1, 130, 577]
    cpu_cache = torch.zeros_like(state.kv[0], device="cpu")
    history = [h * float(state.kv_scale[0]) for h in _fill_history(cpu_cache, state.block_table.cpu(), lengths, gen)]
    state.kv[0].copy_(cpu_cache.to(DEV))
    state.seq_lens.copy_(torch.tensor(lengths, dtype=torch.int32, device=DEV) + 1)
    x = torch.randn(3, cfg.hidden, generator=gen).to(DEV, torch.bfloat16)
    with torch.no_grad():
        y = mla(x, state.kv[0], state.kv_scale[0], state.block_table, state.seq_lens)
    y_ref, _ = mla_reference(x.float().cpu(), history, W, cfg)  # rank 0's heads: its partial out-projection
    rel = float((y.double().cpu() - y_ref).norm() / y_ref.norm())
    assert rel < (2e-2 if kv_dtype == "auto" else 6e-2), rel


def test_validate_model_on_the_rank_slice():
    from k3fuse.tools.model_args import ModelArgs, check_model_args
    from k3fuse.tools.validate_model import ValidateModelConfig, validate_model_rank

    ma = check_model_args(ModelArgs(preset="k3", layers=LAYERS, as_rank=0, of=16, device="cuda"))
    report = validate_model_rank(0, 1, ValidateModelConfig(model=ma, batch=4, steps=100, context=512,
                                                           progress_every=50))
    assert report["verdict"] == [], report["verdict"]  # every token difference a near tie (logits or routing)
    assert 0 < max(report["curves"]["k3fuse_kv"]) < 0.5 and report["fallbacks"] == {}
