"""The K3 decode math, written once (docs/architecture.md "Reference model spelling").

The reference model (k3fuse/model/layers.py) computes with these functions, the rules trace them
(patterns/_pattern_tools.py re-exports them; kda_delta_rule traces `delta_rule`, kda_short_conv traces
`short_conv`, fused_routing traces `route`) and the stock sequences run them (kernels/lib/reference/stock.py). One
definition, so the model, the patterns and the fallbacks cannot drift apart: changing a function here
changes what every rule matches, so change the rules with it.

The `*_hf` functions are the same math as other people's code writes it (Hugging Face transformers'
Kimi Linear, DeepSeek-V3 and Kimi K2.5, FLA's recurrence), in forms the vocabulary cannot equate with
K3's one node at a time (a broadcast contraction for a bmm, a conv1d for a windowed sum, the
group-limited router's extra block, packed experts): the rules trace them beside K3's spellings.

A leaf module: it imports torch and k3fuse.quant (itself a leaf: the checkpoint formats'
dequantization) only, so anything may import it.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from k3fuse.quant import check_layout, dequantize, from_block_order_op

#: K3's SiTU-GLU constants: beta (the gate's tanh bound) and linear_beta (the up projection's)
K3_SITU_BETA = 4.0
K3_SITU_LINEAR_BETA = 25.0


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A projection: `F.linear(x, w)` (ATen `t` + `mm`)."""
    return F.linear(x, w)


def all_reduce_sum(t: torch.Tensor, group: "str | torch.distributed.ProcessGroup") -> torch.Tensor:
    """The functional all-reduce a row-parallel linear is followed by (all_reduce + wait_tensor);
    `group` is the c10d group name or the process group."""
    return funcol.all_reduce(t, "sum", group)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm with the variance in fp32, times the weight in fp32 (when given), back to x's dtype."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        out = out * weight.float()
    return out.to(x.dtype)


def situ(g: torch.Tensor, u: torch.Tensor, beta: float = K3_SITU_BETA,
         linear_beta: float = K3_SITU_LINEAR_BETA) -> torch.Tensor:
    """SiTU-GLU in the inputs' dtype: beta*tanh(g/beta)*sigmoid(g) * linear_beta*tanh(u/linear_beta)."""
    return beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))


def situ_glu(g: torch.Tensor, u: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """K3's SiTU-GLU: `situ` in fp32, one cast back to g's dtype."""
    return situ(g.float(), u.float(), beta, linear_beta).to(g.dtype)


def delta_rule(recurrent: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, kc: torch.Tensor,
               vc: torch.Tensor, qc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The KDA delta-rule step, fp32 state S [T, h, d_k, d_v] (key x value).

    g [T, h, d_k] per-key-channel log decay, beta [T, h] write strength, kc/qc [T, h, d_k] and
    vc [T, h, d_v]. Returns (S_new, o [T, h, d_v]). The rule `kda_delta_rule` traces this very
    function (patterns/kda_delta_rule.py; the parameter names are the match's names).
    """
    S = recurrent * torch.exp(g).unsqueeze(-1)
    e = beta.unsqueeze(-1) * (vc - torch.einsum("thkv,thk->thv", S, kc))
    S = S + kc.unsqueeze(-1) * e.unsqueeze(-2)
    o = torch.einsum("thkv,thk->thv", S, qc)
    return S, o


def delta_rule_hf(recurrent: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, kc: torch.Tensor,
                  vc: torch.Tensor, qc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`delta_rule` with both contractions a broadcast multiply and a sum over the key dim, as HF's
    `recurrent_kimi_delta_attention` (Kimi Linear) and FLA's `naive_recurrent_kda` write one step:
    `(S * k[..., None]).sum(-2)` for S^T k. The same values as `delta_rule` up to summation order."""
    S = recurrent * torch.exp(g).unsqueeze(-1)
    e = beta.unsqueeze(-1) * (vc - (S * kc.unsqueeze(-1)).sum(-2))
    S = S + kc.unsqueeze(-1) * e.unsqueeze(-2)
    o = (S * qc.unsqueeze(-1)).sum(-2)
    return S, o


def short_conv(conv_state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               conv_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA's short causal depthwise conv over [q; k; v] with a rolling window of K-1 past inputs.

    conv_state [T, C, K-1] (oldest first) in the trunk dtype, q/k/v [T, C/3], conv_weight fp32
    [C, K]. Returns (silu of the K-tap conv, fp32 [T, C]; the new state [T, C, K-1], contiguous).
    The rule `kda_short_conv` traces this very function (patterns/kda_short_conv.py).
    """
    u = torch.cat([q, k, v], dim=-1)  # [T, C]
    window = torch.cat([conv_state, u.unsqueeze(-1)], dim=-1)  # [T, C, K], newest last
    new_state = window[..., 1:].contiguous()  # the input's layout: one compiled graph per shape
    conv = F.silu((window.float() * conv_weight).sum(-1))
    return conv, new_state


def short_conv_hf(conv_state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  conv_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`short_conv` as HF's Kimi Linear decodes it (`causal_conv1d_update` over [q; k; v]).

    q/k/v [T, 1, C/3] (HF keeps a sequence dim of one), moved to [T, C, 1]; the window
    cat([conv_state, x], -1) cast to the taps' dtype; the new state its last K-1 positions (of the cast
    window: HF copies them into the state in place); the conv `F.conv1d(window, w.unsqueeze(1),
    groups=C)` over the window's K positions, one output position, then silu. conv_weight is the
    nn.Conv1d weight [C, 1, K], squeezed and unsqueezed as HF does. Returns (silu(conv) [T, C, 1] in the
    taps' dtype, new_state [T, C, K-1])."""
    x = torch.cat([q, k, v], dim=-1).transpose(1, 2)
    weight = conv_weight.squeeze(1)
    window = torch.cat([conv_state, x], dim=-1).to(weight.dtype)
    new_state = window[:, :, -conv_state.shape[-1]:]
    conv = F.conv1d(window, weight.unsqueeze(1), None, padding=0, groups=window.shape[1])
    return F.silu(conv[:, :, -x.shape[-1]:]), new_state


def use_grouped_mm(a: torch.Tensor) -> bool:
    """Route the experts through torch._grouped_mm: CUDA, Hopper or newer, a 16-bit trunk, and a
    torch that has the op (2.8+; the CPU build has no fast kernel for it)."""
    return (a.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(a.device) >= (9, 0))


def routed_experts_grouped(a: torch.Tensor, experts: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                           w2: torch.Tensor, top_k: int, beta: float, linear_beta: float) -> torch.Tensor:
    """The routed experts as serving engines run them: z [T*k, L] in pair order.

    a [T, L] latent, experts int64 [T*k] (pair p = token p // k, slot p % k), w1/w3 [E, I, L],
    w2 [E, L, I]. The pairs are sorted by expert and each projection is one grouped GEMM, so every
    selected expert's weights are read once however many tokens picked it. `offs[e]` is the end row
    of expert e's group (searchsorted keeps the shapes static, where bincount's would depend on the
    data); empty groups cost nothing.
    """
    order = torch.argsort(experts, stable=True)  # pairs grouped by expert, ties in pair order
    sorted_experts = experts.index_select(0, order)
    bounds = torch.arange(1, w1.shape[0] + 1, device=a.device, dtype=sorted_experts.dtype)
    offs = torch.searchsorted(sorted_experts, bounds, right=False).to(torch.int32)
    a_sorted = a.index_select(0, order // top_k)  # [T*k, L]
    g = torch._grouped_mm(a_sorted, w1.transpose(1, 2), offs=offs)  # [T*k, I]
    u = torch._grouped_mm(a_sorted, w3.transpose(1, 2), offs=offs)
    act = situ_glu(g, u, beta, linear_beta)
    z_sorted = torch._grouped_mm(act, w2.transpose(1, 2), offs=offs)  # [T*k, L]
    return torch.empty_like(z_sorted).index_copy(0, order, z_sorted)  # back to pair order


def routed_experts_gathered(a: torch.Tensor, experts: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                            w2: torch.Tensor, top_k: int, beta: float, linear_beta: float) -> torch.Tensor:
    """The same math as `routed_experts_grouped` by gathering each pair's expert weights and a bmm:
    one weight copy per pair (the CPU reference; fine for small test models)."""
    pairs, L = experts.shape[0], a.shape[-1]
    a_rep = a.unsqueeze(1).expand(a.shape[0], top_k, L).reshape(pairs, L, 1)
    g = torch.bmm(w1[experts], a_rep).squeeze(-1)  # [T*k, I]
    u = torch.bmm(w3[experts], a_rep).squeeze(-1)
    act = situ_glu(g, u, beta, linear_beta)
    return torch.bmm(w2[experts], act.unsqueeze(-1)).squeeze(-1)  # [T*k, L]


def routed_experts(a: torch.Tensor, experts: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                   w2: torch.Tensor, top_k: int, beta: float, linear_beta: float) -> torch.Tensor:
    """The model's routed experts: grouped GEMMs where `use_grouped_mm`, else the gathered bmm."""
    spelled = routed_experts_grouped if use_grouped_mm(a) else routed_experts_gathered
    return spelled(a, experts, w1, w3, w2, top_k, beta, linear_beta)


def routed_experts_batched_hf(a: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor, w2: torch.Tensor,
                              top_k: int, gate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The routed experts as HF's `batched_mm_experts_forward` writes them: z [T*k, L] in pair order.

    a's rows repeated top_k times (`repeat_interleave`), the packed gate/up table gate_up [E, 2I, L]
    (rows [0, I) the gate's, [I, 2I) the up projection's) gathered per pair and one bmm, its output
    split in halves (`chunk`), `gate(g, u)` (SiTU-GLU for K3: `situ_glu`), the down table w2 [E, L, I]
    gathered and a second bmm. The same math as `routed_experts_gathered` with w1 = gate_up[:, :I],
    w3 = gate_up[:, I:]."""
    x = a.repeat_interleave(top_k, dim=0)
    gu = torch.bmm(gate_up[experts], x.unsqueeze(-1)).squeeze(-1)
    g, u = gu.chunk(2, dim=-1)
    return torch.bmm(w2[experts], gate(g, u).unsqueeze(-1)).squeeze(-1)


def routed_experts_batched_ungated_hf(a: torch.Tensor, experts: torch.Tensor, w_up: torch.Tensor, w2: torch.Tensor,
                                      top_k: int, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`routed_experts_batched_hf` for ungated experts (HF's `has_gate=False`: one up table w_up
    [E, I, L], `act` on its output, e.g. Nemotron-H's relu^2)."""
    x = a.repeat_interleave(top_k, dim=0)
    h = torch.bmm(w_up[experts], x.unsqueeze(-1)).squeeze(-1)
    return torch.bmm(w2[experts], act(h).unsqueeze(-1)).squeeze(-1)


def slot_count(pairs: int | torch.SymInt, n_experts: int) -> int | torch.SymInt:
    """S = min(pairs, n_experts), the static slot count of `expert_slots`: symbolic under a dynamic
    token count; builtin min for ints, since torch 2.11's dynamo graph-breaks on torch.sym_min of two ints."""
    return torch.sym_min(pairs, n_experts) if isinstance(pairs, torch.SymInt) else min(pairs, n_experts)


def expert_slots(experts: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct experts a step uses, in static shapes: (slot_experts int64 [S], pair_slots int64 [P]).

    P = experts.shape[0] (token, slot) pairs and S = min(P, n_experts) slots. Slot j holds the j-th
    smallest distinct expert id; the slots past the distinct count hold expert 0 and no pair uses them
    (a static shape cannot shrink to the distinct count). pair_slots[p] is pair p's slot, so the
    experts' GEMMs can run over the S slot weights as if they were the whole expert table.
    """
    slots = slot_count(experts.shape[0], n_experts)
    order = torch.argsort(experts, stable=True)
    sorted_experts = experts.index_select(0, order)
    starts = F.pad(sorted_experts[1:] != sorted_experts[:-1], (1, 0), value=True)  # a new expert begins
    sorted_slots = torch.cumsum(starts, 0) - 1
    slot_experts = torch.zeros(slots, dtype=experts.dtype, device=experts.device).scatter(
        0, sorted_slots, sorted_experts)  # repeated slots write the same id
    pair_slots = torch.empty_like(sorted_slots).index_copy(0, order, sorted_slots)
    return slot_experts, pair_slots


def dequantize_experts(packed: torch.Tensor, scale: torch.Tensor, slot_experts: torch.Tensor, fmt: str,
                       dtype: torch.dtype, table: torch.Tensor | None, layout: str = "rows") -> torch.Tensor:
    """The selected experts' weights [S, out, in] in `dtype`: gather their packed weights and scales
    (`packed` [E, out, in/2 or in/8], `scale` [E, out, in/32], held in `layout`: k3fuse.quant.EXPERT_LAYOUTS),
    un-block them where the tables are in block order, then k3fuse.quant's dequantization."""
    check_layout(layout)
    packed, scale = packed.index_select(0, slot_experts), scale.index_select(0, slot_experts)
    if layout == "blocks":
        packed, scale = from_block_order_op(packed, scale)  # torch.ops.k3fuse.from_block_order: one graph node
    return dequantize(packed, scale, fmt, dtype, table=table)


def _quantized_slot_weights(a: torch.Tensor, experts: torch.Tensor, w1_packed: torch.Tensor, w1_scale: torch.Tensor,
                            w3_packed: torch.Tensor, w3_scale: torch.Tensor, w2_packed: torch.Tensor,
                            w2_scale: torch.Tensor, fmt: str, table: torch.Tensor | None, layout: str
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    slot_experts, pair_slots = expert_slots(experts, w1_packed.shape[0])
    w1 = dequantize_experts(w1_packed, w1_scale, slot_experts, fmt, a.dtype, table, layout)  # [S, I, L]
    w3 = dequantize_experts(w3_packed, w3_scale, slot_experts, fmt, a.dtype, table, layout)
    w2 = dequantize_experts(w2_packed, w2_scale, slot_experts, fmt, a.dtype, table, layout)  # [S, L, I]
    return pair_slots, w1, w3, w2


def routed_experts_quantized_grouped(a: torch.Tensor, experts: torch.Tensor, w1_packed: torch.Tensor,
                                     w1_scale: torch.Tensor, w3_packed: torch.Tensor, w3_scale: torch.Tensor,
                                     w2_packed: torch.Tensor, w2_scale: torch.Tensor, top_k: int, beta: float,
                                     linear_beta: float, fmt: str, table: torch.Tensor | None = None,
                                     layout: str = "rows") -> torch.Tensor:
    """`routed_experts_grouped` over quantized experts: z [T*k, L] in pair order.

    The packed weights and scales are the checkpoint's (k3fuse/quant.py: `fmt` "mxfp4" with `table`
    the fp32 `e2m1_table`, or "int4" with `table` None), stacked [E, out, ...], held in `layout` (the
    checkpoint's rows, or quant.block_order's blocks). The step's distinct experts (`expert_slots`) are
    gathered (and un-blocked) and dequantized to a's dtype, then the grouped GEMMs run over those slots
    exactly as `routed_experts_grouped` runs over the whole table.
    """
    pair_slots, w1, w3, w2 = _quantized_slot_weights(a, experts, w1_packed, w1_scale, w3_packed, w3_scale,
                                                     w2_packed, w2_scale, fmt, table, layout)
    return routed_experts_grouped(a, pair_slots, w1, w3, w2, top_k, beta, linear_beta)


def routed_experts_quantized_gathered(a: torch.Tensor, experts: torch.Tensor, w1_packed: torch.Tensor,
                                      w1_scale: torch.Tensor, w3_packed: torch.Tensor, w3_scale: torch.Tensor,
                                      w2_packed: torch.Tensor, w2_scale: torch.Tensor, top_k: int, beta: float,
                                      linear_beta: float, fmt: str, table: torch.Tensor | None = None,
                                      layout: str = "rows") -> torch.Tensor:
    """`routed_experts_gathered` over quantized experts: the same slot selection and dequantization as
    `routed_experts_quantized_grouped`, then one dequantized weight copy per pair and a bmm (CPU)."""
    pair_slots, w1, w3, w2 = _quantized_slot_weights(a, experts, w1_packed, w1_scale, w3_packed, w3_scale,
                                                     w2_packed, w2_scale, fmt, table, layout)
    return routed_experts_gathered(a, pair_slots, w1, w3, w2, top_k, beta, linear_beta)


def routed_experts_quantized(a: torch.Tensor, experts: torch.Tensor, w1_packed: torch.Tensor,
                             w1_scale: torch.Tensor, w3_packed: torch.Tensor, w3_scale: torch.Tensor,
                             w2_packed: torch.Tensor, w2_scale: torch.Tensor, top_k: int, beta: float,
                             linear_beta: float, fmt: str, table: torch.Tensor | None = None,
                             layout: str = "rows") -> torch.Tensor:
    """The model's quantized routed experts: the grouped form where `use_grouped_mm`, else the gathered one."""
    spelled = routed_experts_quantized_grouped if use_grouped_mm(a) else routed_experts_quantized_gathered
    return spelled(a, experts, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale, top_k, beta,
                   linear_beta, fmt, table, layout)


def moe_combine(z: torch.Tensor, weights: torch.Tensor, top_k: int) -> torch.Tensor:
    """The routed experts' weighted combine: fp32 [T, L], row t = sum over slots j of
    weights[t, j] * z[t * top_k + j].

    z [T*top_k, L] in pair order (the routed experts' output), weights fp32 [T, top_k] (`route`'s).
    The model casts the result to its trunk dtype; the rule `moe_combine` traces this function with
    that cast (patterns/moe_combine.py).
    """
    T, L = weights.shape[0], z.shape[-1]
    return (z.float().view(T, top_k, L) * weights.unsqueeze(-1)).sum(1)


#: the guard against an all-zero sum in the router's renormalisation
ROUTE_EPS = 1e-20


def route(logits: torch.Tensor, b_corr: torch.Tensor, top_k: int, routed_scaling: float,
          eps: float = ROUTE_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid router with bias-corrected top-k: the bias picks experts but never weights them.

    Returns (weights fp32 [T, k], expert ids int64 [T, k]); weights = sigma_e / sum_sel sigma,
    times routed_scaling. Ties go to torch.topk's order (identical on every rank).
    """
    scores = torch.sigmoid(logits.float())
    _, idx = torch.topk(scores + b_corr, top_k, dim=-1)
    weights = scores.gather(-1, idx)
    weights = weights / (weights.sum(-1, keepdim=True) + eps)
    return weights * routed_scaling, idx


def route_grouped_hf(logits: torch.Tensor, b_corr: torch.Tensor, top_k: int, routed_scaling: float, eps: float,
                     topk_group: int, n_group: int, fill: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`route` as HF's DeepSeek-V3 / Kimi K2.5 / Kimi Linear routers write it, group-limited top-k included.

    The E experts form n_group groups of E / n_group; a group's score is the sum of its two best biased
    scores; each token keeps its topk_group best groups and fills the others' scores with `fill`
    (HF: -inf, older code 0.0) before the final top-k (unsorted), gathered from the unbiased scores on
    dim 1. With topk_group == n_group (Kimi K2.5 and Kimi Linear: one group) every group is kept and the
    block changes nothing: the result is `route`'s. With fewer (DeepSeek-V3: 4 of 8) it is not."""
    scores = logits.sigmoid()
    choice = scores + b_corr
    per_group = choice.shape[-1] // n_group
    group_scores = choice.view(-1, n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, n_group, per_group).reshape(-1, choice.shape[-1])
    choice = choice.masked_fill(~score_mask.bool(), fill)
    idx = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, idx)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + eps)
    return weights * routed_scaling, idx


def kv_cache_slots(block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """Each sequence's slot for its newest token in a paged cache: int64 [B], `block_table[b, pos // block_size]
    * block_size + pos % block_size` with pos = seq_lens[b] - 1 (seq_lens counts the tokens after this step's
    append; block_table int32 [B, max_blocks_per_seq])."""
    pos = seq_lens.long() - 1
    block = block_table.long().gather(1, (pos // block_size).unsqueeze(1)).squeeze(1)
    return block * block_size + pos % block_size


def kv_cache_append(kv_cache: torch.Tensor, entry: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor) -> None:
    """Write each sequence's new cache entry [B, E] into its slot of `kv_cache` [num_blocks, block_size, E], in
    place: `index_put_` on the cache's flat view, which Inductor keeps in place (a graph input written where it
    lies: no copy of the cache) and torch.export records as a mutation of that input."""
    slots = kv_cache_slots(block_table, seq_lens, kv_cache.shape[1])
    kv_cache.view(-1, kv_cache.shape[-1]).index_put_((slots,), entry.to(kv_cache.dtype))


def paged_mla_attention(q: torch.Tensor, kv_cache: torch.Tensor, kv_scale: torch.Tensor, block_table: torch.Tensor,
                        seq_lens: torch.Tensor, scale: float, kv_lora: int) -> torch.Tensor:
    """Absorbed MLA decode attention over a paged latent cache, one query token per sequence.

    q [B, heads, E] = [q_lat (kv_lora) | q_sh] per head; kv_cache [num_blocks, block_size, E] holding
    [c_kv | k_sh] per token (bf16, or float8_e4m3fn times the fp32 `kv_scale`); block_table int32 [B, max_blocks];
    seq_lens int32 [B] the tokens each sequence has in the cache (lengths may differ). Scores over all E values
    times `scale`, softmax in fp32 over each sequence's first seq_lens[b] tokens, and the weighted sum of the
    first kv_lora values (c_kv): [B, heads, kv_lora] in q's dtype. The plain spelling gathers every sequence's
    blocks (max_blocks * block_size tokens) and masks the tail; a fused kernel reads only the live tokens.
    """
    B, E = q.shape[0], q.shape[-1]
    kv = kv_cache[block_table.long()].view(B, -1, E).float() * kv_scale  # [B, S, E]
    scores = torch.matmul(q.float(), kv.transpose(1, 2)) * scale  # [B, heads, S]
    position = torch.arange(kv.shape[1], device=q.device)
    scores = scores.masked_fill(position.view(1, 1, -1) >= seq_lens.view(-1, 1, 1), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, kv[..., :kv_lora]).to(q.dtype)


__all__ = ["K3_SITU_BETA", "K3_SITU_LINEAR_BETA", "ROUTE_EPS", "route", "linear", "all_reduce_sum", "rms_norm", "situ",
           "situ_glu", "delta_rule", "short_conv", "use_grouped_mm", "routed_experts", "routed_experts_grouped",
           "routed_experts_gathered", "delta_rule_hf", "short_conv_hf", "routed_experts_batched_hf",
           "routed_experts_batched_ungated_hf", "route_grouped_hf", "slot_count", "expert_slots", "dequantize_experts",
           "routed_experts_quantized",
           "routed_experts_quantized_grouped", "routed_experts_quantized_gathered", "moe_combine", "kv_cache_slots",
           "kv_cache_append", "paged_mla_attention"]
