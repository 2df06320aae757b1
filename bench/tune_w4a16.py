"""The CuTe W4A16 launch choices that measured fastest, written as kernels/lib/cute/routed_experts_w4a16_tuned.py.

Reads the JSON of `bench_routed_experts.py --formats ...` runs whose `--cute-choices` arms timed other launches
beside the default (`"rule": {}` times the rule's launch alone). Per row (format, I, tokens), the fastest arm
wins if it beats the fastest arm that ran the rule's launch by at least `--margin`; its launch, as
pick_config's choices, becomes the table's entry; otherwise the entry is empty (the rule's launch, measured
best there, so that no other token count's entry stands in for it). Rows that time no arm at the rule's
launch leave their entry as it was; entries for rows not in these runs are kept. Arms over block-ordered
tables (`blocked`) are left out: no choice spells them, as the op's tables are the checkpoint's.

    python -m bench.tune_w4a16 RUN.json [RUN.json ...] [--margin 0.02] [--skip-arms a,b] [--check]

Run the benchmark and the tuner with the launch-form switches (LAUNCH_FORM_SETTINGS) unset: the rule the arms
are weighed against is today's, without them. `--skip-arms` leaves out arms whose code changed since the run.
"""
from __future__ import annotations

import argparse
import json
import os
import pprint
import runpy
import sys
from pathlib import Path

from k3fuse import settings
from k3fuse.kernels.ops.routed_experts_w4a16 import LAUNCH_FORM_SETTINGS, cute_config

TABLE = Path(__file__).resolve().parent.parent / "kernels" / "lib" / "cute" / "routed_experts_w4a16_tuned.py"
#: pick_config's choices in the order they are tried when a launch is spelled as choices ("stages" sets the
#: gate/up's ring depth, and the down's unless down_stages follows)
CHOICES = ("stages", "split", "n_tiles", "gate_up_tiles", "down_stages", "rows_first", "x_quads", "scale_steps",
           "one_launch", "x_stage", "gate_up_shares", "pdl", "rounds")
Key = tuple[str, int, int, int, int, int]  # format, E, I, L, top_k, tokens


def same_launch(a: dict, b: dict) -> bool:
    """Two configurations launch alike: equal on every key both have (a run older than a key lacks it)."""
    return all(a[k] == b[k] for k in a.keys() & b.keys())


def as_choices(config: dict, shape: tuple[int, int, int, int, int]) -> dict[str, int | bool] | None:
    """The fewest of pick_config's choices that reproduce `config` over the rule at `shape` (T, E, I, L, top_k);
    None where no choices do (another grouping mode, or a key the choices do not reach)."""
    choices: dict[str, int | bool] = {}
    try:
        for _ in CHOICES:  # a choice can move what an earlier one derived (gate_up_tiles the split): to a fixpoint
            now = cute_config(*shape, tuned=False, **choices)
            if same_launch(config, now):
                return choices
            name = next(n for n in CHOICES if _field(n) in config and config[_field(n)] != now[_field(n)]
                        and choices.get(n) != config[_field(n)])
            choices[name] = config[_field(name)]
    except (ValueError, StopIteration):  # refused by pick_config, or a difference no choice reaches
        pass
    return None


def _field(choice: str) -> str:
    """The configuration key a choice sets."""
    return "gate_up_stages" if choice == "stages" else choice


def tune(runs: list[tuple[str, dict]], table: dict[Key, dict], sources: dict[Key, str], margin: float,
         skip_arms: set[str]) -> list[str]:
    """Update `table` and `sources` (key -> the run that decided it) from `runs` ((name, JSON) pairs); a line
    per row saying what was decided and why."""
    lines = []
    for name, run in runs:
        E, top_k, L = run["E"], run["top_k"], run["latent"]
        for row in run["rows"]:
            fmt, I, T = row["format"], row["inter"], row["tokens"]
            key, shape = (fmt, E, I, L, top_k, T), (T, E, I, L, top_k)
            rule = cute_config(*shape, tuned=False)
            arms = {n: (a["us"], a["config"]) for n, a in row.get("cute_choices", {}).items()
                    if "us" in a and n not in skip_arms}
            if row.get("cute") and row.get("cute_config") and "cute" not in skip_arms:
                arms["cute"] = (row["cute"], row["cute_config"])
            at_rule = [us for us, config in arms.values() if same_launch(config, rule)]
            where = f"{fmt} I={I} T={T}:"
            if not at_rule:
                lines.append(f"{where} kept ({'no arm ran the rule' if arms else 'no timed arm'})")
                continue
            spelled = {n: as_choices(config, shape) for n, (_, config) in arms.items()}
            best = min((n for n in arms if spelled[n] is not None), key=lambda n: arms[n][0])
            gain = min(at_rule) / arms[best][0] - 1
            if spelled[best] and gain >= margin:
                table[key], sources[key] = spelled[best], name
                lines.append(f"{where} {spelled[best]} ({best}, {gain:+.1%} over the rule)")
            else:  # an empty entry: measured, the rule's launch (nearer than any other count's entry)
                table[key], sources[key] = {}, name
                lines.append(f"{where} the rule (best {best}, {gain:+.1%})")
            lines += [f"    arm {n}: another mode or a launch no choices spell, left out"
                      for n, c in spelled.items() if c is None]
    return lines


def render(table: dict[Key, dict], sources: dict[Key, str], devices: set[str]) -> str:
    """The generated module's text."""
    keys = sorted(table)
    entries = "".join(f"    {key!r}: {dict(sorted(table[key].items()))!r},\n" for key in keys)
    named = "".join(f"    {key!r}: {sources[key]!r},\n" for key in keys)
    return f'''"""CuTe W4A16 launch choices measured fastest (generated by bench/tune_w4a16.py; do not edit by hand).

TUNED: (format, E, I, L, top_k, tokens) -> pick_config's choices ("stages": the ring depth) that beat the
rule's launch by the tuner's margin in the same run ({{}}: the rule's launch measured best). SOURCES: the run
(bench/results/) that decided each. DEVICES: where those runs were measured. tuned_choices in
kernels/ops/routed_experts_w4a16.py reads TUNED (K3FUSE_W4A16_TUNED=0 sets it aside); the runs' figures are
in docs/perf.md.
"""
DEVICES = {tuple(sorted(devices))!r}
TUNED: dict[tuple[str, int, int, int, int, int], dict[str, int | bool]] = {{
{entries}}}
SOURCES: dict[tuple[str, int, int, int, int, int], str] = {{
{named}}}
'''


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="bench_routed_experts.py --formats JSON files")
    ap.add_argument("--margin", type=float, default=0.02, help="least gain over the rule's launch (0.02: 2%%)")
    ap.add_argument("--skip-arms", default="", help="arm names to leave out (code changed since the run)")
    ap.add_argument("-o", "--out", default=str(TABLE), help="the module to write (default: the package's)")
    ap.add_argument("--check", action="store_true", help="print what would change, write nothing")
    args = ap.parse_args(argv)
    set_switches = [v for v in LAUNCH_FORM_SETTINGS if settings.get(v) is not None]
    if set_switches:
        print(f"error: unset {', '.join(set_switches)}: the arms are weighed against the rule alone", file=sys.stderr)
        return 2
    old = runpy.run_path(args.out) if os.path.exists(args.out) else {}
    table, devices = dict(old.get("TUNED", {})), set(old.get("DEVICES", ()))
    sources = {key: old.get("SOURCES", {}).get(key, "unknown") for key in table}
    runs = []
    for path in args.runs:
        with open(path) as f:
            run = json.load(f)
        runs.append((os.path.basename(path), run))
        devices.add(run["device"])
    for line in tune(runs, table, sources, args.margin, {a for a in args.skip_arms.split(",") if a}):
        print(line)
    text = render(table, sources, devices)
    if args.check:
        print(f"--check: {args.out} not written; its table would be:")
        pprint.pprint(table, sort_dicts=True)
        return 0
    with open(args.out, "w") as f:
        f.write(text)
    print(f"wrote {args.out}: {len(table)} entries")
    return 0


if __name__ == "__main__":
    sys.exit(main())
