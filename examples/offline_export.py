"""Door (c): rewrite a torch.export program offline, save it, load it, run it; 2 gloo ranks.

    python examples/offline_export.py --out /tmp/k3 --log /tmp/k3fuse.jsonl

Each rank exports its TP shard of the reference K3 decode model, saves the export as
`<out>/export_rank<r>.pt2`, rewrites it with `k3fuse.apply(ep, ctx)`, saves `<out>/rank<r>.pt2`,
loads it back with `k3fuse.offline.load_program` (which runs no code from the file, unlike
torch.export.load; the k3fuse ops are registered by `import k3fuse`) and checks it against the eager
model. Both are saved with `k3fuse.offline.save_program`, which records the size of the live
process group on every collective (an all-reduce names its group, not its size), so the export
can be rewritten from the command line too, with the TP size read from the graph and any
`--tp` checked against it:  k3fuse apply <out>/export_rank0.pt2 -o out.pt2 --tokens 1-64 --log FILE
"""
from __future__ import annotations

import argparse
import os
import tempfile

import torch

import k3fuse
from k3fuse.tools.cli import print_rewrite_summary
from k3fuse.dist import launch
from k3fuse.model import K3DecodeStack, get_config
from k3fuse.offline import load_program, save_program


def worker(rank: int, world_size: int, layers: int, tokens: int, out_dir: str,
           log_path: str | None) -> dict:
    model = K3DecodeStack(get_config("tiny", n_layers=layers), tp_size=world_size, rank=rank, seed=0).eval()
    torch.manual_seed(0)
    x = torch.randn(tokens, model.config.hidden)
    state = model.init_state(tokens)
    ep = torch.export.export(model, (x, state))
    save_program(ep, os.path.join(out_dir, f"export_rank{rank}.pt2"))  # records the group's size
    ctx = k3fuse.DecodeContext.from_process_group()
    new_ep, log = k3fuse.apply(ep, ctx, log=log_path)
    path = os.path.join(out_dir, f"rank{rank}.pt2")
    save_program(new_ep, path)
    loaded = load_program(path)
    k3fuse.reset_stats()
    with torch.no_grad():
        y, _ = loaded.module()(x, state)
        k3fuse.check_collectives()  # after each step: a failed fused collective raises here
        y_ref, _ = model(x, state)
    return {"summary": log.summary(), "active": log.active_rules(), "path": path, "stats": k3fuse.stats(),
            "fused_ops": sorted({str(n.target) for n in loaded.graph.nodes
                                 if n.op == "call_function" and str(n.target).startswith("k3fuse.")}),
            "max_abs_diff": (y - y_ref).abs().max().item()}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--layers", type=int, default=2, help="decoder layers of the tiny K3 config")
    p.add_argument("--batch", type=int, default=4, help="tokens decoded per step, one per sequence (1-64)")
    p.add_argument("--out", default=None, help="directory for rank<r>.pt2 (default: a temp dir)")
    p.add_argument("--log", default=None)
    args = p.parse_args(argv)
    out_dir = args.out or tempfile.mkdtemp(prefix="k3fuse_offline_")
    os.makedirs(out_dir, exist_ok=True)
    results = launch(worker, args.tp, backend="gloo", timeout_s=540,
                     args=(args.layers, args.batch, out_dir, args.log))
    r0 = results[0]
    print(f"saved: {[r['path'] for r in results]}")
    print(f"rules that fired: {r0['active'] or 'none'}; fused ops in the program: {r0['fused_ops'] or 'none'}")
    print_rewrite_summary(r0["summary"], title="rewrite log, rank 0")
    print(f"fused op implementations: {r0['stats'] or 'none ran'}")
    print(f"max |loaded - eager| over ranks: {max(r['max_abs_diff'] for r in results):.2e}")
    return {"results": results, "out_dir": out_dir}


if __name__ == "__main__":
    main()
