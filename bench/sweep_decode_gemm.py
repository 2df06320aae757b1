"""Configuration sweep for the decode GEMM kernels on the K3 shapes (one or two GPUs).

Why: the split-K tile (BLOCK_N, BLOCK_K), split count and pipeline depth, and the GEMV's rows per
CTA and threads, decide how many bytes are in flight per SM; the best choice depends on the shape
and the token bucket and is found by measurement, not guessed. Same timing method as
bench_decode_gemm.py (CUDA-graph replays over rotated weight copies, fresh activations, medians).
Triton variants are compiled first by a pool of processes (shared on-disk Triton cache), then timed.
Writes JSON with every timing and prints the best configurations; `--emit` writes the tuned table
kernels/lib/triton/splitk_tuned.py is made from (see docs/perf/), keeping the entries of the sites not
swept this time. `--sites` sweeps other K3 sites than the benchmark's (k3fuse/model/shapes.py names).

    python -m bench.sweep_decode_gemm --json sweep.json [--sites qkvg_tp1,shared_gate_tp1]
        [--emit kernels/lib/triton/splitk_tuned.py]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from concurrent.futures import ProcessPoolExecutor

import torch

from bench.bench_decode_gemm import SHAPES
from k3fuse.model.shapes import gemm_sites
from k3fuse.tools.bench.timing import graph_replay_us

SPLITK_M = (8, 32, 64)          # one M per BLOCK_M bucket (16, 32, 64)
GEMV_M = (1, 2, 4)


def splitk_configs(M, N, K):
    bm = max(16, 1 << (M - 1).bit_length())
    out = []
    for bn in (64, 128):
        if N % bn:
            continue
        tiles = N // bn
        for bk in (64, 128, 256):
            if K % bk:
                continue
            kb = K // bk
            splits = [s for s in range(1, kb + 1) if kb % s == 0 and kb // s >= 2]
            chosen = {min(splits, key=lambda s: abs(tiles * s - t)) for t in (132, 264, 528)}
            for s in sorted(chosen):
                for st in (3, 5):
                    if st * (bn * bk + bk * bm) * 2 > 200_000:
                        continue
                    out.append(dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=s, BLOCK_M=bm, num_warps=4, num_stages=st))
    return out


def gemv_configs(M, N, K):
    out = []
    for rows in (1, 2, 4, 8):
        for th in (64, 96, 128, 192, 224, 256):
            if N % rows or (K // 8) % th or (K // 8) // th > 24 or rows * M > 32:
                continue
            out.append((rows, th))
    return out


def _compile_task(args):
    dev, M, N, K, odt, cfg = args
    torch.cuda.set_device(dev)
    from k3fuse.kernels.lib.triton import splitk_gemm

    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
    y = torch.empty(M, N, device=dev, dtype=odt)
    try:
        splitk_gemm.run(x, w, None, odt, out=y, config=cfg)
        torch.cuda.synchronize()
        return None
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc)[:120]}"


def _gpu(rank, shapes, out_path, jobs):
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    import k3fuse.kernels  # noqa: F401
    from k3fuse.kernels.lib.cute import compat
    from k3fuse.kernels.lib.cute import gemv as decode_gemv
    from k3fuse.kernels.lib.triton import splitk_gemm

    tasks = [(rank, M, N, K, odt, c) for (_, N, K, odt) in shapes for M in SPLITK_M
             for c in splitk_configs(M, N, K)]
    import multiprocessing as mp

    with ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as ex:
        errors = list(ex.map(_compile_task, tasks, chunksize=4))
    bad = {json.dumps(t[5], sort_keys=True) + f"{t[1:4]}": e for t, e in zip(tasks, errors) if e}
    rows = []
    for name, N, K, odt in shapes:
        wbytes = N * K * 2
        copies = max(4, math.ceil(4 * 60e6 / wbytes))
        ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) / K ** 0.5 for _ in range(copies)]
        for M in sorted(set(SPLITK_M) | set(GEMV_M)):
            xs = [torch.randn(M, K, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
            ys = [torch.empty(M, N, device=dev, dtype=odt) for _ in range(copies)]
            r = {"shape": name, "N": N, "K": K, "M": M, "out_dtype": str(odt).split(".")[-1], "copies": copies,
                 "bytes": wbytes + M * K * 2 + M * N * odt.itemsize}
            r["torch.mm"] = graph_replay_us(lambda i: torch.mm(xs[i], ws[i].t()), copies, replays=15)
            try:
                r["torch.mm_fp32out"] = graph_replay_us(
                    lambda i: torch.mm(xs[i], ws[i].t(), out_dtype=torch.float32), copies, replays=15)
            except Exception as exc:
                r["torch.mm_fp32out"] = f"{type(exc).__name__}"
            if M in SPLITK_M:
                sk = {}
                for c in splitk_configs(M, N, K):
                    k = json.dumps(c, sort_keys=True)
                    if k + f"{(M, N, K)}" in bad:
                        continue
                    try:
                        sk[k] = graph_replay_us(lambda i: splitk_gemm.run(xs[i], ws[i], None, odt, out=ys[i], config=c),
                                           copies, replays=10)
                    except Exception as exc:
                        sk[k] = f"{type(exc).__name__}"
                r["splitk"] = sk
            if M in GEMV_M and compat.available():
                gv = {}
                for rows_, th in gemv_configs(M, N, K):
                    gv[f"{rows_},{th}"] = graph_replay_us(
                        lambda i: decode_gemv.run(xs[i], ws[i], None, odt, out=ys[i], config=(rows_, th)),
                        copies, replays=10)
                r["gemv"] = gv
            best = []
            for fam in ("splitk", "gemv"):
                for k, v in r.get(fam, {}).items():
                    if isinstance(v, float):
                        best.append((v, fam, k))
            best.sort()
            r["best"] = best[:3]
            rows.append(r)
            print(f"[gpu{rank}] {name:11s} M={M:2d} mm {r['torch.mm']:7.2f}  best "
                  + "  ".join(f"{fam}{k} {v:.2f}" for v, fam, k in best[:2]), flush=True)
        del ws
        torch.cuda.empty_cache()
    with open(out_path, "w") as f:
        json.dump({"rows": rows, "compile_errors": bad}, f, indent=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="sweep.json")
    ap.add_argument("--emit", default="")
    ap.add_argument("--jobs", type=int, default=12)
    ap.add_argument("--sites", default="", help="K3 GEMM sites to sweep, comma-separated (default: the "
                                                 "decode GEMM benchmark's)")
    args = ap.parse_args(argv)
    import torch.multiprocessing as mp

    shapes = gemm_sites(*args.sites.split(",")) if args.sites else SHAPES
    ngpu = min(2, torch.cuda.device_count())
    order = sorted(shapes, key=lambda s: -s[1] * s[2])
    parts = [order[i::ngpu] for i in range(ngpu)]
    paths = [f"{args.json}.gpu{i}" for i in range(ngpu)]
    mp.spawn(lambda_gpu, args=(parts, paths, args.jobs), nprocs=ngpu, join=True)
    rows, errs = [], {}
    for p in paths:
        d = json.load(open(p))
        rows += d["rows"]
        errs.update(d["compile_errors"])
        os.remove(p)
    from bench.bench_decode_gemm import conditions

    json.dump({"conditions": conditions(), "rows": rows, "compile_errors": errs}, open(args.json, "w"), indent=1)
    table = {}
    for r in rows:
        sk = {k: v for k, v in r.get("splitk", {}).items() if isinstance(v, float)}
        if sk:
            k, v = min(sk.items(), key=lambda kv: kv[1])
            c = json.loads(k)
            table[(r["N"], r["K"], c["BLOCK_M"])] = {kk: c[kk] for kk in ("BLOCK_N", "BLOCK_K", "SPLIT_K",
                                                                            "num_warps", "num_stages")}
            print(f"{r['shape']:11s} M={r['M']:2d} mm {r['torch.mm']:7.2f} splitk best {v:7.2f} {table[(r['N'], r['K'], c['BLOCK_M'])]}")
    if args.emit:
        from k3fuse.kernels.lib.triton.splitk_tuned import TUNED

        with open(args.emit, "w") as f:
            f.write(tuned_source(merged(TUNED, table)))
    print(f"{len(errs)} compile errors")
    return 0


def merged(old: dict, new: dict) -> dict:
    """The tuned table with this sweep's (N, K) shapes replaced by its results, every other kept."""
    swept = {(n, k) for n, k, _ in new}
    return {**{key: v for key, v in old.items() if key[:2] not in swept}, **new}


def tuned_source(table: dict) -> str:
    """kernels/lib/triton/splitk_tuned.py for `table`."""
    lines = ['"""Split-K configs measured fastest on H200 by bench/sweep_decode_gemm.py (generated).', "",
             "Key: (N, K, BLOCK_M). Conditions and timings: docs/perf.md and its history, docs/perf/.", '"""',
             "TUNED = {"]
    lines += [f"    {k!r}: {v!r}," for k, v in sorted(table.items())]
    return "\n".join(lines + ["}", ""])


def lambda_gpu(rank, parts, paths, jobs):
    _gpu(rank, parts[rank], paths[rank], jobs)


if __name__ == "__main__":
    sys.exit(main())
