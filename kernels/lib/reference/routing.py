"""Reference fused routing: sigmoid, correction bias, top-k with lowest-index ties, renormalise, scale.

The model's `route` (k3fuse/model/layers.py) in one function, with two things pinned down that the
model leaves to torch:
* ties: the top-k of the biased scores is taken from a *stable* descending sort, so among equal
  biased scores the lowest expert index wins, and the result never depends on torch.topk's (device
  and version dependent) tie order. -0.0 and +0.0 compare equal (a tie). NaN sorts above every
  number (as torch.sort and torch.topk treat it), NaNs among themselves by index;
* the weight sum: the k selected (unbiased) scores are added one at a time in selection order,
  starting from the first, so the Triton kernel (kernels/lib/triton/route_topk.py), which adds them in
  the same order, gives the same bits. torch.sum's order is an implementation detail (vectorised
  on CPU), which may differ from this by an ulp or so in the weights.

logits fp32 [T, E], b_corr fp32 [E] -> (weights fp32 [T, k], idx int64 [T, k]), in selection order
(descending biased score):
    scores  = sigmoid(logits)
    idx     = the k largest of scores + b_corr (lowest index first among equals)
    w       = scores[idx];  weights = w / (w_0 + w_1 + ... + w_{k-1} + eps) * routed_scaling
"""
from __future__ import annotations

import torch


def select_topk(biased: torch.Tensor, top_k: int) -> torch.Tensor:
    """Indices of the top_k largest entries of `biased` along the last dim, in descending order,
    ties to the lowest index (stable sort); contiguous, as the fake impl promises."""
    return torch.sort(biased, dim=-1, descending=True, stable=True).indices[..., :top_k].contiguous()


def ordered_sum(w: torch.Tensor) -> torch.Tensor:
    """w[..., 0] + w[..., 1] + ... left to right (one fp32 rounding per add), keepdim."""
    acc = w[..., 0]
    for j in range(1, w.shape[-1]):
        acc = acc + w[..., j]
    return acc.unsqueeze(-1)


def route_topk(logits: torch.Tensor, b_corr: torch.Tensor, top_k: int, routed_scaling: float,
               eps: float = 1e-20) -> tuple[torch.Tensor, torch.Tensor]:
    return route_from_scores(torch.sigmoid(logits.float()), b_corr, top_k, routed_scaling, eps)


def route_from_scores(scores: torch.Tensor, b_corr: torch.Tensor, top_k: int, routed_scaling: float,
                      eps: float = 1e-20) -> tuple[torch.Tensor, torch.Tensor]:
    """Everything after the sigmoid (tests feed it another device's sigmoid to compare bits)."""
    idx = select_topk(scores + b_corr.float(), top_k)
    w = scores.gather(-1, idx)
    weights = w / (ordered_sum(w) + eps)
    return weights * routed_scaling, idx
