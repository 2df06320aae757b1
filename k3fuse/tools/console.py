"""The tables the CLI verbs print (rich), shared by `apply`, `log`, `demo` and `validate`.

What a rewrite log holds is data, never markup or terminal control: every cell and title built from
a log (rule names, reasons, guard values, paths) goes through `plain`, which escapes control and
invisible format characters and is rendered as rich Text, so `[/]` or `[link=...]` print as
written and an escape sequence in a log cannot reach the terminal.

A leaf: the verbs import it, it imports none of them (and not torch: `k3fuse --help` stays fast).
"""
from __future__ import annotations

import json
import unicodedata
from typing import Any

#: width of the console when the output is not a terminal and COLUMNS is not exported: wide enough
#: that no value is ever cut or folded (a pipe or a file has no width; rich would assume 80 columns)
UNBOUNDED_WIDTH = 1 << 16

#: longest text shown in one cell of a table built from a log (a line of the log can be megabytes)
MAX_CELL = 2000


def wide_console(stderr: bool = False) -> Any:
    """A rich Console: the terminal's width on a terminal; elsewhere (pipes, files) the width an
    exported COLUMNS asks for, else unbounded, so tables print whole values; no colour there."""
    import os

    from rich.console import Console

    console = Console(stderr=stderr)
    if console.is_terminal:
        return console
    if os.environ.get("COLUMNS", "").strip().isdigit():
        return Console(stderr=stderr, width=max(console.width, 40))
    return Console(stderr=stderr, width=UNBOUNDED_WIDTH, soft_wrap=True)


def _escape_char(ch: str) -> str:
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def plain_str(value: Any, limit: int = MAX_CELL) -> str:
    """`value` as a printable one-line string: control characters (escape sequences, carriage
    returns, newlines) and invisible format characters (bidirectional overrides, zero-width marks)
    written as \\xNN / \\uNNNN, cut to `limit` characters."""
    text = str(value)
    cut = len(text) - limit if len(text) > limit else 0
    if cut:
        text = text[:limit]
    text = "".join(_escape_char(c) if unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp") else c for c in text)
    return text + (f"... ({cut} more characters)" if cut else "")


def plain(value: Any, limit: int = MAX_CELL) -> Any:
    """A rich Text of `plain_str(value)`: printed as is (no markup, no emoji codes, no highlighting)."""
    from rich.text import Text

    return Text(plain_str(value, limit))


#: rejections that are a rule not running (switched off, off by default, the kill switch), not a guard
#: saying no at a site: counted apart so "rejected" means the guards
RULE_OFF = ("contract:rule_disabled", "contract:disabled")


def _longest_word(cells: list[str], cap: int = 48) -> int:
    """The widest word among `cells` (capped): a column at least this wide wraps between words."""
    return min(cap, max((len(w) for c in cells for w in c.split()), default=1))


def print_rewrite_summary(summary: dict[str, dict[str, Any]], title: str = "k3fuse rewrite log") -> None:
    from rich.table import Table

    rows = []
    for rule, s in summary.items():
        off = sum(s["why"].get(k, 0) for k in RULE_OFF)
        why = ", ".join(f"{k} x{v}" for k, v in sorted(s["why"].items()) if k not in RULE_OFF)
        rows.append((plain_str(rule), str(s["applied"]), str(s["rejected"] - off), plain_str(why),
                     str(s["not_matched"]), "yes" if off else "", f"{s['time_ms']:.1f}"))
    table = Table(title=plain(title))
    table.add_column("rule", no_wrap=True)
    for col, justify in (("applied", "right"), ("rejected", "right"), ("why rejected", "left"),
                         ("not matched", "right"), ("off", "left"), ("ms", "right")):
        # the reasons are the point of the table: wrap them between words, never crop them
        table.add_column(col, justify=justify, overflow="fold",  # type: ignore[arg-type]
                         min_width=_longest_word([r[3] for r in rows]) if col == "why rejected" else None)
    for row in rows:
        table.add_row(*map(plain, row))
    wide_console().print(table)


def print_reasons(rows: list[dict[str, Any]], title: str = "why rules did not rewrite") -> None:
    """One row per distinct reason (rejected and not matched), with the values the guard saw."""
    from rich.table import Table

    table = Table(title=plain(title))
    table.add_column("rule", no_wrap=True)
    table.add_column("decision", overflow="fold")
    table.add_column("guard", no_wrap=True)
    table.add_column("reason", overflow="fold", min_width=_longest_word([plain_str(r["reason"] or "-") for r in rows]))
    table.add_column("values seen", overflow="fold")
    table.add_column("count", justify="right")
    table.add_column("ranks")
    for r in rows:
        values = "; ".join(json.dumps(v, sort_keys=True) for v in r["values"])
        if r["more_values"]:
            values += f" (+{r['more_values']} more)"
        decision = "rule off" if r["guard"] in RULE_OFF else r["decision"].replace("_", " ")
        cells = (r["rule"], decision, r["guard"], r["reason"] or "-", values or "-", str(r["count"]),
                 ",".join(map(str, r["ranks"])))
        table.add_row(*map(plain, cells))
    wide_console().print(table)


def print_runs(runs: list[Any]) -> None:
    from rich.table import Table

    table = Table(title="pipeline runs (one per graph per rank)")
    for col in ("run", "rank", "door", "graph", "events", "applied", "rejected", "not matched"):
        table.add_column(col, justify="left" if col in ("door", "graph") else "right")
    for run in runs:
        counts = {d: sum(e.decision == d for e in run.events) for d in ("applied", "rejected", "not_matched")}
        cells = (str(run.index), str(run.rank), run.door or "-", run.graph_id or "-", str(len(run.events)),
                 str(counts["applied"]), str(counts["rejected"]), str(counts["not_matched"]))
        table.add_row(*map(plain, cells))
    wide_console().print(table)


__all__ = ["wide_console", "plain", "plain_str", "print_rewrite_summary", "print_reasons", "print_runs"]
