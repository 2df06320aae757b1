"""Reference shared expert: SiTU-GLU MLP in fp32, run for the fork on the side stream.

SiTU(g, u) = beta*tanh(g/beta)*sigmoid(g) * linear_beta*tanh(u/linear_beta) (K3: beta 4,
linear_beta 25). Gate, up, activation and the optional down projection stay in fp32; the output is
rounded once to x.dtype. Without w_down the output is the activation [T, S/tp] (the down projection
is then fused into the MoE final reduction, gemm_ar_residual).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from .. import streams
from .collectives import accumulation_dtype

K3_SITU_BETA = 4.0
K3_SITU_LINEAR_BETA = 25.0


def situ(g: torch.Tensor, u: torch.Tensor, beta: float = K3_SITU_BETA,
         linear_beta: float = K3_SITU_LINEAR_BETA) -> torch.Tensor:
    """SiTU-GLU in the inputs' dtype (call it with fp32 tensors)."""
    return beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))


def shared_mlp(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
               w_down: torch.Tensor | None, beta: float = K3_SITU_BETA,
               linear_beta: float = K3_SITU_LINEAR_BETA) -> torch.Tensor:
    acc = accumulation_dtype(x, w_gate, w_up, w_down)
    xa = x.to(acc)
    h = situ(xa @ w_gate.to(acc).T, xa @ w_up.to(acc).T, beta, linear_beta)
    if w_down is not None:
        h = h @ w_down.to(acc).T
    return h.to(x.dtype)


def make_fork_run(producer: str) -> Callable[..., None]:
    """A fork `run` that computes the reference MLP via `streams.launch` (side stream on CUDA)."""

    def run(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
            w_down: torch.Tensor | None, site: int, beta: float = K3_SITU_BETA,
            linear_beta: float = K3_SITU_LINEAR_BETA) -> None:
        streams.launch(site, (x, w_gate, w_up, w_down),
                       lambda: shared_mlp(x, w_gate, w_up, w_down, beta, linear_beta), producer)

    return run
