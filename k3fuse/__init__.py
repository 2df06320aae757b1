"""k3fuse: compiler passes for Kimi K3 decode.

Three doors into one rewrite pipeline:
  torch.compile(model, backend="k3fuse")                      (k3fuse.backend)
  torch._inductor.config.post_grad_custom_post_pass = k3fuse.inductor_pass(ctx)
  new_ep, log = k3fuse.apply(exported_program, ctx)            (k3fuse.offline)
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .compat import UnsupportedTorchVersion, check_torch_version

check_torch_version()  # fail here, clearly, rather than deep inside tracing

from . import kernels as _kernels  # noqa: E402,F401  registers torch.ops.k3fuse.* (needed to load saved programs)
from .context import DecodeContext  # noqa: E402
from .log import RewriteLog  # noqa: E402
from .offline import apply  # noqa: E402
from .runtime import disable, reset_stats, stats, strict  # noqa: E402

__version__ = "0.1.0"

if TYPE_CHECKING:
    from .inductor import K3FusePass


def inductor_pass(ctx: DecodeContext | dict[str, Any] | None = None, **kwargs: Any) -> K3FusePass:
    """`k3fuse.inductor.inductor_pass` (imported on first use: torch._inductor is slow to import)."""
    from .inductor import inductor_pass as _inductor_pass

    return _inductor_pass(ctx, **kwargs)


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
]
