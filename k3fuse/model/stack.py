"""The reference Kimi K3 decode stack: N x (KDA + LatentMoE) layers, one decode step per call.

`forward(x, state) -> (y, new_state)` is functional: it returns new state tensors and mutates
nothing, so torch.compile(fullgraph=True) and torch.export trace it into one graph.

What persists across decode steps is only the KDA state (recurrent fp32 state and conv window)
of each layer. The AttnRes bank and prefix sum are over depth within one step: they start from
the step's input x at layer 0 and are discarded after the final aggregation.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .. import dist as k3dist
from .config import DTYPES, K3Config
from .layers import (KDADecode, MoEBlock, TensorParallel, WeightSource, attn_res_mix, make_norm)


@dataclass(frozen=True)
class DecodeState:
    """Per-layer KDA state carried from one decode step to the next.

    recurrent[i]: [T, heads/tp, head_dim, head_dim] fp32 (key x value).
    conv[i]:      [T, 3*P/tp, conv_kernel-1] model dtype, the last inputs of the local [q; k; v].
    Registered as a pytree node, so it can be an input and an output of compiled/exported code.
    """

    recurrent: tuple[torch.Tensor, ...]
    conv: tuple[torch.Tensor, ...]


torch.export.register_dataclass(DecodeState, serialized_type_name="k3fuse.model.DecodeState")
# torch.export.load unpickles example inputs with weights_only=True: allow the state class
torch.serialization.add_safe_globals([DecodeState])


class K3DecodeLayer(nn.Module):
    """attn_norm -> KDA -> residual, moe_norm -> MoE -> residual (plain or AttnRes)."""

    def __init__(self, cfg: K3Config, layer: int, src: WeightSource, tp: TensorParallel):
        super().__init__()
        self.layer_idx = layer
        self.attn_norm = make_norm(cfg, src, layer, "attn_norm", cfg.hidden)
        self.kda = KDADecode(cfg, layer, src, tp)
        self.moe_norm = make_norm(cfg, src, layer, "moe_norm", cfg.hidden)
        self.moe = MoEBlock(cfg, layer, src, tp)
        if cfg.residual == "attnres":
            std = cfg.hidden ** -0.5  # scores w_q . RMSNorm(V_i) of order 1
            self.attn_res_query = src.param(src.normal(layer, "attn_res_query", (cfg.hidden,), std), torch.float32)
            self.moe_res_query = src.param(src.normal(layer, "moe_res_query", (cfg.hidden,), std), torch.float32)


class K3DecodeStack(nn.Module):
    """Kimi K3 reference decode model for one TP rank; x [T, H] -> final-normed hidden [T, H]."""

    def __init__(self, config: K3Config, *, tp_size: int = 1, rank: int = 0,
                 group: dist.ProcessGroup | None = None, seed: int = 0,
                 dtype: torch.dtype | str | None = None, device: torch.device | str = "cpu",
                 init_on_device: bool = False):
        super().__init__()
        config.validate_for_tp(tp_size)
        if tp_size > 1:
            group = k3dist.require_group(group)
            group_size = dist.get_world_size(group)
            if group_size != tp_size:
                raise ValueError(f"tp_size={tp_size} but the process group has {group_size} ranks")
            group_rank = dist.get_rank(group)
            if rank != group_rank:
                raise ValueError(f"rank={rank} but this process is rank {group_rank} of the group")
        elif rank != 0:
            raise ValueError(f"rank={rank} with tp_size=1; rank must be 0")
        if dtype is None:
            dtype = config.torch_dtype
        elif isinstance(dtype, str):
            if dtype not in DTYPES:
                raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)}")
            dtype = DTYPES[dtype]
        self.config = config
        self.tp_size, self.rank, self.group = tp_size, rank, group
        self.dtype = dtype
        self.device = torch.device(device)
        src = WeightSource(seed, dtype, device, on_device=init_on_device)
        tp = TensorParallel(tp_size, rank, group if tp_size > 1 else None)
        self.layers = nn.ModuleList(K3DecodeLayer(config, i, src, tp) for i in range(config.n_layers))
        self.final_norm = make_norm(config, src, -1, "final_norm", config.hidden)
        if config.residual == "attnres":
            self.final_res_query = src.param(
                src.normal(-1, "final_res_query", (config.hidden,), config.hidden ** -0.5), torch.float32)

    def init_state(self, batch: int) -> DecodeState:
        """Zero KDA states for `batch` sequences (the state before their first token)."""
        cfg = self.config
        h = cfg.kda_heads // self.tp_size
        conv_width = 3 * cfg.kda_dim // self.tp_size
        recurrent = tuple(torch.zeros(batch, h, cfg.head_dim, cfg.head_dim, dtype=torch.float32,
                                      device=self.device) for _ in range(cfg.n_layers))
        conv = tuple(torch.zeros(batch, conv_width, cfg.conv_kernel - 1, dtype=self.dtype,
                                 device=self.device) for _ in range(cfg.n_layers))
        return DecodeState(recurrent=recurrent, conv=conv)

    def export_dynamic_shapes(self, max_tokens: int = 1024) -> dict:
        """`dynamic_shapes` for torch.export.export(stack, (x, state), ...) with a dynamic token
        count T (dim 0 of x and of every state tensor). Export with T >= 2 example inputs: an
        example of T = 1 specialises the graph to one token."""
        T = torch.export.Dim("T", min=1, max=max_tokens)
        n = self.config.n_layers
        # a registered dataclass takes its dynamic_shapes as a list in field order
        return {"x": {0: T}, "state": [tuple({0: T} for _ in range(n)), tuple({0: T} for _ in range(n))]}

    def forward(self, x: torch.Tensor, state: DecodeState) -> tuple[torch.Tensor, DecodeState]:
        if self.config.residual == "attnres":
            return self._forward_attnres(x, state)
        return self._forward_plain(x, state)

    def _forward_plain(self, x: torch.Tensor, state: DecodeState) -> tuple[torch.Tensor, DecodeState]:
        recurrent, conv = [], []
        r = x
        for i, layer in enumerate(self.layers):
            y, s, c = layer.kda(layer.attn_norm(r), state.recurrent[i], state.conv[i])
            recurrent.append(s)
            conv.append(c)
            r = r + y
            h = layer.moe_norm(r)
            r = r + layer.moe(h)
        return self.final_norm(r), DecodeState(recurrent=tuple(recurrent), conv=tuple(conv))

    def _forward_attnres(self, x: torch.Tensor, state: DecodeState) -> tuple[torch.Tensor, DecodeState]:
        """Block AttnRes: the bank starts empty and the prefix sum p starts at x; at every
        block boundary (layer_idx % attn_res_block == 0, layer 0 included, so the embedding is
        the first bank entry) the pre-attention p is appended and p restarts from zero. The
        restart is spelled `zeros_like` so every sublayer output is added as `p = p + y`."""
        cfg = self.config
        eps = cfg.rms_eps
        recurrent, conv = [], []
        bank: list[torch.Tensor] = []
        p = x
        for i, layer in enumerate(self.layers):
            h = attn_res_mix(bank, p, layer.attn_res_query, eps)
            if i % cfg.attn_res_block == 0:
                bank.append(p)
                p = torch.zeros_like(p)
            y, s, c = layer.kda(layer.attn_norm(h), state.recurrent[i], state.conv[i])
            recurrent.append(s)
            conv.append(c)
            p = p + y
            h = attn_res_mix(bank, p, layer.moe_res_query, eps)
            p = p + layer.moe(layer.moe_norm(h))
        h = attn_res_mix(bank, p, self.final_res_query, eps)
        return self.final_norm(h), DecodeState(recurrent=tuple(recurrent), conv=tuple(conv))
