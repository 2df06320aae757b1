"""Triton KDA short conv: the K-tap causal depthwise conv over [q; k; v], its silu, and the rolled
conv state, in one kernel.

Why: Inductor compiles the model's spelling (cat of q, k, v; cat onto the state; the state's
slice; cast, multiply, sum, silu) to three kernels that write and re-read the [T, C, K] window.
This one reads the state, q, k, v and the weights once and writes the new state and the fp32 conv
once (docs/perf/2026-12-04-w4a16-ncu-combine-conv.md 0m has the figures).

One program owns (token, source in {q, k, v}, block of BLOCK channels of that source). Every global
access is a contiguous run: the block's taps [BLOCK, K], its state [BLOCK * (K-1)] read flat, its
q, k or v, the fp32 conv, and the new state written flat. The window [BLOCK, K] is assembled on chip
by a gather from the flat state (and the new state gathered back out of it), so no load or store is
strided (a per-tap spelling, every 2-byte tap its own load and store, was about 3x slower; so were
wider blocks and programs that loop over a few tokens to share the taps:
docs/perf/2026-12-04-w4a16-ncu-combine-conv.md 0m). The taps are summed in fp32 within each thread, in
one fixed order: deterministic and independent of T. No workspace, no atomics: safe under CUDA-graph
capture once compiled (`warmup`).

conv_state [T, C, K-1] (last two dims contiguous, any token stride), q/k/v [T, W] (unit inner
stride), weight fp32 [C, K] contiguous, C = 3W; state, q, k, v in one 16-bit or fp32 dtype ->
(conv fp32 [T, C], new_state [T, C, K-1] in the state's dtype), both new and contiguous.
"""
from __future__ import annotations

import torch

from . import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_TAPS = 8  # K (K3: 4): the window [BLOCK, K rounded up to a power of 2] stays in registers
BLOCK = 128  # channels a program, one a thread at 4 warps: the fastest on H200 at 1, 8 and 64 tokens

if HAVE_TRITON:

    @triton.jit
    def _kda_conv_kernel(s_ptr, q_ptr, k_ptr, v_ptr, w_ptr, conv_ptr, ns_ptr,
                         W, s_st, q_st, k_st, v_st,
                         K: tl.constexpr, KP: tl.constexpr, SP: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        src = tl.program_id(1)  # 0: q, 1: k, 2: v
        cb = tl.program_id(2) * BLOCK
        ch = tl.arange(0, BLOCK)  # channel within the block
        ok = cb + ch < W
        if src == 0:  # the newest tap: this block of q, k or v
            u_ptrs = q_ptr + t * q_st + cb + ch
        elif src == 1:
            u_ptrs = k_ptr + t * k_st + cb + ch
        else:
            u_ptrs = v_ptr + t * v_st + cb + ch
        c0 = (src * W + cb).to(tl.int64)  # the block's first channel in [q; k; v]
        C = 3 * W
        tap = tl.arange(0, KP)
        # the taps [BLOCK, KP] (K = 4: one 16-byte row a channel)
        w = tl.load(w_ptr + (c0 + ch)[:, None] * K + tap[None, :], mask=ok[:, None] & (tap[None, :] < K), other=0.0)
        # the block's state, flat: f = channel * (K-1) + tap (SP = K-1 rounded up to a power of 2)
        f = tl.arange(0, SP * BLOCK)
        f_ok = f < (K - 1) * tl.minimum(W - cb, BLOCK)  # a bound, not f // (K-1): keeps the loads vectorised
        flat = tl.load(s_ptr + t * s_st + c0 * (K - 1) + f, mask=f_ok, other=0.0)
        u = tl.load(u_ptrs, mask=ok, other=0.0)
        # window slot (channel, tap < K-1) <- flat state position; the newest tap is u
        slot = tl.arange(0, BLOCK * KP)
        from_state = tl.minimum((slot // KP) * (K - 1) + slot % KP, SP * BLOCK - 1)
        win = tl.reshape(tl.gather(flat, from_state, 0), (BLOCK, KP))
        win = tl.where(tap[None, :] < K - 1, win, tl.where(tap[None, :] == K - 1, u[:, None], 0.0))
        acc = tl.sum(win.to(tl.float32) * w, axis=1)
        tl.store(conv_ptr + t * C + c0 + ch, acc / (1.0 + tl.exp(-acc)), mask=ok)  # silu
        # new state position f <- window slot (f // (K-1), f % (K-1) + 1): the window rolls by one tap
        to_state = tl.minimum((f // (K - 1)) * KP + f % (K - 1) + 1, BLOCK * KP - 1)
        new_state = tl.gather(tl.reshape(win, (BLOCK * KP,)), to_state, 0)
        tl.store(ns_ptr + (t * C + c0) * (K - 1) + f, new_state, mask=f_ok)  # contiguous [T, C, K-1]


def pick_config(T: int, width: int) -> dict:
    """BLOCK channels a program at every T and width (measured on H200 against 256-1024 at K3's widths,
    1-64 tokens), four warps: with one, Triton gathers across lanes by shuffles, which cost more than
    the whole step at one token."""
    return {"BLOCK": BLOCK, "num_warps": 4}


def run(conv_state, q, k, v, weight, config: dict | None = None, out: tuple | None = None):
    """(conv, new_state); `out` = (conv, new_state) contiguous buffers to write instead of new ones."""
    T, C, km1 = conv_state.shape
    W = q.shape[1]
    cfg = config or pick_config(T, W)
    if out is None:
        conv = torch.empty((T, C), dtype=torch.float32, device=conv_state.device)
        new_state = torch.empty((T, C, km1), dtype=conv_state.dtype, device=conv_state.device)
    else:
        conv, new_state = out
        assert conv.is_contiguous() and new_state.is_contiguous() and new_state.shape == conv_state.shape
    if T == 0 or W == 0:
        return conv, new_state
    grid = (T, 3, -(-W // cfg["BLOCK"]))
    _kda_conv_kernel[grid](
        conv_state, q, k, v, weight, conv, new_state, W,
        conv_state.stride(0), q.stride(0), k.stride(0), v.stride(0),
        K=km1 + 1, KP=triton.next_power_of_2(km1 + 1), SP=triton.next_power_of_2(km1), BLOCK=cfg["BLOCK"],
        num_warps=cfg["num_warps"])
    return conv, new_state
