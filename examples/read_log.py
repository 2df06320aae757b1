"""Reading a rewrite log: did each rule fire, where, and if not, which guard said no and why.

    python examples/read_log.py /tmp/k3fuse.jsonl      # a log written by any door (all ranks)
    k3fuse log /tmp/k3fuse.jsonl [--json]               # the same summary from the command line

A rule counts as active only if it has `applied` events; being enabled proves nothing.
"""
from __future__ import annotations

import argparse
import sys

from k3fuse.log import RewriteLog


def describe(log: RewriteLog) -> list[str]:
    lines = [f"{len(log)} events from ranks {sorted({e.rank for e in log})}",
             f"active rules: {log.active_rules() or 'none'}"]
    for rule, s in log.summary().items():
        lines.append(f"{rule}: applied={s['applied']} rejected={s['rejected']} not_matched={s['not_matched']} "
                     f"({s['time_ms']:.1f} ms)")
        for e in log.select(rule, "applied")[:3]:
            lines.append(f"    applied {e.variant} at {e.source or '?'} -> {', '.join(e.new_nodes)}")
        for e in log.rejected(rule)[:3]:
            lines.append(f"    rejected [{e.level}:{e.guard}] {e.reason} {e.values or ''}")
    return lines


def main(argv: list[str] | None = None) -> list[str]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("log", help="JSONL rewrite log (K3FUSE_LOG=... or a door's log= argument)")
    p.add_argument("--rank", type=int, default=None)
    args = p.parse_args(argv)
    log = RewriteLog.from_jsonl(args.log, skip_malformed=True)  # `k3fuse log` also lists the skipped lines
    if args.rank is not None:
        log.events = [e for e in log.events if e.rank == args.rank]
    lines = describe(log)
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main(sys.argv[1:])
