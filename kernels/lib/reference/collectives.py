"""The collectives inside the reference ops: torch.distributed on the group named in the graph.

The reference reduces and gathers in the accumulation dtype (fp32), so the only rounding of a
reference op is the final cast to its output dtype.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from k3fuse import compat


def process_group(group_name: str, world_size: int) -> dist.ProcessGroup | None:
    """The group for `group_name`, or None at world_size 1 (no collective needed)."""
    if world_size == 1:
        return None
    group = compat.resolve_group(group_name)
    if group.size() != world_size:
        raise ValueError(f"k3fuse op was built for world_size {world_size} but process group "
                         f"{group_name!r} has {group.size()} ranks")
    return group


def all_reduce_sum(t: torch.Tensor, group_name: str, world_size: int) -> torch.Tensor:
    """Sum `t` over the group in place (and return it); identity at world_size 1."""
    group = process_group(group_name, world_size)
    if group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def all_gather_last_dim(t: torch.Tensor, group_name: str, world_size: int) -> torch.Tensor:
    """Concatenate every rank's `t` along the last dim, in rank order."""
    group = process_group(group_name, world_size)
    if group is None:
        return t
    parts = [torch.empty_like(t) for _ in range(world_size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def accumulation_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """fp32, or fp64 when an input is fp64 (so float64 oracles stay exact)."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) \
        else torch.float32
