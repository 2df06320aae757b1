"""Door (b): k3fuse as Inductor's post_grad_custom_post_pass (plain torch.compile; SGLang's decode compile).

    python examples/inductor_pass.py --log /tmp/k3fuse.jsonl

Each of 2 gloo ranks installs `k3fuse.inductor_pass(ctx)` (which chains any pass already there)
and compiles the reference K3 decode model with plain torch.compile. The pass's uuid() hashes the
rules and the context, so Inductor's cache recompiles when either changes. vLLM ignores this global
hook: it takes `k3fuse.vllm_pass` in its CompilationConfig (README, "Inside the serving engines").
"""
from __future__ import annotations

import argparse

import torch

import k3fuse
from k3fuse.tools.cli import print_rewrite_summary
from k3fuse.dist import launch
from k3fuse.model import K3DecodeStack, get_config


def worker(rank: int, world_size: int, layers: int, tokens: int, log_path: str | None) -> dict:
    model = K3DecodeStack(get_config("tiny", n_layers=layers), tp_size=world_size, rank=rank, seed=0).eval()
    torch.manual_seed(0)
    x = torch.randn(tokens, model.config.hidden)
    state = model.init_state(tokens)
    ctx = k3fuse.DecodeContext.from_process_group()
    log = k3fuse.RewriteLog(log_path, rank=rank)
    k3fuse_pass = k3fuse.inductor_pass(ctx, log=log)
    torch._dynamo.reset()
    # no compile cache: a cache hit would skip the pass, and this example shows its decisions
    with torch._inductor.config.patch(post_grad_custom_post_pass=k3fuse_pass, fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        compiled = torch.compile(model)
        with torch.no_grad():
            y, _ = compiled(x, state)
            k3fuse.check_collectives()  # after each step: a failed fused collective raises here
            y_ref, _ = model(x, state)
    return {"summary": log.summary(), "active": log.active_rules(), "uuid": k3fuse_pass.uuid()[:12],
            "max_abs_diff": (y - y_ref).abs().max().item()}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--layers", type=int, default=2, help="decoder layers of the tiny K3 config")
    p.add_argument("--batch", type=int, default=4, help="tokens decoded per step, one per sequence (1-64)")
    p.add_argument("--log", default=None)
    args = p.parse_args(argv)
    results = launch(worker, args.tp, backend="gloo", timeout_s=540,
                     args=(args.layers, args.batch, args.log))
    r0 = results[0]
    print(f"pass uuid (cache key part): {r0['uuid']}")
    print(f"rules that fired: {r0['active'] or 'none'}")
    print_rewrite_summary(r0["summary"], title="rewrite log, rank 0")
    print(f"max |compiled - eager| over ranks: {max(r['max_abs_diff'] for r in results):.2e}")
    return {"results": results}


if __name__ == "__main__":
    main()
