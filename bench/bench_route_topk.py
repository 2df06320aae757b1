"""Fused routing benchmark: the model's router tail (stock, under torch.compile) vs k3fuse.route_topk.

K3's router tail on one GPU: logits fp32 [T, 896] -> sigmoid, + b_corr, top-16, gather,
renormalise, * 2.5. Arms: "eager" (the model's `route`, op by op), "compiled" (the same under
torch.compile, Inductor's kernels), "triton" (kernels/lib/triton/route_topk.py, and each --warps
choice), "launch_floor" (a one-program kernel that only copies k floats: what a kernel costs in
this graph before it does any work). Each is timed with
k3fuse.tools.bench.timing's CUDA-graph timer: one graph replays STEPS calls on fresh logits per replay,
median µs per call.

    python -m bench.bench_route_topk [--tokens 1,2,4,8,16,32,64] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

E, K, SCALE = 896, 16, 2.5
STEPS = 20  # calls per captured graph


def _copy_k(logits: torch.Tensor, weights: torch.Tensor) -> None:
    import triton
    import triton.language as tl

    global _copy_kernel
    if _copy_kernel is None:
        @triton.jit
        def kernel(src, dst, K: tl.constexpr):
            offs = tl.arange(0, K)
            tl.store(dst + offs, tl.load(src + offs))

        _copy_kernel = kernel
    _copy_kernel[(1,)](logits, weights, K=K, num_warps=1)


_copy_kernel = None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--warps", default="1,2,4,8", help="num_warps values of the Triton kernel to time")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from k3fuse.tools.bench.timing import capture, time_graph
    from k3fuse.kernels.lib.triton import route_topk
    from k3fuse.model.layers import route

    compiled_route = torch.compile(route, fullgraph=True)
    warps = [int(w) for w in args.warps.split(",") if w]
    rows = []
    for T in (int(t) for t in args.tokens.split(",")):
        logits = torch.randn(STEPS, T, E, device="cuda") * 2
        b = torch.randn(E, device="cuda") * 0.05
        out = [(torch.empty(T, K, device="cuda"), torch.empty(T, K, dtype=torch.int64, device="cuda"))
               for _ in range(STEPS)]
        arms = {"eager": lambda: [route(logits[i], b, K, SCALE) for i in range(STEPS)],
                "compiled": lambda: [compiled_route(logits[i], b, K, SCALE) for i in range(STEPS)],
                "triton": lambda: [route_topk.run(logits[i], b, K, SCALE, out=out[i]) for i in range(STEPS)]}
        # the launch floor: a one-program kernel that only copies the k outputs, timed the same way
        arms["launch_floor"] = lambda: [_copy_k(logits[i], out[i][0]) for i in range(STEPS)]
        for w in warps:
            arms[f"triton_w{w}"] = (lambda w=w: [route_topk.run(logits[i], b, K, SCALE, out=out[i], num_warps=w)
                                                 for i in range(STEPS)])
        row = {"tokens": T}
        for name, steps in arms.items():
            graph = capture(steps, warmup=3)
            row[name] = statistics.median(time_graph(graph, STEPS, args.replays,
                                                     refill=lambda: logits.normal_().mul_(2)))
        row["speedup_vs_compiled"] = row["compiled"] / row["triton"]
        rows.append(row)
    swept = "".join(f" {'w' + str(w) + ' µs':>8}" for w in warps)
    print(f"{'T':>4} {'eager µs':>10} {'compiled µs':>12} {'triton µs':>10} {'vs compiled':>12} {'floor µs':>9}{swept}")
    for r in rows:
        print(f"{r['tokens']:>4} {r['eager']:>10.2f} {r['compiled']:>12.2f} {r['triton']:>10.2f} "
              f"{r['speedup_vs_compiled']:>11.2f}x {r['launch_floor']:>9.2f}" + "".join(f" {r[f'triton_w{w}']:>8.2f}" for w in warps))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"E": E, "top_k": K, "routed_scaling": SCALE, "device": torch.cuda.get_device_name(),
                       "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
