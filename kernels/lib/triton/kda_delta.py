"""Triton KDA delta-rule step: the fp32 recurrent state is read once and written once.

Why: Inductor splits the step at its first reduction (S^T k) and reads the state S [T, h, dk, dv]
in two kernels; at 64 tokens and K3 widths (TP1: 96 heads, 128 x 128) S is 403 MB, so the second
read costs ~190 us on H200.

Column independence: for a value column j, e_j = beta * (v_j - sum_i S'[i, j] k_i), the update
S_new[:, j] = S'[:, j] + k e_j and o_j = sum_i S_new[i, j] q_i need only column j of S. One program
owns (token, head, block of BLOCK_V value columns): it loads S[:, block] (dk x BLOCK_V fp32) once,
applies the decay exp(g) per key channel, reduces over k, forms e, updates, reduces over q, and
stores S_new[:, block] and o[block]. Every reduction is a fixed in-register tree over the key dim
inside one program: deterministic and independent of T (batch-invariant). No workspace, no
atomics: safe under CUDA-graph capture once compiled (`warmup`).

recurrent [T, h, dk, dv] (last two dims contiguous), g/k/q [T, h, dk], beta [T, h], v [T, h, dv]
(any token/head strides, unit inner stride), all fp32 -> (S_new [T, h, dk, dv], o [T, h, dv]) new,
contiguous, fp32.
"""
from __future__ import annotations

import torch

from . import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

MAX_TOKENS = 64
KEY_DIMS = (16, 32, 64, 128)  # dk: a power of two (one tl.arange over the key dim), K3: 128
MAX_DV = 256  # dv: a multiple of 16 up to this (K3: 128)
MIN_PROGRAMS = 264  # 2 per SM on H200: below this, narrower column blocks for more programs

if HAVE_TRITON:

    @triton.jit
    def _kda_delta_kernel(s_ptr, g_ptr, b_ptr, k_ptr, v_ptr, q_ptr, so_ptr, o_ptr,
                          H, DV,
                          s_st, s_sh, g_st, g_sh, b_st, b_sh, k_st, k_sh, v_st, v_sh, q_st, q_sh,
                          DK: tl.constexpr, BLOCK_V: tl.constexpr, EVEN_V: tl.constexpr):
        pid = tl.program_id(0)  # token * H + head
        pid_v = tl.program_id(1)  # block of value columns
        t = (pid // H).to(tl.int64)
        h = (pid % H).to(tl.int64)
        offs_k = tl.arange(0, DK)
        offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        v_ok = offs_v < DV

        g = tl.load(g_ptr + t * g_st + h * g_sh + offs_k)
        kk = tl.load(k_ptr + t * k_st + h * k_sh + offs_k)
        qq = tl.load(q_ptr + t * q_st + h * q_sh + offs_k)
        beta = tl.load(b_ptr + t * b_st + h * b_sh)
        s_ptrs = s_ptr + t * s_st + h * s_sh + offs_k[:, None] * DV + offs_v[None, :]
        if EVEN_V:
            S = tl.load(s_ptrs, eviction_policy="evict_first")
            v = tl.load(v_ptr + t * v_st + h * v_sh + offs_v)
        else:
            S = tl.load(s_ptrs, mask=v_ok[None, :], other=0.0, eviction_policy="evict_first")
            v = tl.load(v_ptr + t * v_st + h * v_sh + offs_v, mask=v_ok, other=0.0)

        S = S * tl.exp(g)[:, None]  # decay per key channel
        e = beta * (v - tl.sum(S * kk[:, None], axis=0))  # [BLOCK_V]
        S = S + kk[:, None] * e[None, :]  # rank-1 update of this column block
        o = tl.sum(S * qq[:, None], axis=0)

        row = t * H + h  # outputs are contiguous [T, H, DK, DV] and [T, H, DV]
        so_ptrs = so_ptr + row * DK * DV + offs_k[:, None] * DV + offs_v[None, :]
        o_ptrs = o_ptr + row * DV + offs_v
        if EVEN_V:
            tl.store(so_ptrs, S, eviction_policy="evict_first")
            tl.store(o_ptrs, o)
        else:
            tl.store(so_ptrs, S, mask=v_ok[None, :], eviction_policy="evict_first")
            tl.store(o_ptrs, o, mask=v_ok)


def pick_config(T: int, heads: int, dk: int, dv: int) -> dict:
    """BLOCK_V (value columns per program) and warps: 32 columns (a 128 x 32 fp32 tile, 32 values a
    thread at 4 warps), 16 when that gives fewer than MIN_PROGRAMS programs (1 token at high TP)."""
    block_v = min(32, triton.next_power_of_2(dv) if HAVE_TRITON else 32)
    if block_v > 16 and T * heads * -(-dv // block_v) < MIN_PROGRAMS:
        block_v = 16
    num_warps = max(1, min(4, dk * block_v // 512))
    return {"BLOCK_V": block_v, "num_warps": num_warps}


def run(recurrent, g, beta, k, v, q, config: dict | None = None, out: tuple | None = None):
    """(S_new, o); `out` = (S_new, o) contiguous fp32 buffers to write instead of new ones."""
    T, H, dk, dv = recurrent.shape
    cfg = config or pick_config(T, H, dk, dv)
    if out is None:
        S_new = torch.empty((T, H, dk, dv), dtype=torch.float32, device=recurrent.device)
        o = torch.empty((T, H, dv), dtype=torch.float32, device=recurrent.device)
    else:
        S_new, o = out
        assert S_new.is_contiguous() and o.is_contiguous() and S_new.shape == recurrent.shape
    if T == 0 or H == 0:
        return S_new, o
    grid = (T * H, -(-dv // cfg["BLOCK_V"]))
    _kda_delta_kernel[grid](
        recurrent, g, beta, k, v, q, S_new, o, H, dv,
        recurrent.stride(0), recurrent.stride(1), g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), q.stride(0), q.stride(1),
        DK=dk, BLOCK_V=cfg["BLOCK_V"], EVEN_V=dv % cfg["BLOCK_V"] == 0, num_warps=cfg["num_warps"])
    return S_new, o


