"""The tables the CLI verbs print (rich), shared by `apply`, `log`, `demo` and `validate`.

A leaf: the verbs import it, it imports none of them (and not torch: `k3fuse --help` stays fast).
"""
from __future__ import annotations

import json
from typing import Any


def wide_console(stderr: bool = False) -> Any:
    """A rich Console; in logs and pipes 120 columns (rich's default 80 would squeeze the reasons)."""
    from rich.console import Console

    console = Console(stderr=stderr)
    return console if console.is_terminal else Console(stderr=stderr, width=max(console.width, 120))


def print_rewrite_summary(summary: dict[str, dict[str, Any]], title: str = "k3fuse rewrite log") -> None:
    from rich.table import Table

    table = Table(title=title)
    table.add_column("rule", no_wrap=True)
    for col, justify in (("applied", "right"), ("rejected", "right"), ("why rejected", "left"),
                         ("not matched", "right"), ("ms", "right")):
        # the reasons are the point of the table: fold them, never crop them to an ellipsis
        table.add_column(col, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for rule, s in summary.items():
        why = ", ".join(f"{k} x{v}" for k, v in sorted(s["why"].items()))
        table.add_row(rule, str(s["applied"]), str(s["rejected"]), why, str(s["not_matched"]), f"{s['time_ms']:.1f}")
    wide_console().print(table)


def print_reasons(rows: list[dict[str, Any]], title: str = "why rules did not rewrite") -> None:
    """One row per distinct reason (rejected and not matched), with the values the guard saw."""
    from rich.table import Table

    table = Table(title=title)
    table.add_column("rule", no_wrap=True)
    for col in ("decision", "guard", "reason", "values seen"):
        table.add_column(col, overflow="fold")
    table.add_column("count", justify="right")
    table.add_column("ranks")
    for r in rows:
        values = "; ".join(json.dumps(v, sort_keys=True) for v in r["values"])
        if r["more_values"]:
            values += f" (+{r['more_values']} more)"
        table.add_row(r["rule"], r["decision"].replace("_", " "), r["guard"], r["reason"] or "-", values or "-",
                      str(r["count"]), ",".join(map(str, r["ranks"])))
    wide_console().print(table)


def print_runs(runs: list[Any]) -> None:
    from rich.table import Table

    table = Table(title="pipeline runs (one per graph per rank)")
    for col in ("run", "rank", "door", "graph", "events", "applied", "rejected", "not matched"):
        table.add_column(col, justify="left" if col in ("door", "graph") else "right")
    for run in runs:
        counts = {d: sum(e.decision == d for e in run.events) for d in ("applied", "rejected", "not_matched")}
        table.add_row(str(run.index), str(run.rank), run.door or "-", run.graph_id or "-", str(len(run.events)),
                      str(counts["applied"]), str(counts["rejected"]), str(counts["not_matched"]))
    wide_console().print(table)


__all__ = ["wide_console", "print_rewrite_summary", "print_reasons", "print_runs"]
