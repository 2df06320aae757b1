"""The K3 decode math, written once (docs/architecture.md "Reference model spelling").

The reference model (k3fuse/model/layers.py) computes with these functions, the rules trace them
(patterns/_spelling.py re-exports them; kda_delta_rule traces `delta_rule`, fused_routing traces
`route`), the stock sequences run them (kernels/reference/stock.py) and the shared-expert reference
evaluates SiTU with them (kernels/reference/shared_expert.py). One definition, so the model, the
patterns and the fallbacks cannot drift apart: changing a function here changes what every rule
matches, so change the rules with it.

A leaf module: it imports torch only (no k3fuse module), so anything may import it.
"""
from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

#: K3's SiTU-GLU constants: beta (the gate's tanh bound) and linear_beta (the up projection's)
K3_SITU_BETA = 4.0
K3_SITU_LINEAR_BETA = 25.0


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A projection: `F.linear(x, w)` (ATen `t` + `mm`)."""
    return F.linear(x, w)


def all_reduce_sum(t: torch.Tensor, group: "str | torch.distributed.ProcessGroup") -> torch.Tensor:
    """The functional all-reduce a row-parallel linear is followed by (all_reduce + wait_tensor);
    `group` is the c10d group name or the process group."""
    return funcol.all_reduce(t, "sum", group)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm with the variance in fp32, times the weight in fp32 (when given), back to x's dtype."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        out = out * weight.float()
    return out.to(x.dtype)


def situ(g: torch.Tensor, u: torch.Tensor, beta: float = K3_SITU_BETA,
         linear_beta: float = K3_SITU_LINEAR_BETA) -> torch.Tensor:
    """SiTU-GLU in the inputs' dtype: beta*tanh(g/beta)*sigmoid(g) * linear_beta*tanh(u/linear_beta)."""
    return beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))


def situ_glu(g: torch.Tensor, u: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """K3's SiTU-GLU: `situ` in fp32, one cast back to g's dtype."""
    return situ(g.float(), u.float(), beta, linear_beta).to(g.dtype)


def delta_rule(recurrent: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, kc: torch.Tensor,
               vc: torch.Tensor, qc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The KDA delta-rule step, fp32 state S [T, h, d_k, d_v] (key x value).

    g [T, h, d_k] per-key-channel log decay, beta [T, h] write strength, kc/qc [T, h, d_k] and
    vc [T, h, d_v]. Returns (S_new, o [T, h, d_v]). The rule `kda_delta_rule` traces this very
    function (patterns/kda_delta_rule.py; the parameter names are the match's names).
    """
    S = recurrent * torch.exp(g).unsqueeze(-1)
    e = beta.unsqueeze(-1) * (vc - torch.einsum("thkv,thk->thv", S, kc))
    S = S + kc.unsqueeze(-1) * e.unsqueeze(-2)
    o = torch.einsum("thkv,thk->thv", S, qc)
    return S, o


#: the guard against an all-zero sum in the router's renormalisation
ROUTE_EPS = 1e-20


def route(logits: torch.Tensor, b_corr: torch.Tensor, top_k: int, routed_scaling: float,
          eps: float = ROUTE_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid router with bias-corrected top-k: the bias picks experts but never weights them.

    Returns (weights fp32 [T, k], expert ids int64 [T, k]); weights = sigma_e / sum_sel sigma,
    times routed_scaling. Ties go to torch.topk's order (identical on every rank).
    """
    scores = torch.sigmoid(logits.float())
    _, idx = torch.topk(scores + b_corr, top_k, dim=-1)
    weights = scores.gather(-1, idx)
    weights = weights / (weights.sum(-1, keepdim=True) + eps)
    return weights * routed_scaling, idx


__all__ = ["K3_SITU_BETA", "K3_SITU_LINEAR_BETA", "ROUTE_EPS", "route", "linear", "all_reduce_sum", "rms_norm", "situ",
           "situ_glu", "delta_rule"]
