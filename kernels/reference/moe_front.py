"""Reference sharded MoE front: one GEMM over [router shard | latent-down shard], one all-gather.

Each rank holds rows [r*E/tp, (r+1)*E/tp) of W_r and [r*L/tp, (r+1)*L/tp) of W_down. It computes
x @ [W_r_shard; W_down_shard].T in fp32, the ranks gather their [T, E/tp + L/tp] blocks in rank
order, and the blocks are split back into router logits (fp32 [T, E]) and latent ([T, L], x.dtype).
"""
from __future__ import annotations

import torch

from .collectives import accumulation_dtype, all_gather_last_dim


def moe_front_sharded(x: torch.Tensor, router_w_shard: torch.Tensor, down_w_shard: torch.Tensor,
                      group_name: str, world_size: int, max_tokens: int = 64
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    acc = accumulation_dtype(x, router_w_shard, down_w_shard)
    e_shard = router_w_shard.shape[0]
    fused_w = torch.cat([router_w_shard.to(acc), down_w_shard.to(acc)], dim=0)
    local = x.to(acc) @ fused_w.T                                   # [T, E/tp + L/tp]
    gathered = all_gather_last_dim(local, group_name, world_size)  # [T, tp * (E/tp + L/tp)]
    blocks = gathered.unflatten(-1, (world_size, fused_w.shape[0]))
    logits = blocks[..., :e_shard].flatten(-2)
    latent = blocks[..., e_shard:].flatten(-2)
    return logits.to(torch.float32).contiguous(), latent.to(x.dtype).contiguous()
