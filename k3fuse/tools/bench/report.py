"""Turning the ranks' reports into what a user reads: tables, one JSON file, two plots.

Latency is the slower rank's median µs per decode step; each arm is also shown as a ratio to
stock measured in the same run. Kernels per step and the per-kernel device times come from the
profiled replay of rank 0; compile time is the slower rank's.
"""
from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

from .arms import STOCK


def conditions(cfg: Any, reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Versions, hardware and settings the figures were measured under."""
    import torch

    cond: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(),
                            "device": cfg.device, "tp": cfg.tp, "preset": cfg.preset,
                            "overrides": cfg.overrides, "layers": cfg.layers, "residual": cfg.residual,
                            "routing": cfg.routing,
                            "steps_per_graph": cfg.steps, "replays": cfg.replays, "compiler": cfg.compiler}
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
        cond["gpu"] = torch.cuda.get_device_name(0)
        cond["cuda"] = torch.version.cuda
        cond["copy_bandwidth_TBps"] = round(reports[0].get("copy_bandwidth_Bps", 0) / 1e12, 3)
        cond["multicast"] = reports[0].get("multicast")
        from ...dist import MULTICAST_OFF

        cond["env"] = {k: os.environ.get(k) for k in MULTICAST_OFF}
    return cond


def merge(cfg: Any, reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One result: per arm and token count the slower rank's µs, ratio to stock, kernels, stats."""
    r0 = reports[0]
    stock = {row["tokens"]: row.get("us") for row in r0["arms"].get(STOCK, {}).get("rows", [])}
    bandwidth = r0.get("copy_bandwidth_Bps")
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
            "model": r0["model"]}


def _worst_rank_err(reports: list[dict[str, Any]], arm: str, T: int) -> float | None:
    """The largest relative error against stock over the ranks at T (None for stock or untested)."""
    errs = [row["rel_err_vs_stock"] for r in reports for row in r["arms"].get(arm, {}).get("rows", [])
            if row["tokens"] == T and row.get("rel_err_vs_stock") is not None]
    return max(errs) if errs else None


def _fmt(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def print_tables(result: dict[str, Any]) -> None:
    """The latency table (µs and ratio to stock), kernels per step, compile time and rewrites."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(120, Console().width))
    c = result["conditions"]
    m = result.get("model", {})
    console.print(f"[bold]k3fuse bench[/]: preset {c['preset']} {c['overrides']} (moe_inter={m.get('moe_inter')}, "
                  f"{m.get('expert_format', 'bf16')} experts, {c.get('routing', 'uniform')} routing) "
                  f"x{c['layers']} layer(s), {c['residual']}, TP {c['tp']}, {c['device']} ({c.get('gpu', 'cpu')}), "
                  f"{c['steps_per_graph']} steps/graph, median of {c['replays']} replays, slower rank")
    arms = result["arms"]
    tokens = sorted({row["tokens"] for a in arms.values() for row in a["rows"]})
    table = Table(title="µs per decode step (x = speed-up vs stock, same run)")
    table.add_column("arm")
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
            cells.append(f"{row['us']:.1f}" + (f" ({ratio:.2f}x)" if ratio and name != STOCK else ""))
        table.add_row(name + (" [red](error)[/]" if arm.get("error") else ""), *cells)
    floor = result["weight_read_floor"]
    table.add_row("weight-read floor", *[_fmt(floor.get(T, {}).get("us")) for T in tokens])
    table.add_row("  + KDA state r/w", *[_fmt(floor.get(T, {}).get("us_with_state")) for T in tokens])
    distinct = result.get("distinct_experts", {})
    table.add_row("distinct experts/step", *[
        "-" if T not in distinct else f"{distinct[T]['mean']:.0f} ({distinct[T]['min']}-{distinct[T]['max']})"
        for T in tokens])
    table.add_row("  uniform expectation", *[_fmt(floor.get(T, {}).get("experts_touched_uniform"), ".0f")
                                             for T in tokens])
    console.print(table)

    kt = Table(title=f"at T={tokens[0] if tokens else '-'}: kernels per step, kernel time run concurrently; compile time, rewrites")
    for col in ("arm", "kernels/step", "device µs/step", "concurrent µs/step", "max rel err vs stock",
                "compile s", "passes ms", "applied", "fallbacks", "error"):
        kt.add_column(col)
    for name, arm in arms.items():
        first = arm["rows"][0] if arm["rows"] else {}
        applied = ", ".join(f"{r}:{s['applied']}" for r, s in (arm.get("rewrites") or {}).items() if s["applied"])
        conc = first.get("concurrency") or {}
        kt.add_row(name, _fmt(first.get("kernels_per_step")), _fmt(first.get("device_us_per_step")),
                   _fmt(conc.get("concurrent_us")),
                   _fmt(max((r["rel_err_vs_stock"] for r in arm["rows"] if r.get("rel_err_vs_stock") is not None),
                            default=None), ".1e"),
                   _fmt(arm["compile_s"]), _fmt(arm.get("passes_ms")), applied or "-",
                   str(sum(sum(v.values()) for v in (arm.get("fallbacks") or {}).values())),
                   arm.get("error") or "")
    console.print(kt)


def write_json(result: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Atomically: a temporary file in the same directory, then os.replace."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(result, indent=1, default=str))
    os.replace(tmp, p)
    return p


def plot(result: dict[str, Any], prefix: str | os.PathLike[str]) -> list[Path]:
    """latency-vs-tokens.png and timeline.png (one step, stock above k3fuse, lanes per stream)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .profile import KINDS

    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    written = []
    c = result["conditions"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, arm in result["arms"].items():
        rows = [r for r in arm["rows"] if r.get("us")]
        if rows:
            ax.plot([r["tokens"] for r in rows], [r["us"] for r in rows], marker="o", label=name,
                    linewidth=2.5 if name in ("stock", "k3fuse") else 1)
    floor = sorted(result["weight_read_floor"].items())
    if floor and floor[0][1].get("us"):
        ax.plot([T for T, _ in floor], [f["us"] for _, f in floor], "k--", label="weight-read floor")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per decode step")
    ax.set_ylabel("µs per step (slower rank)")
    ax.set_title(f"K3 {c['residual']} x{c['layers']}, TP {c['tp']}, {c.get('gpu', c['device'])}")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    out = prefix.with_name(prefix.name + "latency.png")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    written.append(out)

    shown = [(n, a["timeline"]) for n, a in result["arms"].items() if n in ("stock", "k3fuse") and a.get("timeline")]
    if shown:
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
        out = prefix.with_name(prefix.name + "timeline.png")
        fig.savefig(out, dpi=120)
        plt.close(fig)
        written.append(out)
    return written


__all__ = ["merge", "print_tables", "write_json", "plot", "conditions"]
