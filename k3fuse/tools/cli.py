"""`k3fuse` command line: `demo` (the main job), `apply` (rewrite a saved ExportedProgram) and
`log` (read a rewrite log).

Each verb is a `register_<verb>(subparsers)` function that sets `func` on its parser; a new verb
plugs in by adding one function to `SUBCOMMANDS`. A verb reports a user mistake by raising
`k3fuse.usage_error.UsageError` (problem and fix): `main` prints it as one line and exits with status 2
(argparse mistakes too); `--debug` shows the traceback. Verbs import torch inside their handler,
so `k3fuse --help` answers without it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from .. import settings
from ..usage_error import UsageError
from .console import print_reasons, print_rewrite_summary, print_runs
from .flags import (add_moved_batch_flag, add_rules_flag, check_moved_batch, non_negative_int, parse_tokens,
                    positive_int, use_rules)


class OneLineParser(argparse.ArgumentParser):
    """argparse, with a mistake answered in one line (argparse prints the usage block first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


# --- apply ---------------------------------------------------------------------------------------


def decide_tp(requested: int | None, groups: dict[str, int | None]) -> tuple[int, str]:
    """The TP size to rewrite for, from --tp and the graph's collective groups (name -> size or
    None when the graph does not record it, see k3fuse.offline.collective_group_sizes), with a
    note saying where it came from: read from the graph, checked against it, or not checkable."""
    known = {size for size in groups.values() if size is not None}
    shown = ", ".join(f"{name!r}" + (f" (size {size})" if size else "") for name, size in groups.items())
    if len(known) > 1:
        raise UsageError(f"the graph's collectives use groups of different sizes: {shown}",
                         "k3fuse rewrites one tensor-parallel group; export the decode step of one group")
    if requested is None:
        if not groups:
            return 1, "TP 1: the graph has no collectives"
        if known:
            size = known.pop()
            return size, f"TP {size} read from the graph's collectives over group {shown}"
        raise UsageError(f"the graph holds collectives over group {shown}, whose size it does not record",
                         "pass --tp N, the tensor-parallel size it was captured with")
    if not groups and requested > 1:
        raise UsageError(f"--tp {requested} but the graph has no collectives (it was captured at TP 1)",
                         "drop --tp, or export the TP program")
    if groups and requested == 1:
        raise UsageError(f"--tp 1 but the graph holds collectives over group {shown}",
                         "pass --tp N, the tensor-parallel size it was captured with")
    if known and requested not in known:
        raise UsageError(f"--tp {requested} but the graph's collectives run over group {shown}",
                         f"pass --tp {next(iter(known))}, or leave --tp out to read it from the graph")
    if known:
        return requested, f"TP {requested} from --tp (matches the graph)"
    return requested, (f"TP {requested} from --tp, which could not be checked: the graph does not record the "
                       f"size of group {shown} (k3fuse.offline.save_program records it when a process group is "
                       f"live); the fused ops check the live group's size when they run")


class Progress:
    """One status line on stderr while `apply` works (loading a large program takes seconds to
    minutes): on a terminal, rewritten in place and erased at the end; elsewhere nothing, so a pipe
    or a log holds the results alone and every error stays one line."""

    def __init__(self, verb: str):
        self.verb = verb
        self.live = sys.stderr.isatty()

    def __call__(self, what: str) -> None:
        if self.live:
            from .console import plain_str

            sys.stderr.write(f"\r\x1b[2Kk3fuse {self.verb}: {plain_str(what, 200)}...")
            sys.stderr.flush()

    def done(self) -> None:
        if self.live:
            sys.stderr.write("\r\x1b[2K")
            sys.stderr.flush()


def _size(path: Path) -> str:
    n = path.stat().st_size
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n} bytes"


def _cmd_apply(args: argparse.Namespace) -> int:
    progress = Progress("apply")
    try:
        return _apply(args, progress)
    finally:
        progress.done()


def _apply(args: argparse.Namespace, progress: Progress) -> int:
    from ..fileio import (WriteFailed, check_append_file, check_input_file, check_output_file, destination, is_stream,
                          same_file)

    check_moved_batch(args, "apply")
    # every path first: a mistake found after minutes of rewriting is a lost run
    src = check_input_file(args.input, "input program")
    if args.output is None and not args.in_place:
        raise UsageError("no output given", "pass -o OUT.pt2, or --in-place to replace the input")
    if args.output is not None and args.in_place and not same_file(args.output, args.input):
        raise UsageError(f"--in-place replaces the input, but -o names another file ({args.output})",
                         "pass -o OUT.pt2 to write a new file, or --in-place alone to replace the input")
    dst = check_output_file(args.output or args.input, option="-o", inputs=[args.input], in_place=args.in_place)
    if args.log is not None:
        check_append_file(args.log, option="--log", not_same_as=[("input program", src), ("output (-o)", dst)])
    if args.tp is not None and args.rank >= args.tp:
        raise UsageError(f"--rank {args.rank} is outside --tp {args.tp}", f"pass a rank in 0..{args.tp - 1}")

    progress("loading torch and the k3fuse rules")
    import k3fuse

    k3fuse.load()
    from k3fuse.archive import NotAProgram, ProgramRefused
    from k3fuse.context import DecodeContext
    from k3fuse.offline import collective_group_sizes, load_program, save_program
    from k3fuse.pipeline import default_registry

    use_rules(args.rules)
    tokens = {"tokens": args.tokens} if args.tokens else {}  # default: DecodeContext's decode range
    probe = DecodeContext(multicast=args.multicast, strict=args.strict, **tokens)
    default_registry().select(probe)  # unknown names in K3FUSE_RULES: one line, before loading
    progress(f"checking and loading {src} ({_size(src)})")
    try:
        ep = load_program(src)
    except NotAProgram as exc:
        raise UsageError(f"{src} is not a program saved with torch.export.save ({exc.why})",
                         "give the .pt2 file written by torch.export.save") from exc
    except ProgramRefused as exc:
        raise UsageError(f"refused {exc}", "see the README, 'What a .pt2 may contain'") from exc
    except Exception as exc:  # torch raises RuntimeError / zip / schema errors for a non-program
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"{src} is not a program saved with torch.export.save ({first[:300]})",
                         "give the .pt2 file written by torch.export.save") from exc
    groups = collective_group_sizes(ep.graph)
    tp, tp_note = decide_tp(args.tp, groups)
    if args.rank >= tp:
        raise UsageError(f"--rank {args.rank} is outside TP {tp}", f"pass a rank in 0..{tp - 1}")
    group_name = args.group_name
    if group_name is not None and group_name not in groups:
        used = ", ".join(repr(g) for g in groups) if groups else "none (the graph has no collectives)"
        raise UsageError(f"--group-name {group_name!r} is not a group the graph's collectives use; they use {used}",
                         "pass one of those, or leave --group-name out to read it from the graph")
    if tp > 1 and group_name is None:
        if len(groups) != 1:
            raise UsageError(f"the graph uses several collective groups {sorted(groups)}",
                             "pass --group-name with the tensor-parallel one")
        group_name = next(iter(groups))
    ctx = DecodeContext(tp_size=tp, rank=args.rank, group_name=group_name, multicast=args.multicast,
                        strict=args.strict, **tokens)
    target = destination(dst)
    replacing = target.exists() and not is_stream(target.stat().st_mode)
    progress(f"rewriting for TP {tp}")
    new_ep, log = k3fuse.apply(ep, ctx, log=args.log)
    progress(f"saving {dst}")
    try:
        # the output records its group size too, so applying it again checks --tp as well
        save_program(new_ep, dst, group_sizes={group_name: tp} if tp > 1 and group_name else None)
    except WriteFailed as exc:
        raise UsageError(f"could not save {dst}: {exc.strerror}", f"{exc.kept}; free space or choose another -o") \
            from exc
    progress.done()
    print_rewrite_summary(log.summary(), title=f"{src} -> {dst}")
    print(tp_note)
    if replacing:
        print(f"replaced {dst} atomically (written to a temporary file, then renamed)")
    elif target.exists() and is_stream(target.stat().st_mode):
        print(f"wrote the program to {dst} (a device or FIFO: written through, nothing replaced)")
    if log.applied() == 0:
        print("no rewrite applied: the saved program is the decomposed input; `k3fuse log` with --log shows why",
              file=sys.stderr)
    return 0


def register_apply(sub: Any) -> None:
    p = sub.add_parser("apply", help="rewrite a saved ExportedProgram (.pt2) for decode")
    p.add_argument("input", help="program saved with torch.export.save")
    p.add_argument("-o", "--output", default=None,
                   help="where to save the rewritten program (written to a temporary file, then renamed)")
    p.add_argument("--in-place", action="store_true", help="replace the input program (atomically)")
    p.add_argument("--tp", type=positive_int, default=None,
                   help="tensor-parallel size the program was captured with (default: read from the graph)")
    p.add_argument("--rank", type=non_negative_int, default=0, help="rank the program was captured on")
    p.add_argument("--group-name", default=None, help="c10d group name (default: the one in the graph)")
    p.add_argument("--tokens", type=parse_tokens, default=None,
                   help="token range the rewrites are guarded for, e.g. 1-64 (default: the decode range)")
    add_moved_batch_flag(p)
    p.add_argument("--multicast", choices=("auto", "off", "require"), default="auto")
    p.add_argument("--strict", action="store_true", help="bake strict mode into the fused ops")
    add_rules_flag(p)
    p.add_argument("--log", default=None, help="append the rewrite log (JSONL) here")
    p.set_defaults(func=_cmd_apply)


# --- log -----------------------------------------------------------------------------------------


def _finite(value: Any) -> Any:
    """`value` with every non-finite float written as its name ("nan", "inf"): JSON has no NaN."""
    import math

    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _cmd_log(args: argparse.Namespace) -> int:
    """The log's content is data: names, reasons and values are printed as text (no markup, control
    characters escaped, see console.plain) and --json is strict JSON."""
    from ..fileio import NotAFile, check_input_file
    from ..log import RewriteLog, fold_reasons, read_jsonl, split_runs
    from .console import plain_str

    path = check_input_file(args.file, "log file")
    try:
        reading = read_jsonl(path)
    except NotAFile as exc:  # swapped for a FIFO or a device after the check
        raise UsageError(f"log file {exc}", "name a regular file") from None
    shown_path = plain_str(path)
    if reading.malformed:
        shown = ", ".join(str(m.lineno) for m in reading.malformed[:10])
        more = f" and {len(reading.malformed) - 10} more" if len(reading.malformed) > 10 else ""
        first = reading.malformed[0]
        print(f"{shown_path}: skipped {len(reading.malformed)} malformed line(s): {shown}{more} "
              f"(line {first.lineno}: {plain_str(first.why, 200)})", file=sys.stderr)
    events = reading.log.events
    if not events:
        if reading.malformed:
            raise UsageError(f"{path} holds no rewrite events, only malformed lines",
                             "give a JSONL log written by k3fuse (--log, K3FUSE_LOG)")
        print(f"{shown_path}: no rewrite events (the file is empty)", file=sys.stderr)
        return 1
    all_runs = split_runs(events)
    ranks = sorted({e.rank for e in events})
    if args.rank is not None and args.rank not in ranks:
        raise UsageError(f"{path} has no events of rank {args.rank}",
                         f"ranks in the log: {', '.join(map(str, ranks))}")
    if args.run is not None and not 1 <= args.run <= len(all_runs):
        raise UsageError(f"{path} has no run {args.run}", f"runs in the log: 1..{len(all_runs)}")
    runs = [r for r in all_runs
            if (args.rank is None or r.rank == args.rank) and (args.run is None or r.index == args.run)]
    if not runs:
        raise UsageError(f"run {args.run} of {path} is not on rank {args.rank}", "drop --rank or pick another --run")
    log = RewriteLog(path=None)
    log.path = None
    log.events = [e for r in runs for e in r.events]
    summary = log.summary()
    reasons = fold_reasons(log.events)
    sel_ranks = sorted({r.rank for r in runs})
    scope = (f"{len(log.events)} events, {len(runs)} run(s) on rank(s) {', '.join(map(str, sel_ranks))}")
    if args.json:
        json.dump(_finite({"summary": summary, "active_rules": log.active_rules(), "events": len(log.events),
                           "ranks": sel_ranks,
                           "runs": [{"run": r.index, "rank": r.rank, "door": r.door, "graph_id": r.graph_id,
                                     "events": len(r.events)} for r in runs],
                           "reasons": reasons,
                           "malformed_lines": [{"line": m.lineno, "why": m.why} for m in reading.malformed]}),
                  sys.stdout, indent=2, sort_keys=True, allow_nan=False)
        sys.stdout.write("\n")
        return 0
    if len(runs) > 1:
        print_runs(runs)
    summed = " (summed over them; pick one with --rank R / --run N)" if len(runs) > 1 else ""
    print_rewrite_summary(summary, title=f"{path}: {scope}{summed}")
    if reasons:
        print_reasons(reasons)
    print("active rules: " + (", ".join(plain_str(r, 200) for r in log.active_rules()) or "none"))
    return 0


def register_log(sub: Any) -> None:
    p = sub.add_parser("log", help="summarise a rewrite log (JSONL) per rule, with the reasons rules said no")
    p.add_argument("file")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--rank", type=non_negative_int, default=None, help="only events of this rank")
    p.add_argument("--run", type=positive_int, default=None, help="only this pipeline run (numbers as listed)")
    p.set_defaults(func=_cmd_log)


def register_demo(sub: Any) -> None:
    from .demo import register_demo as _register

    _register(sub)


def register_bench(sub: Any) -> None:
    from .bench.cli import register_bench as _register

    _register(sub)


def register_generate(sub: Any) -> None:
    from .generate import register_generate as _register

    _register(sub)


def register_validate(sub: Any) -> None:
    from .validate_cli import register_validate as _register

    _register(sub)


SUBCOMMANDS: list[Callable[[Any], None]] = [register_demo, register_apply, register_log, register_bench,
                                            register_validate, register_generate]


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="k3fuse", description="compiler passes for Kimi K3 decode")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    sub = parser.add_subparsers(dest="command", required=True)
    for register in SUBCOMMANDS:
        register(sub)
    for verb in sub.choices.values():  # also after the verb: `k3fuse apply ... --debug`
        if "--debug" not in verb._option_string_actions:
            verb.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return parser


def one_line(exc: BaseException) -> str | None:
    """An error the user must see as one line (a worker rank's failure, a launch timeout, a file
    the system refused), or None for a bug (shown with its traceback)."""
    dist = sys.modules.get("k3fuse.dist")  # only loaded when a verb launched ranks (it imports torch)
    if dist is not None and isinstance(exc, dist.RankFailedError):
        message = str(exc).splitlines()[0].split(": ", 1)[-1]
        return f"rank {exc.rank} failed: {exc.exc_type}: {message}"
    if dist is not None and isinstance(exc, dist.LaunchTimeout):
        return f"{str(exc).splitlines()[0]} (a dead or hung rank?)"
    if isinstance(exc, OSError):
        if type(exc).__str__ is not OSError.__str__:  # fileio.WriteFailed says it all
            return str(exc)
        where = f"{exc.filename}: " if exc.filename is not None else ""
        return f"{where}{exc.strerror or exc}"
    return None


def _join_rules_value(argv: list[str]) -> list[str]:
    """`--rules -a` as `--rules=-a`: the K3FUSE_RULES grammar starts a value with "-", which argparse
    would otherwise read as an option."""
    out: list[str] = []
    it = iter(argv)
    for arg in it:
        if arg == "--rules":
            value = next(it, None)
            out.append("--rules" if value is None else f"--rules={value}")
        else:
            out.append(arg)
    return out


class _Interrupt:
    """Ctrl-C, however it surfaces: a SIGINT can land inside torch's C++ code, which may turn the
    KeyboardInterrupt into another exception (a FakeTensorMode error, a RuntimeError); the handler
    records that it happened, so `main` reports an interrupt whatever exception comes out."""

    def __init__(self) -> None:
        self.seen = False
        self.previous: Any = None

    def install(self) -> None:
        import signal
        import threading

        # a process started with SIGINT ignored (nohup, a background job of a script) keeps ignoring it
        if threading.current_thread() is threading.main_thread() \
                and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            self.previous = signal.signal(signal.SIGINT, self.handle)

    def handle(self, signum: int, frame: Any) -> None:
        self.seen = True
        raise KeyboardInterrupt

    def restore(self) -> None:
        import signal

        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


def interrupted_message(verb: str) -> str:
    """One line after Ctrl-C, saying what happened to the files this run writes (k3fuse.fileio
    records each output it renamed into place or streamed, and each log it appended to)."""
    from ..fileio import appended_files, written_files

    written = [str(p) for p in written_files()]
    logs = [str(p) for p in appended_files()]
    if written:
        said = f"interrupted after writing {', '.join(written)} (complete)"
    else:
        said = "interrupted; no output file was changed"
    if logs:
        said += f"; {', '.join(logs)} holds the rewrite decisions logged before the interrupt"
    return f"k3fuse {verb}: {said}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run one verb; a user mistake becomes one line on stderr and exit status 2, Ctrl-C one line
    and status 130."""
    import signal

    interrupt = _Interrupt()
    as_command = argv is None  # the console script: this process ends when main returns
    verb = "run"
    try:
        interrupt.install()
        argv = list(sys.argv[1:] if argv is None else argv)
        # torch.export.load's own deprecation (torch internals, nothing the user can act on) would be a
        # second line under every one-line error
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
        # the arguments first: --help answers whatever the environment holds
        args = build_parser().parse_args(_join_rules_value(argv))
        verb = args.command
        try:  # every K3FUSE_* variable, before any work: a bad one is one line, never a traceback later
            debug = "--debug" in argv or settings.check_environment(warn=False).debug
        except settings.SettingsError as exc:
            print(f"k3fuse: error: {exc}", file=sys.stderr)
            return 2
        if unknown := settings.unknown_names():
            print(f"k3fuse: warning: {settings.unknown_names_message(unknown)}", file=sys.stderr)
        return _run(args, debug, interrupt)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the one line short
        print(interrupted_message(verb), file=sys.stderr, flush=True)
        return 130
    finally:
        if as_command and interrupt.previous is not None:
            # the run is over, its files written and its lines printed: a Ctrl-C during the
            # interpreter's teardown would only turn a finished run into a silently killed one
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        else:
            interrupt.restore()


def _run(args: argparse.Namespace, debug: bool, interrupt: _Interrupt) -> int:
    try:
        with settings.restored("K3FUSE_RULES"):  # --rules sets K3FUSE_RULES for this run only
            return int(args.func(args) or 0)
    except KeyboardInterrupt:
        if debug:
            traceback.print_exc()
        raise
    except BrokenPipeError:  # the reader of stdout left (`k3fuse log rw.jsonl | head`): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as exc:
        if interrupt.seen:  # Ctrl-C that torch turned into another error
            if debug:
                traceback.print_exc()
            raise KeyboardInterrupt from exc
        if isinstance(exc, (UsageError, settings.SettingsError)):
            if debug:
                raise
            print(f"k3fuse {args.command}: error: {_printable(str(exc))}", file=sys.stderr)
            return getattr(exc, "exit_status", 2)
        line = one_line(exc)
        if debug or line is None:
            raise
        print(f"k3fuse {args.command}: error: {_printable(line)} (--debug shows the traceback)", file=sys.stderr)
        return 2


def _printable(text: str) -> str:
    """One line without control characters (paths and file contents end up in messages)."""
    from .console import plain_str

    return plain_str(text, limit=4000)


if __name__ == "__main__":
    raise SystemExit(main())
