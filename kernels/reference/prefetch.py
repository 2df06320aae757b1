"""Reference L2 prefetch: does nothing but get counted.

Prefetching is a performance hint with no numerical effect, so "do nothing" is a correct
implementation everywhere. On CPU it is the expected path; on CUDA it counts as a fallback
("no kernel registered") until a GPU module registers a real prefetch for "l2_prefetch" with
`dispatch.register_impl` (run(anchor, weights, budget_bytes) -> None, on the side stream, reading
only the static `weights`, never `anchor`, whose collective may still be in flight).
"""
from __future__ import annotations

import torch


def l2_prefetch(anchor: torch.Tensor, weights: list[torch.Tensor], budget_bytes: int) -> None:
    return None
