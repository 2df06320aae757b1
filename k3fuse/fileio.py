"""Files the CLI produces are written whole or not at all.

Every output goes to a temporary file in the destination's directory and is then renamed over the
destination with `os.replace` (atomic on POSIX and Windows): an interrupted or failed write
(Ctrl-C, full disk, a crash) leaves the previous file, never half of a new one. The path checks run
before any work, so a mistake is reported before minutes of compiling, not after.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from .usage import UsageError

#: prefix of temporary files; a process killed by a signal (SIGKILL, SIGABRT) can leave one behind
TEMP_PREFIX = ".k3fuse-tmp-"


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path next to `path`; on a clean exit rename it over `path`.

    On any exception (KeyboardInterrupt included) the temporary file is removed and `path` is left
    as it was. Writers that take a path (torch.export.save) write to the yielded path.
    """
    dest = Path(path)
    fd, tmp_name = tempfile.mkstemp(prefix=TEMP_PREFIX + dest.name + ".", suffix=dest.suffix,
                                     dir=dest.parent or Path("."))  # same suffix: torch.export.save checks it
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        _fsync(tmp)
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def write_text_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write `text` to `path` atomically (see `atomic_write`)."""
    with atomic_write(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_input_file(path: str | os.PathLike[str], what: str = "input") -> Path:
    """`path` is an existing, readable regular file (UsageError otherwise)."""
    p = Path(path)
    if not p.exists():
        raise UsageError(f"{what} {p} does not exist", "check the path")
    if p.is_dir():
        raise UsageError(f"{what} {p} is a directory, not a file", "name a file")
    if not os.access(p, os.R_OK):
        raise UsageError(f"{what} {p} is not readable", "check its permissions")
    return p


def check_output_file(path: str | os.PathLike[str], *, option: str, inputs: Iterable[str | os.PathLike[str]] = (),
                      in_place: bool = False) -> Path:
    """`path` can receive an atomic write: its directory exists and is writable, it is not a
    directory, and it is not one of `inputs` unless `in_place` (UsageError otherwise)."""
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{option} {p} is a directory", f"give {option} a file name")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"the directory of {option} {p} does not exist", f"create {parent} first")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"cannot write to the directory of {option} {p}", "check its permissions")
    if not in_place:
        for src in inputs:
            if Path(src).exists() and p.exists() and os.path.samefile(src, p):
                raise UsageError(f"{option} {p} is the input file",
                                 "choose another output, or pass --in-place to replace the input "
                                 "(atomically: an interrupted run leaves it intact)")
    return p


def check_append_file(path: str | os.PathLike[str], *, option: str) -> Path:
    """`path` can be appended to (a JSONL log): not a directory, its directory exists or can be made."""
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{option} {p} is a directory", f"give {option} a file name, e.g. {p / 'rewrite.jsonl'}")
    ancestor = p.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UsageError(f"{option} {p}: {ancestor} is not a directory", f"choose another {option} path")
    writable = os.access(p, os.W_OK) if p.exists() else os.access(ancestor, os.W_OK)
    if not writable:
        raise UsageError(f"cannot write {option} {p}", "check its permissions")
    return p


__all__ = ["atomic_write", "write_text_atomic", "check_input_file", "check_output_file", "check_append_file",
           "TEMP_PREFIX"]
