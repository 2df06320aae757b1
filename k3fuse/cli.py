"""`k3fuse` command line: `demo` (the main job), `apply` (rewrite a saved ExportedProgram) and
`log` (read a rewrite log).

Each subcommand is a `register_<name>(subparsers)` function that sets `func` on its parser, so
further subcommands plug in by adding one function to `SUBCOMMANDS`.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any


def parse_tokens(text: str) -> tuple[int, int]:
    """"1-64" -> (1, 64); "8" -> (8, 8)."""
    try:
        if "-" in text:
            lo, hi = text.split("-", 1)
            return int(lo), int(hi)
        return int(text), int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"tokens must look like 1-64 or 8, got {text!r}") from None


# --- apply ---------------------------------------------------------------------------------------


def _cmd_apply(args: argparse.Namespace) -> int:
    import torch

    import k3fuse
    from k3fuse.offline import collective_group_names

    ep = torch.export.load(args.input)
    group_name = args.group_name
    if args.tp > 1 and group_name is None:
        names = collective_group_names(ep.graph)
        if len(names) != 1:
            print(f"error: --tp {args.tp} needs --group-name: the graph uses collective groups {names}",
                  file=sys.stderr)
            return 2
        group_name = names[0]
    ctx = k3fuse.DecodeContext(tp_size=args.tp, rank=args.rank, group_name=group_name, tokens=args.tokens,
                               multicast=args.multicast, strict=args.strict)
    new_ep, log = k3fuse.apply(ep, ctx, log=args.log)
    torch.export.save(new_ep, args.output)
    print_rewrite_summary(log.summary(), title=f"{args.input} -> {args.output}")
    return 0


def register_apply(sub: Any) -> None:
    p = sub.add_parser("apply", help="rewrite a saved ExportedProgram (.pt2) for decode")
    p.add_argument("input", help="program saved with torch.export.save")
    p.add_argument("-o", "--output", required=True, help="where to save the rewritten program")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size the program was captured with")
    p.add_argument("--rank", type=int, default=0, help="rank the program was captured on")
    p.add_argument("--group-name", default=None, help="c10d group name (default: the one in the graph)")
    p.add_argument("--tokens", type=parse_tokens, default=(1, 64), help="decode token range, e.g. 1-64")
    p.add_argument("--multicast", choices=("auto", "off", "require"), default="auto")
    p.add_argument("--strict", action="store_true", help="bake strict mode into the fused ops")
    p.add_argument("--log", default=None, help="append the rewrite log (JSONL) here")
    p.set_defaults(func=_cmd_apply)


# --- log -----------------------------------------------------------------------------------------


def wide_console() -> Any:
    """A rich Console; in logs and pipes 120 columns (rich's default 80 would squeeze the reasons)."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=max(console.width, 120))


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


def _cmd_log(args: argparse.Namespace) -> int:
    from k3fuse.log import RewriteLog

    log = RewriteLog.from_jsonl(args.file)
    if args.rank is not None:
        log.events = [e for e in log.events if e.rank == args.rank]
    summary = log.summary()
    if args.json:
        json.dump({"summary": summary, "active_rules": log.active_rules(), "events": len(log.events)},
                  sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    else:
        print_rewrite_summary(summary, title=f"{args.file} ({len(log.events)} events)")
    return 0


def register_log(sub: Any) -> None:
    p = sub.add_parser("log", help="summarise a rewrite log (JSONL) per rule")
    p.add_argument("file")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--rank", type=int, default=None, help="only events of this rank")
    p.set_defaults(func=_cmd_log)


def register_demo(sub: Any) -> None:
    from .demo import register_demo as _register

    _register(sub)


def register_bench(sub: Any) -> None:
    from .bench.cli import register_bench as _register

    _register(sub)


def register_validate(sub: Any) -> None:
    from .validate import register_validate as _register

    _register(sub)


SUBCOMMANDS: list[Callable[[Any], None]] = [register_demo, register_apply, register_log, register_bench,
                                            register_validate]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="k3fuse", description="compiler passes for Kimi K3 decode")
    sub = parser.add_subparsers(dest="command", required=True)
    for register in SUBCOMMANDS:
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
