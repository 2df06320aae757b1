"""Reference L2 prefetch: does nothing but get counted.

Prefetching is a performance hint with no numerical effect, so "do nothing" is a correct
implementation everywhere. On CPU it is the expected path; on CUDA the kernel is
kernels/lib/triton/l2_prefetch.py (bulk L2 prefetch issued on the current stream while the collective
runs on NCCL's, reading only the static `weights`, never `anchor`).
"""
from __future__ import annotations

import torch


def l2_prefetch(anchor: torch.Tensor, weights: list[torch.Tensor], budget_bytes: int) -> None:
    return None
