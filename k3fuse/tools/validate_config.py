"""What `k3fuse validate` runs: kept free of torch so `k3fuse --help` stays fast."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ValidateConfig:
    preset: str = "small"
    layers: int = 2
    residual: str = "plain"
    tp: int = 2
    tokens: int = 1
    steps: int = 4
    dtype: str | None = None            # model dtype override (default: the preset's)
    device: str = "cpu"
    compiler: str = "inductor"          # k3fuse's inner compiler
    stock: str = "compile"              # "compile" (torch.compile, Inductor) or "eager"
    seed: int = 0
    skew: float = 0.0
    temperature: float = 0.0
    tie_margin: float | None = None
    strict: bool = True
    layer_outputs: bool = True
    timeout_s: float = 900.0
    inject: float = 0.0                 # tests: scale k3fuse's fused all-reduce outputs by 1 + inject
    overrides: tuple[tuple[str, object], ...] = ()   # K3Config fields (`--set moe_inter=128`)
__all__ = ["ValidateConfig"]
