"""The MoE tail at K3 widths: the latent all-reduce + RMSNorm, and W_up replicated against sharded.

The tail of a LatentMoE layer at TP W: the routed experts' latent partial [T, L] is all-reduced,
RMS-normalised and projected back by the replicated W_up [H, L]. Arms (one run, the same inputs;
µs per decode step, median over CUDA-graph replays of STEPS steps, fresh activations per step,
W_up rotated over COPIES weight copies past the L2, the slower rank):
  norm_stock      torch.compile of the model's spelling: funcol all_reduce (NCCL) + RMSNorm
  norm_k3fuse     k3fuse.allreduce_rmsnorm (Lamport push into every peer's symmetric buffer +
                  the one-shot epilogue: fixed-order sum, RMSNorm), no multicast
  up_stock        torch.compile of F.linear(h, W_up), replicated (cuBLAS)
  up_k3fuse       k3fuse.decode_gemm(h, W_up), replicated (the CuTe GEMV / Triton split-K)
  up_sharded      each rank computes H/W rows of W_up and the ranks all-gather them over NVLink
                  (k3fuse.moe_front_sharded in its one-weight form, fp32 out, cast to bf16): what a
                  sharded W_up would cost (issue 9 item 3 asks which of the two wins per token count)
  tail_stock / tail_k3fuse / tail_sharded   the whole tail in one graph: norm_stock + up_stock
                  compiled together; norm_k3fuse + up_k3fuse; norm_k3fuse + up_sharded
With --world 1 --as-tp N (one GPU) the sharded arm runs on 1/N of W_up's rows with a gather of its
own slot only: what each rank of TP N computes, without NVLink time. Floors: W_up's bytes (or a
rank's 1/W of them) over the copy bandwidth measured in the same process.

    python -m bench.bench_moe_tail [--world 2] [--as-tp 2] [--tokens 1,2,4,8,16,32,64] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from k3fuse.tools.bench.timing import copy_bandwidth, graph_replay_us, slowest_rank
from k3fuse.dist import MULTICAST_OFF, launch
from k3fuse.model.shapes import gemm_site

H, L = gemm_site("w_up").n, gemm_site("w_up").k
STEPS, COPIES, MAX_T, EPS = 20, 4, 64, 1e-5
ARMS = ("norm_stock", "norm_k3fuse", "up_stock", "up_k3fuse", "up_sharded", "tail_stock", "tail_k3fuse",
        "tail_sharded")


def _worker(rank, world, tokens, as_tp, out_json):
    import torch.distributed as dist

    import k3fuse.kernels  # noqa: F401
    from k3fuse import runtime
    from k3fuse.spelling import all_reduce_sum, linear, rms_norm

    dev = torch.device("cuda", rank)
    group = dist.group.WORLD.group_name
    g = torch.Generator(device=dev).manual_seed(0)   # the same replicated weights on every rank
    ups = [(torch.randn(H, L, device=dev, generator=g) * L ** -0.5).bfloat16() for _ in range(COPIES)]
    nw = (torch.randn(L, device=dev, generator=g) * 0.1 + 1).bfloat16()
    tail_op, gemm, front = (torch.ops.k3fuse.allreduce_rmsnorm, torch.ops.k3fuse.decode_gemm,
                            torch.ops.k3fuse.moe_front_sharded)

    def norm_stock(x):
        return rms_norm(all_reduce_sum(x, group), nw, EPS)

    def tail_stock(x, w):
        return linear(norm_stock(x), w)

    def sharded_up(h, w, ranks):
        return front(h, w, None, group, ranks, MAX_T, True)[0].to(h.dtype)

    norm_stock_c = torch.compile(norm_stock, fullgraph=True)
    up_stock_c = torch.compile(linear, fullgraph=True)
    tail_stock_c = torch.compile(tail_stock, fullgraph=True)
    gbps = copy_bandwidth(dev)
    floor = lambda rows: rows * L * 2 / gbps * 1e6   # µs to read `rows` bf16 rows of L once
    out_rows = []
    for T in tokens:
        xs = [torch.randn(T, L, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(STEPS)]
        res: dict = {"M": T}
        for fn, args in ((norm_stock_c, (xs[0],)), (up_stock_c, (xs[0], ups[0])), (tail_stock_c, (xs[0], ups[0]))):
            for _ in range(2):
                fn(*args)
        res["norm_stock"] = graph_replay_us(lambda i: norm_stock_c(xs[i]), STEPS)
        res["up_stock"] = graph_replay_us(lambda i: up_stock_c(xs[i], ups[i % COPIES]), STEPS)
        res["tail_stock"] = graph_replay_us(lambda i: tail_stock_c(xs[i], ups[i % COPIES]), STEPS)
        runtime.reset_stats()
        with runtime.strict():
            tail_op(xs[0], nw, EPS, group, world, MAX_T, True)       # compiles, creates the workspaces
            sharded_up(xs[0], ups[0], world)
            res["norm_k3fuse"] = graph_replay_us(lambda i: tail_op(xs[i], nw, EPS, group, world, MAX_T, True), STEPS)
            res["up_k3fuse"] = graph_replay_us(lambda i: gemm(xs[i], ups[i % COPIES], None, None, True), STEPS)
            res["up_sharded"] = graph_replay_us(lambda i: sharded_up(xs[i], ups[i % COPIES], world), STEPS)
            res["tail_k3fuse"] = graph_replay_us(
                lambda i: gemm(tail_op(xs[i], nw, EPS, group, world, MAX_T, True)[1], ups[i % COPIES], None, None,
                               True), STEPS)
            res["tail_sharded"] = graph_replay_us(
                lambda i: sharded_up(tail_op(xs[i], nw, EPS, group, world, MAX_T, True)[1], ups[i % COPIES], world),
                STEPS)
            if as_tp and world == 1:   # one rank's share of TP as_tp: 1/as_tp of the rows, its own slot
                sl = [w[:H // as_tp].contiguous() for w in ups]
                sharded_up(xs[0], sl[0], 1)
                res["up_slice"] = graph_replay_us(lambda i: sharded_up(xs[i], sl[i % COPIES], 1), STEPS)
                res["floor_slice"] = floor(H // as_tp)
        res["impl"] = runtime.stats()
        for k in (*ARMS, "up_slice"):
            if k in res:
                res[k] = slowest_rank(res[k], dev)
        res["floor_up_replicated"] = floor(H)
        res["floor_up_sharded"] = floor(H // world)
        out_rows.append(res)
        if rank == 0:
            slice_txt = (f"  slice(1/{as_tp}) {res['up_slice']:6.2f} (floor {res['floor_slice']:5.2f})"
                         if "up_slice" in res else "")
            print(f"T={T:2d} norm: stock {res['norm_stock']:6.2f} k3fuse {res['norm_k3fuse']:6.2f} | W_up: stock "
                  f"{res['up_stock']:6.2f} k3fuse {res['up_k3fuse']:6.2f} sharded(W={world}) {res['up_sharded']:6.2f} "
                  f"(floors {res['floor_up_replicated']:5.2f} / {res['floor_up_sharded']:5.2f}) | tail: stock "
                  f"{res['tail_stock']:6.2f} k3fuse {res['tail_k3fuse']:6.2f} sharded {res['tail_sharded']:6.2f}"
                  f"{slice_txt}", flush=True)
    if rank == 0:
        from bench.bench_decode_gemm import conditions

        meta = conditions()
        meta.update(world=world, as_tp=as_tp, copy_GBps=gbps / 1e9,
                    env={k: os.environ.get(k) for k in MULTICAST_OFF})
        with open(out_json, "w") as f:
            json.dump({"conditions": meta, "steps": STEPS, "weight_copies": COPIES, "H": H, "L": L,
                       "rows": out_rows}, f, indent=1, default=str)
    dist.barrier()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2, help="ranks (one GPU each)")
    ap.add_argument("--as-tp", type=int, default=0, help="with --world 1: also time one rank's 1/N W_up slice")
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64")
    ap.add_argument("--json", default="bench_moe_tail.json")
    args = ap.parse_args(argv)
    if torch.cuda.device_count() < args.world:
        print(f"needs {args.world} GPUs, found {torch.cuda.device_count()}")
        return 1
    os.environ.update(MULTICAST_OFF)
    tokens = [int(t) for t in args.tokens.split(",")]
    launch(_worker, args.world, backend="nccl", args=(tokens, args.as_tp, os.path.abspath(args.json)),
           timeout_s=3600)
    return 0


if __name__ == "__main__":
    sys.exit(main())
