"""Float64 reference of the K3 decode equations, written from shared/docs/k3-decode.md and
shared/docs/reference/k3-model.md sections 2.1-2.8, independently of k3fuse.model (which it never imports).

Loops over tokens, heads and selected experts on purpose: slow but obviously the equations.
Weights are passed as a dict of FULL (unsharded) tensors named like the model's parameters.
"""
from __future__ import annotations

import math

import torch

F64 = torch.float64


def d(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(F64)


def rmsnorm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """w * x / sqrt(mean(x^2) + eps) over the last dim."""
    x = d(x)
    out = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return out if w is None else out * d(w)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def silu(x: torch.Tensor) -> torch.Tensor:
    return x * sigmoid(x)


def situ(g: torch.Tensor, u: torch.Tensor, beta: float = 4.0, beta_l: float = 25.0) -> torch.Tensor:
    return beta * torch.tanh(g / beta) * sigmoid(g) * beta_l * torch.tanh(u / beta_l)


def kda_step(x: torch.Tensor, S: torch.Tensor, conv_hist: torch.Tensor, W: dict, *, heads: int,
             head_dim: int, lower_bound: float = -5.0, l2_eps: float = 1e-6, eps: float = 1e-5):
    """One KDA decode step for each of T tokens.

    x [T, H]; S [T, heads, d, d] (key x value); conv_hist [T, 3P, K-1] (oldest first).
    W keys: w_q w_k w_v w_g w_fa w_fb w_b dt_bias A_log conv_weight ([3P, K], rows q;k;v)
    w_onorm w_o. Returns (y [T, H], S_new, conv_hist_new).
    """
    x, S, conv_hist = d(x), d(S).clone(), d(conv_hist)
    W = {k: d(v) for k, v in W.items()}
    T = x.shape[0]
    P = heads * head_dim
    ys, S_new, hist_new = [], torch.empty_like(S), torch.empty_like(conv_hist)
    for t in range(T):
        xt = x[t]
        q_raw, k_raw, v_raw = W["w_q"] @ xt, W["w_k"] @ xt, W["w_v"] @ xt
        G = W["w_g"] @ xt
        z = W["w_fb"] @ (W["w_fa"] @ xt) + W["dt_bias"]
        b = W["w_b"] @ xt
        u = torch.cat([q_raw, k_raw, v_raw])  # [3P]
        window = torch.cat([conv_hist[t], u[:, None]], dim=1)  # [3P, K], newest last
        conv_out = silu((window * W["conv_weight"]).sum(1))
        hist_new[t] = window[:, 1:]
        qc, kc, vc = conv_out[:P], conv_out[P:2 * P], conv_out[2 * P:]
        o_all = []
        for n in range(heads):
            sl = slice(n * head_dim, (n + 1) * head_dim)
            qn = qc[sl] / torch.sqrt((qc[sl] ** 2).sum() + l2_eps) / math.sqrt(head_dim)
            kn = kc[sl] / torch.sqrt((kc[sl] ** 2).sum() + l2_eps)
            vn = vc[sl]
            gn = lower_bound * sigmoid(torch.exp(W["A_log"][n]) * z[sl])
            beta = sigmoid(b[n])
            Sn = torch.diag(torch.exp(gn)) @ S[t, n]
            e = beta * (vn - Sn.T @ kn)
            Sn = Sn + torch.outer(kn, e)
            S_new[t, n] = Sn
            on = Sn.T @ qn
            on = on / torch.sqrt((on ** 2).mean() + eps) * W["w_onorm"] * sigmoid(G[sl])
            o_all.append(on)
        ys.append(W["w_o"] @ torch.cat(o_all))
    return torch.stack(ys), S_new, hist_new


def delta_rule(S: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta-rule step of `kda_step` alone, per token and head (the equations of its inner loop).

    S [T, h, dk, dv]; g, k, q [T, h, dk]; beta [T, h]; v [T, h, dv] -> (S_new, o [T, h, dv])."""
    S, g, beta, k, v, q = (d(t) for t in (S, g, beta, k, v, q))
    T, heads = S.shape[:2]
    S_new, o = torch.empty_like(S), torch.empty_like(v)
    for t in range(T):
        for n in range(heads):
            Sn = torch.diag(torch.exp(g[t, n])) @ S[t, n]
            e = beta[t, n] * (v[t, n] - Sn.T @ k[t, n])
            Sn = Sn + torch.outer(k[t, n], e)
            S_new[t, n] = Sn
            o[t, n] = Sn.T @ q[t, n]
    return S_new, o


def route(logits: torch.Tensor, b_corr: torch.Tensor, top_k: int, scaling: float = 1.0):
    """Per token: pick the top_k of sigmoid(l) + b_corr (by sorting), weight by sigmoid(l) only."""
    logits, b_corr = d(logits), d(b_corr)
    sig = sigmoid(logits)
    out_w, out_i = [], []
    for t in range(logits.shape[0]):
        order = sorted(range(logits.shape[1]), key=lambda e: -(sig[t, e] + b_corr[e]).item())
        sel = order[:top_k]
        s = sig[t, sel]
        out_w.append(s / (s.sum() + 1e-20) * scaling)
        out_i.append(torch.tensor(sel))
    return torch.stack(out_w), torch.stack(out_i)


def latent_moe(x: torch.Tensor, W: dict, *, top_k: int, scaling: float = 1.0, eps: float = 1e-5):
    """a = W_down x; r = sum_sel w_e W2_e SiTU(W1_e a, W3_e a); y = W_up RMSNorm_L(r).
    W keys: w_r b_corr w_down w1 [E,I,L] w3 w2 [E,L,I] latent_norm w_up."""
    x = d(x)
    W = {k: d(v) for k, v in W.items()}
    weights, sel = route(x @ W["w_r"].T, W["b_corr"], top_k, scaling)
    ys = []
    for t in range(x.shape[0]):
        a = W["w_down"] @ x[t]
        r = torch.zeros_like(a)
        for j in range(top_k):
            e = int(sel[t, j])
            r = r + weights[t, j] * (W["w2"][e] @ situ(W["w1"][e] @ a, W["w3"][e] @ a))
        ys.append(W["w_up"] @ rmsnorm(r, W["latent_norm"], eps))
    return torch.stack(ys)


def shared_experts(x: torch.Tensor, W: dict) -> torch.Tensor:
    """y = W_down SiTU(W_gate x, W_up x). W keys: w_gate w_up w_down."""
    x = d(x)
    return (d(W["w_down"]) @ situ(d(W["w_gate"]) @ x.T, d(W["w_up"]) @ x.T)).T


def attn_res_mix(values: list[torch.Tensor], w_q: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """h = sum_i softmax_i(w_q . RMSNorm(V_i)) V_i, per token."""
    V = [d(v) for v in values]
    scores = torch.stack([(rmsnorm(v, None, eps) * d(w_q)).sum(-1) for v in V])  # [n, T]
    scores = scores - scores.max(0, keepdim=True).values
    alpha = torch.exp(scores) / torch.exp(scores).sum(0, keepdim=True)
    return sum(alpha[i][:, None] * V[i] for i in range(len(V)))


def decode_step(x: torch.Tensor, recurrent: list, conv: list, W: dict, cfg) -> tuple:
    """One decode step of the whole stack (equations of section 2.2 / 2.8).

    W maps the model's parameter names to full weights; cfg is a K3Config (read as plain fields).
    """
    eps = cfg.rms_eps
    kda_kw = dict(heads=cfg.kda_heads, head_dim=cfg.head_dim, lower_bound=cfg.gate_lower_bound,
                  l2_eps=cfg.l2_eps, eps=eps)

    def sub(prefix: str) -> dict:
        return {k[len(prefix):]: v for k, v in W.items() if k.startswith(prefix)}

    def moe(i: int, h: torch.Tensor) -> torch.Tensor:
        routed = sub(f"layers.{i}.moe.routed.")
        routed = {("w_r" if k == "router.w_r" else "b_corr" if k == "router.b_corr" else
                   "latent_norm" if k == "latent_norm.weight" else k): v for k, v in routed.items()}
        return (latent_moe(h, routed, top_k=cfg.top_k, scaling=cfg.routed_scaling, eps=eps)
                + shared_experts(h, sub(f"layers.{i}.moe.shared.")))

    new_rec, new_conv = [], []
    x = d(x)
    if cfg.residual == "plain":
        r = x
        for i in range(cfg.n_layers):
            y, s, c = kda_step(rmsnorm(r, W[f"layers.{i}.attn_norm.weight"], eps), recurrent[i],
                               conv[i], sub(f"layers.{i}.kda."), **kda_kw)
            new_rec.append(s)
            new_conv.append(c)
            r = r + y
            r = r + moe(i, rmsnorm(r, W[f"layers.{i}.moe_norm.weight"], eps))
        return rmsnorm(r, W["final_norm.weight"], eps), new_rec, new_conv

    blocks: list[torch.Tensor] = []  # bank of block snapshots; the embedding is the first one
    partial = x
    for i in range(cfg.n_layers):
        h1 = attn_res_mix(blocks + [partial], W[f"layers.{i}.attn_res_query"], eps)
        if i % cfg.attn_res_block == 0:
            blocks.append(partial)
            partial = None
        y, s, c = kda_step(rmsnorm(h1, W[f"layers.{i}.attn_norm.weight"], eps), recurrent[i],
                           conv[i], sub(f"layers.{i}.kda."), **kda_kw)
        new_rec.append(s)
        new_conv.append(c)
        partial = y if partial is None else partial + y
        h2 = attn_res_mix(blocks + [partial], W[f"layers.{i}.moe_res_query"], eps)
        partial = partial + moe(i, rmsnorm(h2, W[f"layers.{i}.moe_norm.weight"], eps))
    h = attn_res_mix(blocks + [partial], W["final_res_query"], eps)
    return rmsnorm(h, W["final_norm.weight"], eps), new_rec, new_conv
