"""bench_routed_experts.py --formats: the 4-bit routed experts' table (see that script's docstring).

Per width I: the BF16 kernel's arm on a bf16 table (the MXFP4 codes dequantized), then per format
the packed table, the w4a16 kernel, humming, and stock (whose dequantization of the step's slots
needs the most memory, so it runs last). Prints a row per (I, format, tokens) and writes JSON.
"""
from __future__ import annotations

import dataclasses
import json
import math
import statistics
import sys
import time

import torch

from k3fuse import quant
from k3fuse.tools.bench.profile import profile_steps
from k3fuse.tools.bench.timing import capture, copy_bandwidth, copy_seconds, time_graph
from k3fuse.kernels.lib.triton import routed_experts as bf16_kernel
from k3fuse.kernels.lib.triton import routed_experts_w4a16 as kernel
from k3fuse.kernels.lib.composite.routed_experts_w4a16 import W4A16Launch
from k3fuse.kernels.ops.routed_experts_w4a16 import RoutedExpertsW4A16Spec, cute_accepts, cute_run
from k3fuse.spelling import K3_SITU_BETA, K3_SITU_LINEAR_BETA, routed_experts_quantized_grouped, situ_glu
from bench.touched_read import TiledRead, TouchedRead, distinct

E, K, L = 896, 16, 3584
STEPS = 8
SITU = (K3_SITU_BETA, K3_SITU_LINEAR_BETA)
READ_ARMS = ("read", "read_rows", "read_block")  # bench/touched_read.py's readers of the step's bytes
COPY_BUFFER = 256 << 20  # bytes: the copy bandwidth the targets are stated against


def packed_table(fmt: str, I: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for rows, cols in ((I, L), (I, L), (L, I)):
        out += list(quant.random_experts(fmt, E, rows, cols, gen, "cuda"))
    return out


def dequantized(fmt: str, packed: list[torch.Tensor]) -> list[torch.Tensor]:
    """w1, w3, w2 in bf16, 64 experts at a time (the dequantization's fp32 temporaries stay small)."""
    table = quant.e2m1_table("cuda") if fmt == "mxfp4" else None
    out = []
    for p, s in zip(packed[0::2], packed[1::2]):
        out.append(torch.cat([quant.dequantize(p[i:i + 64], s[i:i + 64], fmt, torch.bfloat16, table=table)
                              for i in range(0, E, 64)]))
    return out


def table_copy_bandwidth(tensors: list[torch.Tensor], reps: int = 3) -> float:
    """Bytes/s (read + write) of copying each whole packed tensor once, under the same timing."""
    total = sum(t.numel() * t.element_size() for t in tensors)
    return 2 * total / sum(copy_seconds(t, torch.empty_like(t), reps) for t in tensors)


class Routing:
    """STEPS steps of T tokens: a [STEPS, T, L] bf16 and distinct experts per token, refilled per replay."""

    def __init__(self, T: int):
        self.T = T
        self.a = torch.randn(STEPS, T, L, device="cuda", dtype=torch.bfloat16)
        self.experts = torch.empty(STEPS, T * K, device="cuda", dtype=torch.int64)
        self.touched: list[int] = []
        self.refill()

    def refill(self) -> None:
        self.a.normal_()
        self.experts.copy_(torch.rand(STEPS, self.T, E, device="cuda").argsort(-1)[..., :K].reshape(STEPS, -1))
        self.touched += [int(self.experts[i].unique().numel()) for i in range(STEPS)]


def timed(steps, refill, replays: int) -> float:
    graph = capture(steps, warmup=2)
    us = statistics.median(time_graph(graph, STEPS, replays, refill=refill))
    del graph
    return us


def profiled(steps, refill) -> list[dict]:
    """The middle call's kernels in one profiled replay: [{name, start_us, dur_us}], start from its first."""
    graph = capture(steps, warmup=2)
    refill()
    timeline = profile_steps(graph.replay, STEPS)["timeline"]
    del graph
    return [{"name": k["name"], "start_us": round(k["start_us"], 2), "dur_us": round(k["dur_us"], 2)}
            for k in timeline]


def _short(names: list[str]) -> list[str]:
    """Kernel names for the profile line: the CuTe launches in their order (gate/up, then down)."""
    cute = iter(("cute.gate_up", "cute.down"))
    return [next(cute, "cute") if "W4A16RowsDot" in n else n.split("(")[0].replace("void ", "")[:28] for n in names]


#: the launch configurations --sweep times (kernels/lib/triton/routed_experts_w4a16.py GATE_UP / DOWN):
#: rows by elements a step, warps, stages; "_wo": WORD_ORDER (the activations permuted to the
#: dequantized weights' register order)
SWEEP = {f"bn{n}_bk{k}_w{w}_s{st}" + ("_wo" if wo else ""):
         {"BLOCK_N": n, "BLOCK_K": k, "num_warps": w, "STAGES": st, "WGMMA": True, "WORD_ORDER": wo}
         for n, k, w, st, wo in ((64, 128, 4, 4, False), (64, 128, 4, 4, True), (64, 64, 4, 4, False),
                                 (64, 64, 4, 4, True), (64, 128, 4, 3, True), (64, 256, 4, 3, True),
                                 (128, 128, 4, 4, True))}


def sweep(args, copy_bw: float) -> dict:
    """The w4a16 kernel under each SWEEP configuration (gate/up and down alike) at the first width,
    each format, the given tokens: {name: {fmt: {T: µs}}}, and the fastest by geometric mean."""
    I, out = int(args.inter.split(",")[0]), {}
    for fmt in [f for f in args.formats.split(",") if f]:
        packed = packed_table(fmt, I, seed=I + 1)
        table = quant.e2m1_table("cuda") if fmt == "mxfp4" else None
        chosen = args.sweep_configs.split(",") if args.sweep_configs else list(SWEEP)
        for name, cfg in ((n, SWEEP[n]) for n in chosen):
            for T in [int(t) for t in args.sweep_tokens.split(",")]:
                r = Routing(T)
                o = torch.empty(STEPS, T * K, L, device="cuda", dtype=torch.bfloat16)
                over = {"gate_up": dict(cfg), "down": dict(cfg)}
                us = timed(lambda: [kernel.run(r.a[i], r.experts[i], *packed, K, *SITU, fmt, table, out=o[i],
                                               config=over) for i in range(STEPS)], r.refill, args.replays)
                out.setdefault(name, {}).setdefault(fmt, {})[T] = us
                touched = statistics.mean(r.touched) * kernel.packed_bytes(fmt, 1, I, L)
                print(f"sweep I={I} {fmt} {name:20} T={T:>3} {us:8.1f} µs "
                      f"{100 * touched / (us * 1e-6) / copy_bw:5.1f}% of copy", flush=True)
        del packed
        torch.cuda.empty_cache()
    score = {n: math.exp(statistics.mean(math.log(v) for f in d.values() for v in f.values())) for n, d in out.items()}
    best = min(score, key=score.get)
    print(f"sweep best (geometric mean): {best} {SWEEP[best]}", flush=True)
    return {"inter": I, "times_us": out, "geomean_us": score, "best": best, "best_config": SWEEP[best]}


def run_w4a16(args) -> int:
    formats = [f for f in args.formats.split(",") if f]
    arms = set(args.arms.split(","))
    inters = [int(i) for i in (args.inter if args.inter != "128,64" else "3072,1536,384").split(",")]
    tokens = [int(t) for t in args.tokens.split(",")]
    cute_choices = json.loads(args.cute_choices) if args.cute_choices else {}
    humming_inters = inters if args.humming_inter is None else [int(i) for i in args.humming_inter.split(",") if i]
    copy_bw = copy_bandwidth(torch.device("cuda"), nbytes=2 * COPY_BUFFER)
    print(f"copy bandwidth, {COPY_BUFFER >> 20} MiB buffer: {copy_bw / 1e12:.2f} TB/s", flush=True)
    swept = sweep(args, copy_bw) if args.sweep else None
    config = None
    if swept is not None and args.sweep_out:
        with open(args.sweep_out, "w") as f:
            json.dump({**swept, "copy_bandwidth_TBps": copy_bw / 1e12}, f, indent=2)
    if args.sweep_only:
        return 0
    if args.w4a16_config:
        config = {"gate_up": dict(json.loads(args.w4a16_config)), "down": dict(json.loads(args.w4a16_config))}
    elif swept is not None:
        config = {"gate_up": dict(swept["best_config"]), "down": dict(swept["best_config"])}
    stock = torch.compile(routed_experts_quantized_grouped, fullgraph=True, dynamic=True)
    rows, tables, humming_errors = [], [], {}
    for I in inters:
        bf16_us = {}
        if "bf16" in arms:
            w = dequantized("mxfp4", packed_table("mxfp4", I, seed=I))  # the BF16 kernel on the same values
            for T in tokens:
                r = Routing(T)
                out = torch.empty(STEPS, T * K, L, device="cuda", dtype=torch.bfloat16)
                bf16_us[T] = timed(lambda: [bf16_kernel.run(r.a[i], r.experts[i], *w, K, *SITU, out=out[i])
                                            for i in range(STEPS)], r.refill, args.replays)
            del w
            torch.cuda.empty_cache()
        for fmt in formats:
            packed = packed_table(fmt, I, seed=I + 1)
            blocked: list[torch.Tensor] = []  # the tables in block order, made for the first blocked arm

            def blocked_tables() -> list[torch.Tensor]:
                if not blocked:
                    for w, sc in zip(packed[0::2], packed[1::2]):
                        blocked.extend(quant.block_order(w, sc))
                return blocked

            table = quant.e2m1_table("cuda") if fmt == "mxfp4" else None
            per_expert = kernel.packed_bytes(fmt, 1, I, L)
            # the CuTe arms where its kernel takes this table (MXFP4; int4 with bf16 scales, K3FUSE_W4A16_CUTE_INT4)
            cute_missing = cute_accepts(RoutedExpertsW4A16Spec(tokens=1, E=E, I=I, L=L, top_k=K, dtype=torch.bfloat16,
                                                               format=fmt, scale_dtype=packed[1].dtype))
            cute_here = cute_missing is None
            tables.append({"inter": I, "format": fmt, "table_bytes": per_expert * E,
                           "table_copy_TBps": table_copy_bandwidth(packed) / 1e12, "cute_not_run": cute_missing,
                           "cute_layout": args.layout})
            results = {T: {} for T in tokens}
            for T in tokens:
                r = Routing(T)
                out = torch.empty(STEPS, T * K, L, device="cuda", dtype=torch.bfloat16)
                results[T]["w4a16"] = timed(lambda: [kernel.run(r.a[i], r.experts[i], *packed, K, *SITU, fmt, table,
                                                                out=out[i], config=config) for i in range(STEPS)],
                                            r.refill, args.replays)

                readers = {"read": lambda: TouchedRead(packed),  # the read ceiling: the step's bytes, no more
                           "read_rows": lambda: TiledRead(packed, contiguous=False),  # on the op's grid, its order
                           "read_block": lambda: TiledRead(packed, contiguous=True)}  # ... each block in order
                ids = torch.empty_like(r.experts)

                def refill_ids() -> None:  # the distinct ids outside the timing, as the routing is
                    r.refill()
                    ids.copy_(torch.stack([distinct(e) for e in r.experts]))

                for arm, make in readers.items():
                    if arm in arms:
                        reader = make()
                        refill_ids()
                        results[T][arm] = timed(lambda: [reader(ids[i]) for i in range(STEPS)], refill_ids,
                                                args.replays)

                def cute_steps(launch: W4A16Launch):  # the CuTe op's STEPS calls at `launch`
                    layout = "blocks" if launch.blocked else "rows"
                    tables = blocked_tables() if launch.blocked else packed
                    return lambda: [cute_run(r.a[i], r.experts[i], *tables, K, *SITU, fmt, table, layout, out=out[i],
                                             launch=launch) for i in range(STEPS)]

                # the op's own launch as a model holding args.layout calls it
                op_config = W4A16Launch.for_call(fmt, T, E, I, L, K, args.layout) if cute_here else None
                if "cute" in arms and cute_here:
                    results[T]["cute"] = timed(cute_steps(op_config), r.refill, args.replays)
                    results[T]["cute_config"] = dataclasses.asdict(op_config)
                for name, choice in cute_choices.items() if cute_here else ():  # imposed launch choices
                    arms_here = results[T].setdefault("cute_choices", {})
                    try:
                        cfg = _imposed(fmt, T, I, choice)
                    except (ValueError, TypeError) as exc:  # a split or tile count the widths do not take
                        arms_here[name] = {"not_run": str(exc)}
                        continue
                    arms_here[name] = {"us": timed(cute_steps(cfg), r.refill, args.replays),
                                       "config": dataclasses.asdict(cfg)}
                if args.profile and "cute" in arms and cute_here:
                    results[T]["cute_profile"] = profiled(cute_steps(op_config), r.refill)
                results[T]["touched"] = statistics.mean(r.touched)
                results[T]["mode"] = "pairwise" if kernel.pick_config(T, E, I, L, K)["pairwise"] else "grouped"
            if I in humming_inters and "humming" in arms:
                _humming_arm(fmt, I, packed, tokens, results, humming_errors, args.replays)
            stock_error = None if "stock" in arms else "not run (--arms)"
            for T in tokens:
                r = Routing(T)
                if stock_error is None:
                    try:
                        results[T]["stock"] = timed(lambda: [stock(r.a[i], r.experts[i], *packed, K, *SITU, fmt,
                                                                   table) for i in range(STEPS)],
                                                    r.refill, max(5, args.replays // 3))
                    except Exception as exc:  # e.g. out of memory for the dequantized slots: not retried
                        stock_error = f"T={T}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                        print(f"stock {fmt} I={I} failed at {stock_error}", file=sys.stderr, flush=True)
                if "stock" not in results[T]:
                    results[T]["stock"], results[T]["stock_error"] = None, stock_error
                torch.cuda.empty_cache()
            for T in tokens:
                res = results[T]
                touched_bytes = res["touched"] * per_expert
                row = {"inter": I, "format": fmt, "tokens": T, "w4a16_mode": res["mode"],
                       "experts_touched": res["touched"],
                       "experts_touched_expected": E * (1 - (1 - K / E) ** T),
                       "packed_bytes_touched": touched_bytes, "w4a16": res["w4a16"], "bf16": bf16_us.get(T),
                       "stock": res.get("stock"), "humming": res.get("humming"),
                       "w4a16_pct_copy_bw": 100 * touched_bytes / (res["w4a16"] * 1e-6) / copy_bw,
                       "floor_us": touched_bytes / copy_bw * 1e6,
                       "vs_bf16": bf16_us[T] / res["w4a16"] if T in bf16_us else None,
                       "vs_stock": res["stock"] / res["w4a16"] if res.get("stock") else None,
                       "vs_humming": res["humming"] / res["w4a16"] if res.get("humming") else None}
                for arm in READ_ARMS:
                    if res.get(arm):
                        row.update({arm: res[arm],
                                    f"{arm}_pct_copy_bw": 100 * touched_bytes / (res[arm] * 1e-6) / copy_bw})
                if res.get("cute"):
                    row.update(cute=res["cute"], cute_pct_copy_bw=100 * touched_bytes / (res["cute"] * 1e-6) / copy_bw,
                               cute_vs_w4a16=res["w4a16"] / res["cute"],
                               cute_vs_humming=res["humming"] / res["cute"] if res.get("humming") else None,
                               cute_vs_bf16=bf16_us[T] / res["cute"] if T in bf16_us else None)
                for name, arm in res.get("cute_choices", {}).items():
                    row.setdefault("cute_choices", {})[name] = arm if "not_run" in arm else {
                        **arm, "pct_copy_bw": 100 * touched_bytes / (arm["us"] * 1e-6) / copy_bw}
                for extra in ("stock_error", "humming_rel_vs_w4a16", "cute_config", "cute_profile"):
                    if extra in res:
                        row[extra] = res[extra]
                rows.append(row)
                cute = (f"  cute {args.layout} "
                        f"{row['cute']:8.1f} µs {row['cute_pct_copy_bw']:5.1f}% of copy" if "cute" in row else "")
                cute += "".join(f"  {arm} {row[arm]:8.1f} µs {row[f'{arm}_pct_copy_bw']:5.1f}%"
                                for arm in READ_ARMS if arm in row)
                cute += "".join(f"  cute[{n}] {a['us']:8.1f} µs {a['pct_copy_bw']:5.1f}%" if "us" in a
                                else f"  cute[{n}] not run" for n, a in row.get("cute_choices", {}).items())
                print(f"I={I:>5} {fmt:5} T={T:>3} touched {row['experts_touched']:6.1f} "
                      f"{touched_bytes / 1e6:8.1f} MB  w4a16 {row['w4a16']:8.1f} µs [{res['mode']:8}] "
                      f"{row['w4a16_pct_copy_bw']:5.1f}% of copy  bf16 {_fmt(row['bf16'])} "
                      f"stock {_fmt(row['stock'])}  humming {_fmt(row['humming'])}{cute}", flush=True)
                if "cute_profile" in row:
                    kernels = row["cute_profile"]
                    print("    cute kernels (start+µs): " + "  ".join(
                        f"{n} {k['start_us']:.1f}+{k['dur_us']:.1f}"
                        for n, k in zip(_short([k["name"] for k in kernels]), kernels)), flush=True)
            del packed, blocked
            torch.cuda.empty_cache()
            _write(args.json, copy_bw, tables, humming_errors, rows, config, swept)  # a cut-short run keeps it
    print(json.dumps({"tables": tables, "humming_errors": humming_errors}), flush=True)
    return 0


def _imposed(fmt: str, T: int, I: int, choice: dict) -> W4A16Launch:  # noqa: E741
    """The CuTe launch of a --cute-choices arm: the op's for T tokens in the mode the choice imposes (pairwise,
    its split and tiles recomputed), over rows or `blocked` tables, its other fields replaced."""
    rest = {k: v for k, v in choice.items() if k not in ("pairwise", "blocked")}
    launch = W4A16Launch.for_call(fmt, T, E, I, L, K, "blocks" if choice.get("blocked") else "rows",
                                  pairwise=choice.get("pairwise"))
    return dataclasses.replace(launch, **rest)


def _write(path: str | None, copy_bw: float, tables: list, humming_errors: dict, rows: list, config, swept) -> None:
    if not path:
        return
    summary = {"E": E, "top_k": K, "latent": L, "steps_per_graph": STEPS, "device": torch.cuda.get_device_name(),
               "torch": torch.__version__, "copy_buffer_bytes": COPY_BUFFER, "copy_bandwidth_TBps": copy_bw / 1e12,
               "w4a16_config": config or {"gate_up": kernel.GATE_UP, "down": kernel.DOWN}, "sweep": swept,
               "tables": tables, "humming_errors": humming_errors, "rows": rows}
    with open(path, "w") as f:
        json.dump(summary, f, indent=2)


def _fmt(us: float | None) -> str:
    return "     n/a" if us is None else f"{us:8.1f}"


def _humming_arm(fmt: str, I: int, packed, tokens, results, errors: dict, replays: int) -> None:
    """humming's two indexed GEMMs per token count (one layer pair per T: its tile follows T*k)."""
    try:
        from bench.humming_moe import HummingMoE
    except Exception as exc:
        errors[f"{fmt}/{I}"] = f"import: {type(exc).__name__}: {exc}"
        return
    for T in tokens:
        t0 = time.time()
        try:
            moe = HummingMoE(fmt, *packed, tokens=T, top_k=K, slots=STEPS)
            r = Routing(T)
            # cross-check on step 0 against the w4a16 kernel (humming computes the same function)
            moe.align(r.experts[0])
            z_h = moe.forward(r.a[0], lambda g, u: situ_glu(g, u, *SITU))
            table = quant.e2m1_table("cuda") if fmt == "mxfp4" else None
            z_k = kernel.run(r.a[0], r.experts[0], *packed, K, *SITU, fmt, table)
            results[T]["humming_rel_vs_w4a16"] = float((z_h.float() - z_k.float()).norm() / z_k.float().norm())

            def refill() -> None:  # new routing, aligned into each call's buffers outside the timing
                r.refill()
                for i in range(STEPS):
                    moe.align(r.experts[i], i)

            refill()
            results[T]["humming"] = timed(lambda: [moe.step(r.a[i], i) for i in range(STEPS)], refill, replays)
            del moe
        except Exception as exc:  # reported, and the width's other token counts skipped (the same cause)
            errors[f"{fmt}/{I}/T{T}"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            print(f"humming {fmt} I={I} T={T} failed: {errors[f'{fmt}/{I}/T{T}']}", file=sys.stderr, flush=True)
            import traceback
            traceback.print_exc()
            torch.cuda.empty_cache()
            return
        torch.cuda.empty_cache()
        print(f"  humming {fmt} I={I} T={T}: {time.time() - t0:.1f} s (compile + time)", flush=True)


__all__ = ["run_w4a16"]
