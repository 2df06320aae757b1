"""k3fuse: compiler passes for Kimi K3 decode.

Three doors into one rewrite pipeline:
  torch.compile(model, backend="k3fuse")                      (k3fuse.backend)
  torch._inductor.config.post_grad_custom_post_pass = k3fuse.inductor_pass(ctx)
      (SGLang: k3fuse.engines.sglang.install(); vLLM: the InductorPass instance k3fuse.vllm_pass)
  new_ep, log = k3fuse.apply(exported_program, ctx)            (k3fuse.offline)

`k3fuse.vllm_pass` and `k3fuse.VllmK3FusePass` import vLLM: they are set when k3fuse finds vLLM
already imported (vLLM resolves `inductor_passes` names through the module's __dict__, not
__getattr__) and otherwise on first access; importing k3fuse never imports vLLM.

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
    "check_collectives": "kernels.collective_guard",
}

if TYPE_CHECKING:
    from .compat import UnsupportedTorchVersion, check_torch_version
    from .context import DecodeContext
    from .inductor import K3FusePass
    from .log import RewriteLog
    from .offline import apply
    from .kernels.collective_guard import check_collectives
    from .runtime import disable, reset_stats, stats, strict

    VllmK3FusePass: Any
    vllm_pass: Any


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
    if "vllm" in sys.modules and "vllm_pass" not in module.__dict__:
        try:
            _load_vllm_pass()
        except Exception as exc:  # an unsupported vLLM must not break plain-torch use; access re-raises
            import logging

            logging.getLogger("k3fuse").warning("k3fuse.vllm_pass not defined: %s", exc)


#: names whose definition imports vLLM (k3fuse.engines.vllm_pass)
_VLLM_NAMES = ("vllm_pass", "VllmK3FusePass")


def _load_vllm_pass() -> None:
    from .engines import vllm_pass

    module = sys.modules[__name__]
    module.__dict__.setdefault("VllmK3FusePass", vllm_pass.VllmK3FusePass)
    module.__dict__.setdefault("vllm_pass", vllm_pass.default_pass())


def vllm_plugin() -> None:
    """vLLM's `vllm.general_plugins` entry point: define `k3fuse.vllm_pass` in every vLLM process,
    so that `inductor_passes` can name it."""
    _load_vllm_pass()


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        load()
        return globals()[name]
    if name in _VLLM_NAMES:
        load()
        _load_vllm_pass()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def inductor_pass(ctx: DecodeContext | dict[str, Any] | None = None, **kwargs: Any) -> K3FusePass:
    """`k3fuse.inductor.inductor_pass` (imported on first use: torch._inductor is slow to import)."""
    load()
    from .inductor import inductor_pass as _inductor_pass

    return _inductor_pass(ctx, **kwargs)


def _running_as_cli() -> bool:
    """True inside the `k3fuse` command: the console script (argv[0] named k3fuse) or
    `python -m k3fuse.tools.cli`; its `main` checks the settings itself and reports them in one line."""
    arg0 = sys.argv[0] if sys.argv and sys.argv[0] else ""
    name = os.path.basename(arg0)
    as_script = name.split(".")[0] == "k3fuse" and not name.endswith(".py")
    orig = list(getattr(sys, "orig_argv", []))
    as_module = any(a == "-m" and b == "k3fuse.tools.cli" for a, b in zip(orig, orig[1:]))
    return as_script or as_module


if not _running_as_cli():
    from . import settings as _settings

    _settings.check_environment()  # every K3FUSE_* variable, once, where the process starts
    load()
    from .pipeline import all_rules as _all_rules

    _settings.check_rule_names([_rule.name for _rule in _all_rules()])  # K3FUSE_RULES, now that the rules are known

__all__ = [
    "DecodeContext",
    "apply",
    "inductor_pass",
    "stats",
    "reset_stats",
    "strict",
    "disable",
    "check_collectives",
    "RewriteLog",
    "UnsupportedTorchVersion",
    "check_torch_version",
    "load",
    "vllm_plugin",
]
