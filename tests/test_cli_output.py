"""What the commands print while and after they work (issue 53 item 10): `apply` shows progress on
a terminal (and nothing extra in a pipe), the CPU bench says what its timings measure, and piped
tables print whole values."""
from __future__ import annotations

import os
import pty
import subprocess

import pytest
from cli_helpers import BIN, k3fuse, save_programs

pytestmark = pytest.mark.slow


def _read_all(fd: int, proc: subprocess.Popen) -> bytes:
    chunks = []
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:  # the other end closed (Linux: EIO)
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=300)
    return b"".join(chunks)


def test_apply_shows_progress_on_a_terminal_and_nothing_extra_in_a_pipe(tmp_path):
    save_programs(tmp_path)
    master, slave = pty.openpty()
    proc = subprocess.Popen([str(BIN / "k3fuse"), "apply", "tp1.pt2", "-o", "out.pt2"], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=slave, stdin=subprocess.DEVNULL)
    os.close(slave)
    screen = _read_all(master, proc).decode()
    os.close(master)
    assert proc.returncode == 0, screen[-3000:]
    for stage in ("loading torch and the k3fuse rules", "checking and loading tp1.pt2 (", "rewriting for TP 1",
                  "saving out.pt2"):
        assert f"k3fuse apply: {stage}" in screen, (stage, screen[-2000:])
    assert screen.rstrip("\r\n").endswith("\r\x1b[2K")  # erased at the end: the terminal keeps the results alone
    res = k3fuse("apply", "tp1.pt2", "-o", "again.pt2", cwd=tmp_path)
    assert res.returncode == 0 and "k3fuse apply:" not in res.stderr, res.stderr[-2000:]


def test_the_cpu_bench_says_its_timings_measure_the_reference_path(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    res = subprocess.run([str(BIN / "k3fuse"), "bench", "--device", "cpu", "--preset", "tiny", "--layers", "1",
                          "--compiler", "eager", "--batch", "1", "--steps", "1", "--replays", "1", "--arms",
                          "stock,k3fuse", "--no-profile"], capture_output=True, text=True, cwd=tmp_path, env=env,
                         timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert ("on CPU the fused ops run their plain-torch reference path, not the CUDA kernels: these timings check "
            "that the bench runs, they measure no speed-up") in res.stdout
    assert "…" not in res.stdout  # piped: every value whole (issue 53 saw `2218.5-538…`)
