"""Files k3fuse reads and writes: whole or not at all, through links you own, never into a device by mistake.

Outputs. A regular file is written to a temporary file in the destination's directory and renamed over
it with `os.replace` (atomic on POSIX and Windows): an interrupted or failed write (Ctrl-C, full disk,
a crash) leaves the previous file, never half of a new one. The replacement keeps what the user set
on the old file: its permission bits and, where the process may, its owner. A new file gets the mode
`open` would give it (0666 less the umask). A character device or a FIFO (`-o /dev/null`, a pipe) is
written by opening it, never replaced; any other special file is refused. A failed write raises
`WriteFailed`, an OSError that names the path the caller gave, not the temporary file.

Symlinks. A symlink stays a symlink: the write goes to its target. k3fuse follows a link itself (the
kernel's own protections apply only to links it follows), so it follows only a link that you (or
root) own and that sits in a directory others cannot write: a link owned by someone else, or in a
world-writable directory such as /tmp, could send the write onto a file you did not name
(`UntrustedLink`). An append-only log is opened without following such a link (O_NOFOLLOW).

Inputs are regular files, opened without blocking (a FIFO or /dev/zero would hang or never end).
The path checks run before any work, so a mistake is reported before minutes of compiling, not after.
"""
from __future__ import annotations

import contextlib
import errno
import io
import os
import shutil
import signal
import stat
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from .usage_error import UsageError

#: prefix of temporary files; a process killed by a signal (SIGKILL, SIGABRT) can leave one behind
TEMP_PREFIX = ".k3fuse-tmp-"

#: symlink hops followed before giving up (the kernel's own limit)
MAX_LINK_HOPS = 40


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


class UntrustedLink(OSError):
    """A symlink k3fuse will not write through: someone other than you (or root) owns it, or it sits
    in a world-writable directory, where anyone may plant or swap it."""

    def __init__(self, link: str | os.PathLike[str], why: str):
        super().__init__(errno.EPERM, why, str(link))
        self.why = why

    def __str__(self) -> str:
        return (f"{self.filename} is a symlink {self.why}: k3fuse does not write through it; "
                f"name the file it points to, or a path of your own")


class NotAFile(OSError):
    """A path that must be a regular file (an input, a log) or a writable stream (an output) is not."""

    def __str__(self) -> str:
        return f"{self.filename} is {self.strerror}"


def describe_mode(mode: int) -> str:
    """What kind of file `mode` (st_mode) is, with its article: "a FIFO", "a character device"..."""
    for test, what in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symlink")):
        if test(mode):
            return what
    return "a special file"


def is_stream(mode: int) -> bool:
    """A character device or FIFO: written by opening it (never replaced), read as a stream."""
    return stat.S_ISCHR(mode) or stat.S_ISFIFO(mode)


def _link_distrust(link: Path) -> str | None:
    """Why k3fuse must not follow the symlink `link` itself, or None when it may: a link you or root
    own, in a directory others cannot write (the rule the kernel's protected_symlinks applies to the
    links it follows, made strict: no link in a world-writable directory at all)."""
    owner = os.lstat(link).st_uid
    me = os.geteuid()
    if owner not in (me, 0):
        return f"owned by uid {owner}, not by you (uid {me})"
    directory = link.parent
    mode = os.stat(directory).st_mode
    if mode & stat.S_IWOTH:
        sticky = " sticky" if mode & stat.S_ISVTX else ""
        return f"in the world-writable{sticky} directory {directory}"
    return None


def destination(path: str | os.PathLike[str]) -> Path:
    """The file a write to `path` reaches: `path`, or the end of its chain of symlinks (so the links
    survive), each hop checked (`UntrustedLink`). Only the last path component is resolved here;
    the directories on the way are left to the kernel, with its protections."""
    p = Path(path)
    for _ in range(MAX_LINK_HOPS):
        if not p.is_symlink():
            return p
        why = _link_distrust(p)
        if why is not None:
            raise UntrustedLink(p, why)
        target = Path(os.readlink(p))
        p = target if target.is_absolute() else p.parent / target
    raise OSError(errno.ELOOP, "too many levels of symbolic links", str(path))


def same_file(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """`a` and `b` name the same file, existing or about to be written (through links)."""
    with contextlib.suppress(OSError):
        return os.path.samefile(a, b)
    return os.path.realpath(a) == os.path.realpath(b)


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


# --- what this process wrote, for the message after an interrupt ---------------------------------

_written: list[Path] = []
_appended: set[Path] = set()


def written_files() -> list[Path]:
    """The outputs this process has written whole (renamed into place, or streamed to a device), in
    order: after Ctrl-C the CLI says which files changed."""
    return list(_written)


def appended_files() -> list[Path]:
    """The logs this process has appended to."""
    return sorted(_appended)


@contextlib.contextmanager
def _no_interrupt() -> Iterator[None]:
    """Hold Ctrl-C (SIGINT) for the duration of the block and deliver it afterwards, so that an
    output's rename and the record that it happened are one step. Python runs signal handlers in
    the main thread only, so only there is the handler swapped (elsewhere no SIGINT can land)."""
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, None):
        yield
        return
    held: list[Any] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held and previous is signal.SIG_DFL:
            raise KeyboardInterrupt
        if held and callable(previous):  # Python's default handler raises KeyboardInterrupt
            previous(signal.SIGINT, held[0])


def _commit(tmp: Path, dest: Path) -> None:
    with _no_interrupt():
        os.replace(tmp, dest)
        _written.append(dest)


def _check_writable_kind(dest: Path) -> os.stat_result | None:
    """dest's stat (None when it does not exist); a special file other than a stream is refused."""
    try:
        st = os.stat(dest)
    except FileNotFoundError:
        return None
    if not (stat.S_ISREG(st.st_mode) or is_stream(st.st_mode)):
        raise NotAFile(errno.EINVAL, f"{describe_mode(st.st_mode)}, not a file k3fuse can write", str(dest))
    return st


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path next to `path` (next to its target for a symlink); on a clean exit
    give it the old file's mode and owner and rename it over the old file.

    On any exception (KeyboardInterrupt included) the temporary file is removed and `path` is left
    as it was; an OSError comes out as `WriteFailed` naming `path`. Writers that take a path write to
    the yielded path; a writer that cannot survive a failing write (torch.export.save) should write
    through `write_stream` instead, which also writes to devices and FIFOs (this one refuses them).
    """
    dest = destination(path)
    st = _check_writable_kind(dest)
    if st is not None and is_stream(st.st_mode):
        raise NotAFile(errno.EINVAL, f"{describe_mode(st.st_mode)}: write it with write_stream", str(dest))
    existed = st is not None
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
        _commit(tmp, dest)
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
    """`writer(file)` into `path`: atomically for a regular file (see `atomic_write`), by opening it
    for a character device or FIFO (the writer, which may seek, writes to an anonymous temporary file
    first, copied to the stream once complete). A failed write raises WriteFailed after `writer`
    returns, never inside it."""
    dest = destination(path)
    st = _check_writable_kind(dest)
    if st is not None and is_stream(st.st_mode):
        _write_to_stream(path, dest, writer)
        return Path(path)
    with atomic_write(path) as tmp:
        with open(tmp, "w+b", buffering=0) as raw:
            latched = _LatchedWrites(raw)
            writer(latched)
            if latched.error is not None:
                raise latched.error
    return Path(path)


def _write_to_stream(path: str | os.PathLike[str], dest: Path, writer: Callable[[IO[bytes]], Any]) -> None:
    try:
        with tempfile.TemporaryFile() as spool:
            latched = _LatchedWrites(spool)
            writer(latched)
            if latched.error is not None:
                raise latched.error
            spool.seek(0)
            fd = os.open(dest, os.O_WRONLY | os.O_CLOEXEC)  # no O_CREAT: a vanished device is an error
            with open(fd, "wb") as out:
                if not is_stream(os.fstat(fd).st_mode):
                    raise NotAFile(errno.EINVAL, "no longer a device or FIFO", str(dest))
                shutil.copyfileobj(spool, out, 1 << 20)
            _written.append(dest)
    except NotAFile:
        raise
    except OSError as exc:
        raise WriteFailed(path, exc, True) from exc


def write_text_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write `text` to `path` (see `write_stream`)."""
    data = text.encode()
    return write_stream(path, lambda f: f.write(data))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- reading -------------------------------------------------------------------------------------


def open_regular(path: str | os.PathLike[str], what: str = "input") -> IO[bytes]:
    """Open `path` for reading, refusing anything but a regular file (NotAFile): the open does not
    block (a FIFO without a writer would) and the file is checked after opening, on the opened file."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotAFile(errno.EINVAL, f"{describe_mode(mode)}, not a regular file ({what} must be one)", str(path))
        os.set_blocking(fd, True)
        return open(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


# --- appending (the rewrite log) -----------------------------------------------------------------


def open_append(path: str | os.PathLike[str]) -> int:
    """A file descriptor appending to the log `path` (created 0644 if missing, its directory must
    exist). A symlink is followed only where `destination` trusts it; any other link fails
    (O_NOFOLLOW) as UntrustedLink. A FIFO, socket or device other than a character device is refused
    (NotAFile) without blocking."""
    p = Path(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NONBLOCK | os.O_CLOEXEC
    if p.is_symlink():
        why = _link_distrust(p)
        if why is not None:
            raise UntrustedLink(p, why)
    else:
        flags |= os.O_NOFOLLOW  # a link planted after the check above fails instead of being followed
    try:
        fd = os.open(p, flags, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UntrustedLink(p, "that appeared while the log was being opened") from exc
        if exc.errno == errno.ENXIO:  # a FIFO that no one reads
            raise NotAFile(errno.EINVAL, "a FIFO (named pipe), not a log file", str(p)) from exc
        raise
    mode = os.fstat(fd).st_mode
    if not (stat.S_ISREG(mode) or stat.S_ISCHR(mode)):
        os.close(fd)
        raise NotAFile(errno.EINVAL, f"{describe_mode(mode)}, not a log file", str(p))
    os.set_blocking(fd, True)
    _appended.add(p)
    return fd


# --- checks before any work (UsageError: one line, exit 2) ---------------------------------------


def check_input_file(path: str | os.PathLike[str], what: str = "input") -> Path:
    """`path` is an existing, readable regular file (UsageError otherwise); stat only, never opened
    (opening a FIFO blocks)."""
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise UsageError(f"{what} {p} does not exist", "check the path") from None
    except OSError as exc:
        raise UsageError(f"{what} {p}: {exc.strerror}", "check the path") from None
    if stat.S_ISDIR(st.st_mode):
        raise UsageError(f"{what} {p} is a directory, not a file", "name a file")
    if not stat.S_ISREG(st.st_mode):
        raise UsageError(f"{what} {p} is {describe_mode(st.st_mode)}, not a regular file",
                         "name a file (k3fuse reads whole files, never streams)")
    if not os.access(p, os.R_OK):
        raise UsageError(f"{what} {p} is not readable", "check its permissions")
    return p


def check_output_file(path: str | os.PathLike[str], *, option: str, inputs: Iterable[str | os.PathLike[str]] = (),
                      in_place: bool = False) -> Path:
    """`path` can receive a write: a regular file (or a new one) whose directory exists and is
    writable, or a writable character device or FIFO; a symlink only where k3fuse may follow it;
    not one of `inputs` unless `in_place` (UsageError otherwise)."""
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{option} {p} is a directory", f"give {option} a file name")
    try:
        dest = destination(p)
        st = _check_writable_kind(dest)
    except UntrustedLink as exc:
        raise UsageError(f"{option} {exc}") from None
    except NotAFile as exc:
        raise UsageError(f"{option} {p}: {exc}", f"give {option} a regular file, a character device or a FIFO") \
            from None
    if st is not None and is_stream(st.st_mode):
        if not os.access(dest, os.W_OK):
            raise UsageError(f"cannot write {option} {p} ({describe_mode(st.st_mode)}: permission denied)",
                             f"choose another {option}")
    else:
        parent = dest.parent if str(dest.parent) else Path(".")
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


def check_append_file(path: str | os.PathLike[str], *, option: str,
                      not_same_as: Iterable[tuple[str, str | os.PathLike[str]]] = ()) -> Path:
    """`path` can be appended to (a JSONL log): a regular file or a new one in an existing directory
    (or a character device such as /dev/null), never a FIFO (its open would block until a reader
    came), a symlink k3fuse may not follow, or one of the files in `not_same_as` ((what, path)
    pairs: the input and output of the same run). UsageError otherwise."""
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{option} {p} is a directory", f"give {option} a file name, e.g. {p / 'rewrite.jsonl'}")
    for what, other in not_same_as:
        if other is not None and same_file(p, other):
            raise UsageError(f"{option} {p} is the {what}", f"the log is appended to: give {option} a file of its own")
    if p.is_symlink():
        why = _link_distrust(p)
        if why is not None:
            raise UsageError(f"{option} {UntrustedLink(p, why)}")
    with contextlib.suppress(FileNotFoundError):
        mode = os.stat(p).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISCHR(mode)):
            raise UsageError(f"{option} {p} is {describe_mode(mode)}, not a log file",
                             f"give {option} a regular file (the log is appended to, line by line)")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"the directory of {option} {p} does not exist", f"create {parent} first")
    writable = os.access(p, os.W_OK) if p.exists() else os.access(parent, os.W_OK)
    if not writable:
        raise UsageError(f"cannot write {option} {p} ({_why_not_writable(p.parent if p.exists() else parent)})",
                         f"choose another {option}")
    return p


__all__ = ["atomic_write", "write_stream", "write_text_atomic", "WriteFailed", "UntrustedLink", "NotAFile",
           "destination", "same_file", "open_regular", "open_append", "written_files", "appended_files",
           "describe_mode", "is_stream", "check_input_file", "check_output_file", "check_output_dir",
           "check_append_file", "TEMP_PREFIX"]
