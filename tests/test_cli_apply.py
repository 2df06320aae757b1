"""`k3fuse apply` never loses a file and answers every mistake in one line (issue 11).

Each case runs the real command in a subprocess and checks the exit status, the one-line message
and that the input (and any existing output) is byte-for-byte what it was.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from cli_helpers import digest, k3fuse, one_line_error

from k3fuse.tools.cli import decide_tp
from k3fuse.usage_error import UsageError

pytestmark = pytest.mark.slow


@pytest.fixture()
def work(tmp_path, programs):
    """Copies of the programs in a fresh directory, with their digests."""
    copies = {}
    for name, src in programs.items():
        dst = tmp_path / src.name
        dst.write_bytes(src.read_bytes())
        copies[name] = dst
    return copies


BAD_ARGS = [
    (["missing.pt2", "-o", "out.pt2"], ["missing.pt2 does not exist"]),
    (["notes.pt2", "-o", "out.pt2"], ["notes.pt2 is not a program saved with torch.export.save"]),
    (["tp1.pt2", "-o", "no/such/dir/out.pt2"], ["directory of -o", "does not exist"]),
    (["tp1.pt2", "-o", "out.pt2", "--tp", "0"], ["--tp", "positive integer"]),
    (["tp1.pt2", "-o", "out.pt2", "--tokens", "70-80"], ["bad token range 70-80"]),
    (["allreduce.pt2", "-o", "out.pt2", "--tp", "2", "--rank", "5"], ["--rank 5 is outside --tp 2"]),
    (["tp1.pt2", "-o", "out.pt2", "--log", "."], ["--log . is a directory"]),
    (["tp1.pt2", "-o", "out.pt2", "--rules", "no_such_rule"], ["unknown rule name(s) ['no_such_rule']"]),
    (["tp1.pt2", "-o", "tp1.pt2"], ["is the input file", "--in-place"]),
    (["tp1.pt2"], ["no output given", "--in-place"]),
    (["tp1.pt2", "-o", "out.pt2", "--tp", "2"], ["--tp 2 but the graph has no collectives"]),
    (["allreduce.pt2", "-o", "out.pt2"], ["whose size it does not record", "pass --tp N"]),
    (["allreduce.pt2", "-o", "out.pt2", "--tp", "1"], ["--tp 1 but the graph holds collectives"]),
    (["gather2.pt2", "-o", "out.pt2", "--tp", "3"], ["--tp 3 but the graph's collectives run over group '0' (size 2)",
                                                     "pass --tp 2"]),
]


@pytest.mark.parametrize("args,fragments", BAD_ARGS, ids=[" ".join(a) for a, _ in BAD_ARGS])
def test_mistake_is_one_line_exit_2_and_no_file_lost(work, args, fragments):
    d = work["tp1"].parent
    (d / "notes.pt2").write_text("these are notes, not a program\n")
    before = {p.name: digest(p) for p in d.iterdir()}
    one_line_error(k3fuse("apply", *args, cwd=d), *fragments)
    assert {p.name: digest(p) for p in d.iterdir()} == before  # nothing lost, nothing half-written


def test_unknown_rule_from_env_is_one_line(work):
    one_line_error(k3fuse("apply", "tp1.pt2", "-o", "out.pt2", cwd=work["tp1"].parent, env={"K3FUSE_RULES": "nope"}),
                   "K3FUSE_RULES names unknown rule(s) ['nope']")


def test_debug_shows_the_traceback(work):
    res = k3fuse("apply", "missing.pt2", "-o", "out.pt2", "--debug", cwd=work["tp1"].parent)
    assert res.returncode != 0 and "Traceback" in res.stderr and "UsageError" in res.stderr


def test_tp_read_from_the_graph_and_said(work):
    d = work["gather2"].parent
    res = k3fuse("apply", "gather2.pt2", "-o", "out.pt2", "--log", "rw.jsonl", cwd=d)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "TP 2 read from the graph's collectives over group '0' (size 2)" in res.stdout
    assert torch.export.load(d / "out.pt2") is not None
    assert all(json.loads(x)["rank"] == 0 for x in (d / "rw.jsonl").read_text().splitlines())


def test_existing_output_is_replaced_atomically_and_in_place_needs_the_flag(work):
    d = work["tp1"].parent
    (d / "out.pt2").write_text("old output")
    res = k3fuse("apply", "tp1.pt2", "-o", "out.pt2", cwd=d)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "replaced out.pt2 atomically" in res.stdout
    torch.export.load(d / "out.pt2")
    res = k3fuse("apply", "tp1.pt2", "--in-place", cwd=d)
    assert res.returncode == 0, res.stderr[-3000:]
    torch.export.load(d / "tp1.pt2")
    assert not [p for p in d.iterdir() if p.name.startswith(".k3fuse-tmp-")]


# A save that dies half-way: Ctrl-C, or a full disk, after writing part of the file (the error is
# injected at the one call that writes output bytes, inside torch.export.save's stream).
INTERRUPTED_SAVE = """
import sys, errno
import k3fuse.fileio, k3fuse.tools.cli
real = k3fuse.fileio.write_bytes
written = []
def broken_write(f, data):
    if written:
        if sys.argv[1] == "ctrl-c":
            raise KeyboardInterrupt
        raise OSError(errno.ENOSPC, "No space left on device")
    written.append(len(data))
    return real(f, data)
k3fuse.fileio.write_bytes = broken_write
sys.exit(k3fuse.tools.cli.main(sys.argv[2:]))
"""


@pytest.mark.parametrize("how,status,message", [("ctrl-c", 130, "interrupted; no output file was changed"),
                                                 ("disk-full", 2, "No space left on device; out.pt2 was left as it was")])
@pytest.mark.parametrize("in_place", [False, True], ids=["to-output", "in-place"])
def test_interrupted_save_leaves_old_files_whole(work, how, status, message, in_place):
    d = work["tp1"].parent
    (d / "out.pt2").write_bytes(work["tp1"].read_bytes())  # an existing good output
    before = {p.name: digest(p) for p in d.iterdir()}
    out_args = ["--in-place"] if in_place else ["-o", "out.pt2"]
    res = subprocess.run([sys.executable, "-c", INTERRUPTED_SAVE, how, "apply", "tp1.pt2", *out_args],
                         capture_output=True, text=True, cwd=d, timeout=300)
    assert res.returncode == status, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert message.replace("out.pt2", "tp1.pt2" if in_place else "out.pt2") in last
    assert {p.name: digest(p) for p in d.iterdir()} == before  # no temp file left, nothing changed
    torch.export.load(d / ("tp1.pt2" if in_place else "out.pt2"))


def test_decide_tp_rules():
    assert decide_tp(None, {}) == (1, "TP 1: the graph has no collectives")
    assert decide_tp(None, {"0": 2})[0] == 2
    assert decide_tp(2, {"0": None})[1].startswith("TP 2 from --tp, which could not be checked")
    assert decide_tp(2, {"0": 2}) == (2, "TP 2 from --tp (matches the graph)")
    with pytest.raises(UsageError, match="different sizes"):
        decide_tp(None, {"0": 2, "1": 4})


def test_reference_model_export_loads_without_a_logging_error_block(tmp_path):
    """The K3 reference model's example inputs hold a DecodeState: no "--- Logging error ---"."""
    code = ("import torch, k3fuse\nfrom k3fuse.model import K3DecodeStack, get_config\n"
            "m = K3DecodeStack(get_config('tiny', n_layers=1), seed=0).eval()\n"
            "x = torch.randn(2, m.config.hidden)\n"
            f"torch.export.save(torch.export.export(m, (x, m.init_state(2))), {str(tmp_path / 'k3.pt2')!r})\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
    # a fresh process: only `k3fuse apply` registers anything before loading
    res = k3fuse("apply", "k3.pt2", "-o", "out.pt2", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Logging error" not in res.stderr and "Traceback" not in res.stderr, res.stderr[-3000:]
    res = subprocess.run([sys.executable, "-c", "import torch, k3fuse.model; torch.export.load('k3.pt2')"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert res.returncode == 0 and "Logging error" not in res.stderr, res.stderr[-3000:]
