"""Reference sharded MoE front: one GEMM over [router shard | latent-down shard], one all-gather.

The op receives the FULL replicated W_r [E, H] and W_down [L, H]; rank r (its rank in the group,
read at run time, so one rewritten graph serves every rank) takes rows [r*E/tp, (r+1)*E/tp) of W_r
and [r*L/tp, (r+1)*L/tp) of W_down as views (no copy), computes x @ [W_r_shard; W_down_shard].T in
fp32, the ranks gather their [T, E/tp + L/tp] blocks in rank order, and the blocks are split back
into router logits (fp32 [T, E]) and latent ([T, L], x.dtype).
Router-only form (down_w None, models without a latent projection): the same with no latent rows;
the latent output is an empty [T, 0] tensor.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .collectives import accumulation_dtype, all_gather_last_dim, process_group


def rank_rows(w: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's contiguous 1/world_size block of rows of `w` (a view)."""
    if w.shape[0] % world_size:
        raise ValueError(f"k3fuse moe_front_sharded: {w.shape[0]} rows not divisible by world_size {world_size}")
    rows = w.shape[0] // world_size
    return w.narrow(0, rank * rows, rows)


def moe_front_sharded(x: torch.Tensor, router_w: torch.Tensor, down_w: torch.Tensor | None,
                      group_name: str, world_size: int, max_tokens: int = 64
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    group = process_group(group_name, world_size)
    rank = dist.get_rank(group) if group is not None else 0
    router_w_shard = rank_rows(router_w, rank, world_size)
    down_w_shard = rank_rows(down_w, rank, world_size) if down_w is not None else router_w_shard[:0]
    acc = accumulation_dtype(x, router_w_shard, down_w_shard)
    e_shard = router_w_shard.shape[0]
    fused_w = torch.cat([router_w_shard.to(acc), down_w_shard.to(acc)], dim=0)
    local = x.to(acc) @ fused_w.T                                   # [T, E/tp + L/tp]
    gathered = all_gather_last_dim(local, group_name, world_size)  # [T, tp * (E/tp + L/tp)]
    blocks = gathered.unflatten(-1, (world_size, fused_w.shape[0]))
    logits = blocks[..., :e_shard].flatten(-2)
    if down_w is None:  # router-only: a fresh [T, 0] (an empty view of `gathered` may alias the logits)
        return logits.to(torch.float32).contiguous(), x.new_empty((*x.shape[:-1], 0))
    latent = blocks[..., e_shard:].flatten(-2)
    return logits.to(torch.float32).contiguous(), latent.to(x.dtype).contiguous()
