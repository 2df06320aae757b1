"""The mla_decode rule on the whole model on one GPU, under CUDA graph replay.

The `small` preset with K3's MLA widths and K3's heads per rank at TP 16 (6), bf16 trunk, pages of 64, 8 sequences
of mixed lengths up to 4096 tokens, bf16 and fp8 caches; k3fuse (Inductor, strict) with every default rule,
and the same without this rule, and stock torch.compile, each stepping 16 tokens in two CUDA graphs of 8 steps
(k3fuse.tools.model_run.GraphedSteps: the step writes its state in place; warm-up off the graph):
* the rule fires once (the MLA + MoE graph) and the warm-up's calls ran its Triton / Gluon kernel, no fallback;
* the graph replays give the tokens of the run without the rule (greedy, except at near ties: at least 90%
  agree, 80% against stock's, whose compile rounds differently) and logits within bf16 rounding of both;
* the output gate on the side stream (the eager compiler, CUDA graphs): its fork and join ran, and the replays
  give the inline arm's tokens and logits exactly.

    python -m pytest -m gpu tests/gpu/test_mla_decode_rule_gpu.py -q
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

DEV = torch.device("cuda", 0)
BATCH, CONTEXT, STEPS = 8, 4096, 8


def _run(model, arm: str, kv_dtype: str, rules=None) -> dict:
    import k3fuse
    from k3fuse.tools.model_run import GraphedSteps, compile_step, fill_context

    torch._dynamo.reset()
    rlog = k3fuse.RewriteLog()
    step = compile_step(model, "stock" if arm == "stock" else "k3fuse", log=rlog, rules=rules)
    state = model.new_state(BATCH, CONTEXT, block_size=64, kv_dtype=kv_dtype, kv_scale=0.25)
    fill_context(model, state, [CONTEXT - 2 * STEPS - 500 * b for b in range(BATCH)], seed=0)
    k3fuse.reset_stats()
    with torch.no_grad(), k3fuse.strict(arm != "stock"):
        graphed = GraphedSteps(step, state, torch.arange(BATCH, device=DEV), STEPS)
        tokens = torch.cat([graphed.replay().clone(), graphed.replay().clone()])
        logits = graphed.logits.float().clone()
    torch.cuda.synchronize()
    applied = [(e.variant, dict(e.values)) for e in rlog.events if e.rule == "mla_decode" and e.decision == "applied"]
    return {"tokens": tokens, "logits": logits, "stats": k3fuse.stats(), "fallbacks": k3fuse.runtime.fallbacks(),
            "applied": applied}


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_the_model_with_the_rule_under_graph_replay(kv_dtype):
    from k3fuse.model import K3Model, get_config
    from k3fuse.pipeline import default_rules

    cfg = get_config("small", kv_lora=512, qk_shared=64, mla_heads=6)
    model = K3Model(cfg, seed=0, dtype="bfloat16", device=DEV, init_on_device=True).eval()
    everything = frozenset(r.name for r in default_rules())
    runs = {"k3fuse": _run(model, "k3fuse", kv_dtype), "without": _run(model, "k3fuse", kv_dtype,
                                                                        rules=everything - {"mla_decode"}),
            "stock": _run(model, "stock", kv_dtype)}
    ours = runs["k3fuse"]
    assert len(ours["applied"]) == 1, ours["applied"]
    assert ours["applied"][0][1]["heads"] == "6", ours["applied"]
    assert ours["fallbacks"] == {} and set(ours["stats"]["mla_decode"]) == {"triton.mla_decode"}, ours["stats"]
    assert "mla_decode" not in runs["without"]["stats"] and runs["without"]["applied"] == []
    for other in ("without", "stock"):
        ref = runs[other]
        rel = float((ours["logits"] - ref["logits"]).norm() / ref["logits"].norm())
        assert rel < 5e-2, (other, rel)
        agree = float((ours["tokens"] == ref["tokens"]).float().mean())
        assert agree >= (0.9 if other == "without" else 0.8), (other, agree)  # flips only at near ties


def test_the_gate_on_the_side_stream_under_graph_replay():
    """gate="side_stream" (the eager compiler: Inductor would compile the bracket on the main stream): the gate
    GEMM's fork and join run in the captured graph, and the replays give the inline arm's tokens and logits."""
    import k3fuse
    from k3fuse.model import DecodeStep, K3Model, get_config
    from k3fuse.patterns.mla_decode import MLADecodeSettings
    from k3fuse.tools.model_run import GraphedSteps, fill_context

    cfg = get_config("small", kv_lora=512, qk_shared=64, mla_heads=6)
    model = K3Model(cfg, seed=0, dtype="bfloat16", device=DEV, init_on_device=True).eval()
    out = {}
    for gate in ("inline", "side_stream"):
        torch._dynamo.reset()
        ctx = k3fuse.DecodeContext(strict=True, rule_settings={"mla_decode": MLADecodeSettings(gate=gate)})
        step = DecodeStep(model, backend="k3fuse", options={"compiler": "eager", "context": ctx})
        state = model.new_state(BATCH, CONTEXT, block_size=64)
        fill_context(model, state, [CONTEXT - 2 * STEPS - 500 * b for b in range(BATCH)], seed=0)
        k3fuse.reset_stats()
        with torch.no_grad(), k3fuse.strict():
            graphed = GraphedSteps(step, state, torch.arange(BATCH, device=DEV), STEPS)
            tokens = torch.cat([graphed.replay().clone(), graphed.replay().clone()])
        torch.cuda.synchronize()
        out[gate] = (tokens, graphed.logits.float().clone(), k3fuse.stats(), k3fuse.runtime.fallbacks())
    (t_in, l_in, _, _), (t_side, l_side, stats, fallbacks) = out["inline"], out["side_stream"]
    assert fallbacks == {} and "shared_expert_fork" in stats and "shared_expert_join" in stats, stats
    assert torch.equal(t_side, t_in)  # the same kernels in another order: the same numbers
    assert torch.equal(l_side, l_in)
