"""The whole K3 model (k3fuse/model/model.py): MLA over the paged cache against float64, the cache written in
place (eager, torch.compile + Inductor, torch.export), TP slices, the parameter table, sampling, compile reuse."""
from __future__ import annotations

import math
import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from k3fuse.model import DecodeStep, K3Model, SamplingConfig, check_room, get_config, prefill
from k3fuse.model import params
from k3fuse.model.layers import MLADecode, TensorParallel
from k3fuse.model.sampling import draw_uniforms, sample, step_uniform
from k3fuse.model.weights import hash_normal

F64 = torch.float64


# --- float64 reference of one MLA decode step, unpaged and un-absorbed ------------------------------------
def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def mla_reference(x: torch.Tensor, history: list[torch.Tensor], W: dict, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """y [B, H] and the new entries [B, E] of one step; history[b] [len_b, E] the cached entries before it.
    Keys and values are expanded per head from c_kv (W_UK c, W_UV c), not absorbed: the model must agree."""
    W = {k: v.to(F64) for k, v in W.items()}
    h_full = W["w_kv_b"].shape[0] // (cfg.qk_nope + cfg.v_head)
    w_kv_b = W["w_kv_b"].view(h_full, cfg.qk_nope + cfg.v_head, cfg.kv_lora)
    w_uk, w_uv = w_kv_b[:, :cfg.qk_nope], w_kv_b[:, cfg.qk_nope:]
    ys, entries = [], []
    for b in range(x.shape[0]):
        xb = x[b].to(F64)
        q = (W["w_q_b"] @ _rms(W["w_q_a"] @ xb, W["q_a_norm.weight"], cfg.rms_eps)).view(h_full, -1)
        q_nope, q_sh = q[:, :cfg.qk_nope], q[:, cfg.qk_nope:]
        kv = W["w_kv_a"] @ xb
        entry = torch.cat([_rms(kv[:cfg.kv_lora], W["kv_a_norm.weight"], cfg.rms_eps), kv[cfg.kv_lora:]])
        cache = torch.cat([history[b].to(F64), entry[None]])  # [S, E]
        c_kv, k_sh = cache[:, :cfg.kv_lora], cache[:, cfg.kv_lora:]
        k_nope = torch.einsum("hnc,sc->hsn", w_uk, c_kv)
        v = torch.einsum("hvc,sc->hsv", w_uv, c_kv)
        scores = (torch.einsum("hn,hsn->hs", q_nope, k_nope) + q_sh @ k_sh.T) * cfg.mla_scale
        o = torch.einsum("hs,hsv->hv", torch.softmax(scores, -1), v)
        o = o * torch.sigmoid((W["w_g"] @ xb).view(h_full, -1))
        ys.append(W["w_o"] @ o.reshape(-1))
        entries.append(entry)
    return torch.stack(ys), torch.stack(entries)


def _fill_history(cache: torch.Tensor, block_table: torch.Tensor, lengths: list[int], gen: torch.Generator
                  ) -> list[torch.Tensor]:
    """Random entries for the first lengths[b] tokens of each sequence, written into their paged slots; returns
    each sequence's entries as the cache holds them (rounded to its dtype), in order."""
    flat, bs = cache.view(-1, cache.shape[-1]), cache.shape[1]
    history = []
    for b, n in enumerate(lengths):
        pos = torch.arange(n)
        slots = block_table[b, pos // bs].long() * bs + pos % bs
        flat[slots] = torch.randn(n, cache.shape[-1], generator=gen).to(cache.dtype)
        history.append(flat[slots].float())
    return history


@pytest.mark.parametrize("block_size", [1, 3, 8])
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_mla_decode_matches_float64_over_a_paged_cache_of_mixed_lengths(block_size, kv_dtype):
    cfg = get_config("tiny")
    model = K3Model(cfg, seed=3)
    mla_layer = next(i for i, k in enumerate(model.kinds) if k.attn == "mla")
    mla: MLADecode = model.layers[mla_layer].attn
    W = {n: p.detach() for n, p in mla.named_parameters()}
    lengths = [0, 5, 17]
    state = model.new_state(3, 24, block_size=block_size, kv_dtype=kv_dtype, kv_scale=0.5)
    kv, scale = state.kv[0], state.kv_scale[0]
    gen = torch.Generator().manual_seed(7)
    history = _fill_history(kv, state.block_table, lengths, gen)
    history = [h * float(scale) for h in history]  # what the entries mean (fp8: stored / scale)
    state.seq_lens.copy_(torch.tensor(lengths, dtype=torch.int32))
    tol = 1e-5 if kv_dtype == "auto" else 0.08  # fp8 e4m3 rounds the new entries to 3 mantissa bits
    for _ in range(3):
        x = torch.randn(3, cfg.hidden, generator=gen)
        state.seq_lens.add_(1)
        y = mla(x, kv, scale, state.block_table, state.seq_lens)
        y_ref, entries = mla_reference(x, history, W, cfg)
        torch.testing.assert_close(y.to(F64), y_ref, rtol=tol, atol=tol)
        flat, bs = kv.view(-1, kv.shape[-1]), kv.shape[1]
        for b in range(3):
            pos = int(state.seq_lens[b]) - 1
            slot = int(state.block_table[b, pos // bs]) * bs + pos % bs
            stored = flat[slot].to(F64) * float(scale)
            torch.testing.assert_close(stored, entries[b], rtol=tol, atol=tol)
            history[b] = torch.cat([history[b], stored[None].float()])
        # nothing but the new slots changed: the other sequences' blocks and the free tail are untouched
    assert int(torch.count_nonzero(kv.view(-1, kv.shape[-1]).float().abs().sum(-1))) == sum(lengths) + 9


def test_tp2_slices_compute_the_tp1_mla_and_model():
    """Stand-in ranks of TP 2 hold exactly the TP 1 model's slices; summing their MLA outputs gives TP 1's."""
    cfg = get_config("tiny")
    full = K3Model(cfg, seed=5)
    ranks = [K3Model(cfg, seed=5, tp_size=2, rank=r, standin=True) for r in range(2)]
    table = {e.param: e.spec for e in params.model_table(cfg)}
    full_params = dict(full.named_parameters())
    for r, m in enumerate(ranks):
        for name, p in m.named_parameters():
            spec, ref = table.get(name), full_params[name]
            dim = spec.shard_dim if spec is not None else None
            expect = ref if dim is None else ref.narrow(dim, r * p.shape[dim], p.shape[dim])
            if spec is not None and spec.parts:  # [q; k; v] stacked: rank r holds each part's slice
                expect = torch.cat([part.narrow(0, r * (p.shape[0] // 3), p.shape[0] // 3)
                                    for part in ref.chunk(3, 0)])
            assert torch.equal(p, expect), name
    i = next(i for i, k in enumerate(full.kinds) if k.attn == "mla")
    x = torch.randn(2, cfg.hidden)
    outs = []
    for m in [full] + ranks:
        st = m.new_state(2, 8, block_size=4)
        st.seq_lens.add_(1)
        outs.append(m.layers[i].attn(x, st.kv[0], st.kv_scale[0], st.block_table, st.seq_lens))
    torch.testing.assert_close(outs[1] + outs[2], outs[0], rtol=1e-5, atol=1e-5)


def test_layer_pattern_matches_k3():
    kinds = get_config("k3").layer_kinds()
    assert len(kinds) == 93
    assert [i + 1 for i, k in enumerate(kinds) if k.attn == "mla"] == list(range(4, 93, 4)) + [93]
    assert kinds[0].name == "kda+dense" and all(k.mlp == "moe" for k in kinds[1:])
    assert sum(k.attn == "kda" for k in kinds) == 69
    # fewer layers keep the pattern: every 4th and the last are MLA, the first is dense
    assert [k.name for k in get_config("k3", n_layers=6).layer_kinds()] == [
        "kda+dense", "kda+moe", "kda+moe", "mla+moe", "kda+moe", "mla+moe"]
    for name in ("tiny", "small"):  # CPU presets hold every layer type
        assert {k.name for k in get_config(name).layer_kinds()} == {"kda+dense", "kda+moe", "mla+moe"} or \
            name == "tiny"
    assert {k.name for k in get_config("tiny").layer_kinds()} == {"kda+dense", "mla+moe"}


@pytest.mark.parametrize("preset,tp", [("tiny", 1), ("tiny", 2), ("small", 4), ("k3", 16), ("k3", 32)])
def test_parameter_table_is_what_the_model_holds(preset, tp):
    over = {"expert_layout": "rows"} if preset == "k3" else {}
    cfg = get_config(preset, n_layers=5, **over)
    model = K3Model(cfg, tp_size=tp, rank=tp - 1, standin=tp > 1, device="meta")
    held = {n: tuple(p.shape) for n, p in model.named_parameters()}
    expected = {}
    for e in params.model_table(cfg):
        if e.spec.dtype == "expert" and cfg.quantized_experts:
            from k3fuse import quant
            E, rows, cols = e.spec.local_shape(tp)
            expected[e.param + "_packed"] = (E, *quant.packed_shape(cfg.expert_format, rows, cols))
            expected[e.param + "_scale"] = (E, *quant.scale_shape(cfg.expert_format, rows, cols))
        else:
            expected[e.param] = e.spec.local_shape(tp)
    assert held == expected
    if preset == "k3":
        assert held["layers.3.attn.w_kv_b"] == (96 // tp * 256, 512) and held["embed.weight"] == (163840 // tp, 7168)
        hf = {e.hf for e in params.model_table(cfg)}
        assert "language_model.model.layers.3.self_attn.kv_a_proj_with_mqa.weight" in hf
        assert "language_model.model.layers.1.block_sparse_moe.experts.{e}.w2.{weight_packed,weight_scale}" in hf
    assert "layers.0.mlp.w_down" in held  # layer 1's dense MLP


def test_hash_draw_is_tp_invariant_and_normal():
    cfg = get_config("tiny")
    full = K3Model(cfg, seed=2, draw="hash")
    half = K3Model(cfg, seed=2, draw="hash", tp_size=2, rank=1, standin=True)
    w_full, w_half = full.layers[0].attn.w_q, half.layers[0].attn.w_q
    assert torch.equal(w_half, w_full[w_full.shape[0] // 2:])
    assert torch.equal(half.layers[0].attn.w_o, full.layers[0].attn.w_o[:, w_full.shape[0] // 2:])
    z = hash_normal(torch.arange(1 << 18), 1234)
    assert abs(float(z.mean())) < 0.01 and abs(float(z.std()) - 1) < 0.01
    assert not torch.equal(full.layers[0].attn.w_q, K3Model(cfg, seed=3, draw="hash").layers[0].attn.w_q)


# --- the cache written in place -------------------------------------------------------------------------
def _mla_step_fn():
    from k3fuse.spelling import kv_cache_append

    def append(kv, entry, block_table, seq_lens):
        kv_cache_append(kv, entry, block_table, seq_lens)
        return kv.sum()
    return append


def test_append_writes_the_cache_in_place_under_inductor():
    kv = torch.zeros(64, 16, 576)
    block_table = torch.randperm(64, generator=torch.Generator().manual_seed(0))[:6].view(2, 3).to(torch.int32)
    seq_lens = torch.tensor([5, 40], dtype=torch.int32)
    entry = torch.randn(2, 576)
    torch._dynamo.reset()
    _, (code,) = run_and_get_code(torch.compile(_mla_step_fn()), kv, entry, block_table, seq_lens)
    flat = kv.view(-1, 576)
    for b, pos in enumerate((4, 39)):
        torch.testing.assert_close(flat[int(block_table[b, pos // 16]) * 16 + pos % 16], entry[b])
    assert int(torch.count_nonzero(flat.abs().sum(-1))) == 2
    # no buffer the size of the cache is allocated: the write is an in-place store into the input
    assert _allocations(code) and kv.numel() not in _allocations(code), code


def _allocations(code: str) -> list[int]:
    """Element counts of the buffers Inductor's generated code allocates."""
    return [math.prod(int(d) for d in dims.split(",") if d.strip())
            for dims in re.findall(r"empty_strided_\w+\(\(([\d, ]*)\)", code)]


def test_whole_model_step_keeps_the_cache_in_place_compiled_and_exported():
    cfg = get_config("tiny")
    model = K3Model(cfg, seed=1)
    tokens = torch.tensor([3, 9])
    ref_state, state = model.new_state(2, 16, block_size=4), model.new_state(2, 16, block_size=4)
    ptrs = [t.data_ptr() for t in state.kv + state.recurrent + state.conv]
    torch._dynamo.reset()
    compiled, eager = DecodeStep(model, backend="inductor"), DecodeStep(model)
    with torch.no_grad():
        mla = next(i for i, k in enumerate(model.kinds) if k.attn == "mla")
        fresh = model.new_state(2, 16, block_size=4, pool_blocks=13)  # not the gathered blocks' size
        fresh.seq_lens.add_(1)  # the step's token is in the cache
        args = (torch.randn(2, cfg.hidden), None, *model.layer_state(mla, fresh))
        _, (code,) = run_and_get_code(compiled.layers[mla], *args)
        assert args[2].numel() not in _allocations(code)  # the MLA layer's graph writes its cache in place
        for _ in range(3):
            _, logits_ref = eager(tokens, ref_state)
            _, logits = compiled(tokens, state)
    torch.testing.assert_close(logits, logits_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state.kv[0], ref_state.kv[0], rtol=1e-5, atol=1e-5)
    assert [t.data_ptr() for t in state.kv + state.recurrent + state.conv] == ptrs
    # torch.export carries the writes: in place in the exported graph (index_put_ on the cache's placeholder),
    # mutations of those inputs once decomposed; k3fuse.apply's program writes them as the model does
    import k3fuse

    ep = torch.export.export(model, (tokens, model.new_state(2, 16, block_size=4)))
    writes = [n.args[0] for n in ep.graph.nodes if n.target == torch.ops.aten.index_put_.default]
    assert [str(w.args[0]) for w in writes] == ["state_kv_0"]  # on the cache's flat view
    decomposed = ep.run_decompositions()
    mutated = {s.target for s in decomposed.graph_signature.output_specs if s.kind.name == "USER_INPUT_MUTATION"}
    assert mutated == {"state_kv_0", "state_recurrent_0", "state_conv_0", "state_seq_lens"}
    rewritten, log = k3fuse.apply(ep, k3fuse.DecodeContext(strict=True))
    assert "decode_gemm" in log.active_rules()
    st_e, st_m = model.new_state(2, 16, block_size=4), model.new_state(2, 16, block_size=4)
    with torch.no_grad(), k3fuse.strict():
        for _ in range(3):
            out_e = rewritten.module()(tokens, st_e)
            out_m = model(tokens, st_m)
    torch.testing.assert_close(out_e[1], out_m[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(st_e.kv[0], st_m.kv[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(st_e.seq_lens, st_m.seq_lens) and int(st_e.seq_lens[0]) == 3


def test_compiled_step_matches_eager_and_reuses_one_graph_per_layer_type():
    graphs: list[int] = []

    def counting(gm, example_inputs):
        graphs.append(len(gm.graph.nodes))
        return gm.forward

    for n_layers in (4, 8):
        cfg = get_config("small", n_layers=n_layers, residual="attnres", attn_res_block=3)
        model = K3Model(cfg, seed=0)
        graphs.clear()
        torch._dynamo.reset()
        step, eager = DecodeStep(model, backend=counting), DecodeStep(model)
        s_c, s_e = model.new_state(2, 12, block_size=4), model.new_state(2, 12, block_size=4)
        tokens = torch.tensor([1, 2])
        with torch.no_grad():
            for _ in range(3):
                tok_c, logit_c = step(tokens, s_c)
                tok_e, logit_e = eager(tokens, s_e)
                tokens = tok_e
        torch.testing.assert_close(logit_c, logit_e, rtol=1e-5, atol=1e-5)
        # embedding, kda+dense, kda+moe, mla+moe, head: 5 graphs however deep the model
        assert len(graphs) == 5, (n_layers, graphs)


def test_attnres_bank_masks_give_the_list_formulation():
    """The fixed bank with masks computes what the reference stack's growing list does (one layer type
    graph for every layer): compare with K3DecodeStack's attn_res_mix on the same values."""
    from k3fuse.model.layers import attn_res_mix, attn_res_mix_bank

    g = torch.Generator().manual_seed(0)
    bank = torch.randn(4, 3, 16, generator=g)
    p, q = torch.randn(3, 16, generator=g), torch.randn(16, generator=g)
    for valid in range(0, 5):
        mask = torch.where(torch.arange(4) < valid, 0.0, float("-inf"))
        got = attn_res_mix_bank(bank, p, q, mask, 1e-5)
        want = attn_res_mix(list(bank[:valid]), p, q, 1e-5)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


# --- sampling ---------------------------------------------------------------------------------------------
def test_greedy_is_argmax_and_temperature_sampling_follows_the_distribution():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    u = draw_uniforms(11, 4, 1)[:, 0]
    assert torch.equal(sample(logits, u, SamplingConfig()), logits.argmax(-1))
    cfg = SamplingConfig(temperature=0.7)
    assert torch.equal(sample(logits, u, cfg), sample(logits.clone(), u.clone(), cfg))  # a pure function
    # frequencies over 20000 draws of one row against the tempered softmax
    us = draw_uniforms(3, 1, 20000)[0]
    draws = sample(logits[:1].expand(20000, -1), us, cfg)
    freq = torch.bincount(draws, minlength=50).float() / draws.numel()
    probs = torch.softmax(logits[0] / 0.7, -1)
    assert float((freq - probs).abs().max()) < 0.02
    # top-p keeps the smallest head of mass >= p: nothing outside it is ever drawn
    top = SamplingConfig(temperature=1.0, top_p=0.5)
    p_sorted, order = torch.softmax(logits[0], -1).sort(descending=True)
    head = set(order[:int((p_sorted.cumsum(0) - p_sorted < 0.5).sum())].tolist())
    drawn = set(sample(logits[:1].expand(500, -1), draw_uniforms(4, 1, 500)[0], top).tolist())
    assert drawn <= head and len(drawn) > 1
    # a state's numbers: one per sequence and position, the same for the same seed, read at the new token
    a, b = draw_uniforms(5, 3, 64), draw_uniforms(5, 3, 64)
    assert torch.equal(a, b) and not torch.equal(a, draw_uniforms(6, 3, 64))
    assert torch.equal(step_uniform(a, torch.tensor([1, 5, 64], dtype=torch.int32)), a[[0, 1, 2], [0, 4, 63]])


def _sampling_worker(rank: int, world: int) -> dict:
    cfg = get_config("tiny")
    model = K3Model(cfg, seed=4, tp_size=world, rank=rank, sampling=SamplingConfig(temperature=1.0, top_p=0.9,
                                                                                  seed=8))
    state = model.new_state(3, 16, block_size=4)
    step = DecodeStep(model)
    tokens, out = torch.tensor([1, 2, 3]), []
    with torch.no_grad():
        for _ in range(6):
            tokens, logits = step(tokens, state)
            out.append(tokens)
    return {"tokens": torch.stack(out), "logits": logits}


@pytest.mark.slow
def test_sampling_gives_the_same_tokens_on_every_rank():
    from k3fuse.dist import launch

    ranks = launch(_sampling_worker, 2, backend="gloo", timeout_s=300)
    assert torch.equal(ranks[0]["tokens"], ranks[1]["tokens"])
    assert torch.equal(ranks[0]["logits"], ranks[1]["logits"])
    single = _sampling_worker(0, 1)  # the TP 1 model: the same draws, logits within fp32 rounding
    torch.testing.assert_close(ranks[0]["logits"], single["logits"], rtol=1e-4, atol=1e-4)


# --- prefill and capacity ---------------------------------------------------------------------------------
def test_prefill_steps_the_prompt_and_refuses_a_context_past_the_cache():
    cfg = get_config("tiny")
    model = K3Model(cfg, seed=0)
    state = model.new_state(2, 6, block_size=4)  # 2 blocks of 4: 8 tokens
    step = DecodeStep(model)
    prompts = torch.randint(0, cfg.vocab_size, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        tokens, logits = prefill(step, state, prompts)
    assert state.seq_lens.tolist() == [5, 5] and logits.shape == (2, cfg.vocab_size)
    check_room(state, 3)
    with pytest.raises(ValueError, match="a context of 9 tokens does not fit the cache \\(8 tokens a sequence"):
        check_room(state, 4)
    with pytest.raises(ValueError, match="prompts must be"):
        prefill(step, state, prompts[0])


def test_a_full_cache_is_refused_before_a_step_reads_past_its_blocks():
    """fill_context and GraphedSteps check the room host-side: a step on a full cache would index past its blocks
    (a device-side assert on a GPU) instead of naming the problem."""
    from k3fuse.tools.model_run import fill_context

    model = K3Model(get_config("tiny"), seed=0)
    state = model.new_state(2, 8, block_size=4)  # 8 tokens a sequence
    fill_context(model, state, [7, 3], seed=0)
    with pytest.raises(ValueError, match="a context of 9 tokens does not fit the cache .* give new_state a context "
                                         "of at least 9 tokens"):
        fill_context(model, state, [8, 3], seed=0)


def test_standin_rank_and_bad_tp_are_refused():
    cfg = get_config("k3", expert_layout="rows")
    with pytest.raises(ValueError, match="TP=64 does not divide kda_heads=96"):
        K3Model(cfg, tp_size=64, rank=0, standin=True, device="meta")
    with pytest.raises(ValueError, match="rank 16 is outside TP 16"):
        K3Model(cfg, tp_size=16, rank=16, standin=True, device="meta")
    with pytest.raises(ValueError, match="TP=16 leaves moe_inter/tp=192"):
        K3Model(get_config("k3", n_layers=2), tp_size=16, rank=0, standin=True, device="meta")
    tp = TensorParallel(4, 1, None, standin=True)
    assert tp.all_gather_last(torch.ones(2, 3)).shape == (2, 12) and not tp.collectives


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_the_model_spelling_and_the_mla_decode_op_compute_one_function(kv_dtype):
    """torch.ops.k3fuse.mla_decode (issue 51's op, built against this cache interface) and the model's plain
    spelling agree at K3's entry width on a paged cache of mixed lengths."""
    import k3fuse
    from k3fuse.spelling import paged_mla_attention

    k3fuse.load()
    gen = torch.Generator().manual_seed(2)
    B, H, bs, blocks = 3, 4, 16, 12
    cache = (torch.randn(blocks, bs, 576, generator=gen) * 0.5).to(
        torch.float8_e4m3fn if kv_dtype == "fp8" else torch.bfloat16)
    scale = torch.tensor([0.5 if kv_dtype == "fp8" else 1.0])
    block_table = torch.randperm(blocks, generator=gen)[:B * 4].view(B, 4).to(torch.int32)
    seq_lens = torch.tensor([1, 23, 64], dtype=torch.int32)
    q = torch.randn(B, H, 576, generator=gen).to(torch.bfloat16)
    ours = paged_mla_attention(q, cache, scale, block_table, seq_lens, 192 ** -0.5, 512)
    op = torch.ops.k3fuse.mla_decode(q, cache, block_table, seq_lens, 192 ** -0.5,
                                     scale if kv_dtype == "fp8" else None)
    torch.testing.assert_close(op.float(), ours.float(), rtol=2e-2, atol=2e-2)
