"""Running the reference K3 stack through a rewritten program next to the eager model (CPU tests
of single rules, inside gloo ranks): the largest difference over outputs and state, in strict mode."""
from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

import k3fuse
from k3fuse import runtime
from k3fuse.model import K3DecodeStack, get_config


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


def tiny_stack(dtype: str, tp_size: int, rank: int, n_layers: int, batch: int, steps: int):
    """The `tiny` reference stack (seed 5) and `steps` decode inputs of `batch` tokens (seed 11)."""
    model = K3DecodeStack(get_config("tiny", n_layers=n_layers, dtype=dtype), tp_size=tp_size, rank=rank, seed=5)
    gen = torch.Generator().manual_seed(11)
    xs = [torch.randn(batch, model.config.hidden, generator=gen).to(getattr(torch, dtype)) for _ in range(steps)]
    return model, xs


def compiled_door(model, xs, ctx: k3fuse.DecodeContext) -> dict:
    """torch.compile(backend="k3fuse", eager compiler) over xs in strict mode, next to the eager
    model: {"summary": the rewrite log's summary, **strict_steps}."""
    rlog = k3fuse.RewriteLog()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="k3fuse", fullgraph=True,
                             options={"compiler": "eager", "context": ctx, "log": rlog})
    res = strict_steps(compiled, model, xs)  # compiles (and rewrites) on the first call
    return {"summary": rlog.summary(), **res}


def reference_then_stock(op: Any, args: tuple, spelled: Any) -> tuple:
    """`op` (a torch.ops.k3fuse packet) on CPU in strict mode runs and counts its reference, close to
    the model's `spelled` function; under the kill switch it runs (counted `fallback:disabled`) the
    stock sequence, `spelled`'s bits. Returns (the reference's outputs, spelled's)."""
    name = op._qualified_op_name.split("::")[1]
    runtime.reset_stats()
    with runtime.strict():
        got = op(*args)
    assert runtime.stats() == {name: {"reference": 1}}
    want = spelled(*args)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    runtime.reset_stats()
    with k3fuse.disable():
        stock = op(*args)
    assert runtime.stats() == {name: {"fallback:disabled": 1}}
    assert all(torch.equal(s, w) for s, w in zip(stock, want))
    return got, want


def assert_one_graph_serves_dynamic_tokens(experts: torch.nn.Module, router: torch.Tensor, inputs, rule: str,
                                           op: str) -> None:
    """torch.compile(backend="k3fuse"), strict, with the token dim marked dynamic (as a recompile for
    a second batch size makes it) over a module whose expert ids come from its tokens (one symbolic
    T): the rule rewrites one graph, and that graph serves 3, 5 and 9 tokens on the op's reference.
    `inputs(experts, T)` returns (a, anything)."""
    torch._dynamo.reset()

    class Routed(torch.nn.Module):
        def forward(self, a):
            return experts(a, torch.topk(a.float() @ router.T, experts.k, dim=-1).indices)

    module = Routed()
    log = k3fuse.RewriteLog()
    fn = torch.compile(module, backend="k3fuse", options={"context": k3fuse.DecodeContext(strict=True), "log": log})
    runtime.reset_stats()
    with torch.no_grad(), runtime.strict():
        for T in (3, 5, 9):
            a, _ = inputs(experts, T=T)
            torch._dynamo.mark_dynamic(a, 0)
            torch.testing.assert_close(fn(a).float(), module(a).float(), rtol=2e-2, atol=2e-2)
    assert log.applied(rule) == 1  # one graph, symbolic in T, serves all three token counts
    assert runtime.stats()[op] == {"reference": 3} and runtime.fallbacks() == {}
