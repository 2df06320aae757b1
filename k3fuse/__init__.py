"""k3fuse: compiler passes for Kimi K3 decode.

Three doors into one rewrite pipeline:
  torch.compile(model, backend="k3fuse")                      (k3fuse.backend)
  torch._inductor.config.post_grad_custom_post_pass = k3fuse.inductor_pass(ctx)
      (SGLang: k3fuse.engines.sglang_hook.install(); vLLM: the InductorPass instance k3fuse.vllm_pass)
  new_ep, log = k3fuse.apply(exported_program, ctx)            (k3fuse.offline)

`import k3fuse` never imports torch, vLLM or the reference model; it checks every K3FUSE_* setting
(but in the `k3fuse` command, which checks them after parsing its arguments: see k3fuse_cli).
`k3fuse.load()` imports torch, checks its version and the K3FUSE_* settings,
registers the torch.ops.k3fuse.* ops (so saved programs load) and installs the K3 rules; the first
use of a public name and every door run it, and `import k3fuse` runs it at once where torch is
already imported (registering then costs nothing more). So the `k3fuse` command answers `--help`
without torch, and code that imports torch before k3fuse finds the ops registered.

`k3fuse.vllm_pass` and `k3fuse.VllmK3FusePass` import vLLM: vLLM resolves `inductor_passes` names
in the module's __dict__, not through __getattr__, so `load()` puts them there when vLLM is
imported, as does vLLM's general-plugin entry point (`k3fuse.vllm_plugin`, run in every vLLM
process); otherwise they load on first access.
"""
from __future__ import annotations

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
    """Import torch, check its version and the K3FUSE_* settings, register the k3fuse ops and wire
    the K3 rules and the kernel registry into the framework (k3fuse.plugins). Idempotent; the first
    use of any public name calls it."""
    from .plugins import install_plugins

    install_plugins()  # torch's version, the settings, torch.ops.k3fuse.* (to load saved programs), the K3 rules

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
    """vLLM's `vllm.general_plugins` entry point, run in every vLLM process: define
    `k3fuse.vllm_pass` (so that `inductor_passes` can name it) and check the collectives after
    every worker step (k3fuse.engines.step_check)."""
    from .engines import step_check

    _load_vllm_pass()
    step_check.install_vllm()


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


# Every K3FUSE_* setting is checked where the process imports k3fuse (K3FUSE_RULES against the rule
# names, which need no torch): a bad value stops the process here, not inside a compiled forward. The
# `k3fuse` command is the exception: its entry point (the top-level module k3fuse_cli) checks them
# itself after parsing its arguments, so that `k3fuse --help` answers whatever the environment holds.
if "k3fuse_cli" not in sys.modules:
    from . import settings as _settings
    from .patterns import RULE_NAMES as _RULE_NAMES

    _settings.check_environment()
    _settings.check_rule_names(list(_RULE_NAMES))

# torch already loaded: registering the ops now costs nothing more. With vLLM imported this also
# defines k3fuse.vllm_pass, which vLLM may look up in this module's __dict__ before its plugins ran
# (LLM(compilation_config=...) builds its config first)
if "torch" in sys.modules:
    load()

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
