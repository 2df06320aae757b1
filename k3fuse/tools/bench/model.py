"""`k3fuse bench --model`: one decode step of the whole model, stock against k3fuse against the engine-like peer.

    k3fuse bench --model --device cuda --preset k3 --as-rank 0 --of 16      # one rank of TP 16 (an H200)
    k3fuse bench --model --device cuda --preset k3 --as-rank 0 --of 32      # TP 32 (an 80 GB H100)
    k3fuse bench --model --preset small --as-rank 0 --of 2                  # CPU smoke run

Per batch (1, 8, 64) and context (4K, 32K, 128K tokens already cached, lengths differing within the batch; the
cache filled with random values), per arm: stock torch.compile (Inductor), k3fuse (strict), the peer
(stock-compiled, routed experts through humming's W4A16 GEMMs, peer.py). A CUDA graph of `--steps` decode steps
is replayed `--replays` times (the state restored between replays, outside the timing): µs per step (median),
tokens per second, kernels per step (one profiled replay), the share of the step in KDA layers, MLA layers and
the head + sampling (each region captured as its own graph and timed with events between them), and the
floor: the bytes this rank must read per step (every weight except the embedding's unread rows and the routed
experts the batch does not touch, uniform routing's expectation; the live KV; the KDA states read and written)
at the card's nominal HBM bandwidth, with the best read bandwidth this run measured beside it. A point whose
cache and scratch do not fit the card's free memory is skipped and the table says so. Rows print as they are
measured and the JSON is rewritten after each, so a run cut short keeps what it measured.
"""
from __future__ import annotations

import gc
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ..model_args import ModelArgs

#: nominal HBM bandwidth by card (bytes/s): the floor's denominator (H100 SXM 3.35 TB/s, H200 4.8 TB/s)
NOMINAL_BW = {"H100": 3.35e12, "H200": 4.8e12}
ARMS = ("stock", "k3fuse", "peer")
#: kernel names of the routed experts' GEMMs, for the experts-GEMM column (k3fuse's W4A16 op, humming's)
EXPERT_KERNELS = r"w4a16|routed_experts|humming|marlin|indexed|moe"


@dataclass(frozen=True)
class ModelBenchConfig:
    model: ModelArgs = field(default_factory=ModelArgs)
    batches: tuple[int, ...] = (1, 8, 64)
    contexts: tuple[int, ...] = (4096, 32768, 131072)
    arms: tuple[str, ...] = ARMS
    steps: int = 4
    replays: int = 10
    profile: bool = True
    shares: bool = True
    margin_gb: float = 4.0
    json: str | None = None
    log: str | None = None


def nominal_bandwidth(name: str | None) -> float | None:
    for card, bw in NOMINAL_BW.items():
        if name and card in name:
            return bw
    return None


def read_bandwidth(device: Any, nbytes: int = 2 << 30, reps: int = 10) -> float:
    """Best read-only bandwidth (bytes/s): a reduction over `nbytes` that writes one value per block."""
    import torch

    buf = torch.empty(nbytes // 4, dtype=torch.int32, device=device).random_(0, 1 << 30)
    out = torch.empty(1, dtype=torch.int64, device=device)
    best = float("inf")
    for _ in range(reps + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.sum(buf, dtype=torch.int64, out=out.view(()))
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del buf
    return nbytes / best


def step_bytes(model: Any, batch: int, lengths: list[int], kv_dtype_bytes: int, state_bytes: int) -> dict[str, float]:
    """Bytes one decode step of this rank must read: weights touched, live KV, KDA states read and written."""
    from .routing import expected_uniform
    from .runner import weight_bytes

    cfg = model.config
    experts, dense = weight_bytes(model)
    embed = dict(model.named_parameters()).get("embed.weight")
    if embed is not None:  # only the rows the tokens look up
        dense += (batch - embed.shape[0]) * embed.shape[1] * embed.element_size()
    touched = expected_uniform(cfg.n_experts, cfg.top_k, batch)
    n_mla = sum(1 for k in model.kinds if k.attn == "mla")
    kv = n_mla * sum(n + 1 for n in lengths) * cfg.kv_entry * kv_dtype_bytes
    weights = dense + experts * touched / cfg.n_experts
    return {"weights": weights, "kv": kv, "state": 2 * state_bytes, "total": weights + kv + 2 * state_bytes,
            "experts_touched": touched}


def _fits(model: Any, cfg: ModelBenchConfig, arm: str, batch: int, context: int) -> str | None:
    """None when the point's cache, states and scratch fit the card's free memory, else why not."""
    import torch

    if model.device.type != "cuda":
        return None
    c = model.config
    n_mla = sum(1 for k in model.kinds if k.attn == "mla")
    n_kda = len(model.kinds) - n_mla
    esize = 1 if cfg.model.kv_dtype == "fp8" else 2
    capacity = context + 3 * cfg.steps
    kv = n_mla * batch * capacity * c.kv_entry * esize
    state = n_kda * batch * (c.kda_heads // model.tp_size * c.head_dim ** 2 * 4 * 2
                             + 3 * c.kda_dim // model.tp_size * (c.conv_kernel - 1) * 2)
    # the plain MLA's gathered cache (cache dtype + its fp32 copy) and scores; stock's dequantized experts
    scratch = batch * capacity * (c.kv_entry * (esize + 4) + c.mla_heads // model.tp_size * 4 * 3)
    if arm == "stock" and c.quantized_experts:
        scratch += min(batch * c.top_k, c.n_experts) * 3 * (c.moe_inter // model.tp_size) * c.latent * 2 * 2
    need = kv + state + scratch + cfg.margin_gb * 2 ** 30
    free = torch.cuda.mem_get_info(model.device)[0]
    if need > free:
        return f"does not fit: needs {need / 2**30:.1f} GiB (KV {kv / 2**30:.1f}), {free / 2**30:.1f} GiB free"
    return None


def _region_us(step: Any, state: Any, tokens: Any, saved: list, replays: int) -> dict[str, float]:
    """µs per step in the embedding, KDA layers, MLA layers and the head + sampling: each region captured as
    its own CUDA graph (one memory pool), replayed in order with events between them."""
    import torch

    from ..model_run import restore

    model = step.model
    regions: list[tuple[str, Any]] = []
    buf: dict[str, Any] = {"r": None}

    def embed() -> None:
        state.seq_lens.add_(1)
        buf["r"] = step.embed(tokens)

    regions.append(("embed", embed))
    for i, layer in enumerate(step.layers):
        def run(i: int = i, layer: Any = layer) -> None:
            buf["r"] = layer(buf["r"], state.bank, *model.layer_state(i, state))
        regions.append((f"{model.kinds[i].attn} layers", run))
    regions.append(("head + sampling", lambda: step.head(buf["r"], state.bank, state.seq_lens, state.uniforms)))
    pool = torch.cuda.graph_pool_handle()
    graphs = []
    restore(state, saved)
    for _, fn in regions:
        fn()  # eager warm-up of this region's inputs (compiled already)
    torch.cuda.synchronize()
    restore(state, saved)
    for _, fn in regions:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            fn()
        graphs.append(g)
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {}
    events = [torch.cuda.Event(enable_timing=True) for _ in range(len(graphs) + 1)]
    for _ in range(replays):
        restore(state, saved)
        events[0].record()
        for g, ev in zip(graphs, events[1:]):
            g.replay()
            ev.record()
        events[-1].synchronize()
        per_kind: dict[str, float] = {}
        for (kind, _), a, b in zip(regions, events, events[1:]):
            per_kind[kind] = per_kind.get(kind, 0.0) + a.elapsed_time(b) * 1e3
        for kind, us in per_kind.items():
            times.setdefault(kind, []).append(us)
    del graphs
    return {kind: statistics.median(v) for kind, v in times.items()}


def _time_point(model: Any, step: Any, cfg: ModelBenchConfig, arm: str, batch: int, context: int,
                bandwidths: dict[str, float | None]) -> dict[str, Any]:
    import torch

    from ..model_run import GraphedSteps, context_lengths, fill_context, now, restore, snapshot
    from . import profile

    lengths = context_lengths(batch, context)
    state = model.new_state(batch, context + 3 * cfg.steps, block_size=cfg.model.block_size,
                            kv_dtype=cfg.model.kv_dtype)
    fill_context(model, state, lengths, cfg.model.seed)
    gen = torch.Generator().manual_seed(cfg.model.seed + batch)
    tokens = torch.randint(0, model.config.vocab_size, (batch,), generator=gen).to(model.device)
    row: dict[str, Any] = {"arm": arm, "batch": batch, "context": context, "lengths": lengths}
    saved = snapshot(state)
    t0 = time.perf_counter()
    if model.device.type == "cuda":
        graphed = GraphedSteps(step, state, tokens, cfg.steps)  # warm-up compiles at a new shape
        row["first_call_s"] = time.perf_counter() - t0
        per_step = []
        for _ in range(cfg.replays):
            restore(state, saved)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graphed.replay()
            end.record()
            end.synchronize()
            per_step.append(start.elapsed_time(end) * 1e3 / cfg.steps)
        if cfg.profile:
            restore(state, saved)
            prof = profile.profile_steps(graphed.graph.replay, cfg.steps)
            row["kernels_per_step"] = prof["kernels_per_step"]
            row["device_us_per_step"] = prof["device_us_per_step"]
            row["top_kernels"] = prof["top_kernels"]
            import re

            row["experts_gemm_us"] = sum(k["us_per_step"] for k in prof["top_kernels"]
                                         if re.search(EXPERT_KERNELS, k["name"], re.I))
        del graphed
        if cfg.shares:
            row["region_us"] = _region_us(step, state, tokens, saved, max(3, cfg.replays // 2))
    else:
        with torch.no_grad():
            tok = tokens
            tok, _ = step(tok, state)  # compiles
            row["first_call_s"] = time.perf_counter() - t0
            per_step = []
            for _ in range(cfg.replays):
                restore(state, saved)
                t1 = now(model.device)
                for _ in range(cfg.steps):
                    tok, _ = step(tok, state)
                per_step.append((now(model.device) - t1) * 1e6 / cfg.steps)
    row["us"] = statistics.median(per_step)
    ordered = sorted(per_step)
    row["us_p10_p90"] = [ordered[len(ordered) // 10], ordered[(len(ordered) * 9) // 10]]
    row["tokens_per_s"] = batch * 1e6 / row["us"]
    esize = 1 if cfg.model.kv_dtype == "fp8" else torch.finfo(model.dtype).bits // 8
    floor = step_bytes(model, batch, lengths, esize, state.state_bytes())
    row["bytes"] = floor
    if bandwidths.get("nominal"):
        row["floor_us"] = floor["total"] / bandwidths["nominal"] * 1e6
    if bandwidths.get("read"):
        row["floor_read_us"] = floor["total"] / bandwidths["read"] * 1e6
    del state, saved
    return row


def bench_model(cfg: ModelBenchConfig, emit: Any = print) -> dict[str, Any]:
    """Every arm at every point; `emit(line)` reports progress; the result as `print_model_bench` reads it."""
    import torch

    import k3fuse
    from k3fuse.log import RewriteLog

    from ..model_run import build_model, compile_step, missing_collectives, projected_us
    from . import timing

    t0 = time.perf_counter()
    model = build_model(cfg.model, 0, 1)
    device = model.device
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    emit(f"built {cfg.model.preset} ({len(model.kinds)} layers) as "
         + (f"rank {cfg.model.as_rank} of TP {cfg.model.of}" if cfg.model.standin else f"TP {model.tp_size}")
         + f": {weights / 1e9:.1f} GB of weights on {gpu or device} in {time.perf_counter() - t0:.0f} s")
    bandwidths: dict[str, float | None] = {"nominal": nominal_bandwidth(gpu)}
    if device.type == "cuda":
        bandwidths["copy"] = timing.copy_bandwidth(device)
        bandwidths["read"] = read_bandwidth(device)
        emit(f"bandwidth: nominal {(bandwidths['nominal'] or 0) / 1e12:.2f} TB/s, copy {bandwidths['copy'] / 1e12:.2f}, "
             f"best read {bandwidths['read'] / 1e12:.2f} TB/s (measured)")
    result: dict[str, Any] = {
        "conditions": {"gpu": gpu, "device": str(device), "torch": torch.__version__, "model": asdict(model.config),
                       "tp": model.tp_size, "rank": model.rank, "standin": model.standin, "kv_dtype": cfg.model.kv_dtype,
                       "block_size": cfg.model.block_size, "steps_per_graph": cfg.steps, "replays": cfg.replays,
                       "weights_bytes": weights, "bandwidth": bandwidths, "notes": list(cfg.model.notes)},
        "rows": [], "arms": {}}
    points = [(b, c) for c in cfg.contexts for b in cfg.batches]
    for arm in cfg.arms:
        entry: dict[str, Any] = {}
        result["arms"][arm] = entry
        try:
            if arm == "peer":
                from .peer import install_peer

                install_peer(model, keep_model=False)  # the last arm: humming takes the tables over
                emit("peer: routed experts handed to humming's W4A16 GEMMs")
            torch._dynamo.reset()
            rlog = RewriteLog(cfg.log, rank=0) if arm == "k3fuse" else None
            step = compile_step(model, "stock" if arm == "peer" else arm, log=rlog)
        except Exception as exc:
            entry["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:400]
            emit(f"{arm}: skipped ({entry['error']})")
            continue
        k3fuse.reset_stats()
        with k3fuse.strict(arm == "k3fuse"):
            for batch, context in points:
                why = _fits(model, cfg, arm, batch, context)
                if why is not None:
                    result["rows"].append({"arm": arm, "batch": batch, "context": context, "skipped": why})
                    emit(f"{arm} B={batch} ctx={context}: skipped, {why}")
                    continue
                t1 = time.perf_counter()
                try:
                    row = _time_point(model, step, cfg, arm, batch, context, bandwidths)
                except Exception as exc:  # an arm's failure (strict mode, memory) must not hide the others
                    why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
                    result["rows"].append({"arm": arm, "batch": batch, "context": context, "error": why})
                    emit(f"{arm} B={batch} ctx={context}: error {why}")
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    continue
                result["rows"].append(row)
                emit(f"{arm} B={batch} ctx={context}: {row['us']:.0f} µs/step, {row['tokens_per_s']:.0f} tok/s"
                     + (f", floor {row['floor_us']:.0f} µs" if row.get("floor_us") else "")
                     + (f", {row['kernels_per_step']:.0f} kernels" if row.get("kernels_per_step") else "")
                     + f" ({time.perf_counter() - t1:.0f} s)")
                if cfg.json:
                    write_result(result, cfg.json)
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        entry["stats"] = k3fuse.stats()
        entry["fallbacks"] = k3fuse.runtime.fallbacks()
        if rlog is not None:
            entry["rewrites"] = {r: s["applied"] for r, s in rlog.summary().items() if s["applied"]}
            entry["graphs"] = len({e.graph_id for e in rlog.events})
        del step
        gc.collect()
    if model.standin:
        result["missing_collectives"] = {b: {"collectives": [asdict(c) for c in missing_collectives(model, b)],
                                             "projected_us": {a: projected_us(missing_collectives(model, b), a)
                                                              for a in cfg.arms}} for b in cfg.batches}
    result["seconds"] = time.perf_counter() - t0
    return result


def write_result(result: dict[str, Any], path: str) -> None:
    import json

    from ...fileio import write_text_atomic

    write_text_atomic(path, json.dumps(result, indent=1, default=str))


def _row(result: dict[str, Any], arm: str, batch: int, context: int) -> dict[str, Any] | None:
    return next((r for r in result["rows"] if r["arm"] == arm and r["batch"] == batch and r["context"] == context),
                None)


def print_model_bench(result: dict[str, Any]) -> None:
    from rich.table import Table

    from ..console import wide_console

    console = wide_console()
    c = result["conditions"]
    m = c["model"]
    who = f"rank {c['rank']} of TP {c['tp']} alone" if c["standin"] else f"TP {c['tp']}"
    bw = c["bandwidth"]
    console.print(f"[bold]k3fuse bench --model[/]: {m['name']} x{m['n_layers']} layers, {m['expert_format']} experts "
                  f"({m['expert_layout']}), {m['residual']}, {who}, {c['gpu'] or c['device']}, KV {c['kv_dtype']} "
                  f"(block {c['block_size']}), {c['steps_per_graph']} steps a graph, median of {c['replays']} replays; "
                  f"nominal {(bw.get('nominal') or 0) / 1e12:.2f} TB/s, best read measured "
                  f"{(bw.get('read') or 0) / 1e12:.2f} TB/s", highlight=False)
    for note in c.get("notes", []):
        console.print(f"note: {note}")
    arms = list(result["arms"])
    points = sorted({(r["context"], r["batch"]) for r in result["rows"]})
    t = Table(title="one decode step: µs (tok/s); x = k3fuse's speed-up; floor = bytes read at nominal / measured "
                    "read bandwidth" + ("; ONE RANK'S COMPUTE, collectives not included" if c["standin"] else ""))
    for col in ("context", "batch", *arms, "k3fuse x stock", "k3fuse x peer", "floor µs (nominal / read)",
                "k3fuse / floor", "k3fuse shares KDA / MLA / head", "kernels/step", "experts GEMM µs"):
        t.add_column(col, overflow="fold")
    for context, batch in points:
        cells, rows = [], {a: _row(result, a, batch, context) for a in arms}
        for a in arms:
            r = rows[a]
            if r is None:
                cells.append("-")
            elif "skipped" in r or "error" in r:
                cells.append(r.get("skipped") or f"error: {r['error']}")
            else:
                cells.append(f"{r['us']:.0f} ({r['tokens_per_s']:.0f})")
        k = rows.get("k3fuse") or {}
        ratio = lambda a: (f"{rows[a]['us'] / k['us']:.2f}x" if k.get("us") and (rows.get(a) or {}).get("us")  # noqa: E731
                           else "-")
        floor = (f"{k['floor_us']:.0f} / {k.get('floor_read_us', 0):.0f}" if k.get("floor_us") else "-")
        over = f"{k['us'] / k['floor_us']:.2f}x" if k.get("floor_us") and k.get("us") else "-"
        shares = "-"
        if k.get("region_us"):
            reg, total = k["region_us"], sum(k["region_us"].values())
            shares = " / ".join(f"{reg.get(n, 0) / total:.0%}" for n in ("kda layers", "mla layers")) + \
                f" / {(reg.get('head + sampling', 0) + reg.get('embed', 0)) / total:.0%}"
        kernels = " / ".join(f"{(rows[a] or {}).get('kernels_per_step', 0):.0f}" if (rows[a] or {}).get(
            "kernels_per_step") else "-" for a in arms)
        experts = " / ".join(f"{(rows[a] or {})['experts_gemm_us']:.0f}" if (rows[a] or {}).get("experts_gemm_us")
                             is not None else "-" for a in arms)
        t.add_row(str(context), str(batch), *cells, ratio("stock"), ratio("peer"), floor, over, shares, kernels,
                  experts)
    console.print(t)
    if result.get("missing_collectives"):
        from ..model_run import PROJECTION_SOURCE

        console.print("what the missing collectives would add per step (PROJECTED): " + "; ".join(
            f"B={b}: " + ", ".join(f"{a} +{us:.0f} µs" for a, us in v["projected_us"].items())
            for b, v in result["missing_collectives"].items()))
        console.print(PROJECTION_SOURCE)
    for arm, entry in result["arms"].items():
        if entry.get("error"):
            console.print(f"{arm}: {entry['error']}")
        if entry.get("fallbacks"):
            console.print(f"[red]{arm}: fallbacks {entry['fallbacks']}[/]")
        if entry.get("rewrites"):
            console.print(f"{arm}: rewrites " + ", ".join(f"{r}:{n}" for r, n in entry["rewrites"].items())
                          + f" over {entry.get('graphs')} graphs")


__all__ = ["ModelBenchConfig", "bench_model", "print_model_bench", "step_bytes", "nominal_bandwidth",
           "read_bandwidth", "ARMS"]
