"""Plain-torch implementations: the numerical oracle, the CPU path and the stock fallbacks.

Importing this package registers, for every op, the "reference" Impl (priority -100, any device)
and the stock sequence (kernels/reference/stock.py) with kernels.dispatch. The shared-expert fork
also gets "torch.side_stream" on CUDA (kernels/cuda_shared_expert.py): the model's own sequence in the
model dtype launched on the side stream, projections by the decode-GEMM kernels (cuBLAS where none
supports the shape); a real implementation (the op exists for the overlap), not a fallback.
"""
from __future__ import annotations

from ..dispatch import ALL_DEVICES, REFERENCE, Impl, register_impl, register_stock
from . import allreduce, kda_delta, linear, moe_front, prefetch, shared_expert, stock

REFERENCE_PRIORITY = -100


def _always(*args: object, **kwargs: object) -> None:
    return None


def _register() -> None:
    runs = {
        "gemm_ar_residual": allreduce.gemm_ar_residual,
        "gemm_ar_residual_rmsnorm": allreduce.gemm_ar_residual_rmsnorm,
        "moe_front_sharded": moe_front.moe_front_sharded,
        "shared_expert_fork": shared_expert.make_fork_run(REFERENCE),
        "decode_gemm": linear.decode_gemm,
        "l2_prefetch": prefetch.l2_prefetch,
        "kda_delta_rule": kda_delta.kda_delta_rule,
    }
    for op, run in runs.items():
        register_impl(op, Impl(REFERENCE, _always, run, REFERENCE_PRIORITY, ALL_DEVICES))
        register_stock(op, getattr(stock, op))
    from .. import cuda_shared_expert

    register_impl("shared_expert_fork",
                  Impl("torch.side_stream", _always, cuda_shared_expert.run, priority=0,
                       device_types=("cuda",), warmup=cuda_shared_expert.warmup))


_register()
