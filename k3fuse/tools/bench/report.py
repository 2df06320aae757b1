"""Turning the ranks' reports into what a user reads: tables, one JSON file, two plots.

Latency is the slower rank's median µs per decode step; each arm is also shown as a ratio to
stock measured in the same run. Kernels per step and the per-kernel device times come from the
profiled replay of rank 0; compile time is the slower rank's.
"""
from __future__ import annotations

import json
import os
import platform
import re
from pathlib import Path
from typing import Any

from .arms import STOCK

#: the floor's denominator: a card's nominal HBM bandwidth in bytes/s, by a pattern of its device name (first
#: match wins). A measured copy rate is no floor: a copy counts its bytes once, and a read-only kernel beats it
NOMINAL_HBM_BPS: tuple[tuple[str, float], ...] = (
    (r"\bH100 PCIe\b", 2.0e12),
    (r"\bH100 NVL\b", 3.9e12),
    (r"\bH100\b", 3.35e12),  # SXM: "NVIDIA H100 80GB HBM3"
    (r"\bH200\b", 4.8e12),  # SXM and NVL
)


def nominal_bandwidth(gpu: str | None) -> float | None:
    """The nominal HBM bandwidth (bytes/s) of the card named `gpu`, None for a CPU or a card not listed."""
    return next((bps for pattern, bps in NOMINAL_HBM_BPS if gpu and re.search(pattern, gpu)), None)


def conditions(cfg: Any, reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Versions, hardware and settings the figures were measured under."""
    import torch

    cond: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(),
                            "device": cfg.device, "tp": cfg.tp, "preset": cfg.preset,
                            "overrides": cfg.overrides, "layers": cfg.layers, "residual": cfg.residual,
                            "steps_per_graph": cfg.steps, "replays": cfg.replays, "compiler": cfg.compiler,
                            "compile_only": cfg.compile_only, "rules": cfg.rules,
                            "routing": cfg.routing, "settings": _settings_set()}
    try:
        import triton

        cond["triton"] = triton.__version__
    except Exception:
        cond["triton"] = None
    try:
        from k3fuse.kernels.lib.cute import compat

        cond["cutlass_dsl"] = compat.cute_version()
    except Exception:
        cond["cutlass_dsl"] = None
    if cfg.device == "cuda" and torch.cuda.is_available():
        cond["gpu"] = reports[0].get("gpu") or torch.cuda.get_device_name(0)
        cond["cuda"] = torch.version.cuda
        nominal = nominal_bandwidth(cond["gpu"])
        cond["nominal_bandwidth_TBps"] = nominal / 1e12 if nominal else None
        cond["read_bandwidth_TBps"] = round(reports[0].get("read_bandwidth_Bps", 0) / 1e12, 3)
        cond["copy_bandwidth_TBps"] = round(reports[0].get("copy_bandwidth_Bps", 0) / 1e12, 3)
        cond["multicast"] = reports[0].get("multicast")
        from ...dist import MULTICAST_OFF

        cond["env"] = {k: os.environ.get(k) for k in MULTICAST_OFF}
    return cond


def _settings_set() -> dict[str, str]:
    """The K3FUSE_* variables set in this run's environment, as set (a kernel choice such as
    K3FUSE_W4A16_CUTE_INT4 changes what the figures measure)."""
    from k3fuse import settings

    return {v.env: os.environ[v.env] for v in settings.VARIABLES if v.env in os.environ}


def _w4a16_launch(config: dict[str, Any]) -> str:
    """A CuTe W4A16 launch (runner.w4a16_launches' config) in words: its mode, K split and down row tiles."""
    mode = "pairwise" if config["pairwise"] else "grouped"
    return f"{mode}, split {config['split']}, {config['n_tiles']} row tiles a down CTA"


def merge(cfg: Any, reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One result: per arm and token count the slower rank's µs, ratio to stock, kernels, stats."""
    r0 = reports[0]
    stock = {row["tokens"]: row.get("us") for row in r0["arms"].get(STOCK, {}).get("rows", [])}
    bandwidth = nominal_bandwidth(r0.get("gpu"))
    arms: dict[str, Any] = {}
    for name, entry in r0["arms"].items():
        rows = []
        for row in entry["rows"]:
            T = row["tokens"]
            prof = row.get("profile") or {}
            out = {"tokens": T, "us": row.get("us"), "us_p10_p90_rank0": row.get("us_p10_p90"),
                   "rel_err_vs_stock": _worst_rank_err(reports, name, T),
                   "first_call_s": row["first_call_s"],
                   "kernels_per_step": prof.get("kernels_per_step"),
                   "device_us_per_step": prof.get("device_us_per_step"),
                   "by_kind_us_per_step": prof.get("by_kind_us_per_step"),
                   "top_kernels": prof.get("top_kernels"), "side_stream": prof.get("side_stream"),
                   "concurrency": prof.get("concurrency")}
            if stock.get(T) and row.get("us"):
                out["speedup_vs_stock"] = stock[T] / row["us"]
            rows.append(out)
        arms[name] = {"rows": rows, "error": max((r["arms"][name].get("error") or "" for r in reports), key=len) or None,
                      "compile_s": max(r["arms"][name]["compile_s"] for r in reports),
                      "passes_ms": entry.get("passes_ms"), "graphs": entry.get("graphs"),
                      "rewrites": entry.get("rewrites"), "stats": entry["stats"],
                      "fallbacks": entry.get("fallbacks"),
                      "timeline": next((row["profile"]["timeline"] for row in entry["rows"]
                                        if row.get("profile") and row["tokens"] == entry["rows"][0]["tokens"]), None)}
    floor = {}
    for T, f in r0["floor"].items():
        total = f["dense_bytes"] + f["expert_bytes_touched"]
        state = f.get("state_bytes_read_write", 0)
        floor[int(T)] = {"bytes": total, "experts_touched": f["experts_touched"],
                         "experts_touched_uniform": f.get("experts_touched_uniform"),
                         "us": total / bandwidth * 1e6 if bandwidth else None, "state_bytes": state,
                         "us_with_state": (total + state) / bandwidth * 1e6 if bandwidth else None}
    distinct = {int(T): {k: v for k, v in d.items() if k != "per_step_layer"}
                for T, d in r0.get("distinct_experts", {}).items()}
    return {"conditions": conditions(cfg, reports), "arms": arms, "weight_read_floor": floor,
            "distinct_experts": distinct, "distinct_experts_per_step_layer":
                {int(T): d["per_step_layer"] for T, d in r0.get("distinct_experts", {}).items()},
            "model": r0["model"], "w4a16_launch": r0.get("w4a16_launch")}


def _worst_rank_err(reports: list[dict[str, Any]], arm: str, T: int) -> float | None:
    """The largest relative error against stock over the ranks at T (None for stock or untested)."""
    errs = [row["rel_err_vs_stock"] for r in reports for row in r["arms"].get(arm, {}).get("rows", [])
            if row["tokens"] == T and row.get("rel_err_vs_stock") is not None]
    return max(errs) if errs else None


def _fmt(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def print_tables(result: dict[str, Any]) -> None:
    """The latency table (µs and ratio to stock), kernels per step, compile time and rewrites."""
    from rich.table import Table

    from ..console import wide_console

    console = wide_console()
    c = result["conditions"]
    overrides = ",".join(f"{k}={v}" for k, v in (c.get("overrides") or {}).items())
    m = result.get("model", {})
    console.print(f"[bold]k3fuse bench[/]: preset {c['preset']}" + (f" ({overrides})" if overrides else "")
                  + f" (moe_inter={m.get('moe_inter')}, {m.get('expert_format', 'bf16')} experts"
                  + (" in blocks" if m.get("expert_layout") == "blocks" else "") + ", "
                  f"{c.get('routing', 'uniform')} routing) x{c['layers']} layer(s), {c['residual']}, TP {c['tp']}, "
                  f"{c['device']} ({c.get('gpu', 'cpu')}), {c['steps_per_graph']} steps/graph, median of "
                  f"{c['replays']} replays, slower rank", highlight=False)
    arms = result["arms"]
    tokens = sorted({row["tokens"] for a in arms.values() for row in a["rows"]})
    table = Table(title="µs per decode step (x = speed-up vs stock, same run); below: rank 0's p10-p90 over "
                        "the replays (a difference inside it is noise)")
    table.add_column("arm", no_wrap=True)
    for T in tokens:
        table.add_column(f"T={T}", justify="right")
    for name, arm in arms.items():
        cells = []
        by_t = {row["tokens"]: row for row in arm["rows"]}
        for T in tokens:
            row = by_t.get(T)
            if row is None or row.get("us") is None:
                cells.append("-")
                continue
            ratio = row.get("speedup_vs_stock")
            spread = row.get("us_p10_p90_rank0")
            cells.append(f"{row['us']:.1f}" + (f" ({ratio:.2f}x)" if ratio and name != STOCK else "")
                         + (f"\n{spread[0]:.1f}-{spread[1]:.1f}" if spread else ""))
        table.add_row(name + (" [red](error)[/]" if arm.get("error") else ""), *cells)
    floor = result["weight_read_floor"]
    table.add_row("weight-read floor", *[_fmt(floor.get(T, {}).get("us")) for T in tokens])
    table.add_row("  + KDA state r/w", *[_fmt(floor.get(T, {}).get("us_with_state")) for T in tokens])
    table.add_row("  GB (weights + state)", *[_fmt((floor[T]["bytes"] + floor[T].get("state_bytes", 0)) / 1e9, ".3f")
                                             if T in floor else "-" for T in tokens])
    distinct = result.get("distinct_experts", {})
    table.add_row("distinct experts/step", *[
        "-" if T not in distinct else f"{distinct[T]['mean']:.0f} ({distinct[T]['min']}-{distinct[T]['max']})"
        for T in tokens])
    table.add_row("  uniform expectation", *[_fmt(floor.get(T, {}).get("experts_touched_uniform"), ".0f")
                                             for T in tokens])
    console.print(table)
    console.print(_floor_line(c), highlight=False)
    if result.get("w4a16_launch"):
        layouts = {w.get("layout", "rows") for w in result["w4a16_launch"].values()}
        console.print(f"4-bit routed experts' CuTe launch over {'/'.join(sorted(layouts))} tables (where the op runs "
                      "on CuTe): " + "; ".join(
            f"T={T} " + ("error" if "error" in w else _w4a16_launch(w["config"]))
            for T, w in sorted(result["w4a16_launch"].items())), highlight=False)

    first_t = f"T={tokens[0]}" if tokens else "no measured batch"
    kt = Table(title=f"at {first_t}: kernels per step, kernel time run concurrently; compile time")
    kt.add_column("arm", no_wrap=True)
    for col in ("kernels per step", "device µs/step", "concurrent µs/step", "max rel err vs stock", "compile s",
                "passes ms", "fallbacks"):
        kt.add_column(col, justify="right")
    for name, arm in arms.items():
        first = arm["rows"][0] if arm["rows"] else {}
        conc = first.get("concurrency") or {}
        kt.add_row(name, _fmt(first.get("kernels_per_step")), _fmt(first.get("device_us_per_step")),
                   _fmt(conc.get("concurrent_us")),
                   _fmt(max((r["rel_err_vs_stock"] for r in arm["rows"] if r.get("rel_err_vs_stock") is not None),
                            default=None), ".1e"),
                   _fmt(arm["compile_s"]), _fmt(arm.get("passes_ms")),
                   str(sum(sum(v.values()) for v in (arm.get("fallbacks") or {}).values())))
    console.print(kt)

    # rule names are never cut: one cell of words that wraps between them
    rw = Table(title="rewrites applied (rule:sites) and errors, per k3fuse arm")
    rw.add_column("arm", no_wrap=True)
    rw.add_column("applied / error", overflow="fold")
    for name, arm in arms.items():
        if arm.get("rewrites") is None and not arm.get("error"):
            continue
        applied = "  ".join(f"{r}:{s['applied']}" for r, s in (arm.get("rewrites") or {}).items() if s["applied"])
        rw.add_row(name, (applied or "none") + (f"\n[red]error: {arm['error']}[/]" if arm.get("error") else ""))
    console.print(rw)


def _floor_line(c: dict[str, Any]) -> str:
    """What the floor divides by, and the read a kernel measured beside it (a floor is no measured rate)."""
    if c.get("device") != "cuda":
        return "floor: none on CPU (bytes in the JSON)"
    measured = (f"a read-only kernel measured {c.get('read_bandwidth_TBps')} TB/s here "
                f"(a copy {c.get('copy_bandwidth_TBps')})")
    if not c.get("nominal_bandwidth_TBps"):
        return (f"floor: none: no nominal HBM bandwidth is listed for {c.get('gpu')} (add it to "
                f"k3fuse.tools.bench.report.NOMINAL_HBM_BPS; bytes in the JSON); {measured}")
    return f"floor: bytes at the {c.get('gpu')}'s nominal {c['nominal_bandwidth_TBps']} TB/s; {measured}"


def write_json(result: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Atomically (k3fuse.fileio: the old file, its mode and symlink survive a failed write)."""
    from ...fileio import write_text_atomic

    return write_text_atomic(path, json.dumps(result, indent=1, default=str))


PLOTS = ("latency.png", "timeline.png")


def plot(result: dict[str, Any], directory: str | os.PathLike[str]) -> tuple[list[Path], dict[str, str]]:
    """latency.png (µs per step vs tokens, p10-p90 band) and timeline.png (one step, stock above
    k3fuse, lanes per stream) in `directory` (created); returns the files written and, per plot
    not drawn, why."""
    skipped: dict[str, str] = {}
    if result["conditions"].get("compile_only"):
        return [], {name: "--compile-only measures no latency and records no timeline" for name in PLOTS}
    try:
        import matplotlib
    except ImportError:
        return [], {name: "matplotlib is not installed (pip install 'k3fuse[plot]')" for name in PLOTS}
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ...fileio import atomic_write
    from .profile import KINDS

    out_dir = Path(directory)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    c = result["conditions"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, arm in result["arms"].items():
        rows = [r for r in arm["rows"] if r.get("us")]
        if rows:
            line, = ax.plot([r["tokens"] for r in rows], [r["us"] for r in rows], marker="o", label=name,
                            linewidth=2.5 if name in ("stock", "k3fuse") else 1)
            spread = [r for r in rows if r.get("us_p10_p90_rank0")]
            if spread:  # the replays' p10-p90 on rank 0: a gap inside the band is noise
                ax.fill_between([r["tokens"] for r in spread], [r["us_p10_p90_rank0"][0] for r in spread],
                                [r["us_p10_p90_rank0"][1] for r in spread], color=line.get_color(), alpha=0.15)
    floor = sorted(result["weight_read_floor"].items())
    if floor and floor[0][1].get("us"):
        ax.plot([T for T, _ in floor], [f["us"] for _, f in floor], "k--", label="weight-read floor (nominal HBM)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per decode step")
    ax.set_ylabel("µs per step (slower rank)")
    ax.set_title(f"K3 {c['residual']} x{c['layers']}, TP {c['tp']}, {c.get('gpu', c['device'])}")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    out = out_dir / "latency.png"
    fig.tight_layout()
    with atomic_write(out) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)
    written.append(out)

    shown = [(n, a["timeline"]) for n, a in result["arms"].items() if n in ("stock", "k3fuse") and a.get("timeline")]
    if not shown:
        skipped["timeline.png"] = ("no kernel timeline was recorded: it comes from the CUDA profiler"
                                   + (" (this run was on CPU)" if c["device"] != "cuda" else " (--no-profile?)"))
    else:
        colours = dict(zip([k for k, _ in KINDS] + ["other"], plt.cm.tab10.colors))
        fig, axes = plt.subplots(len(shown), 1, figsize=(12, 1.6 + 1.2 * len(shown)), sharex=True, squeeze=False)
        for ax, (name, events) in zip(axes[:, 0], shown):
            streams = sorted({e["stream"] for e in events})
            for e in events:
                lane = streams.index(e["stream"])
                ax.broken_barh([(e["start_us"], max(e["dur_us"], 0.3))], (lane - 0.4, 0.8),
                               color=colours.get(e["kind"], "grey"))
            end = max(e["start_us"] + e["dur_us"] for e in events)
            ax.set_yticks(range(len(streams)), [f"stream {s}" for s in streams], fontsize=7)
            ax.set_title(f"{name}: {len(events)} kernels, {end:.0f} µs (one step, T={result['arms'][name]['rows'][0]['tokens']})",
                         fontsize=9, loc="left")
        axes[-1, 0].set_xlabel("µs from the step's first kernel")
        handles = [plt.Rectangle((0, 0), 1, 1, color=colours[k]) for k in colours]
        fig.legend(handles, list(colours), loc="upper right", fontsize=7, ncol=len(colours))
        fig.tight_layout(rect=(0, 0, 1, 0.93))
        out = out_dir / "timeline.png"
        with atomic_write(out) as tmp:
            fig.savefig(tmp, dpi=120, format="png")
        plt.close(fig)
        written.append(out)
    return written, skipped


__all__ = ["merge", "print_tables", "write_json", "plot", "conditions", "nominal_bandwidth", "NOMINAL_HBM_BPS"]
