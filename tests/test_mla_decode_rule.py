"""The mla_decode rule (patterns/mla_decode.py) on the whole K3 model, on CPU.

The model is the `small` preset with K3's MLA widths (kv_lora 512, qk_shared 64: the op's 576-value entry) in
bf16, compiled region by region with torch.compile(backend="k3fuse") (the eager compiler), every default rule on,
against the eager model (stock). What is proved:
* TP 1 (bf16 cache, pages of 4; fp8 cache, pages of 64) and TP 2 (gloo ranks, fp8, pages of 4): the rule fires
  once in the MLA + MoE graph (the one graph every MLA layer shares), in strict mode, and the log names what it
  saw (heads per rank, block size, table width, cache dtype); at run time the op runs once per MLA layer and step
  (runtime counters), nothing falls back;
* this rule alone: over 24 decode steps the tokens are stock's (the eager model), the logits and the caches
  agree with stock's to the bf16 roundings of the attention's output;
* with every default rule: the tokens are those of the same run without this rule (the other rules' bf16
  roundings, not this one, are what moves a bf16 model's tokens away from the eager model's over many steps);
* the output gate on the side stream (setting gate="side_stream"): its GEMM bracketed by the side-stream markers
  (the verifier passes them), a fork and a join per MLA layer and step at run time, the tokens still stock's;
* under Inductor (its constant folding respells the mask's -inf), the rule still fires and the op runs;
* declines, each logged with its guard and values: an fp32 trunk (no kernel takes fp32 queries), entries that
  are not K3's 512 + 64 (the tiny preset), more than 64 sequences, more heads than the op serves.
Lengths past the table's width are the op's (tests/test_mla_decode.py): it attends over the whole table, as the
spelling does. The GPU counterpart (Triton / Gluon kernels, CUDA graphs): tests/gpu/test_mla_decode_rule_gpu.py.
"""
from __future__ import annotations

import pytest
import torch

from k3fuse.dist import launch

STEPS = 24
BATCH = 3
#: K3's MLA widths on the small preset's trunk: the entry the op serves (512 + 64)
K3_MLA = dict(kv_lora=512, qk_shared=64)


def _decode(model, step_fn, state, steps: int, tokens: torch.Tensor):
    out = []
    with torch.no_grad():
        for _ in range(steps):
            tokens, logits = step_fn(tokens, state)
            out.append((tokens.clone(), logits.clone()))
    return out


def _fused_vs_stock(rank: int, world: int, kv_dtype: str, block_size: int, rules: str) -> dict:
    """One model, decoded by the k3fuse-compiled step (rules: "only" this one, "all" the default ones, "without"
    all but this one) and by the eager one from the same start."""
    import k3fuse
    from k3fuse.model import DecodeStep, K3Model, get_config

    cfg = get_config("small", **K3_MLA)
    model = K3Model(cfg, seed=0, tp_size=world, rank=rank, dtype="bfloat16")
    rlog = k3fuse.RewriteLog()
    picked = {"only": dict(enabled_rules={"mla_decode"}), "all": {},
              "without": dict(disabled_rules={"mla_decode"})}[rules]
    ctx = (k3fuse.DecodeContext.from_process_group(strict=True, **picked) if world > 1
           else k3fuse.DecodeContext(strict=True, **picked))
    torch._dynamo.reset()
    fused = DecodeStep(model, backend="k3fuse", options={"compiler": "eager", "context": ctx, "log": rlog})
    stock = DecodeStep(model)
    context = STEPS + 8
    s_f = model.new_state(BATCH, context, block_size=block_size, kv_dtype=kv_dtype, kv_scale=0.5)
    s_e = model.new_state(BATCH, context, block_size=block_size, kv_dtype=kv_dtype, kv_scale=0.5)
    start = torch.tensor([5, 17, 30])
    k3fuse.reset_stats()
    with k3fuse.strict():
        got = _decode(model, fused, s_f, STEPS, start)
    stats, fallbacks = k3fuse.stats(), k3fuse.runtime.fallbacks()
    want = _decode(model, stock, s_e, STEPS, start)
    logit_err = max(float((a[1] - b[1]).abs().max() / b[1].abs().max()) for a, b in zip(got, want))
    cache_err = max(float((a.float() - b.float()).abs().max() / b.float().abs().max()) for a, b in zip(s_f.kv, s_e.kv))
    events = [e for e in rlog.events if e.rule == "mla_decode"]
    return {"tokens": [t.tolist() for t, _ in got], "stock_tokens": [t.tolist() for t, _ in want],
            "logit_err": logit_err, "cache_err": cache_err, "stats": stats, "fallbacks": fallbacks,
            "applied": [(e.variant, dict(e.values)) for e in events if e.decision == "applied"],
            "rejected": [(e.guard, e.reason) for e in events if e.decision == "rejected"],
            "n_mla": sum(1 for k in model.kinds if k.attn == "mla"), "heads": cfg.mla_heads // world}


CASES = {1: (("auto", 4), ("fp8", 64)), 2: (("fp8", 4),)}


def _worker(rank: int, world: int) -> dict:
    return {(kv, bs, rules): _fused_vs_stock(rank, world, kv, bs, rules) for kv, bs in CASES[world]
            for rules in ("only", "all", "without")}


@pytest.fixture(scope="module")
def tp1() -> list[dict]:
    return [_worker(0, 1)]


@pytest.fixture(scope="module")
def tp2() -> list[dict]:
    return launch(_worker, 2, backend="gloo", timeout_s=2400)


@pytest.mark.slow
@pytest.mark.parametrize("tp_name,kv_dtype,block_size", [(f"tp{tp}", *case) for tp, cases in CASES.items()
                                                         for case in cases])
def test_the_rule_fires_on_the_model_and_keeps_stocks_tokens(request, tp_name, kv_dtype, block_size):
    for rank, results in enumerate(request.getfixturevalue(tp_name)):
        only, full, without = (results[(kv_dtype, block_size, r)] for r in ("only", "all", "without"))
        where = (tp_name, rank, kv_dtype, block_size)
        for res in (only, full):
            # one site: the MLA + MoE graph every MLA layer shares; the log says what it saw
            assert res["rejected"] == [] and len(res["applied"]) == 1, (where, res["applied"], res["rejected"])
            variant, values = res["applied"][0]
            assert variant == ("core+float8_e4m3fn[bfloat16]" if kv_dtype == "fp8" else "core[bfloat16]"), variant
            assert values["heads"] == str(res["heads"]), values
            assert values["cache_dtype"] == ("torch.float8_e4m3fn" if kv_dtype == "fp8" else "torch.bfloat16")
            assert {"block_size", "max_context"} <= set(values), values
            # strict mode: the op ran once per MLA layer and step, nothing fell back
            assert res["fallbacks"] == {} and res["stats"]["mla_decode"] == {"reference": res["n_mla"] * STEPS}
        assert "mla_decode" not in without["stats"] and without["applied"] == []
        # this rule alone: stock's tokens; the logits to the bf16 roundings of the attention's output; each cache
        # entry (appended by the model's own spelling, computed by the compiled graph) to one rounding of its dtype
        assert only["tokens"] == only["stock_tokens"], where
        ulp = 2 ** -3 if kv_dtype == "fp8" else 2 ** -7
        assert only["logit_err"] < 0.05 and only["cache_err"] <= ulp, (where, only["logit_err"], only["cache_err"])
        # among every default rule: what the run without it gives
        assert full["tokens"] == without["tokens"], where


@pytest.mark.slow
def test_the_gate_on_the_side_stream_keeps_stocks_tokens():
    import k3fuse
    from k3fuse.model import DecodeStep, K3Model, get_config
    from k3fuse.patterns.mla_decode import MLADecodeSettings

    cfg = get_config("small", **K3_MLA)
    model = K3Model(cfg, seed=0, dtype="bfloat16")
    rlog = k3fuse.RewriteLog()
    ctx = k3fuse.DecodeContext(strict=True, enabled_rules={"mla_decode"},
                               rule_settings={"mla_decode": MLADecodeSettings(gate="side_stream")})
    torch._dynamo.reset()
    fused = DecodeStep(model, backend="k3fuse", options={"compiler": "eager", "context": ctx, "log": rlog})
    s_f, s_e = model.new_state(BATCH, 40, block_size=4), model.new_state(BATCH, 40, block_size=4)
    start = torch.tensor([5, 17, 30])
    k3fuse.reset_stats()
    with k3fuse.strict():
        got = _decode(model, fused, s_f, 12, start)
    stats = k3fuse.stats()
    want = _decode(model, DecodeStep(model), s_e, 12, start)
    assert [t.tolist() for t, _ in got] == [t.tolist() for t, _ in want]
    (applied,) = [e for e in rlog.events if e.rule == "mla_decode" and e.decision == "applied"]
    assert applied.values["gate"] == "side_stream" and applied.values["gate_site"] == 0, applied.values
    n_mla = sum(1 for k in model.kinds if k.attn == "mla")
    assert stats["shared_expert_fork"] == stats["shared_expert_join"] == {"reference": 12 * n_mla}, stats
    with pytest.raises(ValueError, match="gate must be 'inline' or 'side_stream'"):
        MLADecodeSettings(gate="epilogue")


@pytest.mark.slow
def test_the_rule_fires_under_inductor():
    """torch.compile's default compiler: Inductor's joint-graph constant folding spells the length mask's -inf as
    full([], -inf), which the matcher takes for the traced scalar_tensor; the op runs under Inductor's code. The
    tokens are those of Inductor with no rule (Inductor's own bf16 roundings move them off the eager model's)."""
    import k3fuse
    from k3fuse.model import DecodeStep, K3Model, get_config

    model = K3Model(get_config("small", **K3_MLA), seed=0, dtype="bfloat16")
    start = torch.tensor([5, 17, 30])

    def inductor(rules: set[str], rlog=None):
        torch._dynamo.reset()
        ctx = k3fuse.DecodeContext(strict=True, enabled_rules=rules)
        step = DecodeStep(model, backend="k3fuse", options={"compiler": "inductor", "context": ctx, "log": rlog})
        return _decode(model, step, model.new_state(BATCH, 16, block_size=4), 6, start)

    rlog = k3fuse.RewriteLog()
    k3fuse.reset_stats()
    with k3fuse.strict():
        got = inductor({"mla_decode"}, rlog)
    stats = k3fuse.stats()
    want = inductor(set())
    (applied,) = [e for e in rlog.events if e.rule == "mla_decode" and e.decision == "applied"]
    assert applied.variant == "core[bfloat16]", applied.variant
    n_mla = sum(1 for k in model.kinds if k.attn == "mla")
    assert stats["mla_decode"] == {"reference": 6 * n_mla} and k3fuse.runtime.fallbacks() == {}, stats
    assert [t.tolist() for t, _ in got] == [t.tolist() for t, _ in want]


# --- declines ----------------------------------------------------------------------------------------------
def _decline(preset: str, dtype: str, batch: int = 2, **overrides) -> list[tuple]:
    """Compile one step of a one-MLA-layer model with only this rule; the rule's events."""
    import k3fuse
    from k3fuse.model import DecodeStep, K3Model, get_config
    from k3fuse.patterns import MLADecode

    cfg = get_config(preset, n_layers=4, **overrides)
    model = K3Model(cfg, seed=0, dtype=dtype)
    rlog = k3fuse.RewriteLog()
    torch._dynamo.reset()
    step = DecodeStep(model, backend="k3fuse", options={"compiler": "eager", "log": rlog, "rules": [MLADecode()],
                                                        "context": k3fuse.DecodeContext()})
    with torch.no_grad():
        step(torch.arange(batch) % cfg.vocab_size, model.new_state(batch, 8, block_size=4))
    return [(e.decision, e.guard, e.reason, dict(e.values)) for e in rlog.events if e.rule == "mla_decode"
            and e.decision in ("applied", "rejected")]


@pytest.mark.parametrize("what,preset,dtype,batch,overrides,guard,says", [
    ("fp32 trunk", "small", "float32", 2, K3_MLA, "dtype", "bf16 / fp16 queries"),
    ("entry not 512 + 64", "tiny", "bfloat16", 2, {}, "entry", "entries of 576 values"),
    ("65 sequences", "small", "bfloat16", 65, K3_MLA, "token_range", "outside the context's token range"),
    ("130 heads", "tiny", "bfloat16", 2, {**K3_MLA, "mla_heads": 130}, "heads", "heads per rank"),
])
def test_declines_are_logged_with_their_reason(what, preset, dtype, batch, overrides, guard, says):
    events = _decline(preset, dtype, batch, **overrides)
    assert len(events) == 1, (what, events)
    decision, got_guard, reason, values = events[0]
    assert (decision, got_guard) == ("rejected", guard) and says in reason, (what, events)
    assert values, what  # the values it saw are in the log
