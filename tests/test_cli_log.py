"""`k3fuse log` reads damaged logs, shows reasons and values, and says what it summed (issue 11)."""
from __future__ import annotations

import json

import pytest
from cli_helpers import k3fuse, one_line_error

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
