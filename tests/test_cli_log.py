"""`k3fuse log` reads damaged logs, shows reasons and values, and says what it summed (issue 11)."""
from __future__ import annotations

import json
import os
import subprocess

import pytest
from cli_helpers import BIN, k3fuse, one_line_error

from k3fuse.tools.cli import main
from k3fuse.log import RewriteEvent, fold_reasons, read_jsonl, split_runs


def ev(rule, decision, rank=0, graph="g1", **kw):
    return json.dumps(RewriteEvent(rule=rule, decision=decision, rank=rank, graph_id=graph, door="offline",
                                   **kw).to_dict())


def two_runs_two_ranks() -> list[str]:
    lines = []
    for _run in range(2):
        for rank in (0, 1):
            lines += [ev("a", "applied", rank), ev("a", "applied", rank),
                      ev("b", "rejected", rank, level="site", guard="tokens", reason="tokens 70 outside 1-64",
                         values={"tokens": 70}),
                      ev("c", "not_matched", rank, reason="no all_reduce in the graph", values={"collectives": 0})]
    return lines


def test_damaged_lines_are_counted_with_line_numbers_and_the_rest_summarised(tmp_path, capsys):
    path = tmp_path / "rw.jsonl"
    good = two_runs_two_ranks()
    path.write_bytes(("\n".join([good[0], "not json", '{"rule": "x"}', '[1, 2]', good[1]]) + "\n").encode()
                     + b"\xff\xfe\x00binary\n" + b'{"rule": "a", "decision": "appl')  # truncated last line
    assert main(["log", str(path), "--json"]) == 0
    out = capsys.readouterr()
    data = json.loads(out.out)
    assert [m["line"] for m in data["malformed_lines"]] == [2, 3, 4, 6, 7]
    assert data["summary"]["a"]["applied"] == 2
    assert "skipped 5 malformed line(s): 2, 3, 4, 6, 7" in out.err


def test_reasons_and_values_folded_one_row_per_reason():
    rows = fold_reasons(RewriteEvent.from_dict(json.loads(x)) for x in two_runs_two_ranks())
    by_rule = {r["rule"]: r for r in rows}
    assert by_rule["b"]["count"] == 4 and by_rule["b"]["values"] == [{"tokens": 70}]
    assert by_rule["b"]["guard"] == "site:tokens" and by_rule["b"]["ranks"] == [0, 1]
    assert by_rule["c"]["decision"] == "not_matched" and by_rule["c"]["reason"] == "no all_reduce in the graph"


def test_runs_split_per_rank_and_per_pipeline_pass(tmp_path):
    path = tmp_path / "rw.jsonl"
    path.write_text("\n".join(two_runs_two_ranks()) + "\n")
    runs = split_runs(read_jsonl(path).log.events)
    assert [(r.index, r.rank, len(r.events)) for r in runs] == [(1, 0, 4), (2, 1, 4), (3, 0, 4), (4, 1, 4)]


def test_table_shows_runs_reasons_values_and_what_was_summed(tmp_path):
    path = tmp_path / "rw.jsonl"
    path.write_text("\n".join(two_runs_two_ranks()) + "\n")
    res = k3fuse("log", str(path))
    assert res.returncode == 0, res.stderr
    assert "pipeline runs" in res.stdout and "summed over them" in res.stdout
    assert "tokens 70 outside 1-64" in res.stdout and '{"tokens": 70}' in res.stdout
    assert "no all_reduce in the graph" in res.stdout
    res = k3fuse("log", str(path), "--rank", "1", "--run", "2", "--json")
    data = json.loads(res.stdout)
    assert data["ranks"] == [1] and [r["run"] for r in data["runs"]] == [2] and data["summary"]["a"]["applied"] == 2


@pytest.mark.parametrize("content,args,fragments", [
    ("", [], None),
    ("x", ["--rank", "5"], ["holds no rewrite events, only malformed lines"]),
    (None, ["--rank", "5"], ["has no events of rank 5", "ranks in the log: 0, 1"]),
    (None, ["--run", "9"], ["has no run 9", "runs in the log: 1..4"]),
])
def test_empty_selection_says_so(tmp_path, capsys, content, args, fragments):
    path = tmp_path / "rw.jsonl"
    path.write_text("\n".join(two_runs_two_ranks()) + "\n" if content is None else content)
    status = main(["log", str(path), *args])
    err = capsys.readouterr().err
    if fragments is None:
        assert status == 1 and "no rewrite events (the file is empty)" in err
    else:
        assert status == 2 and all(f in err for f in fragments), err


def test_missing_log_file_is_one_line(tmp_path):
    one_line_error(k3fuse("log", str(tmp_path / "nope.jsonl")), "does not exist")
    one_line_error(k3fuse("log", str(tmp_path)), "is a directory")


# --- the log's content is data (issue 48 item 8): no markup, no escape sequences, no crash, strict JSON --

HOSTILE = {
    "closing_tag": "[/]",
    "link": "[link=https://evil.example/]click me[/link]",
    "osc8": "\x1b]8;;https://evil.example/\x1b\\click\x1b]8;;\x1b\\",
    "clear_screen": "\x1b[2J\x1b[H",
    "bidi": "admin\u202etxt.exe",
    "brackets": "[" * 200_000,
}


def _hostile_log(path) -> None:
    lines = []
    for i, text in enumerate(HOSTILE.values()):
        lines += [ev(text, "applied", rank=i % 2, graph=text),
                  ev("r", "rejected", rank=i % 2, level="site", guard=text, reason=text, values={text: text})]
    lines.append("[" * 200_000 + "]" * 200_000)  # nesting no parser should recurse through
    lines.append('{"rule": "r", "decision": "applied", "time_ms": NaN}')
    lines.append('{"rule": "r", "decision": "rejected", "values": {"x": Infinity}}')
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("terminal", [False, True], ids=["pipe", "terminal"])
def test_log_content_is_printed_as_data(tmp_path, terminal):
    path = tmp_path / "rw.jsonl"
    _hostile_log(path)
    env = {"FORCE_COLOR": "1", "TTY_COMPATIBLE": "1", "COLUMNS": "200"} if terminal else {}
    res = k3fuse("log", str(path), env=env)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-3000:]
    out = res.stdout + res.stderr
    assert "\x1b]" not in out, "an escape sequence (hyperlink, title) from the log reached the terminal"
    assert "\x1b[2J" not in out and "\u202e" not in out
    assert "[/]" in res.stdout and "[link=https://evil.example/]click me[/link]" in res.stdout
    assert "\\x1b]8;;https://evil.example/" in res.stdout and "\\u202e" in res.stdout
    assert "skipped 3 malformed line(s): 13, 14, 15" in res.stderr
    assert "nested deeper than" in res.stderr


def test_log_json_is_strict_json(tmp_path):
    path = tmp_path / "rw.jsonl"
    _hostile_log(path)
    huge = [ev("big", "applied", time_ms=1.5e308), ev("big", "applied", time_ms=1.5e308)]  # sums to inf
    with path.open("a") as f:
        f.write("\n".join(huge) + "\n")
    res = k3fuse("log", str(path), "--json")
    assert res.returncode == 0, res.stderr[-3000:]

    def no_constants(name):
        raise AssertionError(f"--json printed {name}, which is not JSON")

    data = json.loads(res.stdout, parse_constant=no_constants)
    assert data["summary"]["big"]["time_ms"] == "inf"
    assert {m["why"] for m in data["malformed_lines"]} >= {"not JSON (NaN is not JSON)",
                                                           "not JSON (Infinity is not JSON)"}


def test_a_log_written_with_a_nan_guard_value_reads_back(tmp_path):
    from k3fuse.log import RewriteLog

    log = RewriteLog(tmp_path / "rw.jsonl")
    log.add(RewriteEvent(rule="r", decision="rejected", values={"scale": float("nan"), "tokens": float("inf")}))
    back = read_jsonl(tmp_path / "rw.jsonl")
    assert not back.malformed and back.log.events[0].values == {"scale": "nan", "tokens": "inf"}


def test_tables_print_whole_values_when_not_on_a_terminal(tmp_path):
    """Issue 53.10: `k3fuse log rw.jsonl | cat` lost the count and rank columns."""
    reason = " ".join(f"word{i}" for i in range(60))
    lines = [ev("some_rule_with_a_long_name", "rejected", rank=r, level="site", guard="tokens", reason=reason,
                values={"tokens": 70, "detail": "x" * 150}) for r in range(8)]
    path = tmp_path / "rw.jsonl"
    path.write_text("\n".join(lines) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}  # a pipe has no width
    res = subprocess.run([str(BIN / "k3fuse"), "log", str(path)], capture_output=True, text=True, env=env,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    row = next(line for line in res.stdout.splitlines() if "some_rule_with_a_long_name" in line and reason in line)
    cells = [c.strip() for c in row.strip("│ ").split("│")]
    assert cells[-2:] == ["8", "0,1,2,3,4,5,6,7"], cells
    assert "…" not in res.stdout
