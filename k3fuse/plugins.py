"""Install the plug-ins into the framework: the K3 rules as the pipeline's default rules, the kernel
registry as what the guards ask about kernels (after checking torch's version and the settings).

The framework core (pipeline, guards, rule, matcher, verify) imports neither the rules
(k3fuse.patterns) nor the kernels (k3fuse.kernels); the kernels import only the framework's
leaves, the rules the core, the leaves and their ops' Specs. This module is the one place that knows both sides. The package root
(`k3fuse.load`) and the doors (backend, inductor, offline) call `install_plugins()`, so every way in
runs with the K3 rules and the kernels' coverage, whichever was imported first.
"""
from __future__ import annotations

import threading

_lock = threading.Lock()
_installed = False


def install_plugins() -> None:
    """Check torch's version and every K3FUSE_* setting (one clear error, where k3fuse is first
    used), then install the K3 rules and the kernel registry (idempotent, thread-safe)."""
    global _installed
    if _installed:
        return
    with _lock:
        if _installed:
            return
        from . import compat, settings

        compat.check_torch_version()  # fail here, clearly, rather than deep inside tracing
        settings.check_environment(warn=False)  # unknown names: said once, at import or by the command
        from . import engines, guards, pipeline  # noqa: F401  engines: their spellings and TP groups
        from .kernels import dispatch  # importing k3fuse.kernels registers torch.ops.k3fuse.*
        from .patterns import all_rules

        pipeline.install_rule_provider(all_rules)
        guards.install_kernel_catalog(guards.KernelCatalog(dispatch.ops_without_kernel, dispatch.import_errors,
                                                           dispatch.coverage, dispatch.COLLECTIVE_OPS.__contains__))
        _installed = True


__all__ = ["install_plugins"]
