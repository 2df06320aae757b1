"""Door (a): torch.compile(model, backend="k3fuse") on the reference K3 decode model, 2 gloo ranks.

    python examples/compile_backend.py                 # Inductor after the rewrite
    python examples/compile_backend.py --compiler eager --log /tmp/k3fuse.jsonl

Every rank compiles its TP shard; the context comes from the process group (TP size, group name,
the rewrite settings agreed across ranks). Prints, for rank 0: the rewrite summary, which implementation each
fused op ran (k3fuse.stats()), and the difference from the uncompiled model.
"""
from __future__ import annotations

import argparse

import torch

import k3fuse
from k3fuse.tools.cli import print_rewrite_summary
from k3fuse.dist import launch
from k3fuse.model import K3DecodeStack, get_config


def worker(rank: int, world_size: int, layers: int, compiler: str, tokens: int,
           log_path: str | None) -> dict:
    torch.manual_seed(0)
    model = K3DecodeStack(get_config("tiny", n_layers=layers), tp_size=world_size, rank=rank, seed=0).eval()
    x = torch.randn(tokens, model.config.hidden)
    state = model.init_state(tokens)
    ctx = k3fuse.DecodeContext.from_process_group(tokens=(1, 64))  # collective: every rank calls it
    log = k3fuse.RewriteLog(log_path, rank=rank)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="k3fuse", options={"compiler": compiler, "context": ctx, "log": log})
    k3fuse.reset_stats()
    with torch.no_grad():
        y, _ = compiled(x, state)
        y_ref, _ = model(x, state)
    return {"summary": log.summary(), "active": log.active_rules(), "stats": k3fuse.stats(),
            "max_abs_diff": (y - y_ref).abs().max().item()}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compiler", choices=("inductor", "eager"), default="inductor")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--layers", type=int, default=2, help="decoder layers of the tiny K3 config")
    p.add_argument("--batch", type=int, default=4, help="tokens decoded per step, one per sequence (1-64)")
    p.add_argument("--log", default=None, help="append the rewrite log (JSONL) here")
    args = p.parse_args(argv)
    results = launch(worker, args.tp, backend="gloo", timeout_s=540,
                     args=(args.layers, args.compiler, args.batch, args.log))
    r0 = results[0]
    print(f"rules that fired: {r0['active'] or 'none'}")
    print_rewrite_summary(r0["summary"], title="rewrite log, rank 0")
    print(f"fused op implementations: {r0['stats'] or 'none ran'}")
    print(f"max |compiled - eager| over ranks: {max(r['max_abs_diff'] for r in results):.2e}")
    return {"results": results}


if __name__ == "__main__":
    main()
