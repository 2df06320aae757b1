"""Reference KDA short conv in float32, tap by tap, as the Triton kernel computes it.

For each token and channel c of [q; k; v] (width C = 3W), with the window x_0 .. x_{K-1} =
conv_state[c, 0 .. K-2], u[c] (oldest first):
    acc      = ((x_0 w_0 + x_1 w_1) + ...) + x_{K-1} w_{K-1}     (fp32, taps left to right)
    conv[c]  = silu(acc)
    state[c] = x_1 .. x_{K-1}                                      (the window less its oldest tap)
No cat of the window and no sum over it: a second, independent spelling of the model's
`short_conv` (k3fuse/spelling.py), checked against a float64 oracle in the tests.
"""
from __future__ import annotations

import torch


def kda_short_conv(conv_state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    f32 = torch.float32
    u = torch.cat([q, k, v], dim=-1)  # [T, C], the newest tap
    taps = [conv_state[..., j] for j in range(conv_state.shape[-1])] + [u]
    w = weight.to(f32)
    acc = taps[0].to(f32) * w[:, 0]
    for j in range(1, len(taps)):
        acc = acc + taps[j].to(f32) * w[:, j]
    new_state = torch.stack([t.to(conv_state.dtype) for t in taps[1:]], dim=-1)  # contiguous [T, C, K-1]
    return acc * torch.sigmoid(acc), new_state
