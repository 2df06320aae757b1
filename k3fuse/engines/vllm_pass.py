"""k3fuse's pass as vLLM's InductorPass (importing this module imports vLLM).

vLLM asserts that its `post_grad_custom_post_pass` is an instance of its own InductorPass and
resolves `CompilationConfig.inductor_passes` names as `__import__("k3fuse").__dict__[name]`, an
object, not a factory: so k3fuse puts an instance, `k3fuse.vllm_pass`, into its namespace when it
finds vLLM imported (and vLLM's general-plugin entry point, `k3fuse.vllm_plugin`, makes sure of
it in every vLLM process). The instance builds its context from vLLM's TP group when it first runs, in the worker.
"""
from __future__ import annotations

from typing import Any

from ..inductor import K3FusePass
from . import vllm as facts

facts.ENGINE.check_version()

try:  # vLLM 0.30+
    from vllm.compilation.passes.inductor_pass import InductorPass
except ImportError:  # earlier releases
    from vllm.compilation.inductor_pass import InductorPass  # type: ignore[no-redef]


class VllmK3FusePass(K3FusePass, InductorPass):
    """K3FusePass for vLLM's PostGradPassManager (finds vLLM's TP group by default).

    vLLM calls `is_applicable_for_range` per compile range; k3fuse runs on ranges inside the
    decode token range only (`compile_ranges_endpoints: [64]` gives decode its own graph)."""

    def __init__(self, ctx: Any = None, **kwargs: Any):
        kwargs.setdefault("group", "vllm")
        super().__init__(ctx, **kwargs)

    # K3FusePass's uuid (a hex str, as vLLM's json.dumps cache key needs), not InductorPass's
    # source hash: the rules' source, the context and the switches change the rewrite
    uuid = K3FusePass.uuid
    is_applicable_for_range = K3FusePass.is_applicable_for_range


def default_pass() -> VllmK3FusePass:
    """The instance `k3fuse.vllm_pass` names: the K3 rules, context from vLLM's TP group."""
    return VllmK3FusePass()


__all__ = ["VllmK3FusePass", "default_pass"]
