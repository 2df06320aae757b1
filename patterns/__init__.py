"""The Kimi K3 decode rules (k3fuse.patterns), one fusion family per file, in pipeline order.

1. oproj_allreduce_residual  row-parallel projection -> all_reduce -> residual add [-> RMSNorm]
2. moe_tail_allreduce_norm   MoE latent all_reduce -> latent RMSNorm -> one op (off by default: not
                             measured on two GPUs yet)
3. moe_front_sharded         replicated router + latent down-projection -> sharded GEMM + all-gather
4. fused_routing             router tail (sigmoid, bias, top-k, renormalise, scale) -> one kernel
5. routed_experts            routed experts (grouped GEMMs or gathered bmm over the pairs) -> one op
6. moe_combine               routed experts' weighted sum over the slots + cast -> one coalesced kernel
7. shared_expert_stream      shared-expert MLP -> side stream (fork/join)
8. kda_short_conv            KDA short conv over [q; k; v] (window, taps, silu, new state) -> one kernel
9. kda_delta_rule            KDA delta-rule step -> one pass over the fp32 recurrent state
10. mla_decode               MLA attention core over the paged latent cache -> flash-decoding kernel
11. decode_gemm              remaining static-weight projections -> decode GEMM
12. weight_prefetch          native collectives left -> L2 prefetch of the next static weights

The order matters: 1 takes the shared down-projection into the MoE reduction before 7 moves the
rest of the shared MLP to the side stream; 2 runs after 1 (1's patterns start at a linear and go
through a residual add, the latent all-reduce has neither, so 1 never takes 2's site) and touches
only the latent all-reduce and its norm; 4 runs after 3 (3 finds the router by walking back from
the expert top-k, which 4 replaces) and reads the logits 3 produces; 5 runs after 4 and reads the
expert ids 4 produces (it touches no linear or collective); 6 reads 5's z and 4's weights and its
output feeds the latent all-reduce (2's op reads it from 6's op when 2 is on: a match's output is
rewired); 7 anchors its join on the routed output downstream of 5's and 6's ops (after the latent
all-reduce, norm and W_up), which still reads the MoE input, so 6 and 7 find their sites in either
order; 8 and 9 touch no projection or collective, so they do not interact with the others (8 reads
the q, k, v projections' outputs and 9's operands are computed from 8's conv output: either order
finds both sites); 10 reads only the cache, the table, the lengths and q, whatever produced q (decode_gemm's
projections or the model's), and touches no projection or collective; 11 takes only what 1-7 left (W_up reads
2's normed output, and the MLA layer's q_a, q_b, kv_a and gate projections stay for it); 12 runs last so it
sees the final ops after each remaining wait (e.g. decode_gemm(W_up) after the latent all-reduce,
when 2 is off).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from k3fuse.rule_api import Rule

#: the rules in pipeline order: each is the name of its module here and of its Rule. Torch-free, so
#: that `import k3fuse` can check K3FUSE_RULES against it before anything imports torch.
RULE_NAMES: tuple[str, ...] = (
    "oproj_allreduce_residual", "moe_tail_allreduce_norm", "moe_front_sharded", "fused_routing", "routed_experts",
    "moe_combine", "shared_expert_stream", "kda_short_conv", "kda_delta_rule", "mla_decode", "decode_gemm",
    "weight_prefetch",
)


def rule_classes() -> tuple[type[Rule], ...]:
    """Every K3 rule's class, in pipeline order (importing a rule's module imports torch)."""
    out = []
    for name in RULE_NAMES:
        module = importlib.import_module(f"{__name__}.{name}")
        (cls,) = [c for c in vars(module).values()
                  if isinstance(c, type) and c.__module__ == module.__name__ and getattr(c, "name", None) == name]
        out.append(cls)
    return tuple(out)


def all_rules() -> list[Rule]:
    """Fresh instances of every K3 rule, in pipeline order (off-by-default ones included)."""
    return [cls() for cls in rule_classes()]


def __getattr__(name: str) -> Any:
    """`RULE_CLASSES` and the rules' classes by name (`from k3fuse.patterns import DecodeGemm`), loaded
    with their modules on first use."""
    if name == "RULE_CLASSES":
        return rule_classes()
    for cls in rule_classes() if name[:1].isupper() else ():
        if cls.__name__ == name:
            return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["RULE_NAMES", "all_rules", "rule_classes"]
