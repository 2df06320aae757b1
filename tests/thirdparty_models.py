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


__all__ = ["DecodeModel", "SingleReductionMoE", "TopkRouter", "Shard"]
