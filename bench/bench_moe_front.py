"""The MoE front at K3 widths: replicated router + latent down-projection vs the sharded op.

Arms (one run, the same inputs; µs per decode step, median over CUDA-graph replays of STEPS steps
over COPIES rotating weight copies, fresh activations per step, the slower rank):
  stock       torch.compile of the model's spelling, replicated on every rank:
              F.linear(x.float(), W_r.float()) and F.linear(x, W_down)
  gemv        k3fuse.decode_gemm on both, replicated (the GEMV / split-K kernels, fp32 router out)
  sharded     k3fuse.moe_front_sharded over the process group: 1/W of the rows per rank, one push
              GEMM and the NVLink gather (triton.moe_front_sharded)
  slice       (--as-tp N on one GPU) the op on one rank with 1/N of the rows: what each rank of TP N
              computes, with the gather of its own slot only; no peer, so no NVLink time
Also the weight-read floor of each arm (bytes / copy bandwidth measured in the same process).

    python bench/bench_moe_front.py [--world 2] [--as-tp 2] [--tokens 1,2,4,8,16,32,64] [--json out.json]
    python bench/bench_moe_front.py --sweep [--as-tp 2] [--tokens 1,8,64]   # push-GEMM configs, one GPU
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from k3fuse.bench.timing import copy_bandwidth, graph_replay_us, slowest_rank
from k3fuse.dist import launch
from k3fuse.model.shapes import gemm_site

E, H = gemm_site("router").n, gemm_site("router").k
L = gemm_site("w_down").n
STEPS, COPIES, MAX_T = 20, 4, 64
#: NVLink multicast stays off (symmetric memory without multicast; the ranks inherit this)
ENV = dict(TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NCCL_NVLS_ENABLE="0", NVSHMEM_DISABLE_NVLS="1")


def _worker(rank, world, tokens, as_tp, out_json):
    import torch.distributed as dist
    import torch.nn.functional as F

    import k3fuse.kernels  # noqa: F401
    from k3fuse import runtime

    dev = torch.device("cuda", rank)
    group = dist.group.WORLD.group_name
    g = torch.Generator(device=dev).manual_seed(0)
    wrs = [(torch.randn(E, H, device=dev, generator=g) * H ** -0.5).bfloat16() for _ in range(COPIES)]
    wds = [(torch.randn(L, H, device=dev, generator=g) * H ** -0.5).bfloat16() for _ in range(COPIES)]
    op = torch.ops.k3fuse.moe_front_sharded
    gemm = torch.ops.k3fuse.decode_gemm

    def stock(x, wr, wd):   # the model's spelling (kernels/reference/stock.py)
        return F.linear(x.float(), wr.float()), F.linear(x, wd)

    stock_c = torch.compile(stock, fullgraph=True)
    gbps = copy_bandwidth(dev)
    floor = lambda rows: rows * H * 2 / gbps * 1e6   # µs to read `rows` bf16 rows of H once
    rows_out = []
    for T in tokens:
        xs = [torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(STEPS)]
        res: dict = {"M": T}
        for _ in range(2):
            stock_c(xs[0], wrs[0], wds[0])
        res["stock"] = graph_replay_us(lambda i: stock_c(xs[i], wrs[i % COPIES], wds[i % COPIES]), STEPS)
        runtime.reset_stats()
        with runtime.strict():
            res["gemv"] = graph_replay_us(lambda i: (gemm(xs[i], wrs[i % COPIES], None, torch.float32, True),
                                                     gemm(xs[i], wds[i % COPIES], None, None, True)), STEPS)
            op(xs[0], wrs[0], wds[0], group, world, MAX_T, True)   # compiles, creates the workspace
            res["sharded"] = graph_replay_us(lambda i: op(xs[i], wrs[i % COPIES], wds[i % COPIES], group, world,
                                                          MAX_T, True), STEPS)
        res["impl"] = runtime.stats()
        res["floor_replicated"] = floor(E + L)
        res["floor_sharded"] = floor((E + L) // world)
        if as_tp and world == 1:
            e1, l1 = E // as_tp, L // as_tp
            sl = [(w[:e1].contiguous(), d[:l1].contiguous()) for w, d in zip(wrs, wds)]
            with runtime.strict():
                op(xs[0], *sl[0], group, 1, MAX_T, True)
                res["slice"] = graph_replay_us(lambda i: op(xs[i], *sl[i % COPIES], group, 1, MAX_T, True), STEPS)
            res["floor_slice"] = floor(e1 + l1)
            from k3fuse.kernels.triton import moe_front_sharded as K

            K.USE_PDL = False   # the same slice without programmatic dependent launch
            with runtime.strict():
                op(xs[0], *sl[0], group, 1, MAX_T, True)
                res["slice_no_pdl"] = graph_replay_us(lambda i: op(xs[i], *sl[i % COPIES], group, 1, MAX_T, True),
                                                      STEPS)
            K.USE_PDL = True
            # where the slice's time goes: its push GEMM alone (no gather), and the CuTe/Triton
            # decode GEMM over the same rows stacked into one weight (what one kernel reaches)
            from k3fuse.kernels.symm_workspace import get_workspace
            from k3fuse.kernels.triton import splitk_gemm

            ws = get_workspace(group, 1, MAX_T, e1 + l1, dev)
            cfg = K.push_config(T, e1, l1, H)
            push = (ws.ptrs, ws.gen, 0, MAX_T)
            res["slice_push_only"] = graph_replay_us(lambda i: splitk_gemm.run(
                xs[i], sl[i % COPIES][0], None, torch.float32, config=cfg, push=push, weight2=sl[i % COPIES][1]), STEPS)
            ws.datas[0].view(torch.int32).fill_(-2**31)   # pushed without a gather: back to the sentinel
            stacked = [torch.cat([w, d]) for w, d in sl]
            with runtime.strict():
                res["slice_stacked_gemm"] = graph_replay_us(lambda i: gemm(xs[i], stacked[i % COPIES], None, None, True),
                                                            STEPS)
        for k in ("stock", "gemv", "sharded", "slice"):
            if k in res:
                res[k] = slowest_rank(res[k], dev)
        res["sharded_vs_stock"] = res["stock"] / res["sharded"]
        rows_out.append(res)
        if rank == 0:
            extra = (f"  slice(1/{as_tp}) {res['slice']:6.2f} (no PDL {res['slice_no_pdl']:5.2f}; floor "
                     f"{res['floor_slice']:5.2f}; push GEMM alone "
                     f"{res['slice_push_only']:5.2f}, one stacked decode GEMM {res['slice_stacked_gemm']:5.2f})"
                     if "slice" in res else "")
            print(f"T={T:2d} stock {res['stock']:6.2f}  gemv {res['gemv']:6.2f}  sharded(W={world}) "
                  f"{res['sharded']:6.2f} (floor {res['floor_sharded']:5.2f}) x{res['sharded_vs_stock']:.2f}{extra}",
                  flush=True)
    if rank == 0:
        sys.path.insert(0, os.path.dirname(__file__))
        from bench_decode_gemm import conditions

        meta = conditions()
        meta["world"] = world
        meta["copy_GBps"] = gbps / 1e9
        meta["env"] = {k: os.environ.get(k) for k in ENV}
        with open(out_json, "w") as f:
            json.dump({"conditions": meta, "steps": STEPS, "weight_copies": COPIES, "E": E, "L": L, "H": H,
                       "rows": rows_out}, f, indent=1, default=str)
    dist.barrier()


def _sweep_worker(rank, world, tokens, as_tp, out_json):
    """Time the op on one rank's 1/as_tp slice under every push-GEMM config; print the best per
    token count as entries for kernels/triton/moe_front_sharded.TUNED."""
    import itertools

    import torch.distributed as dist

    import k3fuse.kernels  # noqa: F401
    from k3fuse import runtime
    from k3fuse.kernels.triton import moe_front_sharded as K
    from k3fuse.kernels.triton import splitk_gemm

    dev = torch.device("cuda", rank)
    group = dist.group.WORLD.group_name
    e1, l1 = E // as_tp, L // as_tp
    g = torch.Generator(device=dev).manual_seed(0)
    sl = [((torch.randn(e1, H, device=dev, generator=g) * H ** -0.5).bfloat16(),
           (torch.randn(l1, H, device=dev, generator=g) * H ** -0.5).bfloat16()) for _ in range(COPIES * 2)]
    op = torch.ops.k3fuse.moe_front_sharded
    kb = H // splitk_gemm.BLOCK_K
    results, best = [], {}
    for T in tokens:
        xs = [torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(STEPS)]
        key = (e1, l1, H, splitk_gemm._block_m(T))
        for bn, split, warps, stages in itertools.product((16, 32, 64), (1, 2, 4, 7, 8, 14), (4,), (3, 5)):
            if e1 % bn or kb % split or kb // split < 2:
                continue
            cfg = dict(BLOCK_N=bn, SPLIT_K=split, BLOCK_K=splitk_gemm.BLOCK_K, num_warps=warps, num_stages=stages)
            K.TUNED[key] = cfg
            try:
                with runtime.strict():
                    op(xs[0], *sl[0], group, 1, MAX_T, True)
                    us = graph_replay_us(lambda i: op(xs[i], *sl[i % len(sl)], group, 1, MAX_T, True), STEPS)
            except Exception as exc:  # a config that does not compile (shared memory) is skipped
                print(f"T={T} {cfg}: {type(exc).__name__}", flush=True)
                continue
            results.append(dict(M=T, us=us, **cfg))
            if key not in best or us < best[key][0]:
                best[key] = (us, cfg)
        K.TUNED.pop(key, None)
        us, cfg = best[key]
        print(f"T={T:2d} best {us:6.2f} us {cfg}", flush=True)
    print("TUNED = {")
    for key, (us, cfg) in best.items():
        print(f"    {key}: {cfg},  # {us:.2f} us")
    print("}")
    with open(out_json, "w") as f:
        json.dump({"as_tp": as_tp, "e1": e1, "l1": l1, "rows": results}, f, indent=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2, help="ranks (one GPU each)")
    ap.add_argument("--as-tp", type=int, default=0, help="with --world 1: also time one rank's 1/N slice")
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64")
    ap.add_argument("--json", default="bench_moe_front.json")
    ap.add_argument("--sweep", action="store_true", help="push-GEMM configs on one rank's slice (one GPU)")
    args = ap.parse_args(argv)
    if args.sweep:
        os.environ.update(ENV)
        launch(_sweep_worker, 1, backend="nccl", args=([int(t) for t in args.tokens.split(",")], args.as_tp or 2,
                                                        os.path.abspath(args.json)), timeout_s=3600)
        return 0
    if torch.cuda.device_count() < args.world:
        print(f"needs {args.world} GPUs, found {torch.cuda.device_count()}")
        return 1
    os.environ.update(ENV)
    tokens = [int(t) for t in args.tokens.split(",")]
    launch(_worker, args.world, backend="nccl", args=(tokens, args.as_tp, os.path.abspath(args.json)),
           timeout_s=3600)
    return 0


if __name__ == "__main__":
    sys.exit(main())
