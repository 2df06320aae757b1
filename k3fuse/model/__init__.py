"""Reference Kimi K3 decode model, tensor-parallel like the engines: the reference-layer stack (stack.py) and
the whole model (model.py: embedding, KDA / MLA / dense / MoE layers in K3's order, LM head, sampling)."""
from .config import PRESETS, K3Config, LayerKind, get_config
from .model import DecodeStep, K3Model, ModelState, check_room, prefill
from .sampling import SamplingConfig
from .stack import DecodeState, K3DecodeStack

__all__ = ["K3Config", "LayerKind", "get_config", "PRESETS", "K3DecodeStack", "DecodeState", "K3Model", "ModelState",
           "DecodeStep", "prefill", "check_room", "SamplingConfig"]
