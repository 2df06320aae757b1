"""k3fuse's pass in every SGLang process, before CUDA-graph capture, and the collectives' check
after every worker step.

SGLang's decode compile (`--enable-torch-compile`) is a plain torch.compile, which honours the
global Inductor hook: `install()` sets it, and registers the post-step check (an AFTER hook of the
worker's step through SGLang's HookRegistry: k3fuse/engines/step_check.py). The
`sglang.srt.plugins` entry point `k3fuse` (`plugin`) calls it in every SGLang process (main,
scheduler, TP workers) when SGLANG_PLUGINS names k3fuse; SGLang applies the hook after its plugins ran.
"""
from __future__ import annotations

import os
import sys
from typing import Any

from ..inductor import K3FusePass, contains_k3fuse_pass
from . import step_check
from .base import EngineError
from .sglang import ENGINE


def install(ctx: Any = None, **kwargs: Any) -> Any:
    """Install k3fuse's pass as the global Inductor post-grad hook for SGLang's decode compile.

    `ctx` and `kwargs` are `k3fuse.inductor.K3FusePass`'s; without a context the pass builds one
    from SGLang's TP group when it first runs. With SGLang imported, also registers the post-step
    check of the collectives (applied by SGLang's `load_plugins`, or its `HookRegistry.apply_hooks()`). Raises EngineError when the installed SGLang is not
    supported or a k3fuse pass is already installed (adding it twice would rewrite every graph
    twice). Returns the pass.
    """
    from torch._inductor import config as inductor_config

    if "sglang" in sys.modules or ENGINE.installed_version() is not None:
        ENGINE.check_version()
    existing = inductor_config.post_grad_custom_post_pass
    if contains_k3fuse_pass(existing):
        raise EngineError("k3fuse's pass is already installed as post_grad_custom_post_pass",
                          "install it once per process (the k3fuse SGLang plugin already does)")
    kwargs.setdefault("group", "sglang")
    pass_ = K3FusePass(ctx, chain=existing, **kwargs)
    inductor_config.post_grad_custom_post_pass = pass_
    if "sglang" in sys.modules:   # SGLang's hook registry (the tests install without SGLang too)
        step_check.register_sglang()
    return pass_


def plugin() -> None:
    """The `sglang.srt.plugins` entry point: `install()` with the defaults, once per process, when
    SGLANG_PLUGINS names k3fuse (opt in: the hook applies to every torch.compile in the process)."""
    from torch._inductor import config as inductor_config

    named = {p.strip() for p in os.environ.get("SGLANG_PLUGINS", "").split(",")}
    if "k3fuse" in named and not contains_k3fuse_pass(inductor_config.post_grad_custom_post_pass):
        install()


__all__ = ["install", "plugin"]
