"""k3fuse: compiler passes for Kimi K3 decode.

Three doors into one rewrite pipeline:
  torch.compile(model, backend="k3fuse")                      (k3fuse.backend)
  torch._inductor.config.post_grad_custom_post_pass = k3fuse.inductor_pass(ctx)
  new_ep, log = k3fuse.apply(exported_program, ctx)            (k3fuse.offline)

`import k3fuse` imports torch and registers the torch.ops.k3fuse.* ops, so saved programs load
anywhere it has run. The `k3fuse` command is the exception: it must answer `--help` in well under a
second, and importing torch takes seconds, so there the public names load on first use instead.
"""
from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: public name -> submodule that defines it
_LAZY = {
    "DecodeContext": "context",
    "RewriteLog": "log",
    "apply": "offline",
    "disable": "runtime",
    "reset_stats": "runtime",
    "stats": "runtime",
    "strict": "runtime",
    "UnsupportedTorchVersion": "compat",
    "check_torch_version": "compat",
}

if TYPE_CHECKING:
    from .compat import UnsupportedTorchVersion, check_torch_version
    from .context import DecodeContext
    from .inductor import K3FusePass
    from .log import RewriteLog
    from .offline import apply
    from .runtime import disable, reset_stats, stats, strict


def load() -> None:
    """Import torch, check its version, register the k3fuse ops and the reference model's
    checkpoint types, and wire the K3 rules and the kernel registry into the framework
    (k3fuse.plugins; idempotent; `import k3fuse` calls it except inside the `k3fuse` command)."""
    from . import compat

    compat.check_torch_version()  # fail here, clearly, rather than deep inside tracing
    from .model import stack  # noqa: F401  DecodeState is a safe global for torch.export.load
    from .plugins import install_plugins

    install_plugins()  # registers torch.ops.k3fuse.* (needed to load saved programs), installs the K3 rules

    module = sys.modules[__name__]
    for name, sub in _LAZY.items():
        if name not in module.__dict__:
            setattr(module, name, getattr(__import__(f"{__name__}.{sub}", fromlist=[name]), name))


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        load()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def inductor_pass(ctx: DecodeContext | dict[str, Any] | None = None, **kwargs: Any) -> K3FusePass:
    """`k3fuse.inductor.inductor_pass` (imported on first use: torch._inductor is slow to import)."""
    load()
    from .inductor import inductor_pass as _inductor_pass

    return _inductor_pass(ctx, **kwargs)


def _running_as_cli() -> bool:
    """True inside the `k3fuse` console script (its argv[0] is the script, named k3fuse)."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return name.split(".")[0] == "k3fuse" and not name.endswith(".py")


if not _running_as_cli():
    load()

__all__ = [
    "DecodeContext",
    "apply",
    "inductor_pass",
    "stats",
    "reset_stats",
    "strict",
    "disable",
    "RewriteLog",
    "UnsupportedTorchVersion",
    "check_torch_version",
    "load",
]
