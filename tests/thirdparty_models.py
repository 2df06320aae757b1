"""Small decode models written the way third-party code (HF transformers, engines) writes them.

Own code, not copied: the spellings follow HF `modeling_deepseek_v3.py` (Kimi K2.5 uses the same MoE),
`modeling_kimi_linear.py` and `modeling_nemotron_h.py`, with tensor parallelism done the way people
add it by hand: column-parallel shards and an in-place `dist.all_reduce(t)` after each row-parallel
projection. Hidden states are 2-D [T, H] (decode: one token per sequence, as engines keep them).

* HF RMSNorm: `weight * (h.float() * rsqrt(var + eps)).to(dtype)`;
* DeepSeek-V3 router: `F.linear(h.type(float32), W.type(float32))`, sigmoid, the correction bias for
  selection only, group-limited top-k (top-2 sum per group, top-k of groups, masked_fill, top-k of
  experts), gather, `/=` normalisation, routed scaling; SiLU-gated experts and shared expert;
* Nemotron-H latent MoE: the router input feeds the router, `fc1_latent_proj` and the shared expert;
  ungated relu^2 experts in latent space, then `fc2_latent_proj`; masked_fill with -inf;
* softmax router (Mixtral / Qwen-MoE style) without groups or bias.
Routed experts gather their weights by expert id and use bmm (traceable, no data-dependent loop).

`HFDecodeModel` is transformers 5's code for Kimi Linear, DeepSeek-V3, Kimi K2.5 (DeepSeek-V3's MoE with
one expert group) and a K3 written the same way, decoding one token per sequence with hidden states
[B, 1, H] as HF keeps them:
* KDA (`KimiLinearDeltaAttention`): q/k/v projections concatenated and moved to [B, C, 1], the short conv
  as `causal_conv1d_update` (conv state updated in place with `copy_`, `F.conv1d` with groups=C, silu),
  the forget gate (Kimi Linear's unbounded `-exp(A_log) * softplus`, softplus spelled with `where`, or K3's
  lower-bounded `lb * sigmoid(exp(A_log) * z)`), beta, and the step of `recurrent_kimi_delta_attention`
  (fp32, l2-normalised q and k, `g[:, i][..., None].exp()`, both contractions a broadcast multiply and
  `.sum(dim=-2)`, the output written into a zeros buffer), gated RMSNorm, o_proj;
* the router (`DeepseekV3TopkRouter`): sigmoid, bias, the group-limited block (always, one group too),
  final `topk(sorted=False)`, `gather(1, ...)`, `/=`, routed scaling;
* the experts as `batched_mm_experts_forward`: `repeat_interleave`, packed `gate_up_proj` [E, 2I, H],
  one bmm, `chunk(2, dim=-1)`, the activation (SiLU, K3's SiTU, or ungated relu^2), the down bmm, flat
  routing weights, `view(T, k, H).sum(dim=1)`;
* the shared expert (`DeepseekV3MLP`), added to the routed output.
By hand at TP > 1 (HF has no plan for these layers): column-parallel heads and expert intermediate, the
row-parallel o_proj reduced in place, and the shared expert's partial added to the routed partial before
the MoE's one all-reduce (the shared down projection is not reduced on its own).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class Shard:
    """Who this module is in the TP group (reduces in place only when tp > 1, as HF does)."""

    def __init__(self, tp: int = 1, rank: int = 0):
        self.tp, self.rank = tp, rank

    def cols(self, w: torch.Tensor, dim: int) -> torch.Tensor:
        return w.chunk(self.tp, dim=dim)[self.rank].contiguous()

    def reduce_(self, t: torch.Tensor) -> torch.Tensor:
        if self.tp > 1:
            dist.all_reduce(t)
        return t


def _param(g: torch.Generator, *shape: int, scale: float | None = None) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * (scale if scale is not None else shape[-1] ** -0.5)


class HFRMSNorm(nn.Module):
    def __init__(self, width: int, g: torch.Generator, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(width, generator=g), requires_grad=False)
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class RowParallelLinear(nn.Module):
    """nn.Linear on this rank's input slice, then the in-place all-reduce."""

    def __init__(self, full: torch.Tensor, shard: Shard):
        super().__init__()
        self.weight = nn.Parameter(shard.cols(full, 1), requires_grad=False)
        self.shard = shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        self.shard.reduce_(out)
        return out


class Mixer(nn.Module):
    """Stands in for attention / KDA / Mamba at decode: a column-parallel input projection, a
    pointwise map, the row-parallel out-projection (o_proj / out_proj) reduced in place."""

    def __init__(self, hidden: int, inner: int, shard: Shard, g: torch.Generator):
        super().__init__()
        self.in_proj = nn.Parameter(shard.cols(_param(g, inner, hidden), 0), requires_grad=False)
        self.o_proj = RowParallelLinear(_param(g, hidden, inner), shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(torch.tanh(F.linear(x, self.in_proj)))


class GatedMLP(nn.Module):
    """HF DeepseekV3MLP / Kimi shared expert: down(silu(gate(x)) * up(x)), TP-sharded, reduced in place."""

    def __init__(self, hidden: int, inter: int, shard: Shard, g: torch.Generator):
        super().__init__()
        self.gate_proj = nn.Parameter(shard.cols(_param(g, inter, hidden), 0), requires_grad=False)
        self.up_proj = nn.Parameter(shard.cols(_param(g, inter, hidden), 0), requires_grad=False)
        self.down_proj = RowParallelLinear(_param(g, hidden, inter), shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(F.linear(x, self.gate_proj)) * F.linear(x, self.up_proj))


class Relu2MLP(nn.Module):
    """Nemotron-H MLP / shared expert: ungated, down(relu(up(x))^2)."""

    def __init__(self, hidden: int, inter: int, shard: Shard, g: torch.Generator):
        super().__init__()
        self.up_proj = nn.Parameter(shard.cols(_param(g, inter, hidden), 0), requires_grad=False)
        self.down_proj = RowParallelLinear(_param(g, hidden, inter), shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.square(F.relu(F.linear(x, self.up_proj))))


class TopkRouter(nn.Module):
    """DeepSeek-V3 / Kimi / Nemotron-H router: fp32 logits, sigmoid (or softmax) scores, correction
    bias for the choice only, group-limited top-k, normalised gathered weights, routed scaling."""

    def __init__(self, hidden: int, n_experts: int, g: torch.Generator, *, top_k: int = 2, n_group: int = 2,
                 topk_group: int = 1, score: str = "sigmoid", bias: bool = True, fill: float = 0.0,
                 routed_scaling_factor: float = 2.5, temperature: float | None = None):
        super().__init__()
        self.weight = nn.Parameter(_param(g, n_experts, hidden), requires_grad=False)
        self.register_buffer("e_score_correction_bias", 0.05 * torch.randn(n_experts, generator=g) if bias else None)
        self.n_routed_experts, self.top_k, self.n_group, self.topk_group = n_experts, top_k, n_group, topk_group
        self.score, self.fill, self.routed_scaling_factor = score, fill, routed_scaling_factor
        self.temperature = temperature  # a near miss: logits scaled before the score function

    def get_topk_indices(self, scores: torch.Tensor) -> torch.Tensor:
        scores_for_choice = scores.view(-1, self.n_routed_experts)
        if self.e_score_correction_bias is not None:
            scores_for_choice = scores_for_choice + self.e_score_correction_bias.unsqueeze(0)
        if self.n_group > 1:
            per_group = self.n_routed_experts // self.n_group
            group_scores = scores_for_choice.view(-1, self.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
            group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores)
            group_mask.scatter_(1, group_idx, 1)
            score_mask = group_mask.unsqueeze(-1).expand(-1, self.n_group, per_group).reshape(-1, self.n_routed_experts)
            scores_for_choice = scores_for_choice.masked_fill(~score_mask.bool(), self.fill)
        return torch.topk(scores_for_choice, k=self.top_k, dim=-1, sorted=False)[1]

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states = hidden_states.view(-1, self.weight.shape[1])
        router_logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))
        if self.temperature is not None:
            router_logits = router_logits / self.temperature
        scores = router_logits.sigmoid() if self.score == "sigmoid" else F.softmax(router_logits, dim=-1,
                                                                                    dtype=torch.float)
        topk_indices = self.get_topk_indices(scores)
        topk_weights = scores.gather(1, topk_indices)
        denominator = topk_weights.sum(dim=-1, keepdim=True) + 1e-20
        topk_weights /= denominator
        topk_weights = topk_weights * self.routed_scaling_factor
        return topk_indices, topk_weights


class RoutedExperts(nn.Module):
    """E experts with a TP-sharded intermediate, gathered by expert id (bmm over token x slot);
    gated SiLU (DeepSeek / Kimi) or ungated relu^2 (Nemotron-H). Returns this rank's partial sum."""

    def __init__(self, n_experts: int, width: int, inter: int, shard: Shard, g: torch.Generator, gated: bool):
        super().__init__()
        self.gated = gated
        self.up = nn.Parameter(shard.cols(_param(g, n_experts, inter, width), 1), requires_grad=False)
        self.gate = nn.Parameter(shard.cols(_param(g, n_experts, inter, width), 1), requires_grad=False) if gated \
            else None
        self.down = nn.Parameter(shard.cols(_param(g, n_experts, width, inter), 2), requires_grad=False)

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        T, k, width = x.shape[0], idx.shape[1], x.shape[1]
        flat = idx.reshape(-1)
        xr = x.unsqueeze(1).expand(T, k, width).reshape(T * k, width, 1)
        u = torch.bmm(self.up[flat], xr).squeeze(-1)
        act = F.silu(torch.bmm(self.gate[flat], xr).squeeze(-1)) * u if self.gate is not None else torch.square(F.relu(u))
        y = torch.bmm(self.down[flat], act.unsqueeze(-1)).squeeze(-1)
        return (y.view(T, k, width) * weights.unsqueeze(-1)).sum(1).type(x.dtype)


class DeepseekV3StyleMoE(nn.Module):
    """Routed SiLU experts on the MoE input itself (no latent projection) + a SiLU-gated shared expert."""

    def __init__(self, hidden: int, shard: Shard, g: torch.Generator, *, n_experts: int = 8, score: str = "sigmoid",
                 n_group: int = 2, bias: bool = True, shared: bool = True, temperature: float | None = None):
        super().__init__()
        self.shard = shard
        self.gate = TopkRouter(hidden, n_experts, g, score=score, n_group=n_group, bias=bias, temperature=temperature)
        self.experts = RoutedExperts(n_experts, hidden, 16, shard, g, gated=True)
        self.shared_experts = GatedMLP(hidden, 32, shard, g) if shared else None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        residuals = hidden_states
        topk_indices, topk_weights = self.gate(hidden_states)
        routed = self.experts(hidden_states.view(-1, hidden_states.shape[-1]), topk_indices, topk_weights)
        self.shard.reduce_(routed)
        if self.shared_experts is None:
            return routed
        return routed + self.shared_experts(residuals)


class NemotronHStyleMoE(nn.Module):
    """Latent MoE: the router input also feeds fc1_latent_proj and the relu^2 shared expert."""

    def __init__(self, hidden: int, shard: Shard, g: torch.Generator, *, n_experts: int = 8, latent: int = 16):
        super().__init__()
        self.shard = shard
        self.gate = TopkRouter(hidden, n_experts, g, n_group=2, fill=float("-inf"))
        self.fc1_latent_proj = nn.Parameter(_param(g, latent, hidden), requires_grad=False)  # replicated
        self.experts = RoutedExperts(n_experts, latent, 16, shard, g, gated=False)
        self.fc2_latent_proj = nn.Parameter(_param(g, hidden, latent), requires_grad=False)  # replicated
        self.shared_experts = Relu2MLP(hidden, 32, shard, g)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        residuals = hidden_states
        topk_indices, topk_weights = self.gate(hidden_states)
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        hidden_states = F.linear(hidden_states, self.fc1_latent_proj)
        hidden_states = self.shard.reduce_(self.experts(hidden_states, topk_indices, topk_weights))
        hidden_states = F.linear(hidden_states, self.fc2_latent_proj)
        return hidden_states + self.shared_experts(residuals)


class DecoderLayer(nn.Module):
    """HF pre-norm decoder layer: mixer and MoE, each `residual + block(norm(h))`."""

    def __init__(self, hidden: int, moe: nn.Module, shard: Shard, g: torch.Generator):
        super().__init__()
        self.input_layernorm = HFRMSNorm(hidden, g)
        self.self_attn = Mixer(hidden, 32, shard, g)
        self.post_attention_layernorm = HFRMSNorm(hidden, g)
        self.mlp = moe

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.self_attn(self.input_layernorm(hidden_states))
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        return residual + hidden_states


class DecodeModel(nn.Module):
    """n decoder layers and the final norm; `kind` picks the MoE: deepseek | nemotron | softmax."""

    HIDDEN = 32

    def __init__(self, kind: str, tp: int = 1, rank: int = 0, n_layers: int = 2, seed: int = 11, **moe_kw):
        super().__init__()
        g = torch.Generator().manual_seed(seed)  # every rank draws the same full weights, then shards
        shard = Shard(tp, rank)
        H = self.HIDDEN

        def moe() -> nn.Module:
            if kind == "nemotron":
                return NemotronHStyleMoE(H, shard, g, **moe_kw)
            if kind == "softmax":
                return DeepseekV3StyleMoE(H, shard, g, score="softmax", n_group=1, bias=False, shared=False, **moe_kw)
            return DeepseekV3StyleMoE(H, shard, g, **moe_kw)

        self.layers = nn.ModuleList([DecoderLayer(H, moe(), shard, g) for _ in range(n_layers)])
        self.norm = HFRMSNorm(H, g)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return self.norm(hidden_states)


class SingleReductionMoE(nn.Module):
    """A near miss for oproj_allreduce_residual: routed and shared partial sums added first and
    reduced once (`dist.all_reduce(routed + shared)`), so the reduced value is not a projection."""

    def __init__(self, tp: int = 1, rank: int = 0, seed: int = 5):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.shard = Shard(tp, rank)
        self.up = nn.Parameter(self.shard.cols(_param(g, 32, 32), 0), requires_grad=False)
        self.down = nn.Parameter(self.shard.cols(_param(g, 32, 32), 1), requires_grad=False)
        self.other = nn.Parameter(self.shard.cols(_param(g, 32, 32), 1), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        h = F.relu(F.linear(x, self.up))
        y = F.linear(h, self.down) + F.linear(h, self.other)
        self.shard.reduce_(y)
        return residual + y


# --- transformers 5 (HF) decode models, hidden states [B, 1, H] -------------------------------------
def hf_l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def hf_causal_conv1d_update(hidden_states: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                            activation: str = "silu") -> torch.Tensor:
    """One decode step of HF's depthwise causal conv: hidden_states [B, C, S], conv_state [B, C, K-1]
    updated in place, weight [C, K]."""
    _, channels, seq_len = hidden_states.shape
    state_len = conv_state.shape[-1]
    window = torch.cat([conv_state, hidden_states], dim=-1).to(weight.dtype)
    conv_state.copy_(window[:, :, -state_len:])
    out = F.conv1d(window, weight.unsqueeze(1), None, padding=0, groups=channels)[:, :, -seq_len:]
    out = F.silu(out) if activation == "silu" else out
    return out.to(hidden_states.dtype)


def hf_recurrent_kda(query, key, value, g, beta, initial_state):
    """HF's recurrent KDA over a [B, S, h, d] sequence (S = 1 at decode); returns (out, final state)."""
    initial_dtype = query.dtype
    query, key, value, g, beta = [t.to(torch.float32) for t in (query, key, value, g, beta)]
    query, key = hf_l2norm(query), hf_l2norm(key)
    batch, seq_len, heads, k_dim = key.shape
    query = query * (1 / (query.shape[-1] ** 0.5))
    out = torch.zeros(batch, seq_len, heads, value.shape[-1], dtype=value.dtype, device=value.device)
    state = initial_state.to(value)
    for i in range(seq_len):
        q_i, k_i, v_i = query[:, i], key[:, i], value[:, i]
        g_i = g[:, i][..., None].exp()
        b_i = beta[:, i][..., None]
        state = state * g_i
        kv_mem = (state * k_i[..., None]).sum(dim=-2)
        delta = (v_i - kv_mem) * b_i
        state = state + k_i.unsqueeze(-1) * delta.unsqueeze(-2)
        out[:, i] = (state * q_i.unsqueeze(-1)).sum(dim=-2)
    return out.to(initial_dtype), state


class HFGatedRMSNorm(nn.Module):
    """KimiLinearRMSNormGated: fp32 norm times weight, times sigmoid(gate)."""

    def __init__(self, width: int, g: torch.Generator, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(width, generator=g), requires_grad=False)
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = self.weight.to(torch.float32) * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))
        return (hidden_states * torch.sigmoid(gate.to(torch.float32))).to(input_dtype)


class HFDeltaAttention(nn.Module):
    """KimiLinearDeltaAttention's cached decode step, this rank's heads. `gate_lower_bound` None: Kimi
    Linear's unbounded decay; a negative float: K3's lower-bounded one."""

    def __init__(self, hidden: int, heads: int, head_dim: int, shard: Shard, g: torch.Generator, *,
                 conv_kernel: int = 4, gate_lower_bound: float | None = None):
        super().__init__()
        self.head_dim, self.shard, self.gate_lower_bound = head_dim, shard, gate_lower_bound
        width = heads * head_dim
        self.qkv_dim = width // shard.tp
        self.q_proj, self.k_proj, self.v_proj = (nn.Parameter(shard.cols(_param(g, width, hidden), 0),
                                                              requires_grad=False) for _ in range(3))
        conv = 0.3 * torch.randn(3, width, 1, conv_kernel, generator=g)  # [q; k; v] channels, nn.Conv1d layout
        self.conv1d_weight = nn.Parameter(torch.cat([shard.cols(c, 0) for c in conv]), requires_grad=False)
        self.f_a_proj = nn.Parameter(_param(g, head_dim, hidden), requires_grad=False)
        self.f_b_proj = nn.Parameter(shard.cols(_param(g, width, head_dim), 0), requires_grad=False)
        self.dt_bias = nn.Parameter(shard.cols(torch.randn(width, generator=g), 0), requires_grad=False)
        self.A_log = nn.Parameter(shard.cols(torch.empty(1, 1, heads, 1).uniform_(0.0, 1.0, generator=g), 2),
                                  requires_grad=False)
        self.b_proj = nn.Parameter(shard.cols(_param(g, heads, hidden), 0), requires_grad=False)
        self.g_a_proj = nn.Parameter(_param(g, head_dim, hidden), requires_grad=False)
        self.g_b_proj = nn.Parameter(shard.cols(_param(g, width, head_dim), 0), requires_grad=False)
        self.o_norm = HFGatedRMSNorm(head_dim, g)
        self.o_proj = RowParallelLinear(_param(g, hidden, width), shard)

    def forget_gate(self, hidden_states: torch.Tensor, hidden_shape: tuple) -> torch.Tensor:
        gate = (F.linear(F.linear(hidden_states, self.f_a_proj), self.f_b_proj).float()
                + self.dt_bias.float().view(1, 1, -1)).view(hidden_shape)
        decay_rate = torch.exp(self.A_log.float())
        if self.gate_lower_bound is not None:
            return self.gate_lower_bound * torch.sigmoid(decay_rate * gate)
        softplus = torch.where(gate > 20.0, gate, torch.log(1.0 + torch.exp(gate)))
        return -decay_rate * softplus

    def forward(self, hidden_states: torch.Tensor, conv_state: torch.Tensor, recurrent_state: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        batch_size, seq_len = hidden_states.shape[:2]
        hidden_shape = (batch_size, seq_len, -1, self.head_dim)
        mixed_qkv = torch.cat([F.linear(hidden_states, self.q_proj), F.linear(hidden_states, self.k_proj),
                               F.linear(hidden_states, self.v_proj)], dim=-1).transpose(1, 2)
        mixed_qkv = hf_causal_conv1d_update(mixed_qkv, conv_state, self.conv1d_weight.squeeze(1))
        query, key, value = torch.split(mixed_qkv.transpose(1, 2), [self.qkv_dim] * 3, dim=-1)
        query, key, value = query.view(hidden_shape), key.view(hidden_shape), value.view(hidden_shape)
        g = self.forget_gate(hidden_states, hidden_shape)
        beta = torch.sigmoid(F.linear(hidden_states, self.b_proj))
        core_attn_out, last_state = hf_recurrent_kda(query, key, value, g, beta, recurrent_state)
        gate = F.linear(F.linear(hidden_states, self.g_a_proj), self.g_b_proj).view(hidden_shape)
        output = self.o_norm(core_attn_out, gate).reshape(batch_size, seq_len, -1)
        return self.o_proj(output), last_state


class HFTopkRouter(nn.Module):
    """DeepseekV3TopkRouter (transformers 5): the group-limited block whatever the number of groups."""

    def __init__(self, hidden: int, n_experts: int, g: torch.Generator, *, top_k: int, n_group: int, topk_group: int,
                 routed_scaling_factor: float = 2.5):
        super().__init__()
        self.weight = nn.Parameter(_param(g, n_experts, hidden), requires_grad=False)
        self.e_score_correction_bias = nn.Buffer(0.05 * torch.randn(n_experts, generator=g))
        self.top_k, self.num_experts, self.hidden_dim = top_k, n_experts, hidden
        self.num_group, self.topk_group, self.routed_scaling_factor = n_group, topk_group, routed_scaling_factor

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states = hidden_states.view(-1, self.hidden_dim)
        router_logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))
        scores = router_logits.sigmoid()
        scores_for_choice = scores + self.e_score_correction_bias
        group_scores = (scores_for_choice.view(-1, self.num_group, self.num_experts // self.num_group)
                        .topk(2, dim=-1)[0].sum(dim=-1))
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = (group_mask.unsqueeze(-1).expand(-1, self.num_group, self.num_experts // self.num_group)
                      .reshape(-1, self.num_experts))
        scores_for_choice = scores_for_choice.masked_fill(~score_mask.bool(), float("-inf"))
        topk_indices = torch.topk(scores_for_choice, k=self.top_k, dim=-1, sorted=False)[1]
        topk_weights = scores.gather(1, topk_indices)
        denominator = topk_weights.sum(dim=-1, keepdim=True) + 1e-20
        topk_weights /= denominator
        return topk_weights * self.routed_scaling_factor, topk_indices


def hf_situ_gate(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """A K3 `_apply_gate` as someone would write it for HF: SiTU-GLU in fp32, back to the gate's dtype."""
    g, u = gate.float(), up.float()
    return (beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))).to(gate.dtype)


class HFExperts(nn.Module):
    """`batched_mm_experts_forward` over this rank's slice of the expert intermediate. act: "silu" (Kimi
    Linear, DeepSeek-V3, K2.5), "situ" (K3) gated with a packed gate_up_proj, or "relu2" ungated (up_proj)."""

    def __init__(self, n_experts: int, hidden: int, inter: int, shard: Shard, g: torch.Generator, act: str):
        super().__init__()
        self.num_experts, self.act = n_experts, act
        if act == "relu2":
            self.up_proj = nn.Parameter(shard.cols(_param(g, n_experts, inter, hidden), 1), requires_grad=False)
        else:  # [gate; up] rows, each half sharded: this rank holds [gate_r; up_r]
            gate, up = _param(g, n_experts, inter, hidden), _param(g, n_experts, inter, hidden)
            self.gate_up_proj = nn.Parameter(torch.cat([shard.cols(gate, 1), shard.cols(up, 1)], dim=1),
                                             requires_grad=False)
        self.down_proj = nn.Parameter(shard.cols(_param(g, n_experts, hidden, inter), 2), requires_grad=False)

    def _apply_gate(self, gate_up_out: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up_out.chunk(2, dim=-1)
        return hf_situ_gate(gate, up) if self.act == "situ" else F.silu(gate) * up

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                ) -> torch.Tensor:
        num_top_k, num_tokens, hidden_dim = top_k_index.size(-1), hidden_states.size(0), hidden_states.size(-1)
        selected_hidden_states = hidden_states.repeat_interleave(num_top_k, dim=0)
        sample_weights = top_k_weights.reshape(-1)
        expert_ids = top_k_index.reshape(-1)
        weights = self.up_proj if self.act == "relu2" else self.gate_up_proj
        proj_out = torch.bmm(weights[expert_ids], selected_hidden_states.unsqueeze(-1)).squeeze(-1)
        proj_out = torch.square(F.relu(proj_out)) if self.act == "relu2" else self._apply_gate(proj_out)
        proj_out = torch.bmm(self.down_proj[expert_ids], proj_out.unsqueeze(-1)).squeeze(-1)
        weighted_out = proj_out * sample_weights.unsqueeze(-1)
        final_hidden_states = weighted_out.view(num_tokens, num_top_k, hidden_dim).sum(dim=1)
        return final_hidden_states.to(hidden_states.dtype)


class HFSharedMLP(nn.Module):
    """DeepseekV3MLP as the shared expert: column-parallel gate/up, its down projection left unreduced
    (the MoE reduces its partial with the routed one)."""

    def __init__(self, hidden: int, inter: int, shard: Shard, g: torch.Generator):
        super().__init__()
        self.gate_proj = nn.Parameter(shard.cols(_param(g, inter, hidden), 0), requires_grad=False)
        self.up_proj = nn.Parameter(shard.cols(_param(g, inter, hidden), 0), requires_grad=False)
        self.down_proj = nn.Parameter(shard.cols(_param(g, hidden, inter), 1), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.silu(F.linear(x, self.gate_proj)) * F.linear(x, self.up_proj), self.down_proj)


class HFMoE(nn.Module):
    """DeepseekV3MoE / KimiLinearMoE: router, routed experts, shared expert. At TP > 1 the shared partial
    joins the routed partial in the MoE's one all-reduce."""

    def __init__(self, hidden: int, shard: Shard, g: torch.Generator, *, act: str, n_group: int, topk_group: int,
                 n_experts: int = 8, top_k: int = 2, inter: int = 16, shared_inter: int = 32):
        super().__init__()
        self.shard = shard
        self.gate = HFTopkRouter(hidden, n_experts, g, top_k=top_k, n_group=n_group, topk_group=topk_group)
        self.experts = HFExperts(n_experts, hidden, inter, shard, g, act)
        self.shared_experts = HFSharedMLP(hidden, shared_inter, shard, g)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        residuals = hidden_states
        orig_shape = hidden_states.shape
        topk_weights, topk_indices = self.gate(hidden_states)
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        hidden_states = self.experts(hidden_states, topk_indices, topk_weights)
        if self.shard.tp == 1:
            return hidden_states.view(*orig_shape) + self.shared_experts(residuals)
        hidden_states = hidden_states + self.shared_experts(residuals).view(-1, hidden_states.shape[-1])
        self.shard.reduce_(hidden_states)
        return hidden_states.view(*orig_shape)


#: the HF models: (mixer, forget gate lower bound, experts' activation, n_group, topk_group)
HF_KINDS = {
    "kimi_linear": ("kda", None, "silu", 1, 1),
    "deepseek_v3": ("attention", None, "silu", 4, 2),
    "kimi_k25": ("attention", None, "silu", 1, 1),
    "k3": ("kda", -5.0, "situ", 1, 1),
}


class HFDecoderLayer(nn.Module):
    """Pre-norm decoder layer: KDA (or an attention stand-in: `Mixer`) and the MoE."""

    def __init__(self, hidden: int, kind: str, shard: Shard, g: torch.Generator, heads: int, head_dim: int):
        super().__init__()
        mixer, lower_bound, act, n_group, topk_group = HF_KINDS[kind]
        self.input_layernorm = HFRMSNorm(hidden, g)
        self.self_attn = (HFDeltaAttention(hidden, heads, head_dim, shard, g, gate_lower_bound=lower_bound)
                          if mixer == "kda" else Mixer(hidden, 32, shard, g))
        self.post_attention_layernorm = HFRMSNorm(hidden, g)
        self.mlp = HFMoE(hidden, shard, g, act=act, n_group=n_group, topk_group=topk_group)

    def forward(self, hidden_states, conv_state, recurrent_state):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        if isinstance(self.self_attn, HFDeltaAttention):
            hidden_states, recurrent_state = self.self_attn(hidden_states, conv_state, recurrent_state)
        else:
            hidden_states = self.self_attn(hidden_states)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        return residual + hidden_states, recurrent_state


class HFDecodeModel(nn.Module):
    """n HF decoder layers and the final norm over hidden states [B, 1, H]: forward(x, conv_states,
    recurrent_states) -> (hidden, new recurrent states); the conv states are updated in place (HF's
    cache). Models without KDA take and return their (unused) states all the same."""

    HIDDEN, HEADS, HEAD_DIM, CONV = 32, 4, 8, 4

    def __init__(self, kind: str, tp: int = 1, rank: int = 0, n_layers: int = 2, seed: int = 13):
        super().__init__()
        g = torch.Generator().manual_seed(seed)  # every rank draws the same full weights, then shards
        shard = Shard(tp, rank)
        self.tp = tp
        self.layers = nn.ModuleList([HFDecoderLayer(self.HIDDEN, kind, shard, g, self.HEADS, self.HEAD_DIM)
                                     for _ in range(n_layers)])
        self.norm = HFRMSNorm(self.HIDDEN, g)

    def init_states(self, batch: int, seed: int = 7) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Random (conv, recurrent) states of this rank's heads, one pair per layer."""
        g = torch.Generator().manual_seed(seed)
        heads = self.HEADS // self.tp
        conv = tuple(torch.randn(batch, 3 * heads * self.HEAD_DIM, self.CONV - 1, generator=g) for _ in self.layers)
        rec = tuple(0.3 * torch.randn(batch, heads, self.HEAD_DIM, self.HEAD_DIM, generator=g) for _ in self.layers)
        return conv, rec

    def forward(self, hidden_states, conv_states, recurrent_states):
        new_states = []
        for layer, conv_state, recurrent_state in zip(self.layers, conv_states, recurrent_states):
            hidden_states, recurrent_state = layer(hidden_states, conv_state, recurrent_state)
            new_states.append(recurrent_state)
        return self.norm(hidden_states), tuple(new_states)


__all__ = ["DecodeModel", "SingleReductionMoE", "TopkRouter", "Shard", "HFDecodeModel", "HFExperts", "HFMoE",
           "HFTopkRouter", "HF_KINDS", "hf_causal_conv1d_update", "hf_recurrent_kda"]
