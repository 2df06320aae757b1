"""shared_expert_fork on CUDA: the model's bf16 sequence on the side stream, projections by decode-GEMM kernels.

Registered as the fork's "torch.side_stream" implementation (kernels/reference/__init__.py). What it
runs is `reference.shared_expert.branch` (the stock op sequence and rounding points, in the model
dtype, never a float32 upcast), inside `streams.launch`, so every kernel goes on the side stream:
  * each projection through the decode-GEMM kernels registered for `decode_gemm` (CuTe GEMV at 1-2
    tokens, Triton split-K above, whichever supports the shape, in their priority order), and
    through cuBLAS (`F.linear`) where none does; which one ran is counted under the runtime key
    `shared_expert_gemm` (`cute.gemv`, `triton.splitk`, `cublas`), a kernel's own decision, not a
    fallback of the fork;
  * the activation: K3's SiTU-GLU as one Triton kernel (kernels/triton/glu_act.py, counted under
    `shared_expert_act`), any other activation with the stock pointwise ops.
The kernels launch on torch's current stream, which `streams.launch` has made the side stream.
"""
from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from k3fuse import runtime

from . import dispatch, streams
from .reference import shared_expert

GEMM_OP = "decode_gemm"
STATS_KEY = "shared_expert_gemm"
ACT_STATS_KEY = "shared_expert_act"  # which activation ran: the fused kernel or the op-by-op program
CUBLAS = "cublas"


def _kernels() -> list[dispatch.Impl]:
    return [i for i in dispatch.implementations(GEMM_OP)
            if i.name != dispatch.REFERENCE and "cuda" in i.device_types]


def _broken() -> dict[str, str]:
    entry = getattr(dispatch, "_ops", {}).get(GEMM_OP)
    return getattr(entry, "broken", {}) if entry is not None else {}


def linear(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x2 [M, K] @ weight.T (+ bias) in x2's dtype: the first decode-GEMM kernel that supports it, else cuBLAS."""
    broken = _broken()
    for impl in _kernels():
        if impl.name in broken:
            continue
        try:
            reason = impl.supports(x2, weight, bias, None)
        except Exception:
            continue
        if reason is not None:
            continue
        try:
            y = impl.run(x2, weight, bias, None)
        except Exception as exc:
            if runtime.is_strict():
                raise runtime.K3FuseFallbackError(
                    f"k3fuse op shared_expert_fork fell back in strict mode: decode-GEMM kernel "
                    f"{impl.name} failed: {type(exc).__name__}: {exc}") from exc
            broken[impl.name] = f"failed: {type(exc).__name__}: {exc}"[:200]
            warnings.warn(f"k3fuse: shared_expert_fork projection kernel {impl.name} failed ({exc}); "
                          "disabled for this process, cuBLAS runs it", RuntimeWarning, stacklevel=2)
            break
        runtime.record(STATS_KEY, impl.name)
        return y
    runtime.record(STATS_KEY, CUBLAS)
    return F.linear(x2, weight, bias)


@functools.lru_cache(maxsize=64)
def _fused_activation(act: str) -> shared_expert.Activation | None:
    """One Triton kernel for K3's SiTU-GLU (the eager program is a dozen launches), else None."""
    try:
        from .triton import glu_act
    except Exception:
        return None
    params = glu_act.situ_params(act)
    if params is None:
        return None

    def fused(p: Sequence[torch.Tensor]) -> torch.Tensor:
        if glu_act.supports(p[0], p[1]):
            runtime.record(ACT_STATS_KEY, "triton.situ_glu")
            return glu_act.situ_glu(p[0], p[1], *params)
        runtime.record(ACT_STATS_KEY, "torch.ops")
        return shared_expert.activation(act)[1](p)

    return fused


def run(x: torch.Tensor, proj: Sequence[torch.Tensor], proj_bias: Sequence[torch.Tensor],
        w_down: torch.Tensor | None, b_down: torch.Tensor | None, act: str, site: int,
        producer: str = "torch.side_stream") -> None:
    shared_expert.check_branch(x, proj, proj_bias, act)
    act_fn = _fused_activation(act)
    streams.launch(site, shared_expert.reads(x, proj, proj_bias, w_down, b_down),
                   lambda: shared_expert.branch(x, proj, proj_bias, w_down, b_down, act, linear, act_fn),
                   producer)


def warmup(shapes: Sequence[Any]) -> None:
    """Create the side stream (outside any capture) and let the GEMM kernels compile for `shapes`
    (decode_gemm's format: [{"M", "N", "K", "dtype"}], may be empty)."""
    if not torch.cuda.is_available():
        return
    streams.prepare()
    if shapes:
        dispatch.warmup(GEMM_OP, shapes)


__all__ = ["linear", "run", "warmup", "STATS_KEY"]


dispatch.register_impl("shared_expert_fork",
                       dispatch.Impl("torch.side_stream", lambda *a, **k: None, run, priority=0,
                                     device_types=("cuda",), warmup=warmup))
