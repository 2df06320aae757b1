"""Test-only rules and ops (namespace k3fuse_test) that exercise the engine without the K3 rules.

`linear_residual`: residual + x @ w.T       (LinearResidualRule, variants plain / bias)
`rms_norm`:        rmsnorm(x) * weight, fp32 math cast back (RMSNormRule, eps is a literal wildcard)
"""
from __future__ import annotations

from collections import Counter

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from k3fuse.guards import failures, static_weight
from k3fuse.rule import Match, PatternSpec, Rule
from k3fuse.graph_facts import op_qualname

_lib = torch.library.Library("k3fuse_test", "DEF")
_lib.define("linear_residual(Tensor x, Tensor w, Tensor residual, Tensor? bias=None) -> Tensor")
_lib.define("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor")


def _linear_residual(x, w, residual, bias=None):
    y = x @ w.t()
    if bias is not None:
        y = y + bias
    return residual + y.reshape(residual.shape)


def _rms_norm(x, weight, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


torch.library.impl("k3fuse_test::linear_residual", "CompositeExplicitAutograd", lib=_lib)(_linear_residual)
torch.library.register_fake("k3fuse_test::linear_residual", lib=_lib)(
    lambda x, w, residual, bias=None: torch.empty_like(residual))
torch.library.impl("k3fuse_test::rms_norm", "CompositeExplicitAutograd", lib=_lib)(_rms_norm)
torch.library.register_fake("k3fuse_test::rms_norm", lib=_lib)(lambda x, weight, eps: torch.empty_like(x))

LINEAR_RESIDUAL = "k3fuse_test::linear_residual"
RMS_NORM = "k3fuse_test::rms_norm"


def _ex(*shapes):
    return lambda: tuple(torch.randn(*s) for s in shapes)


class LinearResidualRule(Rule):
    """residual + F.linear(x, w[, b]) -> k3fuse_test.linear_residual; w must be a static weight."""

    name = "linear_residual"
    description = "test-only: linear + residual add"

    def patterns(self):
        def plain(x, w, residual):
            return residual + F.linear(x, w)

        def bias(x, w, b, residual):
            return residual + F.linear(x, w, b)

        return [PatternSpec("plain", plain, _ex((4, 8), (16, 8), (4, 16))),
                PatternSpec("bias", bias, _ex((4, 8), (16, 8), (16,), (4, 16)))]

    def check_site(self, match: Match, ctx):
        return failures(static_weight(match["w"], "w"))

    def rewrite(self, match: Match, ctx):
        bias = match.inputs.get("b")
        out = match.insert(torch.ops.k3fuse_test.linear_residual.default,
                           (match["x"], match["w"], match["residual"], bias))
        match.replace([out])
        return [out]


class RMSNormRule(Rule):
    """fp32 RMSNorm times weight, cast back -> k3fuse_test.rms_norm (eps captured from the graph)."""

    name = "rms_norm"
    description = "test-only: RMSNorm"

    def patterns(self):
        def rms(x, weight, eps: float):
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(torch.bfloat16)

        return [PatternSpec("bf16", rms, lambda: (torch.randn(4, 16, dtype=torch.bfloat16),
                                                  torch.randn(16, dtype=torch.bfloat16), 1e-6))]

    def rewrite(self, match: Match, ctx):
        out = match.insert(torch.ops.k3fuse_test.rms_norm.default, (match["x"], match["weight"], match["eps"]))
        match.replace([out])
        return [out]


def op_counts(graph: fx.Graph | fx.GraphModule) -> Counter:
    """{"ns::op": calls} of a graph (getitem and non-op nodes are not counted)."""
    g = graph.graph if isinstance(graph, fx.GraphModule) else graph
    return Counter(q for q in (op_qualname(n) for n in g.nodes) if q is not None)


class ResidualStack(nn.Module):
    """n layers of h = h + linear(norm(h)): one linear_residual site per layer."""

    def __init__(self, hidden=16, layers=2, bias=False, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.ws = nn.ParameterList([nn.Parameter(torch.randn(hidden, hidden, generator=g) / hidden**0.5)
                                    for _ in range(layers)])
        self.bs = (nn.ParameterList([nn.Parameter(torch.randn(hidden, generator=g)) for _ in range(layers)])
                   if bias else None)

    def forward(self, h):
        for i, w in enumerate(self.ws):
            x = torch.tanh(h)
            h = h + F.linear(x, w, self.bs[i] if self.bs is not None else None)
        return h




class Capture(Rule):
    """A rule that rewrites nothing and records the graph's op counts when it runs.

    Put Capture("before") first and Capture("after") last in a rule list to see what a door's
    pipeline did to the graph (like vLLM's TestBackend before/after graphs).
    """

    def __init__(self, tag: str):
        self.name = f"capture_{tag}"  # type: ignore[misc]
        self.counts: list[Counter] = []

    def find(self, graph, ctx):
        self.counts.append(op_counts(graph))
        return []

    def fingerprint(self) -> str:
        return self.name


__all__ = ["LinearResidualRule", "RMSNormRule", "Capture", "op_counts", "ResidualStack", "LINEAR_RESIDUAL", "RMS_NORM"]
