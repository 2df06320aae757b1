"""Reference decode GEMM: x @ W.T (+ bias) accumulated in fp32, rounded once."""
from __future__ import annotations

import torch

from .collectives import accumulation_dtype


def decode_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    acc = accumulation_dtype(x, weight, bias)
    y = x.to(acc) @ weight.to(acc).T
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(out_dtype or x.dtype)
