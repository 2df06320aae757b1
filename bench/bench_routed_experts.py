"""Routed-experts benchmark: the model's grouped GEMMs (stock) vs k3fuse.routed_experts (Triton), and
with --formats the 4-bit experts: stock vs k3fuse.routed_experts_w4a16 vs the BF16 kernel vs humming.

K3's routed experts on one GPU: latent a [T, 3584] bf16, 16 of 896 experts per token, w1/w3
[896, I, 3584], w2 [896, 3584, I] with I = moe_inter / TP (128 and 64: the layer benchmark's
widths at TP 1 and 2; 1536: the published width at TP 2). Arms: "eager" (spelling
`routed_experts_grouped`: argsort, searchsorted, three torch._grouped_mm, index_copy), "compiled"
(the same under torch.compile, Inductor's kernels around the grouped GEMMs), "triton"
(kernels/lib/triton/routed_experts.py in the mode pick_config chooses, printed after its time), and
"triton_pairwise" / "triton_grouped" (each mode forced: where they cross is PAIRWISE_MAX_PAIRS).
Each is timed with k3fuse.tools.bench.timing's CUDA-graph timer: one graph replays STEPS calls, new
tokens and experts per replay, median µs per call. "floor" is the touched experts' weight bytes
over the measured copy bandwidth (the expected number of distinct experts for T tokens drawing 16
of 896 each).

    python -m bench.bench_routed_experts [--inter 128,64] [--tokens 1,2,4,8,16,32,64] [--json out.json]

W4A16 (--formats mxfp4,int4; I = 3072, 1536, 384 per rank by default): the packed experts drawn as
random codes and scales in k3fuse/quant.py's layouts (the bytes the checkpoint has). Arms, each in
one CUDA graph of STEPS calls with new tokens and experts per replay: "stock" (the model's spelling
`routed_experts_quantized_grouped` under torch.compile: the step's distinct experts gathered,
dequantized, grouped GEMMs), "w4a16" (kernels/lib/triton/routed_experts_w4a16.py, pick_config's mode),
"bf16" (today's BF16 kernel on the dequantized weights, 3.8x the bytes) and "humming" (humming's
indexed W4A16 MoE GEMMs, gate/up and down only: bench/humming_moe.py; --humming-inter picks the
widths it compiles for, its JIT takes seconds a shape) and "cute" (the CuTe expert GEMMs on MXFP4 and
on int4 with bf16 scales, kernels/lib/composite/routed_experts_w4a16.py: the CuTe GEMMs between the
Triton grouping and SiTU-GLU, at the op's own launch, W4A16Launch.for_call). --cute-choices adds CuTe arms
with an imposed mode / split / row tiles / layout, for A/B in one run; --profile records the CuTe arm's
kernels in one profiled replay. "read" (bench/touched_read.py) reads the step's distinct experts' packed bytes in the op's
two launches and does nothing else: the ceiling a few-token step's size and scatter leave any kernel,
against the same copy; "read_rows" and "read_block" read them on the CuTe op's grid, a 64-row block a
program, 128 elements a step, in the op's order (each row's next 64 bytes) and each block front to back
(the order of weights repacked into steps). Each row reports the distinct experts the timed steps touched, their packed bytes
(weights and scales) and the w4a16 arm's share of the copy bandwidth measured in the same run on a
256 MiB buffer; the JSON also has a copy over each whole packed table. The steps' experts are random
over tables of several GB, far past the 60 MB L2.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

E, K, L = 896, 16, 3584
STEPS = 8  # calls per captured graph, each on its own token rows


def main(argv: list[str] | None = None) -> int:
    from k3fuse import quant
    from k3fuse.model import PRESETS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inter", default="128,64", help="expert intermediate widths per rank")
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64")
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--sweep", action="store_true",
                    help="time the Triton kernels' launch configurations instead (gate/up, then down); with "
                         "--formats, first time the W4A16 configurations and use the fastest for the table")
    ap.add_argument("--json", default=None)
    ap.add_argument("--formats", default=None, help="4-bit expert formats (mxfp4,int4): the W4A16 table")
    ap.add_argument("--humming-inter", default=None, help="widths to time humming at (default: every --inter)")
    ap.add_argument("--arms", default="w4a16,bf16,humming,stock",
                    help="W4A16 table: the arms to time (also cute, read, read_rows, read_block)")
    ap.add_argument("--cute-choices", default=None,
                    help='W4A16 table: CuTe arms with imposed launch choices, JSON {"name": {"split": 2, '
                         '"n_tiles": 1, "pairwise": false, "blocked": true}} (W4A16Launch fields)')
    ap.add_argument("--layout", default=PRESETS["k3"].expert_layout, choices=quant.EXPERT_LAYOUTS,
                    help="W4A16 table: the tables' layout the cute arm (the op as a model calls it) and the profile "
                         "run over (default: the k3 preset's)")
    ap.add_argument("--profile", action="store_true",
                    help="W4A16 table: the CuTe arm's kernels in one profiled replay (the middle call)")
    ap.add_argument("--w4a16-config", default=None, help="W4A16: a GATE_UP/DOWN override (JSON) for both kernels")
    ap.add_argument("--sweep-tokens", default="1,64", help="W4A16 --sweep: token counts")
    ap.add_argument("--sweep-out", default=None, help="W4A16 --sweep: JSON of the sweep")
    ap.add_argument("--sweep-only", action="store_true", help="W4A16: the sweep alone")
    ap.add_argument("--sweep-configs", default=None,
                    help="W4A16 --sweep: the configurations to time, by name (default: all of w4a16_table.SWEEP)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.formats:
        from bench.w4a16_table import run_w4a16

        return run_w4a16(args)
    from k3fuse.tools.bench.timing import capture, copy_bandwidth, time_graph
    from k3fuse.kernels.lib.triton import routed_experts as kernel
    from k3fuse.spelling import K3_SITU_BETA, K3_SITU_LINEAR_BETA, routed_experts_grouped

    situ = (K3_SITU_BETA, K3_SITU_LINEAR_BETA)
    if args.sweep:
        return _sweep(args, kernel, situ, capture, time_graph)
    bandwidth = copy_bandwidth(torch.device("cuda"))
    compiled = torch.compile(routed_experts_grouped, fullgraph=True)
    rows = []
    for I in (int(i) for i in args.inter.split(",")):
        w = _expert_weights(I)
        for T in (int(t) for t in args.tokens.split(",")):
            a = torch.randn(STEPS, T, L, device="cuda", dtype=torch.bfloat16)
            experts = torch.empty(STEPS, T * K, device="cuda", dtype=torch.int64)

            def refill() -> None:
                a.normal_()
                experts.copy_(torch.rand(STEPS, T, E, device="cuda").argsort(-1)[..., :K].reshape(STEPS, -1))

            refill()
            out = torch.empty(STEPS, T * K, L, device="cuda", dtype=torch.bfloat16)

            def triton_arm(config: dict | None):
                return lambda: [kernel.run(a[i], experts[i], *w, K, *situ, out=out[i], config=config)
                                for i in range(STEPS)]

            arms = {"eager": lambda: [routed_experts_grouped(a[i], experts[i], *w, K, *situ) for i in range(STEPS)],
                    "compiled": lambda: [compiled(a[i], experts[i], *w, K, *situ) for i in range(STEPS)],
                    "triton": triton_arm(None), "triton_pairwise": triton_arm({"pairwise": True}),
                    "triton_grouped": triton_arm({"pairwise": False})}
            touched = E * (1 - (1 - K / E) ** T)
            mode = "pairwise" if kernel.pick_config(T, E, I, L, K)["pairwise"] else "grouped"
            row = {"inter": I, "tokens": T, "triton_mode": mode, "experts_touched": touched,
                   "floor": touched * 3 * I * L * 2 / bandwidth * 1e6}
            for name, steps in arms.items():
                graph = capture(steps, warmup=2)
                row[name] = statistics.median(time_graph(graph, STEPS, args.replays, refill=refill))
                del graph
            row["speedup_vs_compiled"] = row["compiled"] / row["triton"]
            rows.append(row)
            print(f"I={I:>5} T={T:>3}  eager {row['eager']:8.1f}  compiled {row['compiled']:8.1f}  "
                  f"triton {row['triton']:8.1f} µs {'[' + mode + ']':<10} ({row['speedup_vs_compiled']:.2f}x)  "
                  f"forced: pairwise {row['triton_pairwise']:8.1f} grouped {row['triton_grouped']:8.1f}  "
                  f"floor {row['floor']:7.1f}", flush=True)
        w = None  # free this width's weights before the next width's
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"E": E, "top_k": K, "latent": L, "device": torch.cuda.get_device_name(),
                       "copy_bandwidth_TBps": bandwidth / 1e12, "rows": rows}, f, indent=2)
    return 0


def _expert_weights(I: int) -> list[torch.Tensor]:
    """w1, w3 [E, I, L] and w2 [E, L, I], bf16, scaled like the model's."""
    return [torch.randn(E, I, L, device="cuda", dtype=torch.bfloat16) * L ** -0.5,
            torch.randn(E, I, L, device="cuda", dtype=torch.bfloat16) * L ** -0.5,
            torch.randn(E, L, I, device="cuda", dtype=torch.bfloat16) * I ** -0.5]


def _configs() -> list[dict]:
    """Gate/up blocks, stages and warps with the default down; then the down's with the default gate/up."""
    out = [{"gate_up": {"BLOCK_N": n, "BLOCK_K": k, "num_warps": w, "num_stages": st}}
           for n in (16, 32) for k in (128, 256, 512) for w in (4, 8) for st in (2, 4)]
    out += [{"down": {"BLOCK_N": n, "num_warps": w, "num_stages": st}}
            for n in (64, 128, 256) for w in (4, 8) for st in (2, 4)]
    return out


def _sweep(args, kernel, situ, capture, time_graph) -> int:
    results = []
    for I in (int(i) for i in args.inter.split(",")):
        w = _expert_weights(I)
        for T in (int(t) for t in args.tokens.split(",")):
            a = torch.randn(STEPS, T, L, device="cuda", dtype=torch.bfloat16)
            experts = torch.rand(STEPS, T, E, device="cuda").argsort(-1)[..., :K].reshape(STEPS, -1).contiguous()
            out = torch.empty(STEPS, T * K, L, device="cuda", dtype=torch.bfloat16)
            timed = []
            for cfg in [None, *_configs()]:
                try:
                    graph = capture(lambda: [kernel.run(a[i], experts[i], *w, K, *situ, out=out[i], config=cfg)
                                             for i in range(STEPS)], warmup=1)
                    us = statistics.median(time_graph(graph, STEPS, 10))
                except Exception as exc:  # a configuration the compiler refuses (shared memory)
                    print(f"I={I} T={T} {cfg}: {type(exc).__name__}", flush=True)
                    continue
                timed.append((us, cfg))
                results.append({"inter": I, "tokens": T, "config": cfg, "us": us})
            timed.sort(key=lambda r: r[0])
            default = next(us for us, c in timed if c is None)
            print(f"I={I} T={T}: default {default:.1f} µs; best " +
                  "; ".join(f"{us:.1f} {c}" for us, c in timed[:4]), flush=True)
        w = None  # free this width's weights before the next width's
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sweep": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
