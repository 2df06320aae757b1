"""The Kimi K3 decode rules (k3fuse.patterns), one fusion family per file, in pipeline order.

1. oproj_allreduce_residual  row-parallel projection -> all_reduce -> residual add [-> RMSNorm]
2. moe_front_sharded         replicated router + latent down-projection -> sharded GEMM + all-gather
3. shared_expert_stream      shared-expert MLP -> side stream (fork/join)
4. decode_gemm               remaining static-weight projections -> decode GEMM
5. weight_prefetch           native collectives left -> L2 prefetch of the next static weights

The order matters: 1 takes the shared down-projection into the MoE reduction before 3 moves the
rest of the shared MLP to the side stream; 4 takes only what 1-3 left; 5 runs last so it sees
the final ops after each remaining wait (e.g. decode_gemm(W_up) after the latent all-reduce).
"""
from __future__ import annotations

from k3fuse.rule import Rule

from .decode_gemm import DecodeGemm
from .moe_front_sharded import MoEFrontSharded
from .oproj_allreduce_residual import OProjAllReduceResidual
from .shared_expert_stream import SharedExpertStream
from .weight_prefetch import WeightPrefetch

RULE_CLASSES: tuple[type[Rule], ...] = (OProjAllReduceResidual, MoEFrontSharded, SharedExpertStream, DecodeGemm,
                                        WeightPrefetch)


def default_rules() -> list[Rule]:
    """Fresh instances of the K3 rules, in pipeline order."""
    return [cls() for cls in RULE_CLASSES]


def describe() -> list[tuple[str, str]]:
    """(name, description) of every rule, in pipeline order."""
    return [(cls.name, cls.description) for cls in RULE_CLASSES]


__all__ = ["default_rules", "describe", "RULE_CLASSES", "OProjAllReduceResidual", "MoEFrontSharded",
           "SharedExpertStream", "DecodeGemm", "WeightPrefetch"]
