"""Everything a rule may use from the framework, in one place: `from k3fuse.rule_api import ...`.

A rule (patterns/<rule>.py) imports the framework only from here; besides this it reads the K3
math (`k3fuse.spelling`, `k3fuse.quant`), its ops' Specs (`k3fuse.kernels.ops.<op>`) and the
pattern helpers (`patterns/_pattern_tools.py`). tests/test_rule_api.py checks it.

* the rule itself: `Rule`, `PatternSpec`, `Variant` (a spelling's form, dtype and typed parameters),
  `Match` (`match.replace_with(op, **arguments)` for the common rewrite), `RewriteError`;
* guards: `GuardFailure`, `failures` and the reusable predicates, `DecodeContext`;
* the matcher, for rules that find their sites themselves: `compile_pattern`, `compiled_patterns`,
  `find_matches`, `near_miss`, `int_sentinel`;
* the vocabulary the matcher reads graphs with (`canonical`, `skip_transparent`, `forward_users`...)
  and graph facts (`node_order`, `node_value`, `op_qualname`...);
* the functional collectives a pattern or a structural rule names: `ALL_REDUCE`, `WAIT_TENSOR`.
"""
from __future__ import annotations

from .compat import ALL_REDUCE, WAIT_TENSOR
from .context import ContextError, DecodeContext
from .graph_facts import (is_collective, is_erased, is_static_value, is_sync, node_order, node_value, op_qualname,
                          tensor_value)
from .guards import (GuardFailure, divisible, failures, is_static, kernel_covers, same_group, shape_of, site_tokens,
                     static_weight, token_count, tp_at_least)
from .matcher import CompiledPattern, compile_pattern, compiled_patterns, find_matches, int_sentinel, near_miss
from .rewrite_site import Match, PatternSpec, RewriteError, Variant
from .rule import Rule
from .vocabulary import (CAST, CAST_OPS, TRANSPOSE_LAST2, VIEW_LIKE, canonical, cast_dtype, forward_users,
                         is_layout_only, is_metadata_check, is_transparent, op_key, op_name, skip_transparent,
                         value_root)

__all__ = [
    # the rule
    "Rule", "PatternSpec", "Variant", "Match", "RewriteError",
    # guards and context
    "GuardFailure", "failures", "divisible", "is_static", "kernel_covers", "same_group", "shape_of", "site_tokens",
    "static_weight", "token_count", "tp_at_least", "DecodeContext", "ContextError",
    # the matcher
    "CompiledPattern", "compile_pattern", "compiled_patterns", "find_matches", "near_miss", "int_sentinel",
    # the vocabulary and graph facts
    "canonical", "op_key", "op_name", "cast_dtype", "is_transparent", "is_layout_only", "is_metadata_check",
    "skip_transparent", "value_root", "forward_users", "VIEW_LIKE", "CAST_OPS", "TRANSPOSE_LAST2", "CAST",
    "node_order", "node_value", "tensor_value", "op_qualname", "is_collective", "is_sync", "is_static_value",
    "is_erased",
    # the functional collectives
    "ALL_REDUCE", "WAIT_TENSOR",
]
