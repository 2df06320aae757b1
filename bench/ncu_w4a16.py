"""One call of the CuTe W4A16 op per (width, token count), for Nsight Compute: the hardware's view of
its launches (DRAM and L2 traffic, stalls, occupancy) where the benchmark only has times. --choices
profiles launch choices (cute_config's) after the default, on the same tokens.

Each call runs on tokens and experts drawn as bench/w4a16_table.py draws them (16 of 896 a token,
over a random packed table of several GB), after a call on other tokens that compiles it; only the
profiled call sits between cudaProfilerStart and Stop, so run it under `ncu --profile-from-start off`:

    ncu --profile-from-start off --clock-control none -k regex:W4A16RowsDot --section SpeedOfLight \
        python bench/ncu_w4a16.py --inter 3072 --tokens 1,64
"""
from __future__ import annotations

import argparse
import json

import torch

from k3fuse.kernels.ops.routed_experts_w4a16 import cute_config, cute_run

from w4a16_table import E, K, L, SITU, Routing, packed_table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inter", default="3072", help="expert widths per rank, comma-separated")
    ap.add_argument("--tokens", default="1,64", help="token counts, comma-separated")
    ap.add_argument("--choices", default=None,
                    help='JSON {name: cute_config choices}: each profiled after the default, e.g. {"s256":{"step":256}}')
    args = ap.parse_args(argv)
    arms = {"default": {}, **(json.loads(args.choices) if args.choices else {})}
    for I in (int(i) for i in args.inter.split(",")):
        packed = packed_table("mxfp4", I, seed=I + 1)
        for T in (int(t) for t in args.tokens.split(",")):
            r = Routing(T)
            for name, choice in arms.items():
                try:
                    cfg = cute_config(T, E, I, L, K, **choice)
                except ValueError as exc:  # a choice of the other mode (one_launch: pairwise only)
                    print(f"not profiled I={I} T={T} {name}: {exc}", flush=True)
                    continue
                cute_run(r.a[0], r.experts[0], *packed, K, *SITU, "mxfp4", config=cfg)  # compiled outside the range
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaProfilerStart()
                cute_run(r.a[1], r.experts[1], *packed, K, *SITU, "mxfp4", config=cfg)
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaProfilerStop()
                print(f"profiled I={I} T={T} {name} {cfg}: {r.touched[1 - len(r.a)]} experts touched", flush=True)
        del packed
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
