"""SGLang's facts for k3fuse, and the hook that installs k3fuse's pass in every SGLang process.

SGLang's decode compile (`--enable-torch-compile`) wraps the model in a plain `torch.compile`
during CUDA-graph capture, so the global Inductor hook `post_grad_custom_post_pass` is honoured.
`sglang_hook.install()` sets it (and the `sglang.srt.plugins` entry point calls it in every
SGLang process); the pass finds SGLang's TP group when it runs, in the worker.

Spellings in SGLang's graphs:
  all-reduce  torch.ops.sglang.outplace_all_reduce(x, group_name, method)         out of place
              torch.ops.sglang.flashinfer_allreduce(x, group_name)                 out of place (FlashInfer)
              torch.ops.sglang.inplace_all_reduce(x, group_name)  mutates x (functionalised:
              auto_functionalized(...) -> getitem, copied back into x)
  norm        native ATen: the residual added in fp32 (x.float() + residual.float()), kept in the
              trunk dtype (fp32_residual.translate_fp32_residual_norms)
Nothing here imports SGLang at import time.
"""
from __future__ import annotations

import sys
import torch.distributed as dist

from .. import doors, engine_ops, fp32_residual
from .base import Engine, EngineError

#: SGLang releases with K3 model code that k3fuse's adapters were checked against: 0.5.17 (torch 2.11), 0.5.18-0.5.21
#: (2.13), 0.5.22 and 0.5.23 (2.14.1). 0.5.22 and 0.5.23 by reading their release wheels' source (the ops, parallel
#: state, plugin loader, hook registry, worker step and decode compile are unchanged) and by running
#: tests/test_engine_sglang.py on that source; CI runs 0.5.21's source (SGLang pins CUDA torch).
ENGINE = Engine("SGLang", "sglang", ("sglang",), (0, 5, 17), (0, 5, 24))

OUTPLACE_ALL_REDUCE = "sglang::outplace_all_reduce"
INPLACE_ALL_REDUCE = "sglang::inplace_all_reduce"
#: `flashinfer_allreduce(Tensor tensor, str group_name) -> Tensor` (srt/distributed/parallel_state.py, 0.5.21-0.5.23):
#: what GroupCoordinator.all_reduce emits under torch.compile where FlashInfer's all-reduce applies; out of place
FLASHINFER_ALL_REDUCE = "sglang::flashinfer_allreduce"


def _parallel_state():  # type: ignore[no-untyped-def]
    if "sglang" not in sys.modules:
        return None
    from sglang.srt.distributed import parallel_state

    return parallel_state


def tp_group() -> dist.ProcessGroup | None:
    """SGLang's TP device group in this process, or None when its parallel state is not set up."""
    ps = _parallel_state()
    if ps is None:
        return None
    try:
        coordinator = ps.get_tp_group()
    except Exception:  # SGLang asserts or raises AttributeError before initialize_model_parallel
        return None
    return getattr(coordinator, "device_group", None)


def c10d_group_name(group_name: str) -> str:
    """The torch process group behind SGLang group `group_name` (e.g. "tp:0"), by its c10d name."""
    ps = _parallel_state()
    ref = getattr(ps, "_groups", {}).get(group_name) if ps is not None else None
    coordinator = ref() if ref is not None else None
    if coordinator is None or coordinator.device_group is None:
        known = sorted(getattr(ps, "_groups", {})) if ps is not None else []
        raise EngineError(f"the graph all-reduces over SGLang group {group_name!r}, which this process does not "
                          f"have (SGLang groups here: {known or 'none'})",
                          "run the pass in the SGLang worker that traced the graph")
    return coordinator.device_group.group_name


doors.register_engine_group(doors.EngineGroup("sglang", ENGINE.name, ENGINE.module, tp_group))
engine_ops.register_engine_spelling(engine_ops.AllReduceSpelling(OUTPLACE_ALL_REDUCE, "SGLang", c10d_group_name))
fp32_residual.register_fp32_residual_norm("SGLang")
engine_ops.register_engine_spelling(engine_ops.AllReduceSpelling(INPLACE_ALL_REDUCE, "SGLang", c10d_group_name,
                                                                 mutates=True))
engine_ops.register_engine_spelling(engine_ops.AllReduceSpelling(FLASHINFER_ALL_REDUCE, "SGLang", c10d_group_name))


__all__ = ["ENGINE", "OUTPLACE_ALL_REDUCE", "INPLACE_ALL_REDUCE", "FLASHINFER_ALL_REDUCE", "tp_group", "c10d_group_name"]
