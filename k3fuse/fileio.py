"""Files the CLI produces are written whole or not at all.

Every output goes to a temporary file in the destination's directory and is then renamed over the
destination with `os.replace` (atomic on POSIX and Windows): an interrupted or failed write
(Ctrl-C, full disk, a crash) leaves the previous file, never half of a new one. The replacement
keeps what the user set on the old file: its permission bits and, where the process may, its owner;
a symlink stays a symlink (the write goes to its target). A new file gets the mode `open` would give
it (0666 less the umask). A failed write raises `WriteFailed`, an OSError that names the path the
caller gave, not the temporary file. The path checks run before any work, so a mistake is reported
before minutes of compiling, not after.
"""
from __future__ import annotations

import contextlib
import io
import os
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from .usage_error import UsageError

#: prefix of temporary files; a process killed by a signal (SIGKILL, SIGABRT) can leave one behind
TEMP_PREFIX = ".k3fuse-tmp-"


class WriteFailed(OSError):
    """Writing `filename` failed (full disk, read-only filesystem, no permission); whatever was there
    before is untouched. `str()` is one line: the path, the system's reason, what was kept."""

    def __init__(self, path: str | os.PathLike[str], cause: OSError, existed: bool):
        super().__init__(cause.errno, cause.strerror or str(cause), str(path))
        self.existed = existed

    @property
    def kept(self) -> str:
        return f"{self.filename} was left as it was" if self.existed else f"{self.filename} was not created"

    def __str__(self) -> str:
        return f"could not write {self.filename}: {self.strerror}; {self.kept}"


def destination(path: str | os.PathLike[str]) -> Path:
    """The file a write to `path` replaces: a symlink's target (so the link survives), else `path`."""
    p = Path(path)
    return Path(os.path.realpath(p)) if p.is_symlink() else p


def _umask() -> int:
    mask = os.umask(0o22)
    os.umask(mask)
    return mask


def _take_over_metadata(tmp: Path, dest: Path) -> None:
    """Give `tmp` the mode (and owner, where allowed) of `dest`, or a new file's mode."""
    try:
        st = dest.stat()
    except FileNotFoundError:
        os.chmod(tmp, 0o666 & ~_umask())
        return
    os.chmod(tmp, stat.S_IMODE(st.st_mode))
    if (st.st_uid, st.st_gid) != (os.getuid(), os.getgid()) and hasattr(os, "chown"):
        with contextlib.suppress(PermissionError):  # only root (or the owner, for the group) may
            os.chown(tmp, st.st_uid, st.st_gid)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path next to `path` (next to its target for a symlink); on a clean exit
    give it the old file's mode and owner and rename it over the old file.

    On any exception (KeyboardInterrupt included) the temporary file is removed and `path` is left
    as it was; an OSError comes out as `WriteFailed` naming `path`. Writers that take a path write to
    the yielded path; a writer that cannot survive a failing write (torch.export.save) should write
    through `write_stream` instead.
    """
    dest = destination(path)
    existed = dest.exists()
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=TEMP_PREFIX + dest.name + ".", suffix=dest.suffix,
                                         dir=dest.parent or Path("."))  # same suffix: torch.export.save checks it
    except OSError as exc:
        raise WriteFailed(path, exc, existed) from exc
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        _take_over_metadata(tmp, dest)
        _fsync(tmp)
        os.replace(tmp, dest)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(exc, OSError) and not isinstance(exc, WriteFailed):
            raise WriteFailed(path, exc, existed) from exc
        raise


class _LatchedWrites(io.RawIOBase):
    """A file for writers whose C++ side aborts the process when a write fails mid-stream
    (torch.export.save ends in `terminate called` on a full disk): the first error (OSError, or a
    Ctrl-C that lands in a write) is kept and later writes are dropped, so the writer finishes
    normally and the error is raised after it."""

    def __init__(self, f: IO[bytes]):
        super().__init__()
        self._f = f
        self.error: BaseException | None = None

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def readinto(self, buffer: Any) -> int:
        return self._f.readinto(buffer)  # type: ignore[attr-defined]

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if self.error is None:
            try:
                while view:
                    view = view[write_bytes(self._f, view):]
            except BaseException as exc:  # noqa: B036  (raised again by write_stream, after the writer)
                self.error = exc
        return len(memoryview(data).cast("B"))


def write_bytes(f: IO[bytes], data: memoryview) -> int:
    """One write of `data` to `f` (the one place output bytes reach the filesystem)."""
    return f.write(data)  # type: ignore[return-value]


def write_stream(path: str | os.PathLike[str], writer: Callable[[IO[bytes]], Any]) -> Path:
    """`writer(file)` into `path` atomically; a failed write raises WriteFailed after `writer`
    returns, never inside it."""
    with atomic_write(path) as tmp:
        with open(tmp, "w+b", buffering=0) as raw:
            latched = _LatchedWrites(raw)
            writer(latched)
            if latched.error is not None:
                raise latched.error
    return Path(path)


def write_text_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write `text` to `path` atomically (see `atomic_write`)."""
    data = text.encode()
    return write_stream(path, lambda f: f.write(data))


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
    parent = destination(p).parent if str(destination(p).parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"the directory of {option} {p} does not exist", f"create {parent} first")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"cannot write to the directory of {option} {p} ({_why_not_writable(parent)})",
                         f"choose another {option}")
    if not in_place:
        for src in inputs:
            if Path(src).exists() and p.exists() and os.path.samefile(src, p):
                raise UsageError(f"{option} {p} is the input file",
                                 "choose another output, or pass --in-place to replace the input "
                                 "(atomically: an interrupted run leaves it intact)")
    return p


def _why_not_writable(directory: Path) -> str:
    with contextlib.suppress(OSError):
        if os.statvfs(directory).f_flag & os.ST_RDONLY:
            return "read-only filesystem"
    return "permission denied"


def check_output_dir(path: str | os.PathLike[str], *, option: str) -> Path:
    """`path` is a directory that exists or can be created, and is writable (UsageError otherwise)."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise UsageError(f"{option} {p} is a file, not a directory", f"give {option} a directory (created if missing)")
    ancestor = p
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UsageError(f"{option} {p}: {ancestor} is not a directory", f"choose another {option}")
    if not os.access(ancestor, os.W_OK):
        raise UsageError(f"cannot write {option} {p} ({_why_not_writable(ancestor)})", f"choose another {option}")
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
        raise UsageError(f"cannot write {option} {p} ({_why_not_writable(p.parent if p.exists() else ancestor)})",
                         f"choose another {option}")
    return p


__all__ = ["atomic_write", "write_stream", "write_text_atomic", "WriteFailed", "destination", "check_input_file",
           "check_output_file", "check_output_dir", "check_append_file", "TEMP_PREFIX"]
