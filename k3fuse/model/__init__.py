"""Reference Kimi K3 decode model (KDA + LatentMoE layers), tensor-parallel like the engines."""
from .config import PRESETS, K3Config, get_config
from .stack import DecodeState, K3DecodeStack

__all__ = ["K3Config", "get_config", "PRESETS", "K3DecodeStack", "DecodeState"]
