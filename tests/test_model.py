"""The reference K3 decode model against the float64 equations, across TP sizes, and traced."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.utils._pytree as pytree

import reference_f64 as ref
from k3fuse import compat
from k3fuse.dist import ProcessGroupMissing, launch
from k3fuse.model import PRESETS, DecodeState, K3Config, K3DecodeStack, get_config
from k3fuse.model.layers import attn_res_mix, rms_norm, route

STEPS = 4
BATCH = 3


def full_weights(model: K3DecodeStack) -> dict[str, torch.Tensor]:
    assert model.tp_size == 1, "full weights come from the TP=1 model"
    return {name: p.detach() for name, p in model.named_parameters()}


def sub(weights: dict, prefix: str) -> dict:
    return {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}


def inputs(cfg: K3Config, steps: int = STEPS, batch: int = BATCH, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, cfg.hidden, generator=g) for _ in range(steps)]


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 2e-5) -> None:
    torch.testing.assert_close(a.to(torch.float64), b.to(torch.float64), rtol=tol, atol=tol)


def run_steps(model: K3DecodeStack, xs: list[torch.Tensor]):
    state = model.init_state(xs[0].shape[0])
    outs, states = [], []
    for x in xs:
        y, state = model(x, state)
        outs.append(y)
        states.append(state)
    return outs, states


# --- config --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_presets_divide_by_common_tp(name, tp):
    PRESETS[name].validate_for_tp(tp)


def test_k3_preset_has_published_dims():
    c = get_config("k3")
    assert (c.hidden, c.kda_heads, c.head_dim, c.gate_rank) == (7168, 96, 128, 128)
    assert (c.n_experts, c.top_k, c.moe_inter, c.latent, c.shared_inter) == (896, 16, 3072, 3584, 6144)
    assert c.residual == "attnres" and c.attn_res_block == 12 and c.torch_dtype == torch.bfloat16


def test_get_config_overrides_and_errors():
    assert get_config("tiny", residual="attnres").residual == "attnres"
    with pytest.raises(ValueError, match="unknown K3 preset 'huge'"):
        get_config("huge")
    with pytest.raises(ValueError, match="unknown K3Config field"):
        get_config("tiny", hiden=64)
    with pytest.raises(ValueError, match="residual"):
        get_config("tiny", residual="postnorm")
    with pytest.raises(ValueError, match="top_k=32 exceeds n_experts=16"):
        get_config("tiny", top_k=32)
    with pytest.raises(ValueError, match="hidden must be a positive int"):
        get_config("tiny", hidden=0)
    with pytest.raises(ValueError, match="dtype"):
        get_config("tiny", dtype="int8")


@pytest.mark.parametrize("field,value,tp", [("kda_heads", 6, 4), ("n_experts", 12, 8), ("latent", 66, 4),
                                            ("moe_inter", 36, 8), ("shared_inter", 60, 8)])
def test_validate_for_tp_names_the_dimension(field, value, tp):
    cfg = get_config("tiny", **{field: value})
    with pytest.raises(ValueError, match=f"TP={tp} does not divide {field}={value}"):
        cfg.validate_for_tp(tp)


def test_stack_rejects_bad_tp_and_missing_group():
    cfg = get_config("tiny")
    with pytest.raises(ValueError, match="TP=3 does not divide kda_heads=8"):
        K3DecodeStack(cfg, tp_size=3)
    if not torch.distributed.is_initialized():  # another test may have left a group behind
        with pytest.raises(ProcessGroupMissing, match="init_process_group"):
            K3DecodeStack(cfg, tp_size=2)
    with pytest.raises(ValueError, match="rank must be 0"):
        K3DecodeStack(cfg, rank=1)
    with pytest.raises(ValueError, match="unknown dtype"):
        K3DecodeStack(cfg, dtype="fp8")


def test_k3_shapes_on_meta_device():
    model = K3DecodeStack(get_config("k3", n_layers=1), device="meta")
    kda, moe = model.layers[0].kda, model.layers[0].moe
    assert kda.w_q.shape == (12288, 7168) and kda.w_o.shape == (7168, 12288)
    assert kda.w_fa.shape == (128, 7168) and kda.w_fb.shape == (12288, 128)
    # MXFP4 experts as the checkpoint stores them: uint8 nibbles [E, out, in/2], E8M0 scales [E, out, in/32]
    routed = moe.routed
    assert routed.expert_format == "mxfp4" and not hasattr(routed, "w1")
    assert routed.w1_packed.shape == routed.w3_packed.shape == (896, 3072, 1792)
    assert routed.w1_scale.shape == (896, 3072, 112) and routed.w2_scale.shape == (896, 3584, 96)
    assert routed.w2_packed.shape == (896, 3584, 1536)
    assert routed.w1_packed.dtype == routed.w1_scale.dtype == torch.uint8
    bf16_cfg = get_config("k3", n_layers=1, expert_format="bf16", expert_layout="rows")
    bf16 = K3DecodeStack(bf16_cfg, device="meta").layers[0].moe.routed
    assert bf16.w1.shape == (896, 3072, 3584) and bf16.w2.shape == (896, 3584, 3072)
    assert moe.shared.w_gate.shape == (6144, 7168) and moe.shared.w_down.shape == (7168, 6144)
    assert kda.w_q.dtype == torch.bfloat16 and kda.A_log.dtype == torch.float32


# --- weights and state ---------------------------------------------------------------------------
def test_weights_are_deterministic_and_frozen():
    cfg = get_config("tiny")
    a, b, c = K3DecodeStack(cfg, seed=5), K3DecodeStack(cfg, seed=5), K3DecodeStack(cfg, seed=6)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert not pa.requires_grad
        assert torch.equal(pa, pb), name
        assert pa.numel() < 4 or not torch.equal(pa, pc), name
    # different layers and names draw different weights
    assert not torch.equal(a.layers[0].kda.w_q, a.layers[1].kda.w_q)
    assert not torch.equal(a.layers[0].kda.w_q, a.layers[0].kda.w_k)


def test_init_state_shapes_and_pytree():
    cfg = get_config("tiny", conv_kernel=3)
    state = K3DecodeStack(cfg).init_state(5)
    assert len(state.recurrent) == len(state.conv) == cfg.n_layers
    assert state.recurrent[0].shape == (5, 8, 16, 16) and state.recurrent[0].dtype == torch.float32
    assert state.conv[0].shape == (5, 3 * 128, 2)
    leaves, spec = pytree.tree_flatten(state)
    assert len(leaves) == 2 * cfg.n_layers
    rebuilt = pytree.tree_unflatten([t + 1 for t in leaves], spec)
    assert isinstance(rebuilt, DecodeState) and torch.equal(rebuilt.conv[1], state.conv[1] + 1)


def test_forward_does_not_mutate_its_inputs():
    cfg = get_config("tiny", residual="attnres")
    model = K3DecodeStack(cfg)
    x = inputs(cfg, steps=1)[0]
    _, state = model(x, model.init_state(BATCH))  # non-zero state
    before = [t.clone() for t in pytree.tree_leaves(state)] + [x.clone()]
    model(x, state)
    for a, b in zip(pytree.tree_leaves(state) + [x], before):
        assert torch.equal(a, b)


# --- sublayers against the float64 equations -----------------------------------------------------
def test_rmsnorm_matches_reference_and_keeps_dtype():
    x = torch.randn(4, 64) * 3
    w = torch.randn(64)
    close(rms_norm(x, w, 1e-5), ref.rmsnorm(x, w, 1e-5), 1e-5)
    xb = x.to(torch.bfloat16)
    out = rms_norm(xb, w.to(torch.bfloat16), 1e-5)
    assert out.dtype == torch.bfloat16
    close(out, ref.rmsnorm(xb, w.to(torch.bfloat16), 1e-5), 2e-2)


def test_kda_steps_match_reference_and_roll_conv_state():
    cfg = get_config("tiny")
    model = K3DecodeStack(cfg, seed=3)
    kda = model.layers[0].kda
    W = sub(full_weights(model), "layers.0.kda.")
    state = model.init_state(BATCH)
    S, conv = state.recurrent[0], state.conv[0]
    S_ref, conv_ref = ref.d(S), ref.d(conv)
    pre_conv_inputs = []
    for step, x in enumerate(inputs(cfg, steps=5)):
        y, S, conv = kda(x, S, conv)
        y_ref, S_ref, conv_ref = ref.kda_step(x, S_ref, conv_ref, W, heads=cfg.kda_heads,
                                              head_dim=cfg.head_dim, l2_eps=cfg.l2_eps)
        close(y, y_ref, 1e-4)
        close(S, S_ref, 1e-4)
        close(conv, conv_ref, 1e-5)
        # the window holds the last K-1 pre-conv inputs [q; k; v], newest last
        pre_conv_inputs.append(torch.cat([x @ W["w_q"].T, x @ W["w_k"].T, x @ W["w_v"].T], -1))
        for back in range(min(step + 1, cfg.conv_kernel - 1)):
            close(conv[..., -1 - back], pre_conv_inputs[-1 - back], 1e-5)
        if step < cfg.conv_kernel - 2:
            assert torch.count_nonzero(conv[..., 0]) == 0
    assert S.abs().max() > 0.1  # the state really accumulated


def test_router_matches_reference():
    cfg = get_config("tiny", routed_scaling=2.5)
    router = K3DecodeStack(cfg, seed=2).layers[0].moe.routed.router
    x = torch.randn(6, cfg.hidden)
    w, idx = router(x)
    w_ref, idx_ref = ref.route(x.double() @ router.w_r.double().T, router.b_corr, cfg.top_k, 2.5)
    assert w.dtype == torch.float32 and router.logits(x).dtype == torch.float32
    assert torch.equal(idx, idx_ref)
    close(w, w_ref, 1e-6)
    close(w.sum(-1), torch.full((6,), 2.5), 1e-6)


def test_router_bias_changes_selection_not_weights():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    no_bias = torch.zeros(5)
    w, idx = route(logits, no_bias, 2, 1.0)
    assert sorted(idx[0].tolist()) == [0, 1]
    bias = torch.tensor([-10.0, 0.0, 0.0, 0.0, 5.0])  # drop expert 0, force expert 4
    w_b, idx_b = route(logits, bias, 2, 1.0)
    assert sorted(idx_b[0].tolist()) == [1, 4]
    sig = torch.sigmoid(logits[0])
    expected = {1: sig[1] / (sig[1] + sig[4]), 4: sig[4] / (sig[1] + sig[4])}
    for e, weight in zip(idx_b[0].tolist(), w_b[0]):
        close(weight, expected[e], 1e-6)


def test_router_ties_and_renormalisation():
    # all experts tie: any k distinct experts, equal weights summing to the scaling
    w, idx = route(torch.zeros(2, 8), torch.zeros(8), 4, 1.5)
    assert all(len(set(row.tolist())) == 4 for row in idx)
    close(w, torch.full((2, 4), 1.5 / 4), 1e-7)
    # a tie straddling the k-th place: the strictly better experts always make it, one tied one does
    logits = torch.tensor([[2.0, 1.0, 1.0, 1.0, -3.0]])
    w, idx = route(logits, torch.zeros(5), 2, 1.0)
    chosen = set(idx[0].tolist())
    assert 0 in chosen and len(chosen & {1, 2, 3}) == 1 and 4 not in chosen
    sig = torch.sigmoid(torch.tensor([2.0, 1.0]))
    close(w[0].sort(descending=True).values, sig / sig.sum(), 1e-6)
    # a bias tie broken the same way on every call (replicated routing must agree across ranks)
    assert torch.equal(route(logits, torch.zeros(5), 2, 1.0)[1], idx)


def test_latent_moe_and_shared_experts_match_reference():
    cfg = get_config("tiny", routed_scaling=1.7)
    model = K3DecodeStack(cfg, seed=4)
    moe = model.layers[1].moe
    W = full_weights(model)
    routed = {k.replace("router.", "").replace("latent_norm.weight", "latent_norm"): v
              for k, v in sub(W, "layers.1.moe.routed.").items()}
    x = torch.randn(5, cfg.hidden)
    y_routed = moe.routed(x)
    close(y_routed, ref.latent_moe(x, routed, top_k=cfg.top_k, scaling=1.7), 1e-4)
    y_shared = moe.shared(x)
    close(y_shared, ref.shared_experts(x, sub(W, "layers.1.moe.shared.")), 1e-4)
    close(moe(x), y_routed + y_shared, 1e-6)
    assert y_routed.abs().mean() > 0.05 and y_shared.abs().mean() > 0.05


def test_situ_clamps_like_the_equation():
    from k3fuse.model.layers import situ_glu
    g = torch.tensor([-100.0, -1.0, 0.0, 1.0, 100.0])
    u = torch.tensor([1000.0, 2.0, 3.0, -2.0, -1000.0])
    close(situ_glu(g, u, 4.0, 25.0), ref.situ(ref.d(g), ref.d(u)), 1e-6)
    assert situ_glu(g, u, 4.0, 25.0)[-1] < -99  # 4*tanh(25)*1 * 25*tanh(-40) = -100


def test_attn_res_mix_matches_reference():
    bank = [torch.randn(3, 32) * s for s in (1.0, 4.0, 0.5)]
    partial = torch.randn(3, 32)
    query = torch.randn(32)
    close(attn_res_mix(bank, partial, query, 1e-5), ref.attn_res_mix(bank + [partial], query), 1e-5)
    # a single entry mixes to itself; equal scores average the entries
    close(attn_res_mix([], partial, query, 1e-5), partial, 1e-6)
    close(attn_res_mix([partial * 2], partial, torch.zeros(32), 1e-5), partial * 1.5, 1e-6)


@pytest.mark.parametrize("residual", ["plain", "attnres"])
def test_stack_matches_reference_over_steps(residual):
    # 4 layers with block 2: AttnRes appends at layers 0 and 2, so the bank holds 2 snapshots
    cfg = get_config("tiny", residual=residual, n_layers=4, attn_res_block=2)
    model = K3DecodeStack(cfg, seed=7)
    W = full_weights(model)
    state = model.init_state(BATCH)
    rec = [ref.d(t) for t in state.recurrent]
    conv = [ref.d(t) for t in state.conv]
    for x in inputs(cfg):
        y, state = model(x, state)
        y_ref, rec, conv = ref.decode_step(x, rec, conv, W, cfg)
        close(y, y_ref, 2e-4)
        for a, b in zip(state.recurrent, rec):
            close(a, b, 2e-4)
        for a, b in zip(state.conv, conv):
            close(a, b, 2e-4)


# --- tracing ---------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("residual", ["plain", "attnres"])
def test_compile_and_export_trace_and_match_eager(residual):
    cfg = get_config("tiny", residual=residual, n_layers=2)
    model = K3DecodeStack(cfg, seed=1)
    xs = inputs(cfg, steps=2)
    _, state = model(xs[0], model.init_state(BATCH))
    y, new_state = model(xs[1], state)

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    y_c, state_c = compiled(xs[1], state)
    close(y_c, y, 1e-6)
    assert isinstance(state_c, DecodeState)
    for a, b in zip(pytree.tree_leaves(state_c), pytree.tree_leaves(new_state)):
        close(a, b, 1e-6)

    ep = torch.export.export(model, (xs[1], state))
    y_e, state_e = ep.module()(xs[1], state)
    close(y_e, y, 1e-6)
    for a, b in zip(pytree.tree_leaves(state_e), pytree.tree_leaves(new_state)):
        close(a, b, 1e-6)
    targets = {n.target for n in ep.graph.nodes if n.op == "call_function"}
    assert not targets & compat.COLLECTIVE_OPS  # no collectives at tp=1
    assert torch.ops.aten.mm.default in targets or torch.ops.aten.linear.default in targets
    n_params = sum(1 for s in ep.graph_signature.input_specs if s.kind.name == "PARAMETER")
    assert n_params == len(list(model.parameters()))


@pytest.mark.slow
def test_export_with_dynamic_token_count():
    cfg = get_config("tiny", residual="attnres", n_layers=2)
    model = K3DecodeStack(cfg, seed=2)
    ep = torch.export.export(model, (inputs(cfg, 1, batch=2)[0], model.init_state(2)),
                             dynamic_shapes=model.export_dynamic_shapes(max_tokens=64))
    for batch in (1, 5):
        x, state = inputs(cfg, 1, batch=batch)[0], model.init_state(batch)
        y_e, state_e = ep.module()(x, state)
        y, new_state = model(x, state)
        close(y_e, y, 1e-6)
        close(state_e.recurrent[1], new_state.recurrent[1], 1e-6)


def test_bfloat16_tracks_float32_when_routing_cannot_flip():
    # top_k = n_experts: every expert is selected, so bf16 rounding cannot change a routing choice
    # (with real top-k a near-tie flips in bf16 and the outputs legitimately diverge)
    cfg = get_config("tiny", residual="attnres", n_layers=3, top_k=16)
    m32, m16 = K3DecodeStack(cfg, seed=3), K3DecodeStack(cfg, seed=3, dtype=torch.bfloat16)
    s32, s16 = m32.init_state(BATCH), m16.init_state(BATCH)
    assert s16.conv[0].dtype == torch.bfloat16 and s16.recurrent[0].dtype == torch.float32
    for x in inputs(cfg):
        y32, s32 = m32(x, s32)
        y16, s16 = m16(x.to(torch.bfloat16), s16)
        assert y16.dtype == torch.bfloat16
        assert (y16.float() - y32).norm() / y32.norm() < 0.05
        assert (s16.recurrent[2] - s32.recurrent[2]).norm() / s32.recurrent[2].norm() < 0.05


# --- tensor parallelism ----------------------------------------------------------------------------
def _tp_worker(rank: int, world_size: int) -> dict:
    """On each rank: both residual kinds over STEPS decode steps, a few weight shards, and the
    collectives of the exported graph (proof of the funcol spelling)."""
    out = {"errors": []}
    for kwargs in ({"tp_size": 2 * world_size, "rank": rank}, {"tp_size": world_size, "rank": 1 - rank}):
        try:
            K3DecodeStack(get_config("tiny"), **kwargs)
        except ValueError as exc:
            out["errors"].append(str(exc))
    for residual in ("plain", "attnres"):
        cfg = get_config("tiny", residual=residual, n_layers=3, attn_res_block=2)
        model = K3DecodeStack(cfg, tp_size=world_size, rank=rank, seed=11)
        ys, states = run_steps(model, inputs(cfg))
        out[residual] = (ys, states[-1])
        if residual == "plain":
            out["shards"] = {"w_q": model.layers[1].kda.w_q, "w_o": model.layers[1].kda.w_o,
                             "w2": model.layers[1].moe.routed.w2,
                             "w_down_shared": model.layers[1].moe.shared.w_down}
        if world_size == 2 and residual == "attnres":  # compiled code runs the collectives: all ranks compile
            torch._dynamo.reset()
            compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
            y_c, _ = compiled(inputs(cfg, 1)[0], states[-1])
            y, _ = model(inputs(cfg, 1)[0], states[-1])
            out[residual + "_compiled_err"] = (y_c - y).abs().max().item()
        if residual == "plain" and rank == 0:  # tracing needs the group, not the peers
            ep = torch.export.export(model, (inputs(cfg, 1)[0], model.init_state(BATCH)))
            out["collectives"] = [str(n.target) for n in ep.graph.nodes
                                  if n.op == "call_function" and n.target in compat.COLLECTIVE_OPS]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_matches_tp1(tp):
    results = launch(_tp_worker, tp, backend="gloo", timeout_s=240)
    for residual in ("plain", "attnres"):
        cfg = get_config("tiny", residual=residual, n_layers=3, attn_res_block=2)
        model = K3DecodeStack(cfg, seed=11)
        ys, states = run_steps(model, inputs(cfg))
        final = states[-1]
        heads, conv_width = cfg.kda_heads // tp, 3 * cfg.kda_dim // tp
        for rank, res in enumerate(results):
            ys_tp, state_tp = res[residual]
            for y_tp, y in zip(ys_tp, ys):
                close(y_tp, y, 1e-4)
            for i in range(cfg.n_layers):
                # a rank's recurrent state is its slice of heads
                close(state_tp.recurrent[i], final.recurrent[i][:, rank * heads:(rank + 1) * heads], 1e-4)
                # a rank's conv window is its slice of each of q, k and v
                full = final.conv[i].view(BATCH, 3, cfg.kda_dim, -1)
                mine = full[:, :, rank * conv_width // 3:(rank + 1) * conv_width // 3].reshape(BATCH, conv_width, -1)
                close(state_tp.conv[i], mine, 1e-4)
    full = model.layers[1]
    I, S, P = 32, 64, 128
    assert results[0]["errors"] == [f"tp_size={2 * tp} but the process group has {tp} ranks",
                                    "rank=1 but this process is rank 0 of the group"]
    if tp == 2:
        assert all(res["attnres_compiled_err"] < 1e-6 for res in results)
    # 3 reductions per layer (KDA out-proj, routed latent, shared down), each then waited on
    assert results[0]["collectives"] == ["_c10d_functional.all_reduce.default"] * 3 * 3
    for rank, res in enumerate(results):
        sh = res["shards"]
        assert torch.equal(sh["w_q"], full.kda.w_q[rank * P // tp:(rank + 1) * P // tp])
        assert torch.equal(sh["w_o"], full.kda.w_o[:, rank * P // tp:(rank + 1) * P // tp])
        assert torch.equal(sh["w2"], full.moe.routed.w2[:, :, rank * I // tp:(rank + 1) * I // tp])
        assert torch.equal(sh["w_down_shared"], full.moe.shared.w_down[:, rank * S // tp:(rank + 1) * S // tp])


def test_dataclass_config_is_frozen():
    cfg = get_config("tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden = 1  # type: ignore[misc]


def test_grouped_experts_compute_what_the_gathered_reference_does(monkeypatch):
    """The CUDA spelling (pairs sorted by expert, torch._grouped_mm) against the CPU gather+bmm."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no torch._grouped_mm")
    from k3fuse import spelling
    from k3fuse.model import layers

    cfg = get_config("tiny", n_layers=1, dtype="bfloat16")
    moe = layers.LatentMoE(cfg, 0, layers.WeightSource(3, torch.bfloat16, "cpu"),
                           layers.TensorParallel(1, 0, None))
    for T in (1, 3, 8):
        a = torch.randn(T, cfg.latent, dtype=torch.bfloat16)
        experts = torch.randint(0, cfg.n_experts, (T, cfg.top_k)).reshape(-1)
        experts[: cfg.top_k] = 5  # a crowded expert next to empty ones
        args = (moe.w1, moe.w3, moe.w2, cfg.top_k, cfg.situ_beta, cfg.situ_linear_beta)
        ref = spelling.routed_experts_gathered(a, experts, *args).float()
        try:
            got = spelling.routed_experts_grouped(a, experts, *args).float()
        except RuntimeError as exc:  # a CPU build without the grouped kernel
            pytest.skip(f"torch._grouped_mm does not run on this CPU build: {exc}")
        assert (got - ref).norm() / ref.norm() < 2e-2, T
    monkeypatch.setattr(spelling, "use_grouped_mm", lambda a: True)
    x = torch.randn(4, cfg.hidden, dtype=torch.bfloat16)
    grouped = moe(x).float()
    monkeypatch.setattr(spelling, "use_grouped_mm", lambda a: False)
    gathered = moe(x).float()
    assert (grouped - gathered).norm() / gathered.norm() < 2e-2
