"""The MoE front at K3 widths: replicated router + latent down-projection vs the sharded op.

Arms (one run, the same inputs; µs per decode step, median over CUDA-graph replays of STEPS steps
over COPIES rotating weight copies, fresh activations per step, the slower rank):
  stock       torch.compile of the model's spelling, replicated on every rank:
              F.linear(x.float(), W_r.float()) and F.linear(x, W_down)
  gemv        k3fuse.decode_gemm on both, replicated (the GEMV / split-K kernels, fp32 router out)
  sharded     k3fuse.moe_front_sharded over the process group: 1/W of the rows per rank, one push
              GEMM and the NVLink gather (triton.moe_front_sharded)
  slice       (--as-tp N[,N...] on one GPU) the op on one rank with 1/N of the rows: what each rank of
              TP N computes, with the gather of its own slot only; no peer, so no NVLink time. Per row
              "slices" holds every N ({"2": {"slice": ..., ...}, "16": {"skipped": why}}); the first N's
              timings also stay at the row's top level ("slice", "slice_push_only", ...) as before
Also the weight-read floor of each arm (bytes / copy bandwidth measured in the same process).

    python -m bench.bench_moe_front [--world 2] [--as-tp 2,4,8,16] [--tokens 1,2,4,8,16,32,64] [--json out.json]
    python -m bench.bench_moe_front --sweep [--as-tp 2] [--tokens 1,8,64]   # push-GEMM configs, one GPU
    python -m bench.bench_moe_front --project bench/results/h200_moe_front_slice.json [more.json ...]
        # no GPU: fit bench/front_model.py on the slices, print the TP 2/4/8/16 projection
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

E, H = gemm_site("router").n, gemm_site("router").k
L = gemm_site("w_down").n
STEPS, COPIES, MAX_T = 20, 4, 64


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

    def stock(x, wr, wd):   # the model's spelling (kernels/lib/reference/stock.py)
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
            res["slices"] = {str(n): _time_slice(n, T, xs, wrs, wds, group, dev, floor) for n in as_tp}
            first = res["slices"][str(as_tp[0])]
            if "skipped" not in first:   # the first N's keys at the top level, as before lists
                res.update({k: v for k, v in first.items() if k != "errors"})
        for k in ("stock", "gemv", "sharded", "slice"):
            if k in res:
                res[k] = slowest_rank(res[k], dev)
        res["sharded_vs_stock"] = res["stock"] / res["sharded"]
        rows_out.append(res)
        if rank == 0:
            print(f"T={T:2d} stock {res['stock']:6.2f}  gemv {res['gemv']:6.2f}  sharded(W={world}) "
                  f"{res['sharded']:6.2f} (floor {res['floor_sharded']:5.2f}) x{res['sharded_vs_stock']:.2f}",
                  flush=True)
            for n, sl in res.get("slices", {}).items():
                if "skipped" in sl:
                    print(f"      slice(1/{n}) skipped: {sl['skipped']}", flush=True)
                    continue
                print(f"      slice(1/{n}) {sl['slice']:6.2f} (no PDL {_us(sl['slice_no_pdl'])}; floor "
                      f"{sl['floor_slice']:5.2f}; push GEMM alone {_us(sl['slice_push_only'])}, one stacked "
                      f"decode GEMM {_us(sl['slice_stacked_gemm'])})", flush=True)
    if rank == 0:
        from bench.bench_decode_gemm import conditions

        meta = conditions()
        meta["world"] = world
        meta["copy_GBps"] = gbps / 1e9
        meta["env"] = {k: os.environ.get(k) for k in MULTICAST_OFF}
        with open(out_json, "w") as f:
            json.dump({"conditions": meta, "steps": STEPS, "weight_copies": COPIES, "E": E, "L": L, "H": H,
                       "as_tp": list(as_tp) if world == 1 else [], "rows": rows_out}, f, indent=1, default=str)
    dist.barrier()


def _us(v) -> str:
    return "  n/a" if v is None else f"{v:5.2f}"


def _time_slice(n, T, xs, wrs, wds, group, dev, floor) -> dict:
    """One rank's TP-n slice on this GPU (world 1): the op, the op without PDL, its push GEMM alone
    and one decode GEMM over the same rows stacked; {"skipped": why} where the kernel declines.
    A side arm that fails (no kernel for the stacked rows in strict mode) is None, its error kept."""
    from k3fuse import runtime
    from k3fuse.kernels.collective import get_workspace
    from k3fuse.kernels.lib.triton import moe_gather as K
    from k3fuse.kernels.lib.triton import splitk_gemm
    from k3fuse.kernels.ops import moe_front

    op = torch.ops.k3fuse.moe_front_sharded
    gemm = torch.ops.k3fuse.decode_gemm
    e1, l1 = E // n, L // n
    why = moe_front.accepts(moe_front.MoEFrontSpec(tokens=T, E=e1, L=l1, H=H, dtype=torch.bfloat16, world_size=1,
                                                   max_tokens=MAX_T)) \
        if E % n == 0 and L % n == 0 else f"E {E} / L {L} not divisible by {n}"
    if why is not None:
        return {"skipped": why}
    out: dict = {"floor_slice": floor(e1 + l1), "errors": {}}
    sl = [(w[:e1].contiguous(), d[:l1].contiguous()) for w, d in zip(wrs, wds)]
    with runtime.strict():
        op(xs[0], *sl[0], group, 1, MAX_T, True)
        out["slice"] = graph_replay_us(lambda i: op(xs[i], *sl[i % COPIES], group, 1, MAX_T, True), STEPS)

    def side(key, fn):
        try:
            out[key] = fn()
        except Exception as exc:   # recorded, never the whole run lost
            out[key] = None
            out["errors"][key] = f"{type(exc).__name__}: {exc}"[:300]

    def no_pdl():
        K.USE_PDL = False   # the same slice without programmatic dependent launch
        try:
            with runtime.strict():
                op(xs[0], *sl[0], group, 1, MAX_T, True)
                return graph_replay_us(lambda i: op(xs[i], *sl[i % COPIES], group, 1, MAX_T, True), STEPS)
        finally:
            K.USE_PDL = True

    side("slice_no_pdl", no_pdl)
    # where the slice's time goes: its push GEMM alone (no gather), and the CuTe/Triton decode GEMM
    # over the same rows stacked into one weight (what one kernel reaches)
    ws = get_workspace(group, 1, MAX_T, e1 + l1, dev)
    cfg = K.push_config(T, e1, l1, H)
    push = (ws.ptrs, ws.gen, 0, MAX_T)

    def push_only():
        try:
            return graph_replay_us(lambda i: splitk_gemm.run(xs[i], sl[i % COPIES][0], None, torch.float32, config=cfg,
                                                             push=push, weight2=sl[i % COPIES][1]), STEPS)
        finally:
            ws.datas[0].view(torch.int32).fill_(-2**31)   # pushed without a gather: back to the sentinel

    side("slice_push_only", push_only)
    stacked = [torch.cat([w, d]) for w, d in sl]

    def stacked_gemm():
        with runtime.strict():
            return graph_replay_us(lambda i: gemm(xs[i], stacked[i % COPIES], None, None, True), STEPS)

    side("slice_stacked_gemm", stacked_gemm)
    if not out["errors"]:
        del out["errors"]
    return out


def _sweep_worker(rank, world, tokens, as_tp, out_json):
    """Time the op on one rank's 1/as_tp slice under every push-GEMM config; print the best per
    token count as entries for kernels/lib/triton/moe_gather.TUNED."""
    import itertools

    import torch.distributed as dist

    import k3fuse.kernels  # noqa: F401
    from k3fuse import runtime
    from k3fuse.kernels.lib.triton import moe_gather as K
    from k3fuse.kernels.lib.triton import splitk_gemm

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


RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
#: the fused out-projection all-reduce (TP 2) and its GEMM alone (section 2 of
#: docs/perf/2026-11-30-decode-gemm-fused-ar.md): the pessimistic bracket of the exchange in --project
BRACKET = (os.path.join(RESULTS, "h200_fused_ar_tp2.json"), os.path.join(RESULTS, "h200_decode_gemm.json"))


def _coverage(tps) -> dict:
    """Per TP: None where the kernel takes K3's front (the op at world W, and one rank's slice) at
    1, 8 and 64 tokens, else its reasons; {} when the kernel module cannot be imported here."""
    try:
        from k3fuse.kernels.ops import moe_front
        from k3fuse.kernels.lib.triton import splitk_gemm  # noqa: F401  (the predicate reads its tiles)
    except Exception:  # pragma: no cover - a checkout without the kernels
        return {}

    def why_not(T, e, l_, W):
        return moe_front.accepts(moe_front.MoEFrontSpec(tokens=T, E=e, L=l_, H=H, dtype=torch.bfloat16, world_size=W,
                                                        max_tokens=MAX_T))
    out = {}
    for W in tps:
        whys = []
        for T in (1, 8, MAX_T):
            for why in (why_not(T, E, L, W), why_not(T, E // W, L // W, 1)):
                if why and why not in whys:
                    whys.append(why)
        out[W] = "; ".join(whys) or None
    return out


def project(paths, out_json, bracket=BRACKET, nvlink_GBps=None, nvlink_latency_us=None) -> int:
    """Fit bench/front_model.py on slice JSON(s), print the projection, write its JSON."""
    from bench import front_model as M

    runs = M.load_runs(paths)
    br, br_src, gemm = None, "", None
    if bracket and all(os.path.exists(b) for b in bracket):
        with open(bracket[0]) as f, open(bracket[1]) as g:
            fused, gemm = json.load(f), json.load(g)
        br = M.bracket_from_json(fused, gemm)
        br_src = (f"measured on 2 x H200 (docs/perf/2026-11-30-decode-gemm-fused-ar.md section 2): 'k3fuse' of "
                  f"{os.path.basename(bracket[0])} minus 'k3fuse' of oproj_tp2 in {os.path.basename(bracket[1])}, "
                  f"per token count: the fused out-projection all-reduce's whole cost over its GEMM (exchange, "
                  f"second kernel, launch boundary, skew), charged instead of the exchange")
    kw = {}
    if nvlink_GBps is not None:
        kw["nvlink_GBps"] = nvlink_GBps
    if nvlink_latency_us is not None:
        kw["nvlink_latency_us"] = nvlink_latency_us
    params = M.fit_params(runs, bracket_us=br, bracket_source=br_src, **kw)
    lines, js = M.report(params, runs, _coverage(M.TABLE_TP), decode_gemm=gemm)
    print("\n".join(lines))
    with open(out_json, "w") as f:
        json.dump(js, f, indent=1)
    print(f"\nwrote {out_json}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2, help="ranks (one GPU each)")
    ap.add_argument("--as-tp", default="", help="with --world 1: also time one rank's 1/N slice for each N "
                    "of a comma list (2,4,8,16)")
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64")
    ap.add_argument("--json", default=None, help="output (default bench_moe_front.json; with --project "
                    "bench_moe_front_projection.json)")
    ap.add_argument("--sweep", action="store_true", help="push-GEMM configs on one rank's slice (one GPU)")
    ap.add_argument("--project", nargs="+", metavar="JSON", help="no GPU: project TP 2/4/8/16 from these runs")
    ap.add_argument("--no-bracket", action="store_true", help="--project without bench/results' fused-AR bracket "
                    "column and split-K check")
    ap.add_argument("--nvlink-GBps", type=float, default=None, help="--project: override the assumed bandwidth")
    ap.add_argument("--nvlink-latency-us", type=float, default=None, help="--project: override the assumed latency")
    args = ap.parse_args(argv)
    if args.project:
        return project(args.project, args.json or "bench_moe_front_projection.json",
                       bracket=None if args.no_bracket else BRACKET, nvlink_GBps=args.nvlink_GBps,
                       nvlink_latency_us=args.nvlink_latency_us)
    out_json = os.path.abspath(args.json or "bench_moe_front.json")
    as_tp = [int(n) for n in args.as_tp.split(",") if n.strip()]
    if args.sweep:
        if len(as_tp) > 1:
            ap.error("--sweep takes one --as-tp value")
        os.environ.update(MULTICAST_OFF)
        launch(_sweep_worker, 1, backend="nccl", args=([int(t) for t in args.tokens.split(",")],
                                                        as_tp[0] if as_tp else 2, out_json), timeout_s=3600)
        return 0
    if as_tp and args.world != 1:
        ap.error("--as-tp times one rank's slice on one GPU: use it with --world 1")
    if torch.cuda.device_count() < args.world:
        print(f"needs {args.world} GPUs, found {torch.cuda.device_count()}")
        return 1
    os.environ.update(MULTICAST_OFF)
    tokens = [int(t) for t in args.tokens.split(",")]
    launch(_worker, args.world, backend="nccl", args=(tokens, as_tp, out_json), timeout_s=3600)
    return 0

if __name__ == "__main__":
    sys.exit(main())
