"""The files a run reads and writes (issue 48 item 7, issue 53 items 1, 2, 3, 8 and 10): outputs
through symlinks only where the link is yours, devices and FIFOs written by opening them (never
replaced), inputs and logs that are regular files, a log that is not the input or output, and the
README's claims about files, each in a test that names it.

Each case runs the real `k3fuse` command in a subprocess (or the Python API where the claim is about
the API) and checks the exit status, the one line it prints and the files it leaves. Links owned by
another user need root (os.lchown); this suite runs as root in CI.
"""
from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from cli_helpers import digest, k3fuse, one_line_error

pytestmark = pytest.mark.slow

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="links owned by another user need root (lchown)")
OTHER_UID = 4321


@pytest.fixture()
def work(tmp_path, programs):
    for name in ("tp1", "allreduce"):
        (tmp_path / f"{name}.pt2").write_bytes(programs[name].read_bytes())
    return tmp_path


def _null_device(path: Path) -> Path:
    """A character device node like /dev/null (major 1, minor 3), made here: the tests never point a
    write at the real /dev/null (an old k3fuse replaced it with a regular file)."""
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("mknod needs CAP_MKNOD")
    return path


# --- README: "a symlink stays a symlink"; links that are not yours are refused (48.7) -----------------


def test_readme_claim_a_symlink_stays_a_symlink(work):
    """Through your own link the link's target is replaced and the link stays, for -o and --json."""
    (work / "releases").mkdir()
    target = work / "releases" / "v1.pt2"
    target.write_bytes(b"old program")
    (work / "deploy.pt2").symlink_to("releases/v1.pt2")
    res = k3fuse("apply", "tp1.pt2", "-o", "deploy.pt2", cwd=work)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (work / "deploy.pt2").is_symlink() and os.readlink(work / "deploy.pt2") == "releases/v1.pt2"
    torch.export.load(target)
    from k3fuse.fileio import write_text_atomic

    (work / "report.json").symlink_to(work / "releases" / "report.json")
    write_text_atomic(work / "report.json", "{}")
    assert (work / "report.json").is_symlink() and (work / "releases" / "report.json").read_text() == "{}"


@ROOT_ONLY
@pytest.mark.parametrize("option", ["-o", "--log"])
def test_a_link_owned_by_someone_else_is_not_followed(work, option):
    victim = work / "victim.conf"
    victim.write_text("precious\n")
    link = work / ("out.pt2" if option == "-o" else "rw.jsonl")
    link.symlink_to(victim)
    os.lchown(link, OTHER_UID, OTHER_UID)
    args = ["-o", "out.pt2"] if option == "-o" else ["-o", "x.pt2", "--log", "rw.jsonl"]
    res = k3fuse("apply", "tp1.pt2", *args, cwd=work)
    one_line_error(res, f"{option} {link.name} is a symlink owned by uid {OTHER_UID}")
    assert victim.read_text() == "precious\n" and link.is_symlink()
    assert not (work / "x.pt2").exists()


@ROOT_ONLY
def test_a_dangling_link_owned_by_someone_else_creates_nothing(work):
    link = work / "out.pt2"
    link.symlink_to(work / "planted.pt2")
    os.lchown(link, OTHER_UID, OTHER_UID)
    one_line_error(k3fuse("apply", "tp1.pt2", "-o", "out.pt2", cwd=work), "owned by uid")
    assert not (work / "planted.pt2").exists()


@pytest.mark.parametrize("option", ["-o", "--log"])
def test_a_link_in_a_world_writable_sticky_directory_is_not_followed(work, option):
    shared = work / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # like /tmp
    victim = work / "victim.conf"
    victim.write_text("precious\n")
    link = shared / "out"
    link.symlink_to(victim)
    args = ["-o", str(link)] if option == "-o" else ["-o", "x.pt2", "--log", str(link)]
    res = k3fuse("apply", "tp1.pt2", *args, cwd=work)
    one_line_error(res, f"{option} {link} is a symlink in the world-writable sticky directory")
    assert victim.read_text() == "precious\n"


@ROOT_ONLY
def test_k3fuse_log_opens_without_following_a_link_that_is_not_yours(work):
    """K3FUSE_LOG and RewriteLog append with O_NOFOLLOW semantics where the link is not the caller's."""
    victim = work / "victim.conf"
    victim.write_text("precious\n")
    link = work / "rw.jsonl"
    link.symlink_to(victim)
    os.lchown(link, OTHER_UID, OTHER_UID)
    code = ("import torch, k3fuse\n"
            "ep = torch.export.export(torch.nn.Linear(64, 64), (torch.randn(4, 64),))\n"
            "k3fuse.apply(ep, k3fuse.DecodeContext())\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=work, timeout=300,
                         env={**os.environ, "K3FUSE_LOG": str(link)})
    assert res.returncode != 0 and "is a symlink owned by uid" in res.stderr, res.stderr[-2000:]
    assert victim.read_text() == "precious\n"


# --- devices and FIFOs are written by opening them, other special files refused (53.1) ---------------


def test_an_output_that_is_a_character_device_stays_one(work):
    dev = _null_device(work / "null")
    res = k3fuse("apply", "tp1.pt2", "-o", str(dev), "--log", "rw.jsonl", cwd=work)
    assert res.returncode == 0, res.stderr[-3000:]
    assert stat.S_ISCHR(os.stat(dev).st_mode), "the device was replaced by a regular file"
    assert "written through, nothing replaced" in res.stdout
    from k3fuse.fileio import write_text_atomic

    write_text_atomic(dev, '{"bench": 1}')  # what demo/bench/validate --json do
    assert stat.S_ISCHR(os.stat(dev).st_mode)


def test_an_output_that_is_a_fifo_receives_the_program(work):
    fifo = work / "pipe.pt2"
    os.mkfifo(fifo)
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()), daemon=True)
    reader.start()
    res = k3fuse("apply", "tp1.pt2", "-o", str(fifo), cwd=work)
    reader.join(60)
    assert res.returncode == 0, res.stderr[-3000:]
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    (work / "received.pt2").write_bytes(received[0])
    torch.export.load(work / "received.pt2")


def test_an_output_that_is_a_socket_is_refused(work):
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(work / "s.pt2"))
    try:
        one_line_error(k3fuse("apply", "tp1.pt2", "-o", "s.pt2", cwd=work), "-o s.pt2", "a socket")
        assert stat.S_ISSOCK(os.stat(work / "s.pt2").st_mode)
    finally:
        sock.close()


# --- inputs and logs that never end (53.8) -----------------------------------------------------------


def test_a_fifo_as_input_is_refused_at_once(work):
    os.mkfifo(work / "in.pt2")
    t0 = time.monotonic()
    one_line_error(k3fuse("apply", "in.pt2", "-o", "out.pt2", cwd=work, timeout=60),
                   "input program in.pt2 is a FIFO (named pipe), not a regular file")
    one_line_error(k3fuse("log", "in.pt2", cwd=work, timeout=60), "log file in.pt2 is a FIFO")
    assert time.monotonic() - t0 < 60


def _limit_memory() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))  # an endless read fails here, not the machine


def test_an_endless_device_as_input_is_refused_at_once(work):
    try:
        os.mknod(work / "zero", stat.S_IFCHR | 0o444, os.makedev(1, 5))  # like /dev/zero
    except PermissionError:
        pytest.skip("mknod needs CAP_MKNOD")
    res = subprocess.run([str(Path(sys.executable).parent / "k3fuse"), "log", "zero"], capture_output=True,
                         text=True, cwd=work, timeout=60, preexec_fn=_limit_memory)
    one_line_error(res, "log file zero is a character device, not a regular file")
    one_line_error(k3fuse("apply", "zero", "-o", "out.pt2", cwd=work, timeout=60),
                   "input program zero is a character device")


def test_a_fifo_as_the_log_is_refused_and_nothing_hangs(work):
    os.mkfifo(work / "rw.jsonl")
    res = k3fuse("apply", "tp1.pt2", "-o", "out.pt2", "--log", "rw.jsonl", cwd=work, timeout=120)
    one_line_error(res, "--log rw.jsonl is a FIFO")
    assert not (work / "out.pt2").exists()


def test_the_api_refuses_a_fifo_log_without_blocking(tmp_path):
    from k3fuse.fileio import NotAFile
    from k3fuse.log import RewriteEvent, RewriteLog

    os.mkfifo(tmp_path / "rw.jsonl")
    log = RewriteLog(tmp_path / "rw.jsonl")
    with pytest.raises(NotAFile, match="FIFO"):
        log.add(RewriteEvent(rule="r", decision="applied"))


# --- --log is not the input or the output (53.2) -------------------------------------------------------


@pytest.mark.parametrize("log,what", [("tp1.pt2", "input program"), ("out.pt2", "output (-o)"),
                                      ("link.pt2", "input program")])
def test_the_log_may_not_be_the_input_or_the_output(work, log, what):
    (work / "link.pt2").symlink_to("tp1.pt2")
    before = digest(work / "tp1.pt2")
    one_line_error(k3fuse("apply", "tp1.pt2", "-o", "out.pt2", "--log", log, cwd=work), f"--log {log} is the {what}")
    assert digest(work / "tp1.pt2") == before and not (work / "out.pt2").exists()


# --- flags that were silently misread (53.3, 53.10) -----------------------------------------------------


def test_a_group_name_the_graph_does_not_use_is_an_error(work):
    res = k3fuse("apply", "allreduce.pt2", "-o", "out.pt2", "--tp", "2", "--group-name", "nosuch", cwd=work)
    one_line_error(res, "--group-name 'nosuch' is not a group the graph's collectives use; they use '0'")
    assert not (work / "out.pt2").exists()
    one_line_error(k3fuse("apply", "tp1.pt2", "-o", "out.pt2", "--group-name", "0", cwd=work),
                   "the graph has no collectives")


def test_in_place_with_another_output_is_an_error(work):
    before = digest(work / "tp1.pt2")
    one_line_error(k3fuse("apply", "tp1.pt2", "-o", "out.pt2", "--in-place", cwd=work),
                   "--in-place replaces the input, but -o names another file")
    assert digest(work / "tp1.pt2") == before and not (work / "out.pt2").exists()


def test_apply_batch_points_to_tokens(work):
    one_line_error(k3fuse("apply", "tp1.pt2", "-o", "out.pt2", "--batch", "8", cwd=work),
                   "apply --batch", "--tokens LO-HI")


def test_the_api_creates_no_missing_directory(tmp_path):
    """The CLI refuses an output in a missing directory; the API does too, for the log and the program."""
    from k3fuse import DecodeContext, apply
    from k3fuse.fileio import WriteFailed
    from k3fuse.offline import save_program

    ep = torch.export.export(torch.nn.Linear(64, 64), (torch.randn(4, 64),))
    missing = tmp_path / "nonexist"
    with pytest.raises(OSError, match="cannot append to the rewrite log: No such file or directory"):
        apply(ep, DecodeContext(), log=missing / "rw.jsonl")
    with pytest.raises(WriteFailed):
        save_program(ep, missing / "out.pt2")
    assert not missing.exists()
    (tmp_path / "x.pt2").write_bytes(b"")
    one_line_error(k3fuse("apply", "x.pt2", "-o", "o.pt2", "--log", str(missing / "rw.jsonl"), cwd=tmp_path),
                   f"the directory of --log {missing / 'rw.jsonl'} does not exist")
    assert not missing.exists()


# --- README: "never half-written" -----------------------------------------------------------------------


# A save that stops half-way through its bytes: the error is injected at the one call that writes
# output bytes (k3fuse.fileio.write_bytes), after some of the program reached the temporary file.
HALF_WRITTEN = """
import errno, sys
import k3fuse.fileio, k3fuse.tools.cli
real, calls = k3fuse.fileio.write_bytes, []
def failing(f, data):
    calls.append(1)
    if len(calls) > 3:
        raise OSError(errno.EIO, "Input/output error")
    return real(f, data)
k3fuse.fileio.write_bytes = failing
sys.exit(k3fuse.tools.cli.main(sys.argv[1:]))
"""


def test_readme_claim_files_are_never_half_written(work):
    """Whatever stops a write (here an I/O error after part of the bytes went out), the destination
    holds the old file or nothing, never a prefix of the new one; the temporary file is gone."""
    (work / "out.pt2").write_bytes(b"old program")
    for out in ("out.pt2", "new.pt2"):
        res = subprocess.run([sys.executable, "-c", HALF_WRITTEN, "apply", "tp1.pt2", "-o", out],
                             capture_output=True, text=True, cwd=work, timeout=300)
        one_line_error(res, f"could not save {out}: Input/output error")
        assert not [p for p in work.iterdir() if p.name.startswith(".k3fuse-tmp-")]
    assert (work / "out.pt2").read_bytes() == b"old program" and not (work / "new.pt2").exists()
