"""The K3 rules on each spelling of transformers 5's Kimi Linear / DeepSeek-V3 / Kimi K2.5 code.

One small module per spelling (tests/thirdparty_models.py writes them as HF does), exported and run through
k3fuse.apply in one process (TP 1): the rule fires with the HF variant, the rewritten program equals the
unrewritten one in strict mode with the fused op counted, or the site is refused with a reason that names
the semantic difference:
* KDA: `g[..., None].exp()` (unsqueeze, then exp) and both contractions a broadcast multiply and
  `.sum(dim=-2)` -> kda_delta_rule "broadcast"; the unsqueeze-then-exp decay alone, in K3's einsum step,
  still matches K3's own forms; the short conv through `F.conv1d` -> kda_short_conv "conv1d" (the conv
  state updated in place as HF does); bf16 taps (HF's bf16 checkpoints) refused by the fp32-taps guard;
* routing: the group-limited block with one group (K2.5, Kimi Linear) and with every group kept ->
  fused_routing "grouped"; DeepSeek-V3's 2 of 4 groups refused as `group_limited`; older HF's
  `bias.unsqueeze(0)` -> fused_routing;
* experts: `repeat_interleave`, packed gate_up_proj with one bmm and `chunk` -> routed_experts "batched"
  (fp32, bf16, and torch.export's core decomposition: `squeeze.dims`, `split_with_sizes`, silu as
  `x * sigmoid(x)`); SiLU and relu^2 experts refused as `activation`; the packed form refused on a GPU
  context (`kernel_layout`); flat [T*k] routing weights -> moe_combine;
* a near miss between two overloads of one op names the overloads;
* the vocabulary reads each pair of spellings as one op (canonical form), node by node.
The whole models, every door, TP 1 and TP 2, are tests/test_thirdparty_hf_models.py.
"""
from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from thirdparty_models import (HFDeltaAttention, HFExperts, HFTopkRouter, Shard, TopkRouter, hf_causal_conv1d_update,
                               hf_recurrent_kda)
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import k3fuse
from k3fuse import runtime, vocabulary
from k3fuse.matcher import compile_pattern, decomposition_table, find_matches, trace_aten
from k3fuse.rewrite_site import PatternSpec
from k3fuse.spelling import delta_rule

T, H, HEADS, D = 3, 32, 2, 8
TOL = 2e-5


def _apply(module: nn.Module, args: tuple, rules: set[str], ctx: k3fuse.DecodeContext | None = None,
           core: bool = False):
    """Export `module` (torch.export's own core decomposition with `core`, as a user calling
    run_decompositions() gets, else the doors' table) and apply `rules`: (program, log)."""
    ep = torch.export.export(module, args)
    ep = ep.run_decompositions() if core else ep.run_decompositions(decomposition_table())
    ctx = (ctx or k3fuse.DecodeContext(strict=True)).with_(enabled_rules=frozenset(rules))
    return k3fuse.apply(ep, ctx, decompose=core)


def _events(log, rule: str, decision: str) -> list:
    return [e for e in log.events if e.rule == rule and e.decision == decision]


def _strict_equal(program, module: nn.Module, make_args, tol: float = TOL) -> dict:
    """Run the rewritten program (strict) and the module on fresh copies of the same inputs (inputs
    the step mutates included): the largest difference over outputs and inputs, and the op counts."""
    runtime.reset_stats()
    fused_args, eager_args = make_args(), make_args()
    with torch.no_grad(), runtime.strict():
        fused = program.module()(*fused_args)
    with torch.no_grad():
        eager = module(*eager_args)
    err = max(float((a.double() - b.double()).abs().max())
              for a, b in zip(pytree.tree_leaves((fused, fused_args)), pytree.tree_leaves((eager, eager_args))))
    assert err < tol, err
    assert runtime.fallbacks() == {}
    return runtime.stats()


# --- KDA ------------------------------------------------------------------------------------------------
class HFStep(nn.Module):
    """HF's `recurrent_kimi_delta_attention` on one decode token ([B, 1, h, d] q/k/v/g, [B, 1, h] beta)."""

    def forward(self, q, k, v, g, beta, state):
        return hf_recurrent_kda(q, k, v, g, beta, state)


def _step_args(seed: int = 0) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return (rn(T, 1, HEADS, D), rn(T, 1, HEADS, D), rn(T, 1, HEADS, D), -torch.rand(T, 1, HEADS, D, generator=gen),
            torch.rand(T, 1, HEADS, generator=gen), 0.3 * rn(T, HEADS, D, D))


def test_hf_delta_step_broadcast_contractions_and_unsqueeze_then_exp_fire():
    program, log = _apply(HFStep(), _step_args(), {"kda_delta_rule"})
    (e,) = _events(log, "kda_delta_rule", "applied")
    assert e.variant == "broadcast"
    stats = _strict_equal(program, HFStep(), _step_args)
    assert stats == {"kda_delta_rule": {"reference": 1}}


class K3StepHFDecay(nn.Module):
    """K3's einsum step with HF's decay spelling `g[..., None].exp()`: the vocabulary alone matches it."""

    def forward(self, recurrent, g, beta, kc, vc, qc):
        S = recurrent * g[..., None].exp()
        e = beta.unsqueeze(-1) * (vc - torch.einsum("thkv,thk->thv", S, kc))
        S = S + kc.unsqueeze(-1) * e.unsqueeze(-2)
        return S, torch.einsum("thkv,thk->thv", S, qc)


def test_unsqueeze_then_exp_is_k3s_decay_to_the_matcher():
    def args():
        q, k, v, g, beta, state = _step_args(1)
        return state, g[:, 0], beta[:, 0], k[:, 0], v[:, 0], q[:, 0]

    program, log = _apply(K3StepHFDecay(), args(), {"kda_delta_rule"})
    (e,) = _events(log, "kda_delta_rule", "applied")
    assert e.variant == "tokens"  # K3's own einsum form (T, h >= 2)
    S, o = K3StepHFDecay()(*args())
    torch.testing.assert_close((S, o), delta_rule(*args()), rtol=0, atol=0)  # the same function
    assert _strict_equal(program, K3StepHFDecay(), args) == {"kda_delta_rule": {"reference": 1}}


@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["kimi_linear_unbounded", "k3_lower_bounded"])
def test_hf_kda_layer_fuses_step_and_conv_whatever_the_decay(lower_bound):
    """The decay is an operand of the step: Kimi Linear's unbounded -exp(A_log)*softplus(z) and K3's
    lower-bounded one both fuse, and the layer (conv state updated in place) keeps its numbers."""
    layer = HFDeltaAttention(H, 2 * HEADS, D, Shard(), torch.Generator().manual_seed(3), gate_lower_bound=lower_bound)

    def args():
        gen = torch.Generator().manual_seed(4)
        return (torch.randn(T, 1, H, generator=gen), torch.randn(T, 3 * 2 * HEADS * D, 3, generator=gen),
                0.3 * torch.randn(T, 2 * HEADS, D, D, generator=gen))

    program, log = _apply(layer, args(), {"kda_delta_rule", "kda_short_conv"})
    assert [e.variant for e in _events(log, "kda_delta_rule", "applied")] == ["broadcast"]
    assert [e.variant for e in _events(log, "kda_short_conv", "applied")] == ["conv1d"]
    stats = _strict_equal(program, layer, args)
    assert stats == {"kda_delta_rule": {"reference": 1}, "kda_short_conv": {"reference": 1}}


class HFConv(nn.Module):
    """KimiLinearDeltaAttention's short conv: [q; k; v] moved to [B, C, 1], `causal_conv1d_update`."""

    def __init__(self, width: int, taps: torch.dtype = torch.float32):
        super().__init__()
        self.conv1d_weight = nn.Parameter(0.3 * torch.randn(3 * width, 1, 4, generator=torch.Generator().manual_seed(2))
                                          .to(taps), requires_grad=False)

    def forward(self, q, k, v, conv_state):
        mixed_qkv = torch.cat([q, k, v], dim=-1).transpose(1, 2)
        return hf_causal_conv1d_update(mixed_qkv, conv_state, self.conv1d_weight.squeeze(1)).transpose(1, 2)


def _conv_args(width: int = 12, dtype: torch.dtype = torch.float32) -> tuple:
    gen = torch.Generator().manual_seed(5)
    return (*(torch.randn(T, 1, width, generator=gen).to(dtype) for _ in range(3)),
            torch.randn(T, 3 * width, 3, generator=gen).to(dtype))


def test_conv1d_short_conv_fires_and_updates_the_state_in_place():
    program, log = _apply(HFConv(12), _conv_args(), {"kda_short_conv"})
    (e,) = _events(log, "kda_short_conv", "applied")
    assert e.variant == "conv1d" and e.values["channels"] == 36 and e.values["taps"] == 4
    before = _conv_args()[3]
    fused_args = _conv_args()
    with torch.no_grad(), runtime.strict():
        program.module()(*fused_args)
    assert not torch.equal(fused_args[3], before)  # the state was written, in place, as HF's copy_ does
    assert _strict_equal(program, HFConv(12), _conv_args) == {"kda_short_conv": {"reference": 1}}


def test_bf16_taps_are_refused_by_the_fp32_taps_guard():
    """HF's bf16 checkpoints convolve in bf16 (the window cast to the taps' dtype): K3 fuses fp32 taps."""
    _, log = _apply(HFConv(12, torch.bfloat16), _conv_args(dtype=torch.bfloat16), {"kda_short_conv"})
    (e,) = _events(log, "kda_short_conv", "rejected")
    assert (e.guard, e.reason) == ("dtype", "the conv taps are fused in fp32 only")
    assert e.values["conv_weight"] == "torch.bfloat16"


# --- routing -------------------------------------------------------------------------------------------
def _router_args():
    return (torch.randn(T, 1, H, generator=torch.Generator().manual_seed(6)),)


def _by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An unsorted top-k's answer in a canonical order (ascending expert id per token)."""
    order = ids.argsort(dim=-1)
    return weights.gather(-1, order), ids.gather(-1, order)


@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (4, 4)], ids=["one_group", "every_group_kept"])
def test_group_block_that_keeps_every_group_is_the_plain_top_k(n_group, topk_group):
    router = HFTopkRouter(H, 8, torch.Generator().manual_seed(7), top_k=2, n_group=n_group, topk_group=topk_group)
    program, log = _apply(router, _router_args(), {"fused_routing"})
    (e,) = _events(log, "fused_routing", "applied")
    assert e.variant == "grouped" and e.values["n_group"] == n_group and e.values["topk_group"] == topk_group
    runtime.reset_stats()
    with torch.no_grad(), runtime.strict():
        fused = program.module()(*_router_args())
    eager = router(*_router_args())
    assert runtime.stats() == {"route_topk": {"reference": 1}}
    (fw, fi), (ew, ei) = _by_expert(*fused), _by_expert(*eager)
    assert torch.equal(fi, ei)  # the same experts (HF's top-k is unsorted: compared as sets)
    torch.testing.assert_close(fw, ew, rtol=1e-6, atol=1e-6)


def test_deepseek_group_limited_routing_is_refused_naming_it():
    router = HFTopkRouter(H, 8, torch.Generator().manual_seed(7), top_k=2, n_group=4, topk_group=2)
    _, log = _apply(router, _router_args(), {"fused_routing"})
    (e,) = _events(log, "fused_routing", "rejected")
    assert e.guard == "group_limited" and e.variant == "grouped"
    assert e.reason == ("group-limited routing: each token takes its experts from its best 2 of 4 expert groups, "
                        "k3fuse.route_topk from all 8 experts (it would pick others)")
    assert e.values == {"n_group": 4, "topk_group": 2, "group_size": 2, "E": 8, "fill": "-inf"}


def test_older_hf_router_bias_unsqueezed_fires():
    """transformers 4's DeepSeek-V3 router adds `e_score_correction_bias.unsqueeze(0)` and, with one
    group, has no group block."""
    router = TopkRouter(H, 8, torch.Generator().manual_seed(8), n_group=1)

    class Router(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = router

        def forward(self, x):
            idx, weights = self.gate(x)
            return weights, idx

    program, log = _apply(Router(), (torch.randn(T, H),), {"fused_routing"})
    (e,) = _events(log, "fused_routing", "applied")
    assert e.variant == "sigmoid"
    with torch.no_grad(), runtime.strict():
        fused = program.module()(torch.randn(T, H, generator=torch.Generator().manual_seed(1)))
    eager = Router()(torch.randn(T, H, generator=torch.Generator().manual_seed(1)))
    (fw, fi), (ew, ei) = _by_expert(*fused), _by_expert(*eager)
    assert torch.equal(fi, ei)
    torch.testing.assert_close(fw, ew, rtol=1e-6, atol=1e-6)


# --- experts -------------------------------------------------------------------------------------------
class Experts(nn.Module):
    """HF's experts behind a fixed routing (the ids and weights are inputs)."""

    def __init__(self, act: str, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.experts = HFExperts(8, H, 16, Shard(), torch.Generator().manual_seed(9), act).to(dtype)

    def forward(self, x, ids, weights):
        return self.experts(x, ids, weights)


def _expert_args(dtype: torch.dtype = torch.float32) -> tuple:
    gen = torch.Generator().manual_seed(10)
    ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(T)])
    return torch.randn(T, H, generator=gen).to(dtype), ids, torch.rand(T, 2, generator=gen)


@pytest.mark.parametrize("dtype,core", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)],
                         ids=["fp32", "bf16", "fp32_core_decomposition"])
def test_batched_mm_situ_experts_and_flat_weight_combine_fire(dtype, core):
    """repeat_interleave, packed gate_up_proj, one bmm and chunk -> routed_experts; the flat [T*k] weights'
    combine -> moe_combine. torch.export's core decomposition writes squeeze.dims, split_with_sizes and
    silu as x * sigmoid(x): the same sites."""
    module = Experts("situ", dtype)
    program, log = _apply(module, _expert_args(dtype), {"routed_experts", "moe_combine"}, core=core)
    (e,) = _events(log, "routed_experts", "applied")
    suffix = "" if dtype == torch.float32 else "[bfloat16]"
    assert e.variant == f"batched{suffix}" and e.values["packed_gate_up"] is True and e.values["I"] == 16
    (c,) = _events(log, "moe_combine", "applied")
    assert c.variant == ("combine" if dtype == torch.float32 else "combine_flat[bfloat16]")
    assert c.values["weights"] == "flat [T*k]"
    if core:
        targets = {str(n.target) for n in torch.export.export(module, _expert_args(dtype)).run_decompositions()
                   .graph.nodes}
        assert {"aten.squeeze.dims", "aten.split_with_sizes.default"} <= targets
    stats = _strict_equal(program, module, lambda: _expert_args(dtype), TOL if dtype == torch.float32 else 2e-2)
    assert stats == {"routed_experts": {"reference": 1}, "moe_combine": {"reference": 1}}


@pytest.mark.parametrize("act,what", [("silu", "SiLU-GLU, silu(g) * u"), ("relu2", "ungated relu^2, relu(u)^2")])
def test_silu_and_relu2_experts_are_refused_naming_the_activation(act, what):
    _, log = _apply(Experts(act), _expert_args(), {"routed_experts", "moe_combine"})
    (e,) = _events(log, "routed_experts", "rejected")
    assert e.guard == "activation" and e.values["activation"] == act
    assert e.reason == (f"the experts compute {what}; k3fuse.routed_experts computes K3's SiTU-GLU, another "
                        "function of the same projections")
    assert len(_events(log, "moe_combine", "applied")) == 1  # the combine does not depend on the activation


def test_packed_gate_up_is_refused_on_a_gpu_context():
    pytest.importorskip("triton")
    gpu = k3fuse.DecodeContext(device_capability=(9, 0))
    _, log = _apply(Experts("situ", torch.bfloat16), _expert_args(torch.bfloat16), {"routed_experts"}, ctx=gpu)
    (e,) = _events(log, "routed_experts", "rejected")
    assert e.guard == "kernel_layout" and "packed gate_up_proj" in e.reason


# --- near misses -----------------------------------------------------------------------------------------
class SqueezeAll(nn.Module):
    """The experts with `.squeeze()` (every unit dim) after each bmm: another overload of squeeze."""

    def __init__(self):
        super().__init__()
        self.experts = HFExperts(8, H, 16, Shard(), torch.Generator().manual_seed(9), "situ")

    def forward(self, x, ids):
        e = self.experts
        flat = ids.reshape(-1)
        proj = torch.bmm(e.gate_up_proj[flat], x.repeat_interleave(2, dim=0).unsqueeze(-1)).squeeze()
        return torch.bmm(e.down_proj[flat], e._apply_gate(proj).unsqueeze(-1)).squeeze()


def test_near_miss_between_two_overloads_names_them():
    _, log = _apply(SqueezeAll(), _expert_args()[:2], {"routed_experts"})
    (e,) = _events(log, "routed_experts", "not_matched")
    assert "aten.squeeze.default" in e.reason and "not aten.squeeze.dim" in e.reason, e.reason
    assert e.values["expected"] == "aten.squeeze.dim"


# --- the vocabulary, one pair of spellings at a time ------------------------------------------------------
aten = torch.ops.aten


def _form(fn, *examples: torch.Tensor, decompose: bool = True) -> tuple:
    """The canonical form of `fn`'s first output node (the node under a getitem), tensors named by the
    placeholder they are, and the nodes the recogniser folded in."""
    gm = trace_aten(fn, list(examples)) if decompose else make_fx(fn, tracing_mode="fake")(*examples)
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    node = out[0] if isinstance(out, (list, tuple)) else out
    while node.target is operator.getitem:
        node = node.args[0]
    key, args = vocabulary.canonical(node)
    named = tuple(a.name if isinstance(a, torch.fx.Node) else a for a in args)
    return key, named, sorted(n.name for n in vocabulary.absorbed(node))


X, I2 = torch.randn(3, 4), torch.randint(0, 4, (3, 2))
PAIRS = {
    "exp_then_unsqueeze": (lambda g: g.exp().unsqueeze(-1), lambda g: g[..., None].exp(), (X,)),
    "squeeze_dim_dims": (lambda x: x.unsqueeze(-1).squeeze(-1), lambda x: aten.squeeze.dims(x.unsqueeze(-1), [-1]),
                         (X,)),
    "topk_unsorted": (lambda x: torch.topk(x, 2), lambda x: torch.topk(x, 2, dim=-1, largest=True, sorted=False),
                      (X,)),
    "gather_dim": (lambda x, i: x.gather(-1, i), lambda x, i: x.gather(1, i), (X, I2)),
    "chunk_split": (lambda x: x.chunk(2, dim=-1), lambda x: aten.split_with_sizes.default(x, [2, 2], -1), (X,)),
    "silu_decomposed_sigmoid": (lambda x: F.silu(x), lambda x: x * torch.sigmoid(x), (X,)),
}


@pytest.mark.parametrize("name", list(PAIRS))
def test_vocabulary_reads_both_spellings_as_one_op(name):
    first, second, examples = PAIRS[name]
    a, b = _form(first, *examples), _form(second, *examples)
    assert a[:2] == b[:2], (a, b)


def test_unsqueeze_pair_and_silu_chain_are_absorbed_into_the_outer_node():
    assert _form(lambda g: g.exp().unsqueeze(-1), X)[2] == ["exp"]
    assert _form(lambda g: g[..., None].exp(), X)[2] == ["unsqueeze"]
    assert _form(lambda x: F.silu(x), X)[2] == ["add", "exp", "neg"]  # Inductor's x / (exp(-x) + 1)
    assert _form(lambda x: x * torch.sigmoid(x), X)[2] == ["sigmoid"]
    assert _form(lambda x: F.silu(x), X, decompose=False)[:2] == _form(lambda x: x * torch.sigmoid(x), X)[:2]

    def shared(g):
        e = g.exp()
        return e.unsqueeze(-1), e * 2

    assert _form(shared, X)[2] == []  # exp read elsewhere too: it stays its readers'


def _bound(pattern, graph_fn, *examples: torch.Tensor) -> list[dict[str, str]]:
    """The inputs each match of `pattern` binds in `graph_fn`'s ATen graph, by node name."""
    spec = PatternSpec("p", pattern, lambda: examples)
    gm = trace_aten(graph_fn, list(examples))
    return [{name: n.name for name, n in m.inputs.items()} for m in find_matches(gm.graph, [compile_pattern(spec)])]


def test_a_pattern_input_at_the_inner_node_of_a_fold_binds_it():
    """K3's `kc.unsqueeze(-1)` with kc a pattern input, where the graph's kc is exp / silu of something:
    the unary + unsqueeze fold would read through the input, so the node as written is tried too."""
    def outer(k, e):
        return k.unsqueeze(-1) * e.unsqueeze(-2)

    assert _bound(outer, lambda x, e: outer(x.exp(), e), X, X.clone()) == [{"k": "exp", "e": "e_1"}]
    # silu decomposed as x / (exp(-x) + 1): k is the div
    assert _bound(outer, lambda x, e: outer(F.silu(x), e), X, X.clone()) == [{"k": "div", "e": "e_1"}]

    def gated(a, b):  # a * sigmoid(b) with a and b one value is silu's spelling: the mul still binds both
        return a * torch.sigmoid(b)

    assert _bound(gated, lambda x, unused: gated(x, x), X, X.clone()) == [{"a": "x_1", "b": "x_1"}]


def test_sizes_and_semantics_stay_apart():
    """What the vocabulary must not equate: another dim, another k, largest=False, x * sigmoid(y)."""
    assert _form(lambda g: g.exp().unsqueeze(-1), X)[:2] != _form(lambda g: g.exp().unsqueeze(0), X)[:2]
    assert _form(lambda x: torch.topk(x, 2), X)[:2] != _form(lambda x: torch.topk(x, 3), X)[:2]
    assert _form(lambda x: torch.topk(x, 2), X)[:2] != _form(lambda x: torch.topk(x, 2, largest=False), X)[:2]
    assert _form(lambda x, y: x * torch.sigmoid(y), X, X.clone())[0] != vocabulary.SILU
