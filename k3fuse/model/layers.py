"""Sublayers of the reference Kimi K3 decode layer, written in the ATen spelling the rules match.

See docs/architecture.md "Reference model spelling": projections are `F.linear`, RMSNorm computes
its variance in fp32, and every row-parallel linear is followed directly by a functional
`all_reduce` (only when tp > 1) and then the add. Changing the spelling here changes what the
compiler rules see, so change both together.

Sharding follows the serving engines: KDA q/k/v/g/f_b/b column-parallel by heads, W_fa
replicated, W_o row-parallel; router, W_down and W_up replicated; routed experts split along the
intermediate width (latent partial sum reduced before the latent norm); shared experts
column/row-parallel. Routed experts in `mxfp4` or `int4` are stored as the checkpoint stores them
(k3fuse/quant.py: packed weights and group scales, each rank its slice of the intermediate width)
and dequantized by the step's spelling.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

# the K3 math, written once (rms_norm, situ_glu, delta_rule are this module's names too: the rules
# and the tests import them from here)
from .. import quant
from ..spelling import (all_reduce_sum, delta_rule, kv_cache_append, moe_combine, paged_mla_attention, rms_norm, route,
                        routed_experts, routed_experts_quantized, short_conv, situ_glu)
from . import params
from .config import K3Config
from .weights import NORM_INIT, ParamSpec, WeightSource, shard  # noqa: F401  (WeightSource, shard: re-exported)


def build(module: nn.Module, specs: list[ParamSpec], cfg: K3Config, src: WeightSource, layer: int,
          tp: "TensorParallel") -> None:
    """Give `module` the parameters of `specs` (params.py), each rank's slice drawn by `src`; a dotted name
    ("latent_norm.weight") is the weight of an RMSNorm submodule. Routed experts (dtype "expert") are LatentMoE's."""
    for spec in specs:
        if spec.dtype == "expert":
            continue
        p = src.build(spec, layer, tp.tp_size, tp.rank)
        if "." in spec.name:
            sub, _, leaf = spec.name.partition(".")
            if leaf != "weight":
                raise ValueError(f"parameter spec {spec.name!r}: only an RMSNorm's weight may be nested")
            setattr(module, sub, RMSNorm(p, cfg.rms_eps))
        else:
            setattr(module, spec.name, p)


# --- shared pieces ------------------------------------------------------------------------------
#: the functional all-gather along a dim (torch 2.13 renamed all_gather_tensor, which still works but warns)
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


class TensorParallel:
    """Who this module is in the TP group, and its collectives: identity at tp=1.

    `standin` (one rank of a TP N deployment run alone, `--as-rank R --of N`): the rank's slice of every
    sharded width, but no process group; each collective is a local stand-in of the same shape (an
    all-reduce returns its input, a gather tiles this rank's slice), so the step is one rank's compute."""

    def __init__(self, tp_size: int, rank: int, group: dist.ProcessGroup | None, standin: bool = False):
        if standin and group is not None:
            raise ValueError("a stand-in TP rank runs without a process group")
        self.tp_size = tp_size
        self.rank = rank
        self.group = group
        self.standin = standin

    @property
    def collectives(self) -> bool:
        """The step really runs collectives (TP > 1 with a group)."""
        return self.tp_size > 1 and not self.standin

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if not self.collectives:
            return t
        return all_reduce_sum(t, self.group)

    def all_gather_last(self, t: torch.Tensor) -> torch.Tensor:
        """[T, n] per rank -> [T, n * tp], the ranks' slices in rank order (the vocab-parallel logits)."""
        if self.tp_size == 1:
            return t
        if self.standin:
            return t.repeat(1, self.tp_size)
        gathered = _all_gather(t.contiguous(), 0, self.group)  # [tp * T, n]
        T, n = t.shape
        return gathered.view(self.tp_size, T, n).permute(1, 0, 2).reshape(T, self.tp_size * n)


class RMSNorm(nn.Module):
    def __init__(self, weight: nn.Parameter, eps: float):
        super().__init__()
        self.weight = weight
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def make_norm(cfg: K3Config, src: WeightSource, layer: int, name: str, width: int) -> RMSNorm:
    """RMSNorm with weight 1 + small noise, so a wrong weight shows up in tests (replicated: TP-free)."""
    spec = ParamSpec("weight", "", (width,), "replicated", NORM_INIT, name)
    return RMSNorm(src.build(spec, layer, 1, 0), cfg.rms_eps)


# --- KDA ----------------------------------------------------------------------------------------
class KDADecode(nn.Module):
    """One recurrent Kimi Delta Attention decode step for T sequences (one token each).

    Inputs x [T, H]; recurrent state [T, h/tp, d, d] fp32 (key x value); conv state
    [T, 3P/tp, K-1] in the model dtype holding the last K-1 pre-conv inputs of [q; k; v].
    Returns the all-reduced out-projection [T, H] and the NEW states (inputs are not mutated).
    """

    def __init__(self, cfg: K3Config, layer: int, src: WeightSource, tp: TensorParallel):
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        self.local_heads = cfg.kda_heads // tp.tp_size
        build(self, params.kda_params(cfg), cfg, src, layer, tp)

    def forward(self, x: torch.Tensor, recurrent: torch.Tensor, conv_state: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        T = x.shape[0]
        h, d = self.local_heads, cfg.head_dim
        q = F.linear(x, self.w_q)
        k = F.linear(x, self.w_k)
        v = F.linear(x, self.w_v)
        gate_out = F.linear(x, self.w_g)
        z = F.linear(F.linear(x, self.w_fa), self.w_fb).float() + self.dt_bias
        b = F.linear(x, self.w_b).float()

        # short causal depthwise conv over [q; k; v] with a rolling window of K-1 past inputs (the
        # spelling patterns/kda_short_conv.py traces)
        conv, new_conv_state = short_conv(conv_state, q, k, v, self.conv_weight)  # fp32 [T, 3P/tp]
        qc, kc, vc = conv.view(T, 3, h, d).unbind(1)  # each [T, h, d]
        qc = qc * torch.rsqrt(qc.pow(2).sum(-1, keepdim=True) + cfg.l2_eps) * d ** -0.5
        kc = kc * torch.rsqrt(kc.pow(2).sum(-1, keepdim=True) + cfg.l2_eps)

        # gates: lower-bounded per-key-channel decay and per-head write strength
        g = cfg.gate_lower_bound * torch.sigmoid(torch.exp(self.A_log).unsqueeze(-1) * z.view(T, h, d))
        beta = torch.sigmoid(b)  # [T, h]

        # delta rule, fp32 state S [T, h, d_k, d_v] (the spelling patterns/kda_delta_rule.py traces)
        S, o = delta_rule(recurrent, g, beta, kc, vc, qc)

        # gated RMSNorm per head, then the row-parallel out-projection and its reduction
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + cfg.rms_eps) * self.w_onorm
        o = o * torch.sigmoid(gate_out.float().view(T, h, d))
        o = o.reshape(T, h * d).to(x.dtype)
        y = F.linear(o, self.w_o)
        y = self.tp.all_reduce(y)
        return y, S, new_conv_state


# --- MoE ----------------------------------------------------------------------------------------
class Router(nn.Module):
    """Replicated router: fp32 logits F.linear(x.float(), W_r.float()) [T, E], then `route`."""

    def __init__(self, cfg: K3Config, layer: int, src: WeightSource):
        super().__init__()
        self.cfg = cfg
        build(self, params.router_params(cfg), cfg, src, layer, TensorParallel(1, 0, None))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.w_r.float())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(self.logits(x), self.b_corr, self.cfg.top_k, self.cfg.routed_scaling)


class LatentMoE(nn.Module):
    """Routed experts in latent space: a = W_down x; r = sum_e w_e W2_e SiTU(W1_e a, W3_e a);
    all_reduce(r) (each rank holds a slice of the expert intermediate); y = W_up RMSNorm_L(r).

    The experts are `routed_experts` of k3fuse/spelling.py over the T*top_k (token, slot) pairs:
    grouped GEMMs on CUDA (bf16/fp16, torch._grouped_mm available), a gathered bmm elsewhere; both
    with static shapes (no data-dependent control flow, which torch.compile(fullgraph) and
    torch.export need). Quantized experts (`expert_format` mxfp4 / int4) are `w1_packed`/`w1_scale`
    etc. in k3fuse/quant.py's layout, held as `expert_layout` says (the checkpoint's rows, or repacked in
    block order), and run `routed_experts_quantized`: the step's experts are gathered (un-blocked),
    dequantized, and the same grouped or gathered GEMMs follow.
    """

    def __init__(self, cfg: K3Config, layer: int, src: WeightSource, tp: TensorParallel):
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        E, n, r = cfg.n_experts, tp.tp_size, tp.rank
        self.router = Router(cfg, layer, src)
        build(self, params.latent_params(cfg), cfg, src, layer, tp)
        #: (module, a [T, L], experts [T*k]) -> z [T*k, L] in place of the model's spelling (bench's peer arm)
        self.experts_override: Callable[[LatentMoE, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        self.expert_format = cfg.expert_format
        self.expert_layout = cfg.expert_layout
        # w1/w3 [E, I, L] split by rows (I), w2 [E, L, I] by its input width (I)
        experts = [(spec.name, spec.shape[1:], spec.init.b, spec.shard_dim - 1) for spec in params.expert_params(cfg)]
        if cfg.quantized_experts:
            cfg.check_expert_layout(n)
            for proj, shape, std, dim in experts:
                packed, scale = src.experts_quantized(layer, f"moe.{proj}", cfg.expert_format, E, shape, std,
                                                      dim, n, r, cfg.expert_layout)
                setattr(self, f"{proj}_packed", packed)
                setattr(self, f"{proj}_scale", scale)
            # MXFP4's nibble -> value table, an input of the spelling (not a checkpoint tensor)
            table = quant.e2m1_table(src.device) if cfg.expert_format == "mxfp4" else None
            self.register_buffer("e2m1_table", table, persistent=False)
        else:
            for proj, shape, std, dim in experts:
                setattr(self, proj, src.experts_normal(layer, f"moe.{proj}", E, shape, std, dim, n, r))

    def quantized_weight(self, proj: str) -> quant.QuantizedWeight:
        """Expert projection `proj` ("w1", "w3", "w2") in the checkpoint's layout, [E, out, ...] packed with its
        scales (a copy where the model holds them in block order)."""
        if not self.cfg.quantized_experts:
            raise ValueError(f"the routed experts are stored in {self.expert_format}, not quantized")
        packed, scale = quant.from_layout(getattr(self, f"{proj}_packed"), getattr(self, f"{proj}_scale"),
                                          self.expert_layout)
        columns = packed.shape[-1] * (quant.FP4_PER_BYTE if self.expert_format == "mxfp4" else quant.INT4_PER_WORD)
        return quant.QuantizedWeight(packed, scale, self.expert_format, columns)

    def store_expert(self, proj: str, expert: int, packed: torch.Tensor, scale: torch.Tensor) -> None:
        """Copy one expert's `proj` tables, given in the checkpoint's layout ([out, ...] each, this rank's
        slice), into the model's, held in its expert_layout."""
        held = quant.to_layout(packed[None], scale[None], self.expert_layout)
        with torch.no_grad():
            getattr(self, f"{proj}_packed")[expert].copy_(held[0][0])
            getattr(self, f"{proj}_scale")[expert].copy_(held[1][0])

    def expert_weights(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1, w3, w2) of every expert, [E, I/tp, L] and [E, L, I/tp], in `dtype` (the model's unless
        told): the stored bf16 tensors, or the quantized ones dequantized (exact in fp32 and float64)."""
        if not self.cfg.quantized_experts:
            return tuple(getattr(self, p).to(dtype or self.w1.dtype) for p in ("w1", "w3", "w2"))  # type: ignore
        dtype = dtype or self.w_down.dtype
        return tuple(self.quantized_weight(p).dequantize(dtype) for p in ("w1", "w3", "w2"))  # type: ignore

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        k = cfg.top_k
        weights, idx = self.router(x)
        a = F.linear(x, self.w_down)  # [T, L]
        experts = idx.reshape(-1)  # [T*k], pair p = (token p // k, slot p % k)
        if self.experts_override is not None:  # a benchmark's peer runs the experts its own way
            z = self.experts_override(self, a, experts)
        elif cfg.quantized_experts:
            z = routed_experts_quantized(a, experts, self.w1_packed, self.w1_scale, self.w3_packed, self.w3_scale,
                                         self.w2_packed, self.w2_scale, k, cfg.situ_beta, cfg.situ_linear_beta,
                                         self.expert_format, self.e2m1_table, self.expert_layout)
        else:
            z = routed_experts(a, experts, self.w1, self.w3, self.w2, k, cfg.situ_beta, cfg.situ_linear_beta)
        # the weighted combine over the slots (the spelling patterns/moe_combine.py traces)
        partial = moe_combine(z, weights, k).to(x.dtype)
        r = self.tp.all_reduce(partial)
        r = self.latent_norm(r)
        return F.linear(r, self.w_up)


class SharedExperts(nn.Module):
    """The fused shared experts: gate/up column-parallel, down row-parallel, then all_reduce."""

    def __init__(self, cfg: K3Config, layer: int, src: WeightSource, tp: TensorParallel):
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        build(self, params.shared_params(cfg), cfg, src, layer, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = F.linear(x, self.w_gate)
        u = F.linear(x, self.w_up)
        h = situ_glu(g, u, self.cfg.situ_beta, self.cfg.situ_linear_beta)
        y = F.linear(h, self.w_down)
        return self.tp.all_reduce(y)


class MoEBlock(nn.Module):
    """MoE(x) = routed LatentMoE(x) + shared experts(x)."""

    def __init__(self, cfg: K3Config, layer: int, src: WeightSource, tp: TensorParallel):
        super().__init__()
        self.routed = LatentMoE(cfg, layer, src, tp)
        self.shared = SharedExperts(cfg, layer, src, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y_routed = self.routed(x)
        y_sh = self.shared(x)
        return y_routed + y_sh


# --- gated NoPE MLA -------------------------------------------------------------------------------
class MLADecode(nn.Module):
    """K3's gated NoPE multi-head latent attention, one decode token per sequence, absorbed form over a paged
    latent cache (shared/docs/reference/k3-model.md 2.4).

    c_q = RMSNorm(W_qa x); per head [q_nope | q_sh] = W_qb c_q; [c_kv | k_sh] = W_kva x, c_kv = RMSNorm(c_kv);
    the cache entry [c_kv | k_sh] is appended in place; q_lat = W_UK^T q_nope (W_UK, W_UV: views of W_kvb);
    o_lat = attention of [q_lat | q_sh] over the cache (spelling.paged_mla_attention); o = W_UV o_lat, gated by
    sigmoid(W_g x); y = all_reduce(W_o o). Heads are split by TP (W_qb, W_kvb, W_g column, W_o row); W_qa, W_kva
    and the cache are replicated. No RoPE anywhere (mla_use_nope): the 64-wide shared key is cached as is.
    """

    def __init__(self, cfg: K3Config, layer: int, src: WeightSource, tp: TensorParallel):
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        self.local_heads = cfg.mla_heads // tp.tp_size
        build(self, params.mla_params(cfg), cfg, src, layer, tp)

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [h, qk_nope, kv_lora], W_UV [h, v_head, kv_lora]): this rank's heads of W_kvb, as views."""
        cfg = self.cfg
        w = self.w_kv_b.view(self.local_heads, cfg.qk_nope + cfg.v_head, cfg.kv_lora)
        return w[:, :cfg.qk_nope], w[:, cfg.qk_nope:]

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor, kv_scale: torch.Tensor, block_table: torch.Tensor,
                seq_lens: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        T, h = x.shape[0], self.local_heads
        c_q = self.q_a_norm(F.linear(x, self.w_q_a))
        q = F.linear(c_q, self.w_q_b).view(T, h, cfg.qk_nope + cfg.qk_shared)
        q_nope, q_sh = q.split([cfg.qk_nope, cfg.qk_shared], dim=-1)
        c_kv, k_sh = F.linear(x, self.w_kv_a).split([cfg.kv_lora, cfg.qk_shared], dim=-1)
        entry = torch.cat([self.kv_a_norm(c_kv), k_sh], dim=-1)  # [T, kv_lora + qk_shared]
        if kv_cache.dtype == torch.float8_e4m3fn:
            entry = entry.float() / kv_scale
        kv_cache_append(kv_cache, entry, block_table, seq_lens)
        w_uk, w_uv = self.absorbed_weights()
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, h, kv_lora]
        o_lat = paged_mla_attention(torch.cat([q_lat, q_sh], dim=-1), kv_cache, kv_scale, block_table, seq_lens,
                                    cfg.mla_scale, cfg.kv_lora)
        o = torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [T, h, v_head]
        gate = F.linear(x, self.w_g).view(T, h, cfg.v_head)
        o = (o.float() * torch.sigmoid(gate.float())).reshape(T, h * cfg.v_head).to(x.dtype)
        return self.tp.all_reduce(F.linear(o, self.w_o))


# --- layer 1's dense MLP, the embedding and the head ---------------------------------------------
class DenseMLP(nn.Module):
    """The dense SiTU-GLU MLP of the first layer(s): gate/up column-parallel, down row-parallel, all_reduce."""

    def __init__(self, cfg: K3Config, layer: int, src: WeightSource, tp: TensorParallel):
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        build(self, params.dense_mlp_params(cfg), cfg, src, layer, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = situ_glu(F.linear(x, self.w_gate), F.linear(x, self.w_up), self.cfg.situ_beta, self.cfg.situ_linear_beta)
        return self.tp.all_reduce(F.linear(h, self.w_down))


class VocabEmbedding(nn.Module):
    """Vocab-parallel embedding: rank r holds rows [r V/tp, (r+1) V/tp); ids outside are zero rows, summed by an
    all_reduce. A stand-in rank (no group) looks every id up in its own rows (id mod V/tp): one rank's work."""

    def __init__(self, weight: nn.Parameter, tp: TensorParallel):
        super().__init__()
        self.weight = weight
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.shape[0]
        if self.tp.tp_size == 1:
            return F.embedding(ids, self.weight)
        if self.tp.standin:
            return F.embedding(ids % rows, self.weight)
        local = ids - self.tp.rank * rows
        inside = (local >= 0) & (local < rows)
        emb = F.embedding(torch.where(inside, local, 0), self.weight)
        return self.tp.all_reduce(torch.where(inside.unsqueeze(-1), emb, 0.0).to(emb.dtype))


class LMHead(nn.Module):
    """Vocab-parallel LM head: this rank's logits [T, V/tp] in the trunk dtype, gathered to [T, V], in fp32."""

    def __init__(self, weight: nn.Parameter, tp: TensorParallel):
        super().__init__()
        self.weight = weight
        self.tp = tp

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_last(F.linear(h, self.weight)).float()


# --- Block Attention Residuals --------------------------------------------------------------------
def attn_res_mix(bank: list[torch.Tensor], partial: torch.Tensor, query: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """Depth softmax over [bank..., partial]: s_i = w_q . RMSNorm(V_i); h = sum_i alpha_i V_i (fp32).

    The key norm has no weight of its own: it folds into the pseudo-query w_q.
    """
    V = torch.stack(bank + [partial], dim=0).float()  # [n, T, H]
    keys = V * torch.rsqrt(V.pow(2).mean(-1, keepdim=True) + eps)
    scores = (keys * query.float()).sum(-1)  # [n, T]
    alpha = torch.softmax(scores, dim=0)
    return (alpha.unsqueeze(-1) * V).sum(0).to(partial.dtype)


def attn_res_mix_bank(bank: torch.Tensor, partial: torch.Tensor, query: torch.Tensor, mask: torch.Tensor,
                      eps: float) -> torch.Tensor:
    """`attn_res_mix` over a fixed bank: bank [n, T, H] (entry i valid where mask[i] == 0, -inf where not yet
    written this step), partial [T, H]. The same depth softmax (fp32), with the unwritten entries' weights
    exactly 0, so one compiled layer step serves every layer whatever its place in its AttnRes block."""
    def score(v: torch.Tensor) -> torch.Tensor:
        return (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * query.float()).sum(-1)

    vb, vp = bank.float(), partial.float()
    scores = torch.cat([score(vb) + mask.unsqueeze(-1), score(vp).unsqueeze(0)], dim=0)  # [n + 1, T]
    alpha = torch.softmax(scores, dim=0).unsqueeze(-1)
    return ((alpha[:-1] * vb).sum(0) + alpha[-1] * vp).to(partial.dtype)
