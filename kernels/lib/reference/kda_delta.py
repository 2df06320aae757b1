"""Reference KDA delta-rule step in float32, written per value column as the Triton kernel computes it.

For each (token, head) and value column j, only column j of the state is involved:
    S[:, j]   = recurrent[:, j] * exp(g)                  (decay per key channel)
    e_j       = beta * (v_j - sum_i S[i, j] k_i)
    S'[:, j]  = S[:, j] + k e_j
    o_j       = sum_i S'[i, j] q_i
Reductions over the key dim are explicit fp32 sums (no einsum/bmm), so this is a second,
independent spelling of the model's `delta_rule` (checked against a float64 oracle in the tests).
"""
from __future__ import annotations

import torch


def kda_delta_rule(recurrent: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    f32 = torch.float32
    S = recurrent.to(f32) * torch.exp(g.to(f32)).unsqueeze(-1)  # [T, h, dk, dv]
    kf, qf = k.to(f32).unsqueeze(-1), q.to(f32).unsqueeze(-1)  # [T, h, dk, 1]
    kS = (S * kf).sum(-2)  # [T, h, dv]
    e = beta.to(f32).unsqueeze(-1) * (v.to(f32) - kS)
    S_new = S + kf * e.unsqueeze(-2)
    o = (S_new * qf).sum(-2)
    return S_new, o
