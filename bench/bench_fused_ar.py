"""Fused out-projection + all-reduce + residual + RMSNorm at TP 2 vs the stock sequence.

Stock: torch.compile of (mm -> funcol.all_reduce (NCCL) -> add residual -> RMSNorm), the spelling
of the reference model. k3fuse: torch.ops.k3fuse.gemm_ar_residual_rmsnorm (decode GEMM + CuTe
one-shot push/flag all-reduce with the residual/norm epilogue, symmetric memory, no multicast).
Also cuBLAS GEMM alone. CUDA graphs of 20 steps over 4 rotating weight copies (4 x 88 MB), fresh
random activations per step, median µs per step over replays, the slower rank reported.

    python -m bench.bench_fused_ar [--tokens 1,2,4,8,16,32,64] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from k3fuse.tools.bench.timing import graph_replay_us
from k3fuse.dist import MULTICAST_OFF, launch
from k3fuse.model.shapes import gemm_site

_OPROJ = gemm_site("oproj_tp2")  # the out-projection at TP 2: W_o [H, P/2] per rank
H, P = _OPROJ.n, _OPROJ.k
STEPS, COPIES, EPS = 20, 4, 1e-5


def _graph_time(step, replays=20) -> float:
    """Median µs per step of a graph of STEPS steps, ranks at a barrier before each replay."""
    return graph_replay_us(step, STEPS, replays)


def _worker(rank, world, tokens, out_json):
    """One rank (k3fuse.dist.launch: NCCL process group up, this rank's GPU current)."""
    import torch.distributed as dist

    import k3fuse.kernels  # noqa: F401
    from k3fuse import runtime
    from k3fuse.kernels.collective_guard import reagree
    from k3fuse.spelling import all_reduce_sum, linear, rms_norm

    dev = torch.device("cuda", rank)
    group = dist.group.WORLD.group_name
    torch.manual_seed(rank)
    ws = [torch.randn(H, P, device=dev, dtype=torch.bfloat16) / P ** 0.5 for _ in range(COPIES)]
    nw = torch.randn(H, device=dev, dtype=torch.bfloat16)

    def stock(x, w, r, nw):  # the reference model's spelling (k3fuse.spelling)
        y = linear(x, w)
        y = all_reduce_sum(y, group)
        h = r + y
        return h, rms_norm(h, nw, EPS)

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
        reagree(group)                       # path settings reach the fused ops through the group's agreement
        with runtime.strict():
            torch.ops.k3fuse.gemm_ar_residual_rmsnorm(xs[0], ws[0], rs[0], None, nw, EPS, group, world, 64)
            res["k3fuse_pdl"] = _graph_time(lambda i: torch.ops.k3fuse.gemm_ar_residual_rmsnorm(
                xs[i], ws[i % COPIES], rs[i], None, nw, EPS, group, world, 64))
        os.environ.pop("K3FUSE_AR_PDL")
        reagree(group)
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
        from bench.bench_decode_gemm import conditions

        meta = conditions()
        meta["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        meta["env"] = {k: os.environ.get(k) for k in MULTICAST_OFF}
        with open(out_json, "w") as f:
            json.dump({"conditions": meta, "steps": STEPS, "weight_copies": COPIES, "rows": rows}, f,
                      indent=1, default=str)
        print("\n" + " ".join(f"{k}={v}" for k, v in meta.items()))
        print(f"{'M':>3s} {'cuBLAS':>8s} {'eager':>8s} {'compile':>8s} {'k3fuse':>8s} {'PDL':>8s} {'x compile':>9s}")
        for r in rows:
            print(f"{r['M']:3d} {r['cublas_gemm']:8.2f} {r['eager']:8.2f} {r['torch_compile']:8.2f} "
                  f"{r['k3fuse']:8.2f} {r['k3fuse_pdl']:8.2f} {r['k3fuse_vs_compile']:9.2f}")
    dist.barrier()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64")
    ap.add_argument("--json", default="bench_fused_ar.json")
    args = ap.parse_args(argv)
    if torch.cuda.device_count() < 2:
        print("needs 2 GPUs")
        return 1
    os.environ.update(MULTICAST_OFF)
    tokens = [int(t) for t in args.tokens.split(",")]
    launch(_worker, 2, backend="nccl", args=(tokens, os.path.abspath(args.json)), timeout_s=3600)
    return 0


if __name__ == "__main__":
    sys.exit(main())
