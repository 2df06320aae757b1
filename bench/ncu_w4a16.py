"""One call of the CuTe W4A16 op per (format, width, token count), for Nsight Compute: the hardware's view
of its launches (DRAM and L2 traffic, L1/TEX requests by kind, stalls, occupancy) where the benchmark only
has times. "default" is the op's own launch (W4A16Launch.for_call); --choices profiles launches with imposed
choices (W4A16Launch fields, as bench_routed_experts.py --cute-choices) after it, on the same tokens.

Each call runs on tokens and experts drawn as bench/w4a16_table.py draws them (16 of 896 a token,
over a random packed table of several GB), after a call on other tokens that compiles it; only the
profiled call sits between cudaProfilerStart and Stop, so run it under `ncu --profile-from-start off`:

    ncu --profile-from-start off --clock-control none -k regex:W4A16RowsDot --section SpeedOfLight \
        --section MemoryWorkloadAnalysis_Tables python -m bench.ncu_w4a16 --inter 3072 --tokens 1,64

(MemoryWorkloadAnalysis_Tables splits the L1/TEX wavefronts by instruction kind: the activations'
global loads, the weights' and scales' LDGSTS, the shared-memory reads: which of them holds the busy
memory pipeline.)
"""
from __future__ import annotations

import argparse
import json

import torch

from k3fuse import quant
from k3fuse.kernels.ops.routed_experts_w4a16 import cute_run

from bench.w4a16_table import K, SITU, Routing, _imposed, packed_table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="mxfp4", help="expert formats (mxfp4,int4), comma-separated")
    ap.add_argument("--inter", default="3072", help="expert widths per rank, comma-separated")
    ap.add_argument("--tokens", default="1,64", help="token counts, comma-separated")
    ap.add_argument("--choices", default=None,
                    help='JSON {name: launch choices}: each profiled after the default, e.g. {"s1":{"split":1}}')
    args = ap.parse_args(argv)
    arms = {"default": {}, **(json.loads(args.choices) if args.choices else {})}
    for fmt in args.formats.split(","):
        table = quant.e2m1_table("cuda") if fmt == "mxfp4" else None
        for I in (int(i) for i in args.inter.split(",")):
            packed = packed_table(fmt, I, seed=I + 1)
            for T in (int(t) for t in args.tokens.split(",")):
                r = Routing(T)
                for name, choice in arms.items():
                    try:
                        cfg = _imposed(fmt, T, I, choice)
                    except (ValueError, TypeError) as exc:  # a split or tile count the widths do not take
                        print(f"not profiled {fmt} I={I} T={T} {name}: {exc}", flush=True)
                        continue
                    def call(i, cfg=cfg):
                        cute_run(r.a[i], r.experts[i], *packed, K, *SITU, fmt, table, launch=cfg)

                    call(0)  # compiled outside the profiled range
                    torch.cuda.synchronize()
                    torch.cuda.cudart().cudaProfilerStart()
                    call(1)
                    torch.cuda.synchronize()
                    torch.cuda.cudart().cudaProfilerStop()
                    print(f"profiled {fmt} I={I} T={T} {name} {cfg}: {r.touched[1 - len(r.a)]} experts touched",
                          flush=True)
            del packed
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
