"""Which experts a benchmark's decode steps touch: uniform or skewed routing, and the measured count.

Real prompts concentrate expert choice, and the routed experts' bytes are the layer's bytes at decode
batch sizes, so the touched-expert count decides the weight-read floor. `--routing uniform` keeps the
model's router as drawn (every expert equally likely); `--routing zipf:<s>` adds a Zipf-shaped
correction bias: the expert of popularity rank r (a seeded permutation per layer) gets
-s * GUMBEL_SCALE * ln(r), which makes top-k selection roughly proportional to r^-s (top-k of
log-probability plus Gumbel noise samples without replacement in proportion to the probability; the
router's score noise is close to a Gumbel of scale GUMBEL_SCALE). `distinct_experts` then measures,
on the benchmark's own inputs, how many distinct experts each decode step of each layer touches.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any

import torch

#: the Gumbel scale matching the spread of the reference router's scores sigmoid(N(0, 1)) (std 0.21)
GUMBEL_SCALE = 0.21 * math.sqrt(6) / math.pi
#: token chunk of the eager probe: bounds the dequantized expert copies the eager step holds
PROBE_CHUNK = 8
ROUTINGS = ("uniform", "zipf:<s>")


@dataclass(frozen=True)
class Routing:
    kind: str  # "uniform" or "zipf"
    exponent: float = 0.0

    def __str__(self) -> str:
        return self.kind if self.kind == "uniform" else f"zipf:{self.exponent:g}"


def parse_routing(spec: str) -> Routing:
    """`uniform` or `zipf:<s>` (s > 0); anything else is a ValueError naming the forms."""
    spec = spec.strip()
    if spec == "uniform":
        return Routing("uniform")
    kind, sep, value = spec.partition(":")
    if kind == "zipf" and sep:
        try:
            s = float(value)
        except ValueError:
            s = float("nan")
        if s > 0 and math.isfinite(s):
            return Routing("zipf", s)
    raise ValueError(f"unknown routing {spec!r}; use one of {ROUTINGS} (s a positive number, e.g. zipf:1.1)")


def zipf_bias(n_experts: int, exponent: float, seed: int, layer: int) -> torch.Tensor:
    """fp32 [E]: -exponent * GUMBEL_SCALE * ln(rank), ranks 1..E over a seeded permutation."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"k3fuse/routing/{seed}/{layer}".encode()))
    ranks = torch.empty(n_experts, dtype=torch.float32)
    ranks[torch.randperm(n_experts, generator=gen)] = torch.arange(1, n_experts + 1, dtype=torch.float32)
    return -exponent * GUMBEL_SCALE * torch.log(ranks)


def apply_routing(model: Any, routing: Routing, seed: int) -> None:
    """Add the routing's correction bias to every layer's router (uniform: nothing)."""
    if routing.kind == "uniform":
        return
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            b = layer.moe.routed.router.b_corr
            b.add_(zipf_bias(b.numel(), routing.exponent, seed, i).to(b.device, b.dtype))


def expected_uniform(n_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts T tokens touch when each picks top_k experts uniformly."""
    return n_experts * (1 - (1 - top_k / n_experts) ** tokens)


def distinct_experts(model: Any, xs: list[torch.Tensor], state: Any) -> dict[str, Any]:
    """Run the decode steps `xs` eagerly from `state` and count, per step and layer, the distinct
    experts the router picks. Tokens are independent within a step, so the probe runs them in chunks
    of PROBE_CHUNK (the eager dequantization holds one chunk's experts) and unites the chunks' sets."""
    from k3fuse.model import DecodeState

    picked: dict[tuple[int, int], set[int]] = {}
    step = [0]
    handles = []
    for i, layer in enumerate(model.layers):
        def hook(mod, args, out, i=i):
            picked.setdefault((step[0], i), set()).update(out[1].reshape(-1).tolist())
        handles.append(layer.moe.routed.router.register_forward_hook(hook))
    try:
        T = xs[0].shape[0]
        with torch.no_grad():
            for start in range(0, T, PROBE_CHUNK):
                rows = slice(start, min(start + PROBE_CHUNK, T))
                s = DecodeState(recurrent=tuple(r[rows] for r in state.recurrent),
                                conv=tuple(c[rows] for c in state.conv))
                for t, x in enumerate(xs):
                    step[0] = t
                    _, s = model(x[rows], s)
    finally:
        for h in handles:
            h.remove()
    counts = [len(v) for v in picked.values()]
    return {"mean": sum(counts) / len(counts), "min": min(counts), "max": max(counts),
            "per_step_layer": {f"{t}/{i}": len(v) for (t, i), v in sorted(picked.items())}}


__all__ = ["Routing", "ROUTINGS", "GUMBEL_SCALE", "parse_routing", "zipf_bias", "apply_routing",
           "expected_uniform", "distinct_experts"]
