"""What the routed-experts GPU tests share (BF16 and W4A16): K3's expert shapes, the step's tokens
and expert ids, and the relative error they are judged by."""
from __future__ import annotations

import torch

from k3fuse.spelling import K3_SITU_BETA, K3_SITU_LINEAR_BETA

DEV = "cuda"
BF16 = torch.bfloat16
E, K, L = 896, 16, 3584  # K3's routed experts, top-k and latent width
SITU = (K3_SITU_BETA, K3_SITU_LINEAR_BETA)


def tokens(T: int, seed: int, crowded: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(a [T, L] bf16, experts int64 [T * K]): distinct experts per token, as torch.topk gives, or
    `crowded`: every token picks experts 0..K-1 (K groups of T rows, a group over several row blocks)."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    a = torch.randn(T, L, device=DEV, dtype=BF16, generator=gen)
    if crowded:
        experts = torch.arange(K, device=DEV).repeat(T)
    else:
        experts = torch.rand(T, E, device=DEV, generator=gen).argsort(-1)[:, :K].reshape(-1).contiguous()
    return a, experts


def rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error of `got` against `ref`, in float64."""
    return ((got.double() - ref.double()).norm() / ref.double().norm()).item()
