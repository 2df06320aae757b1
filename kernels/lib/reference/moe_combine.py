"""Reference MoE combine: the routed experts' weighted sum over the slots, added in slot order.

    out[t] = ((w[t, 0] * z[t*k + 0] + w[t, 1] * z[t*k + 1]) + ...) + w[t, k-1] * z[t*k + k-1]

in fp32 (each product and each add rounded once), then cast to z's dtype. This is the Triton
kernel's order of operations (kernels/lib/triton/moe_combine.py, compiled without FMA contraction),
so on one device the two give the same bits; the model's spelling (k3fuse.spelling `moe_combine`)
leaves the order of its sum over the slots to torch.

z [T*k, L] (pair order), weights fp32 [T, k] -> [T, L] in z's dtype.
"""
from __future__ import annotations

import torch


def moe_combine(z: torch.Tensor, weights: torch.Tensor, top_k: int) -> torch.Tensor:
    T, L = weights.shape[0], z.shape[-1]
    slots = z.reshape(T, top_k, L)
    w = weights.float()
    acc = slots[:, 0].float() * w[:, 0:1]
    for j in range(1, top_k):
        acc = acc + slots[:, j].float() * w[:, j:j + 1]
    return acc.to(z.dtype)
