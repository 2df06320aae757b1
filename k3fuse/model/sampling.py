"""The token after the LM head: greedy, or temperature with top-p from a seeded, counter-based generator.

The random number a sequence draws at a step is a hash of (seed, sequence index, its length in the cache), so:
* every rank draws the same number from the same gathered logits: the same token on every rank, no broadcast;
* the draw is a pure function of its inputs, in plain tensor ops: it compiles, it replays inside a CUDA graph
  (no generator state to register), and stock, k3fuse and a float32 copy draw the same numbers, so their tokens
  differ only where their logits do.
Sampling inverts the CDF of the tempered distribution at that number (top-p: over the smallest set of the most
likely tokens whose mass reaches top_p, renormalised).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .weights import fmix32, hash32


@dataclass(frozen=True)
class SamplingConfig:
    """temperature 0 is greedy (argmax, ties to the lowest id); top_p in (0, 1] (1: no truncation)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def step_uniform(seed: int, seq_lens: torch.Tensor) -> torch.Tensor:
    """One fp32 number in (0, 1) per sequence: a hash of (seed, sequence index, length in the cache)."""
    rows = torch.arange(seq_lens.shape[0], device=seq_lens.device, dtype=torch.int64)
    h = hash32(fmix32(rows ^ (seed & 0xFFFFFFFF)), 0x2545F491) ^ seq_lens.long()
    h = hash32(h, seed & 0xFFFFFFFF)
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def sample(logits: torch.Tensor, seq_lens: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Next token ids int64 [B] from fp32 logits [B, V]."""
    if cfg.greedy:
        return logits.argmax(-1)
    u = step_uniform(cfg.seed, seq_lens)
    z = logits.float() / cfg.temperature
    if cfg.top_p < 1:
        z, order = torch.sort(z, dim=-1, descending=True, stable=True)
        probs = torch.softmax(z, dim=-1)
        kept = (torch.cumsum(probs, dim=-1) - probs) < cfg.top_p  # the first token is always kept
        probs = probs * kept
        last = kept.sum(-1, keepdim=True) - 1
    else:
        order = None
        probs = torch.softmax(z, dim=-1)
        last = torch.full_like(seq_lens.long(), z.shape[-1] - 1).unsqueeze(-1)
    cdf = torch.cumsum(probs, dim=-1)
    target = (u.unsqueeze(-1) * cdf[:, -1:]).contiguous()
    idx = torch.minimum(torch.searchsorted(cdf.contiguous(), target, right=True), last)
    return (idx if order is None else order.gather(-1, idx)).squeeze(-1)


__all__ = ["SamplingConfig", "sample", "step_uniform"]
