"""The token after the LM head: greedy, or temperature with top-p from a seeded generator.

The random numbers are drawn once, when the state is made (`draw_uniforms`: a `torch.Generator` seeded by the
sampling seed, on the host), one per sequence and cache position; a step reads sequence b's number at its new
token's position. So:
* every rank holds the same numbers and samples from the same gathered logits: the same token on every rank,
  no broadcast;
* a step reads a tensor, no generator: it compiles, it replays inside a CUDA graph (no generator state to
  register), and stock, k3fuse and a float32 copy draw the same numbers, so their tokens differ only where
  their logits do.
Sampling inverts the CDF of the tempered distribution at that number (top-p: over the smallest set of the most
likely tokens whose mass reaches top_p, renormalised).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch



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


def draw_uniforms(seed: int, batch: int, positions: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """fp32 [batch, positions] in [0, 1): sequence b's number for the token at each cache position, from a host
    generator seeded by `seed` (the same on every rank and device)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(batch, positions, generator=gen).to(device)


def step_uniform(uniforms: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """This step's number per sequence: uniforms[b, seq_lens[b] - 1] (the new token's position)."""
    return uniforms.gather(1, (seq_lens.long() - 1).unsqueeze(1)).squeeze(1)


def sample(logits: torch.Tensor, u: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Next token ids int64 [B] from fp32 logits [B, V]; u [B] the step's numbers in [0, 1) (`step_uniform`)."""
    if cfg.greedy:
        return logits.argmax(-1)
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
        last = torch.full((z.shape[0], 1), z.shape[-1] - 1, dtype=torch.int64, device=z.device)
    cdf = torch.cumsum(probs, dim=-1)
    target = (u.unsqueeze(-1) * cdf[:, -1:]).contiguous()
    idx = torch.minimum(torch.searchsorted(cdf.contiguous(), target, right=True), last)
    return (idx if order is None else order.gather(-1, idx)).squeeze(-1)


__all__ = ["SamplingConfig", "sample", "step_uniform", "draw_uniforms"]
