"""The collectives' post-step check after every step of a serving engine's worker.

Inside vLLM or SGLang a replayed CUDA graph never passes through k3fuse's dispatch, and the step
loop is the engine's, not the user's: a fused collective that timed out on the device (or a peer
that failed) would show only as NaN outputs spreading through the peers' sums. So the adapters run
`check_collectives()` after each step of each worker, and the step raises there, naming the op,
the rank and the peer; the engine then stops as it does on any worker error.

- vLLM (no per-step hook of its own): k3fuse's vLLM plugin (`k3fuse.vllm_plugin`, run in every vLLM
  process) wraps `WorkerWrapperBase.execute_model`, the call every executor makes on every worker.
- SGLang: an AFTER hook on `TpModelWorker.forward_batch_generation` through SGLang's own
  HookRegistry, registered by k3fuse's SGLang plugin (`k3fuse.engines.sglang_hook.plugin`).

The check reads the failure board and the device error words without a device sync (the words'
copy is queued after each step and read at the next check): a device failure raises at the end of
the step after it where the engine reads each step's tokens back before the next step (one more
step where it runs a step ahead), for one 16-byte copy per fused workspace per step; a failure on
the board raises at the end of its own step. Nothing runs while no collective op has run here.
"""
from __future__ import annotations

import functools
import sys
from typing import Any

#: the method every vLLM executor calls on every worker for each step (vLLM 0.27-0.34)
VLLM_STEP = "vllm.v1.worker.worker_base.WorkerWrapperBase.execute_model"
#: SGLang's per-step worker call, hooked through its HookRegistry (SGLang 0.5.17-0.5.23)
SGLANG_STEP = "sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation"
_MARK = "_k3fuse_step_check"


def after_step() -> None:
    """The post-step check: raises the collective error this process's last steps recorded, here
    or on a peer (kernels/collective_guard.check_collectives)."""
    guard = sys.modules.get("k3fuse.kernels.collective_guard")
    if guard is not None:   # no collective op has run here otherwise: nothing can have failed
        guard.check_collectives()


def install_vllm() -> None:
    """Run the check after every `execute_model` of every vLLM worker (idempotent)."""
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    step = WorkerWrapperBase.execute_model
    if getattr(step, _MARK, False):
        return

    @functools.wraps(step)
    def execute_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        output = step(self, *args, **kwargs)
        after_step()
        return output

    setattr(execute_model, _MARK, True)
    WorkerWrapperBase.execute_model = execute_model  # type: ignore[method-assign]


def sglang_after_step(result: Any, *args: Any, **kwargs: Any) -> None:
    """SGLang's AFTER hook signature: (result, *args, **kwargs); returns None (result unchanged)."""
    after_step()


_sglang_registered = False


def register_sglang() -> None:
    """Register the check as an AFTER hook of SGLang's worker step (once per process). SGLang's
    `load_plugins` applies every registered hook after the plugins ran; registered later, it takes
    effect at the next `HookRegistry.apply_hooks()`."""
    global _sglang_registered
    if _sglang_registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(SGLANG_STEP, sglang_after_step, HookType.AFTER)
    _sglang_registered = True


__all__ = ["after_step", "install_vllm", "register_sglang", "sglang_after_step", "VLLM_STEP", "SGLANG_STEP"]
