"""The rewrite log: one structured event per decision, as Python objects and JSONL.

Decisions are `applied`, `rejected` (with the guard's level, name and values) and `not_matched`.
A rule is reported active only by `applied` events, never by being configured; users read
"did it fire?" from here (`k3fuse log FILE`). The JSONL file is opened in append mode and each
event is one write of one line carrying the rank, so ranks can share a file.
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from . import settings

logger = logging.getLogger("k3fuse")

Decision = Literal["applied", "rejected", "not_matched"]
DECISIONS: tuple[Decision, ...] = ("applied", "rejected", "not_matched")


def _plain(value: Any) -> Any:
    """JSON-safe version of a guard value (dtypes, SymInts, tuples...); a non-finite float becomes its
    name ("nan", "inf", "-inf"): NaN and Infinity are not JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_plain(v) for v in value]
    return str(value)


@dataclass
class RewriteEvent:
    """One decision of one rule at one site (or for the whole graph: contract, not_matched)."""

    rule: str
    decision: Decision
    graph_id: str = ""
    door: str = ""
    variant: str | None = None
    nodes: list[str] = field(default_factory=list)
    new_nodes: list[str] = field(default_factory=list)
    shapes: dict[str, list[Any]] = field(default_factory=dict)
    source: str | None = None
    guard: str | None = None
    level: str | None = None
    reason: str | None = None
    values: dict[str, Any] = field(default_factory=dict)
    time_ms: float = 0.0
    rank: int = 0
    timestamp: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        return _plain(asdict(self))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RewriteEvent:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})

    def line(self) -> str:
        """Human one-liner for the Python logger."""
        where = f" at {self.source}" if self.source else ""
        if self.decision == "applied":
            return f"{self.rule}: applied variant {self.variant} -> {', '.join(self.new_nodes)}{where}"
        if self.decision == "rejected":
            return f"{self.rule}: rejected [{self.level}:{self.guard}] {self.reason}{where} {self.values}"
        return f"{self.rule}: not matched"


#: JSON type(s) of each optional event field, checked when a log is read back
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "graph_id": (str,), "door": (str,), "variant": (str, type(None)), "nodes": (list,), "new_nodes": (list,),
    "shapes": (dict,), "source": (str, type(None)), "guard": (str, type(None)), "level": (str, type(None)),
    "reason": (str, type(None)), "values": (dict,), "time_ms": (int, float), "rank": (int,),
    "timestamp": (int, float),
}


def event_schema_error(data: Any) -> str | None:
    """Why `data` (one decoded JSONL line) is not a rewrite event, or None if it is one."""
    if not isinstance(data, dict):
        return f"a JSON {type(data).__name__}, not an object"
    if not isinstance(data.get("rule"), str) or not data["rule"]:
        return "no rule name"
    if data.get("decision") not in DECISIONS:
        return f"decision {data.get('decision')!r} is not one of {', '.join(DECISIONS)}"
    for name, types in _FIELD_TYPES.items():
        value = data.get(name)
        if name in data and (not isinstance(value, types) or isinstance(value, bool)):
            return f"field {name} is {value!r}"
    return None


@dataclass(frozen=True)
class MalformedLine:
    lineno: int
    why: str


@dataclass
class LogReading:
    """A log read leniently: the events of every good line, and the lines that were not events."""

    log: RewriteLog
    malformed: list[MalformedLine]


#: deepest nesting of lists and objects a log line may hold (k3fuse's own lines hold 3 or 4)
MAX_DEPTH = 32


def _too_deep(value: Any, limit: int = MAX_DEPTH) -> bool:
    """`value` nests lists/objects deeper than `limit` (checked without recursion)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth > limit:
                return True
            stack.extend((c, depth + 1) for c in (v.values() if isinstance(v, dict) else v))
    return False


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def read_jsonl(path: str | os.PathLike[str]) -> LogReading:
    """Read a JSONL rewrite log line by line: a truncated last line (a process killed mid-write),
    binary junk, NaN or Infinity (not JSON), nesting deeper than MAX_DEPTH or a line of another
    schema is reported, never fatal to the rest. `path` must be a regular file (a FIFO or a device
    is refused: k3fuse.fileio.NotAFile)."""
    from .fileio import open_regular

    log = RewriteLog(path=None)
    log.path = None
    malformed: list[MalformedLine] = []
    with open_regular(path, "a rewrite log") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                data = json.loads(raw.decode("utf-8"), parse_constant=_not_json)
            except UnicodeDecodeError:
                malformed.append(MalformedLine(lineno, "not UTF-8 text"))
                continue
            except json.JSONDecodeError as exc:
                malformed.append(MalformedLine(lineno, f"not JSON ({exc.msg})"))
                continue
            except ValueError as exc:  # NaN / Infinity
                malformed.append(MalformedLine(lineno, f"not JSON ({exc})"))
                continue
            except RecursionError:
                malformed.append(MalformedLine(lineno, f"nested deeper than {MAX_DEPTH} levels"))
                continue
            if _too_deep(data):
                malformed.append(MalformedLine(lineno, f"nested deeper than {MAX_DEPTH} levels"))
                continue
            why = event_schema_error(data)
            if why is not None:
                malformed.append(MalformedLine(lineno, why))
                continue
            log.events.append(RewriteEvent.from_dict(data))
    return LogReading(log, malformed)


@dataclass(frozen=True)
class Run:
    """One pass of the pipeline over one graph on one rank (what one compile/apply logs)."""

    index: int
    rank: int
    door: str
    graph_id: str
    events: list[RewriteEvent]


def split_runs(events: Iterable[RewriteEvent]) -> list[Run]:
    """Cut the events of a log (several ranks, graphs and runs may share a file) into pipeline runs.

    Per rank, a run ends when the graph or door changes, or when a rule that already spoke in the
    run speaks again after another rule (the pipeline visits each rule once per graph).
    """
    open_runs: dict[int, tuple[list[RewriteEvent], list[str]]] = {}
    ordered: list[tuple[int, list[RewriteEvent]]] = []  # (rank, events) in order of their first event
    for e in events:
        current = open_runs.get(e.rank)
        if current is not None:
            evs, rules = current
            last = evs[-1]
            new_run = (e.graph_id != last.graph_id or e.door != last.door
                       or (e.rule != rules[-1] and e.rule in rules))
            if not new_run:
                evs.append(e)
                if e.rule != rules[-1]:
                    rules.append(e.rule)
                continue
        evs = [e]
        open_runs[e.rank] = (evs, [e.rule])
        ordered.append((e.rank, evs))
    return [Run(i, rank, evs[0].door, evs[0].graph_id, evs) for i, (rank, evs) in enumerate(ordered, 1)]


def fold_reasons(events: Iterable[RewriteEvent], max_values: int = 3) -> list[dict[str, Any]]:
    """Rejected and not-matched events folded to one row per (rule, decision, guard, reason), with
    how often, on which ranks, and up to `max_values` distinct sets of values it saw."""
    rows: dict[tuple[str, str, str, str], dict[str, Any]] = {}
    for e in events:
        if e.decision == "applied":
            continue
        guard = f"{e.level}:{e.guard}" if e.guard else ""
        key = (e.rule, e.decision, guard, e.reason or "")
        row = rows.setdefault(key, {"rule": e.rule, "decision": e.decision, "guard": guard,
                                    "reason": e.reason or "", "count": 0, "ranks": set(), "values": [],
                                    "more_values": 0})
        row["count"] += 1
        row["ranks"].add(e.rank)
        if e.values:
            values = _plain(e.values)
            if values in row["values"]:
                pass
            elif len(row["values"]) < max_values:
                row["values"].append(values)
            else:
                row["more_values"] += 1
    out = []
    for row in rows.values():
        row["ranks"] = sorted(row["ranks"])
        out.append(row)
    return out


class RewriteLog:
    """Events in decision order; optionally streamed to a JSONL file as they arrive."""

    def __init__(self, path: str | os.PathLike[str] | None = None, *, rank: int = 0):
        env_path = settings.get("K3FUSE_LOG")
        self.path: Path | None = Path(path) if path is not None else (Path(env_path) if env_path else None)
        self.rank = rank
        self.events: list[RewriteEvent] = []
        self.rule_time_ms: dict[str, float] = defaultdict(float)

    @classmethod
    def coerce(cls, log: RewriteLog | str | os.PathLike[str] | None, *, rank: int = 0) -> RewriteLog:
        """A log from a log (returned as is), a JSONL path, or None (K3FUSE_LOG, else in memory)."""
        return log if isinstance(log, RewriteLog) else cls(log, rank=rank)

    # --- recording -------------------------------------------------------------------------------
    def add(self, event: RewriteEvent) -> RewriteEvent:
        if event.rank == 0:
            event.rank = self.rank
        self.events.append(event)
        if self.path is not None:
            self._append(self.path, [event])
        (logger.info if event.decision == "applied" else logger.debug)("k3fuse[%s] %s", event.door, event.line())
        return event

    @staticmethod
    def _append(path: Path, events: Iterable[RewriteEvent]) -> None:
        """Append one line per event. The directory must exist (a log never creates directories);
        a symlink is followed only where k3fuse.fileio trusts it, a FIFO is refused."""
        from .fileio import NotAFile, UntrustedLink, open_append

        try:
            fd = open_append(path)
        except (UntrustedLink, NotAFile):
            raise
        except OSError as exc:
            raise OSError(exc.errno, f"cannot append to the rewrite log: {exc.strerror}", str(path)) from exc
        try:
            for e in events:  # one write per line: lines from several ranks never interleave
                os.write(fd, (json.dumps(e.to_dict(), sort_keys=True, allow_nan=False) + "\n").encode())
        except OSError as exc:  # name the log, not the errno alone (os.write's error has no filename)
            raise OSError(exc.errno, f"cannot append to the rewrite log: {exc.strerror}", str(path)) from exc
        finally:
            os.close(fd)

    @classmethod
    def from_jsonl(cls, path: str | os.PathLike[str], *, skip_malformed: bool = False) -> RewriteLog:
        """The events of a JSONL log. A malformed line raises ValueError naming it, unless
        `skip_malformed` (then see `read_jsonl`, which also says which lines were skipped)."""
        reading = read_jsonl(path)
        if reading.malformed and not skip_malformed:
            bad = reading.malformed[0]
            raise ValueError(f"{path}:{bad.lineno}: not a rewrite event: {bad.why}")
        return reading.log

    # --- reading ---------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[RewriteEvent]:
        return iter(self.events)

    def __len__(self) -> int:
        return len(self.events)

    def select(self, rule: str | None = None, decision: Decision | None = None) -> list[RewriteEvent]:
        return [e for e in self.events
                if (rule is None or e.rule == rule) and (decision is None or e.decision == decision)]

    def applied(self, rule: str | None = None) -> int:
        """Number of applied rewrites (of `rule`, or of all rules)."""
        return len(self.select(rule, "applied"))

    def rejected(self, rule: str | None = None) -> list[RewriteEvent]:
        return self.select(rule, "rejected")

    def active_rules(self) -> list[str]:
        """Rules that rewrote at least one site; configured-but-silent rules are not here."""
        return sorted({e.rule for e in self.events if e.decision == "applied"})

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per rule: applied / rejected / not_matched counts, rejections by level:guard, time.

        time_ms is the sum over the rule's events (what the JSONL file holds too, so a log read back
        shows the same figure); `rule_time_ms` keeps the whole rule's time, finding included.
        """
        out: dict[str, dict[str, Any]] = {}
        for e in self.events:
            s = out.setdefault(e.rule, {"applied": 0, "rejected": 0, "not_matched": 0, "why": Counter(),
                                        "variants": Counter(), "time_ms": 0.0})
            s[e.decision] += 1
            s["time_ms"] += e.time_ms
            if e.decision == "rejected":
                s["why"][f"{e.level}:{e.guard}"] += 1
            if e.decision == "applied" and e.variant:
                s["variants"][e.variant] += 1
        for s in out.values():
            s["why"] = dict(s["why"])
            s["variants"] = dict(s["variants"])
            s["time_ms"] = round(s["time_ms"], 3)
        return out

    def __repr__(self) -> str:
        return f"RewriteLog({len(self.events)} events, applied={self.applied()}, path={self.path})"


__all__ = ["RewriteEvent", "RewriteLog", "Decision", "DECISIONS", "read_jsonl", "LogReading", "MalformedLine",
           "event_schema_error", "Run", "split_runs", "fold_reasons"]
