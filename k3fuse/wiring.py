"""Wire the plug-ins into the framework: the K3 rules as the pipeline's default rules, the kernel
registry as what the guards ask about kernels.

The framework core (pipeline, guards, rule, matcher, verify) imports neither the rules
(k3fuse.patterns) nor the kernels (k3fuse.kernels); the rules and kernels import only the
framework's leaves. This module is the one place that knows both sides. The package root
(`k3fuse.load`) and the doors (backend, inductor, offline) call `wire_defaults()`, so every way in
runs with the K3 rules and the kernels' coverage, whichever was imported first.
"""
from __future__ import annotations

import threading

_lock = threading.Lock()
_wired = False


def wire_defaults() -> None:
    """Install the K3 rules and the kernel registry (idempotent, thread-safe)."""
    global _wired
    if _wired:
        return
    with _lock:
        if _wired:
            return
        from . import engines, guards, pipeline  # noqa: F401  engines: their ops' spellings
        from .kernels import dispatch  # importing k3fuse.kernels registers torch.ops.k3fuse.*
        from .patterns import all_rules

        pipeline.install_rule_provider(all_rules)
        guards.install_kernel_catalog(guards.KernelCatalog(dispatch.ops_without_kernel, dispatch.import_errors,
                                                           dispatch.coverage))
        _wired = True


__all__ = ["wire_defaults"]
