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

import math
import zlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

# the K3 math, written once (rms_norm, situ_glu, delta_rule are this module's names too: the rules
# and the tests import them from here)
from .. import quant
from ..spelling import (all_reduce_sum, delta_rule, moe_combine, rms_norm, route, routed_experts,
                        routed_experts_quantized, short_conv, situ_glu)
from .config import K3Config

#: the spread of the drawn E8M0 exponents around their centre (-1, 0, +1) and of int4 scales (x0.5 to x1.5)
_EXPONENT_SPREAD = 1
_INT4_SCALE_SPREAD = 0.5
#: RMS of a uniformly drawn code: E2M1 (mean square of the 16 values 8.5625) times the exponent spread
#: (mean square of 2^-1, 1, 2: 1.75); int4 q in [-8, 7] (mean square 21.5) times the scale spread (13/12)
_MXFP4_CODE_RMS = (8.5625 * 1.75) ** 0.5
_INT4_CODE_RMS = (21.5 * 13 / 12) ** 0.5


# --- weights ------------------------------------------------------------------------------------
class WeightSource:
    """Deterministic random weights: each FULL tensor comes from its own generator seeded by
    (seed, layer, name), then each rank slices its shard. TP=1/2/4 models are the same function.

    `on_device=True` draws on the model's CUDA device instead of the CPU: seconds instead of
    minutes for K3 widths (benchmarks), but other numbers than the CPU draw for the same seed."""

    def __init__(self, seed: int, dtype: torch.dtype, device: torch.device | str, on_device: bool = False):
        self.seed = int(seed)
        self.dtype = dtype
        self.device = torch.device(device)
        self.draw_device = self.device if on_device and self.device.type == "cuda" else torch.device("cpu")

    def _generator(self, layer: int, name: str) -> torch.Generator:
        key = zlib.crc32(f"k3fuse/{self.seed}/{layer}/{name}".encode())
        return torch.Generator(self.draw_device).manual_seed((self.seed * 1_000_003 + key) % (2**63))

    def normal(self, layer: int, name: str, shape: tuple[int, ...], std: float,
               mean: float = 0.0) -> torch.Tensor:
        """Full fp32 tensor on the draw device (or an empty meta tensor on the meta device)."""
        if self.device.type == "meta":
            return torch.empty(shape, device="meta")
        t = torch.randn(shape, generator=self._generator(layer, name), dtype=torch.float32,
                        device=self.draw_device)
        return t * std + mean

    def uniform(self, layer: int, name: str, shape: tuple[int, ...], low: float,
                high: float) -> torch.Tensor:
        if self.device.type == "meta":
            return torch.empty(shape, device="meta")
        t = torch.rand(shape, generator=self._generator(layer, name), dtype=torch.float32,
                       device=self.draw_device)
        return low + (high - low) * t

    def experts_normal(self, layer: int, name: str, n_experts: int, shape: tuple[int, int], std: float,
                       shard_dim: int, tp_size: int, rank: int) -> nn.Parameter:
        """Experts [E, *shape] in the model dtype, sharded along `shard_dim` of each expert's shape.

        Drawn one expert at a time from the tensor's generator (fp32 temporaries of one expert, never
        of the whole table), so every rank sees the same full experts and keeps its slice.
        """
        local = list(shape)
        local[shard_dim] //= tp_size
        out = torch.empty((n_experts, *local), dtype=self.dtype, device=self.device)
        if self.device.type != "meta":
            g = self._generator(layer, name)
            for e in range(n_experts):
                full = torch.randn(shape, generator=g, dtype=torch.float32, device=self.draw_device)
                out[e].copy_(shard(full * std, shard_dim, tp_size, rank))
        return nn.Parameter(out, requires_grad=False)

    def experts_quantized(self, layer: int, name: str, fmt: str, n_experts: int, shape: tuple[int, int],
                          std: float, shard_dim: int, tp_size: int, rank: int, layout: str = "rows"
                          ) -> tuple[nn.Parameter, nn.Parameter]:
        """(weight_packed, weight_scale) of E experts of `shape` [out, in] in `fmt`, the layout of
        k3fuse/quant.py, each sharded along `shard_dim` (0: rows; 1: the input width, in whole groups),
        then held in `layout` (quant.to_layout: the same draws, repacked in block order for "blocks").

        Drawn directly in the packed layout, one expert at a time: uniform codes (random bytes or
        int32 words) and scales around the power of two (MXFP4) or the value (int4) that gives the
        dequantized weights an RMS near `std`. No float temporary of the weights is ever built.
        """
        rows, cols = shape
        p_shape, s_shape = quant.packed_shape(fmt, rows, cols), quant.scale_shape(fmt, rows, cols)
        p_dtype, s_dtype = quant.packed_dtype(fmt), quant.scale_dtype(fmt)

        def local(full: tuple[int, int]) -> tuple[int, ...]:
            dims = list(full)
            dims[shard_dim] //= tp_size
            return (n_experts, *dims)

        packed = torch.empty(local(p_shape), dtype=p_dtype, device=self.device)
        scale = torch.empty(local(s_shape), dtype=s_dtype, device=self.device)
        if self.device.type != "meta":
            g_packed = self._generator(layer, f"{name}.weight_packed")
            g_scale = self._generator(layer, f"{name}.weight_scale")
            draw = {"dtype": p_dtype, "device": self.draw_device, "generator": g_packed}
            for e in range(n_experts):
                if fmt == "mxfp4":
                    codes = torch.randint(0, 256, p_shape, **draw)
                    centre = quant.E8M0_BIAS + round(math.log2(std / _MXFP4_CODE_RMS))
                    s = torch.randint(centre - _EXPONENT_SPREAD, centre + _EXPONENT_SPREAD + 1, s_shape,
                                      generator=g_scale, dtype=torch.int32, device=self.draw_device).to(s_dtype)
                else:
                    codes = torch.randint(-2 ** 31, 2 ** 31, p_shape, **draw)
                    u = torch.rand(s_shape, generator=g_scale, dtype=torch.float32, device=self.draw_device)
                    s = (std / _INT4_CODE_RMS * (1 + _INT4_SCALE_SPREAD * (2 * u - 1))).to(s_dtype)
                held = quant.to_layout(shard(codes, shard_dim, tp_size, rank)[None],
                                       shard(s, shard_dim, tp_size, rank)[None], layout)
                packed[e].copy_(held[0][0])
                scale[e].copy_(held[1][0])
        return nn.Parameter(packed, requires_grad=False), nn.Parameter(scale, requires_grad=False)

    def param(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> nn.Parameter:
        """A frozen parameter in `dtype` (the model dtype unless told, e.g. fp32 vectors)."""
        # clone: a shard must not keep the full tensor's storage alive
        t = t.to(device=self.device, dtype=dtype or self.dtype).clone(memory_format=torch.contiguous_format)
        return nn.Parameter(t, requires_grad=False)


def shard(t: torch.Tensor, dim: int, tp_size: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s contiguous 1/tp_size slice of `t` along `dim`."""
    size = t.shape[dim] // tp_size
    return t.narrow(dim, rank * size, size)


# --- shared pieces ------------------------------------------------------------------------------
class TensorParallel:
    """Who this module is in the TP group; `all_reduce` is the identity at tp=1."""

    def __init__(self, tp_size: int, rank: int, group: dist.ProcessGroup | None):
        self.tp_size = tp_size
        self.rank = rank
        self.group = group

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return t
        return all_reduce_sum(t, self.group)


class RMSNorm(nn.Module):
    def __init__(self, weight: nn.Parameter, eps: float):
        super().__init__()
        self.weight = weight
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def make_norm(cfg: K3Config, src: WeightSource, layer: int, name: str, width: int) -> RMSNorm:
    """RMSNorm with weight 1 + small noise, so a wrong weight shows up in tests."""
    return RMSNorm(src.param(src.normal(layer, name, (width,), std=0.1, mean=1.0)), cfg.rms_eps)


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
        H, P, R, h, d, K = (cfg.hidden, cfg.kda_dim, cfg.gate_rank, cfg.kda_heads, cfg.head_dim,
                            cfg.conv_kernel)
        n, r = tp.tp_size, tp.rank
        self.local_heads = h // n

        def col(name: str, rows: int, cols: int) -> nn.Parameter:
            """Column-parallel weight: this rank's rows of the full [rows, cols] matrix."""
            return src.param(shard(src.normal(layer, name, (rows, cols), cols ** -0.5), 0, n, r))

        self.w_q = col("kda.w_q", P, H)
        self.w_k = col("kda.w_k", P, H)
        self.w_v = col("kda.w_v", P, H)
        self.w_g = col("kda.w_g", P, H)
        self.w_fa = src.param(src.normal(layer, "kda.w_fa", (R, H), H ** -0.5))  # replicated
        self.w_fb = col("kda.w_fb", P, R)
        self.w_b = col("kda.w_b", h, H)
        # fp32 vectors
        self.dt_bias = src.param(shard(src.normal(layer, "kda.dt_bias", (P,), 0.5), 0, n, r), torch.float32)
        self.A_log = src.param(shard(src.uniform(layer, "kda.A_log", (h,), math.log(0.5), math.log(2.0)), 0, n, r),
                               torch.float32)
        conv = [shard(src.normal(layer, f"kda.conv_{c}", (P, K), 0.5), 0, n, r) for c in "qkv"]
        self.conv_weight = src.param(torch.cat(conv, 0), torch.float32)  # [3P/tp, K], local [q;k;v]
        self.w_onorm = src.param(src.normal(layer, "kda.w_onorm", (d,), 0.1, 1.0), torch.float32)
        self.w_o = src.param(shard(src.normal(layer, "kda.w_o", (H, P), P ** -0.5), 1, n, r))  # row-parallel

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
        # spelling patterns/kda_conv_rule.py traces)
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
        self.w_r = src.param(src.normal(layer, "moe.w_r", (cfg.n_experts, cfg.hidden), cfg.hidden ** -0.5))
        self.b_corr = src.param(src.normal(layer, "moe.b_corr", (cfg.n_experts,), 0.05), torch.float32)

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
        E, H, L, I = cfg.n_experts, cfg.hidden, cfg.latent, cfg.moe_inter
        n, r = tp.tp_size, tp.rank
        self.router = Router(cfg, layer, src)
        self.w_down = src.param(src.normal(layer, "moe.w_down", (L, H), H ** -0.5))  # replicated
        self.expert_format = cfg.expert_format
        self.expert_layout = cfg.expert_layout
        # w1/w3 [E, I, L] split by rows (I), w2 [E, L, I] by its input width (I)
        experts = {"w1": ((I, L), L ** -0.5, 0), "w3": ((I, L), L ** -0.5, 0), "w2": ((L, I), I ** -0.5, 1)}
        if cfg.quantized_experts:
            cfg.check_expert_layout(n)
            for proj, (shape, std, dim) in experts.items():
                packed, scale = src.experts_quantized(layer, f"moe.{proj}", cfg.expert_format, E, shape, std,
                                                      dim, n, r, cfg.expert_layout)
                setattr(self, f"{proj}_packed", packed)
                setattr(self, f"{proj}_scale", scale)
            # MXFP4's nibble -> value table, an input of the spelling (not a checkpoint tensor)
            table = quant.e2m1_table(src.device) if cfg.expert_format == "mxfp4" else None
            self.register_buffer("e2m1_table", table, persistent=False)
        else:
            for proj, (shape, std, dim) in experts.items():
                setattr(self, proj, src.experts_normal(layer, f"moe.{proj}", E, shape, std, dim, n, r))
        self.latent_norm = make_norm(cfg, src, layer, "moe.latent_norm", L)
        self.w_up = src.param(src.normal(layer, "moe.w_up", (H, L), L ** -0.5))  # replicated

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
        if cfg.quantized_experts:
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
        H, S = cfg.hidden, cfg.shared_inter
        n, r = tp.tp_size, tp.rank
        self.w_gate = src.param(shard(src.normal(layer, "shared.w_gate", (S, H), H ** -0.5), 0, n, r))
        self.w_up = src.param(shard(src.normal(layer, "shared.w_up", (S, H), H ** -0.5), 0, n, r))
        self.w_down = src.param(shard(src.normal(layer, "shared.w_down", (H, S), S ** -0.5), 1, n, r))

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
