"""Decode GEMM benchmark: torch.mm (cuBLAS) vs k3fuse kernels on K3 per-rank shapes, one GPU.

CUDA-graph replays of one pass over >= 4 weight copies (more for small shapes, so the copies
together exceed 4x the 60 MB L2), a fresh random activation per copy, median over replays,
stock and k3fuse in the same run. Reports µs per GEMM, achieved bandwidth (weight + activation +
output bytes) against the 4.28 TB/s device-to-device copy bandwidth measured on an H200, and the
ratio to torch.mm (configuration sweeps: sweep_decode_gemm.py).

    python -m bench.bench_decode_gemm [--tokens 1,2,4,8,16,32,64] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import math
import sys

import torch

from k3fuse.tools.bench.timing import graph_replay_us
from k3fuse.model.shapes import DECODE_GEMM_BENCH_SITES, gemm_sites

COPY_BW = 4.28e12
# (name, N, K, out dtype): the K3 per-rank shapes (k3fuse/model/shapes.py)
SHAPES = gemm_sites(*DECODE_GEMM_BENCH_SITES)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64")
    ap.add_argument("--json", default="bench_decode_gemm.json")
    ap.add_argument("--shapes", default="")
    args = ap.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]

    import k3fuse.kernels  # noqa: F401
    from k3fuse import runtime
    from k3fuse.kernels import dispatch
    from k3fuse.kernels.lib.cute import compat
    from k3fuse.kernels.lib.cute import gemv as decode_gemv
    from k3fuse.kernels.ops import decode_gemm
    from k3fuse.kernels.lib.triton import splitk_gemm

    dev = torch.device("cuda", 0)
    props = torch.cuda.get_device_properties(dev)
    rows = []
    shapes = [s for s in SHAPES if not args.shapes or s[0] in args.shapes.split(",")]
    for name, N, K, odt in shapes:
        wbytes = N * K * 2
        copies = max(4, math.ceil(4 * 60e6 / wbytes))
        ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) / K ** 0.5 for _ in range(copies)]
        for M in tokens:
            xs = [torch.randn(M, K, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
            ys = [torch.empty(M, N, device=dev, dtype=odt) for _ in range(copies)]
            nbytes = wbytes + M * K * 2 + M * N * odt.itemsize
            res = {"shape": name, "N": N, "K": K, "M": M, "out_dtype": str(odt).split(".")[-1],
                   "weight_copies": copies}
            res["torch.mm"] = graph_replay_us(lambda i: torch.mm(xs[i], ws[i].t()), copies)
            if odt == torch.float32:
                res["torch.mm_note"] = "bf16 out (cuBLAS has no bf16->fp32 mm here)"
            dispatch.warmup("decode_gemm", [{"M": M, "N": N, "K": K, "dtype": torch.bfloat16,
                                             "out_dtype": odt, "device": dev}])
            runtime.reset_stats()
            with runtime.strict():
                torch.ops.k3fuse.decode_gemm(xs[0], ws[0], None, odt)
            res["k3fuse_impl"] = next(iter(runtime.stats()["decode_gemm"]))
            res["k3fuse"] = graph_replay_us(lambda i: torch.ops.k3fuse.decode_gemm(xs[i], ws[i], None, odt), copies)
            spec = decode_gemm.DecodeGemmSpec.from_call(xs[0], ws[0], None, odt)
            if decode_gemm.gemv_accepts(spec, crossover=False) is None:
                res["cute.gemv"] = graph_replay_us(lambda i: decode_gemv.run(xs[i], ws[i], None, odt, out=ys[i]), copies)
            if decode_gemm.splitk_accepts(spec) is None:
                res["triton.splitk"] = graph_replay_us(lambda i: splitk_gemm.run(xs[i], ws[i], None, odt, out=ys[i]), copies)
                res["splitk_cfg"] = splitk_gemm.pick_config(M, N, K, props.multi_processor_count)
            for k in ("torch.mm", "k3fuse", "cute.gemv", "triton.splitk"):
                if k in res:
                    res[f"{k}_bw_frac"] = nbytes / (res[k] * 1e-6) / COPY_BW
            res["k3fuse_vs_mm"] = res["torch.mm"] / res["k3fuse"]
            rows.append(res)
            print(f"{name:11s} M={M:2d} mm {res['torch.mm']:7.2f}us ({res['torch.mm_bw_frac']:5.1%}) "
                  f"k3fuse[{res['k3fuse_impl']}] {res['k3fuse']:7.2f}us ({res['k3fuse_bw_frac']:5.1%}) "
                  f"speedup x{res['k3fuse_vs_mm']:.2f}"
                  + (f"  gemv {res['cute.gemv']:.2f}" if "cute.gemv" in res else "")
                  + (f"  splitk {res['triton.splitk']:.2f}" if "triton.splitk" in res else ""), flush=True)
            del xs, ys
        del ws
        torch.cuda.empty_cache()

    meta = conditions()
    with open(args.json, "w") as f:
        json.dump({"conditions": meta, "copy_bw_Bps": COPY_BW, "rows": rows}, f, indent=1, default=str)
    print_table(rows, meta)
    return 0


def conditions() -> dict:
    import importlib.metadata as md
    import subprocess

    out = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0), "python": sys.version.split()[0]}
    for pkg in ("triton", "nvidia-cutlass-dsl"):
        try:
            out[pkg] = md.version(pkg)
        except Exception:
            out[pkg] = None
    try:
        out["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                       capture_output=True, text=True).stdout.strip().splitlines()[0]
    except Exception:
        out["driver"] = None
    return out


def print_table(rows, meta) -> None:
    print("\n" + " ".join(f"{k}={v}" for k, v in meta.items()))
    print(f"{'shape':11s} {'M':>3s} {'mm us':>8s} {'mm %bw':>7s} {'k3f us':>8s} {'k3f %bw':>8s} {'x mm':>6s}  impl")
    for r in rows:
        print(f"{r['shape']:11s} {r['M']:3d} {r['torch.mm']:8.2f} {r['torch.mm_bw_frac']:7.1%} "
              f"{r['k3fuse']:8.2f} {r['k3fuse_bw_frac']:8.1%} {r['k3fuse_vs_mm']:6.2f}  {r['k3fuse_impl']}")


if __name__ == "__main__":
    sys.exit(main())
