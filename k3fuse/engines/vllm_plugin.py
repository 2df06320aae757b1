"""k3fuse's K3 model for vLLM, as an opt-in `vllm.general_plugins` entry point (`k3fuse_model`).

vLLM runs every general plugin in every process (API server, engine core, workers) before it builds a model. This
one maps K3's architectures to `k3fuse.engines.vllm_model.K3FuseForCausalLM` in vLLM's `ModelRegistry` (which
replaces vLLM's own mapping), but only when the user asks for it:

    K3FUSE_VLLM_MODEL=1 vllm serve CHECKPOINT ...           # or VLLM_PLUGINS=k3fuse,k3fuse_model

Without it (or with K3FUSE_VLLM_MODEL=0) vLLM serves K3 with its own class, which it does not compile. The
registration names the class by its import path: vLLM imports it (and with it vLLM's model code) only when it
builds that architecture.
"""
from __future__ import annotations

import logging
import os

from .. import settings

logger = logging.getLogger("vllm.k3fuse")  # under vLLM's logger: its handler prints it

#: this plugin's entry-point name (what VLLM_PLUGINS lists)
PLUGIN = "k3fuse_model"
#: the architectures the plugin serves: K3's, and Kimi Linear's (which vLLM maps to the same model code). Not K3.1's
#: KimiK31ForConditionalGeneration (vLLM 0.34 maps it to its K3 class too): its DSA layers are not K3's; vLLM keeps it
ARCHITECTURES = ("KimiK3ForConditionalGeneration", "KimiLinearForCausalLM")
MODEL_CLASS = "k3fuse.engines.vllm_model:K3FuseForCausalLM"
ENV = "K3FUSE_VLLM_MODEL"
#: vLLM's switch that, unset, makes it run K3's architectures as breakable CUDA graphs with compilation off
BREAKABLE_CUDAGRAPH = "VLLM_USE_BREAKABLE_CUDAGRAPH"


def enabled() -> bool:
    """The user asked for k3fuse's model: K3FUSE_VLLM_MODEL=1, or VLLM_PLUGINS names this plugin (K3FUSE_VLLM_MODEL=0
    wins over VLLM_PLUGINS)."""
    switch = settings.get(ENV)
    if switch is not None:
        return switch
    return PLUGIN in {p.strip() for p in os.environ.get("VLLM_PLUGINS", "").split(",")}


def register() -> bool:
    """The entry point: register K3FuseForCausalLM for K3's architectures when enabled; True if it did."""
    if not enabled():
        return False
    from vllm import ModelRegistry

    # vLLM turns compilation off for K3's architectures (it runs them as breakable CUDA graphs unless this is set):
    # k3fuse's model is there to be compiled
    if os.environ.setdefault(BREAKABLE_CUDAGRAPH, "0") != "0":
        logger.warning("k3fuse: %s=%s makes vLLM run K3 uncompiled: k3fuse's passes will not see it; unset it or "
                       "set it to 0", BREAKABLE_CUDAGRAPH, os.environ[BREAKABLE_CUDAGRAPH])
    for arch in ARCHITECTURES:
        ModelRegistry.register_model(arch, MODEL_CLASS)
    logger.info("k3fuse: vLLM serves %s with %s (%s)", ", ".join(ARCHITECTURES), MODEL_CLASS,
                f"{ENV}=1" if settings.get(ENV) else f"VLLM_PLUGINS names {PLUGIN}")
    return True


__all__ = ["register", "enabled", "ARCHITECTURES", "MODEL_CLASS", "PLUGIN", "ENV"]
