"""Running the reference K3 stack through a rewritten program next to the eager model (CPU tests
of single rules, inside gloo ranks): the largest difference over outputs and state, in strict mode."""
from __future__ import annotations

from typing import Any

import torch.utils._pytree as pytree

from k3fuse import runtime


def max_diff(a: Any, b: Any) -> float:
    """Largest absolute difference over the tensor leaves of two pytrees of the same structure."""
    return max(float((x.double() - y.double()).abs().max()) for x, y in zip(pytree.tree_leaves(a),
                                                                             pytree.tree_leaves(b)))


def strict_steps(fn, model, xs) -> dict:
    """Decode steps xs through `fn` (rewritten) and `model` (eager), each carrying its own state,
    in strict mode: {"err": largest difference, "stats": runtime stats, "fallbacks": ...}."""
    runtime.reset_stats()
    state_f = state_m = model.init_state(xs[0].shape[0])
    err = 0.0
    with runtime.strict():
        for x in xs:
            y_f, state_f = fn(x, pytree.tree_map(lambda t: t.contiguous(), state_f))
            y_m, state_m = model(x, state_m)
            err = max(err, max_diff((y_f, state_f), (y_m, state_m)))
    return {"err": err, "stats": runtime.stats(), "fallbacks": runtime.fallbacks()}
