"""The decode token range the rewrites and the fused kernels are built for, defined once.

A leaf that imports nothing (the torch-free CLI reads it too): DecodeContext rejects a range
outside it, and the CLI's --tokens option defaults to it.
"""
from __future__ import annotations

#: tokens per decode step (one token per sequence), inclusive
DECODE_TOKENS: tuple[int, int] = (1, 64)

__all__ = ["DECODE_TOKENS"]
