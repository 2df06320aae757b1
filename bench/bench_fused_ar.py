"""Fused out-projection + all-reduce + residual + RMSNorm at TP 2 vs the stock sequence.

Stock: torch.compile of (mm -> funcol.all_reduce (NCCL) -> add residual -> RMSNorm), the spelling
of the reference model. k3fuse: torch.ops.k3fuse.gemm_ar_residual_rmsnorm (decode GEMM + CuTe
one-shot push/flag all-reduce with the residual/norm epilogue, symmetric memory, no multicast).
Also cuBLAS GEMM alone. CUDA graphs of 20 steps over 4 rotating weight copies (4 x 88 MB), fresh
random activations per step, median µs per step over replays, the slower rank reported.

    python bench/bench_fused_ar.py [--tokens 1,2,4,8,16,32,64] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys

import torch

H, P = 7168, 6144
STEPS, COPIES, EPS = 20, 4, 1e-5


def _graph_time(step, replays=20) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(STEPS):
            step(i)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(STEPS):
            step(i)
    import torch.distributed as dist

    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        dist.barrier()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / STEPS)
    return statistics.median(times)


def _worker(rank, world, port, tokens, out_json):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
                      NCCL_NVLS_ENABLE="0", NVSHMEM_DISABLE_NVLS="1")
    torch.cuda.set_device(rank)
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    import k3fuse.kernels  # noqa: F401
    from k3fuse import runtime

    dev = torch.device("cuda", rank)
    group = dist.group.WORLD.group_name
    torch.manual_seed(rank)
    ws = [torch.randn(H, P, device=dev, dtype=torch.bfloat16) / P ** 0.5 for _ in range(COPIES)]
    nw = torch.randn(H, device=dev, dtype=torch.bfloat16)

    def stock(x, w, r, nw):
        y = torch.nn.functional.linear(x, w)
        y = funcol.all_reduce(y, "sum", group)
        h = r + y
        hf = h.float()
        n = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS) * nw.float()
        return h, n.to(h.dtype)

    stock_c = torch.compile(stock, fullgraph=True)
    rows = []
    for T in tokens:
        xs = [torch.randn(T, P, device=dev, dtype=torch.bfloat16) for _ in range(STEPS)]
        rs = [torch.randn(T, H, device=dev, dtype=torch.bfloat16) for _ in range(STEPS)]
        res = {"M": T}
        res["cublas_gemm"] = _graph_time(lambda i: torch.mm(xs[i], ws[i % COPIES].t()))
        for _ in range(2):
            stock_c(xs[0], ws[0], rs[0], nw)
        res["torch_compile"] = _graph_time(lambda i: stock_c(xs[i], ws[i % COPIES], rs[i], nw))
        res["eager"] = _graph_time(lambda i: stock(xs[i], ws[i % COPIES], rs[i], nw))
        runtime.reset_stats()
        with runtime.strict():
            torch.ops.k3fuse.gemm_ar_residual_rmsnorm(xs[0], ws[0], rs[0], None, nw, EPS, group, world, 64)
            res["k3fuse"] = _graph_time(lambda i: torch.ops.k3fuse.gemm_ar_residual_rmsnorm(
                xs[i], ws[i % COPIES], rs[i], None, nw, EPS, group, world, 64))
        res["impl"] = runtime.stats()
        os.environ["K3FUSE_AR_PDL"] = "1"     # the same op with programmatic dependent launch
        with runtime.strict():
            torch.ops.k3fuse.gemm_ar_residual_rmsnorm(xs[0], ws[0], rs[0], None, nw, EPS, group, world, 64)
            res["k3fuse_pdl"] = _graph_time(lambda i: torch.ops.k3fuse.gemm_ar_residual_rmsnorm(
                xs[i], ws[i % COPIES], rs[i], None, nw, EPS, group, world, 64))
        os.environ.pop("K3FUSE_AR_PDL")
        # the slower rank decides
        for k in ("cublas_gemm", "torch_compile", "eager", "k3fuse", "k3fuse_pdl"):
            t = torch.tensor([res[k]], device=dev, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            res[k] = t.item()
        res["k3fuse_vs_compile"] = res["torch_compile"] / res["k3fuse"]
        rows.append(res)
        if rank == 0:
            print(f"M={T:2d} cuBLAS {res['cublas_gemm']:6.2f}us  eager {res['eager']:6.2f}  "
                  f"torch.compile {res['torch_compile']:6.2f}  k3fuse {res['k3fuse']:6.2f} "
                  f"(PDL {res['k3fuse_pdl']:6.2f})  "
                  f"x{res['k3fuse_vs_compile']:.2f} vs compile", flush=True)
    if rank == 0:
        sys.path.insert(0, os.path.dirname(__file__))
        from bench_decode_gemm import conditions

        meta = conditions()
        meta["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        meta["env"] = {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                      "NVSHMEM_DISABLE_NVLS")}
        with open(out_json, "w") as f:
            json.dump({"conditions": meta, "steps": STEPS, "weight_copies": COPIES, "rows": rows}, f,
                      indent=1, default=str)
        print("\n" + " ".join(f"{k}={v}" for k, v in meta.items()))
        print(f"{'M':>3s} {'cuBLAS':>8s} {'eager':>8s} {'compile':>8s} {'k3fuse':>8s} {'PDL':>8s} {'x compile':>9s}")
        for r in rows:
            print(f"{r['M']:3d} {r['cublas_gemm']:8.2f} {r['eager']:8.2f} {r['torch_compile']:8.2f} "
                  f"{r['k3fuse']:8.2f} {r['k3fuse_pdl']:8.2f} {r['k3fuse_vs_compile']:9.2f}")
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64")
    ap.add_argument("--json", default="bench_fused_ar.json")
    args = ap.parse_args(argv)
    if torch.cuda.device_count() < 2:
        print("needs 2 GPUs")
        return 1
    import torch.multiprocessing as mp

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    tokens = [int(t) for t in args.tokens.split(",")]
    mp.spawn(_worker, args=(2, port, tokens, os.path.abspath(args.json)), nprocs=2, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
