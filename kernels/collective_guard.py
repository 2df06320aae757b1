"""Cross-rank safety of every collective op (fused kernels, reference and stock paths alike).

Why a module of its own: the ranks of a TP group must take the same path through each collective
call and must all stop when one of them fails; that is one protocol for every collective op, so
dispatch and the fused workspaces (collective.py) call it instead of each op keeping a copy.

- Agreement: the first collective call on a group (every rank makes it: the graphs are the same)
  gathers everything that decides a rank's path (`path_facts`: the kill switch, strict mode,
  K3FUSE_DISABLE_CUTE / _TRITON, kernel modules that failed to import, K3FUSE_AR_PROTOCOL, ...)
  and raises one `CollectiveSettingsError` on every rank naming each setting and the ranks' values
  when they differ. After that the agreed values decide the group's path: a later toggle of the
  kill switch or a path variable on a rank is refused for the collective ops, with one warning
  naming it; `reagree(group_name)` (collective: every rank calls it) applies a change to the whole
  group. Strict mode may change per rank later: a collective op's strict fallback raises after its
  stock sequence ran, so its collective has paired on every rank either way.
- World size: an op whose world_size differs from its group's size raises on every rank and every
  path (stock, reference, fused), before any collective.
- Failure board: a few bytes of host shared memory per group (the ranks of a symmetric-memory group
  share a host), one slot per rank. A rank whose collective call fails at any point posts the
  reason there; every rank checks the board at the start of each collective call and raises
  `CollectivePeerError` naming the failed rank and its reason. A failed group stays failed (its
  buffers may hold partial sums): restart the TP group.
- `check_collectives()`: the post-step check (after CUDA-graph replays: the device error words of
  the fused workspaces are mirrored to pinned memory inside the graph); the torch.compile door runs
  it after every compiled call, bench / validate / the examples after each step.
Every collective error is counted in `k3fuse.stats()` as "error:<kind>" under its op.
"""
from __future__ import annotations

import mmap
import os
import socket
import struct
import tempfile
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from k3fuse import runtime, settings

from .dispatch import K3FuseCollectiveError


class CollectiveError(K3FuseCollectiveError):
    """A collective op failed; raised on every rank (never a per-rank fallback)."""


class CollectiveTimeoutError(CollectiveError):
    """A peer never arrived within K3FUSE_AR_TIMEOUT_S (or a peer reported a failure)."""

    kind = "timeout"


class CollectivePeerError(CollectiveTimeoutError):
    """A rank of the group (a peer, or this one earlier) failed in a collective call: every later
    collective call of this rank on the group raises this."""

    kind = "peer failure"


class CollectiveSettingsError(CollectiveError):
    """The ranks of a group disagree on a setting that decides their path (raised on every rank)."""

    kind = "settings mismatch"


#: K3FUSE_* variables that decide which path a collective op takes (or which rewrites exist)
PATH_SETTINGS: tuple[str, ...] = ("K3FUSE_RULES", "K3FUSE_DISABLE_CUTE", "K3FUSE_DISABLE_TRITON",
                                  "K3FUSE_AR_PROTOCOL", "K3FUSE_AR_PDL", "K3FUSE_GEMV_MAX_M",
                                  "K3FUSE_AR_START_GENERATION")
KILL_SWITCH = "kill switch (K3FUSE_DISABLE / k3fuse.disable())"
STRICT = "strict mode (K3FUSE_STRICT / k3fuse.strict())"
IMPORTS = "kernel modules that failed to import"
TOOLCHAIN = "kernel toolchain versions"


def path_facts(device_type: str) -> dict[str, Any]:
    """Everything that decides this rank's path through a collective op on `device_type`."""
    facts: dict[str, Any] = {KILL_SWITCH: runtime.is_disabled(), STRICT: runtime.is_strict()}
    facts.update({name: settings.get(name) for name in PATH_SETTINGS})
    if device_type == "cuda":
        from . import dispatch

        dispatch.load_gpu_impls()
        facts[IMPORTS] = sorted(dispatch.import_errors())
        facts[TOOLCHAIN] = _toolchain()
    return facts


def _toolchain() -> str:
    versions = [f"torch {torch.__version__}"]
    for module in ("triton", "cutlass"):
        try:
            versions.append(f"{module} {__import__(module).__version__}")
        except Exception:
            versions.append(f"{module} absent")
    return ", ".join(versions)


def _mutable_facts() -> dict[str, Any]:
    """The facts a process can change after the agreement (read per call: cheap)."""
    facts: dict[str, Any] = {KILL_SWITCH: runtime.is_disabled(), STRICT: runtime.is_strict()}
    facts.update({name: settings.get(name) for name in PATH_SETTINGS})
    return facts


# --- the failure board ------------------------------------------------------------------------------
_SLOT = 512            # bytes per rank: int32 state (0 ok, 1 failed), int32 length, the reason (utf-8)
_HEAD = struct.Struct("<ii")


class FailureBoard:
    """Host shared memory with one slot per rank of a group (created collectively).

    A file under /dev/shm (or the temp dir), mapped by every rank and unlinked once every rank
    has mapped it, so nothing is left behind however the processes end."""

    def __init__(self, rank: int, world: int, mapping: mmap.mmap):
        self.rank, self.world, self.map = rank, world, mapping

    @classmethod
    def create(cls, group: dist.ProcessGroup, rank: int, world: int) -> FailureBoard | None:
        """The group's board (collective), or None on every rank when some rank cannot map it
        (e.g. no shared /dev/shm): the device error words then carry the failures alone."""
        path, mapping = None, None
        if rank == 0:
            try:
                root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
                fd, path = tempfile.mkstemp(prefix="k3fuse-board-", dir=root)
                os.ftruncate(fd, _SLOT * world)
                os.close(fd)
            except OSError:
                path = None
        box = [path]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        if box[0] is not None:
            try:
                fd = os.open(box[0], os.O_RDWR)
                try:
                    mapping = mmap.mmap(fd, _SLOT * world)
                finally:
                    os.close(fd)
            except OSError:
                mapping = None
        mapped: list = [None] * world
        dist.all_gather_object(mapped, mapping is not None, group=group)
        if rank == 0 and box[0] is not None:
            os.unlink(box[0])   # every rank has mapped it (or given up): nothing left behind
        if not all(mapped):
            return None
        return cls(rank, world, mapping)

    def post(self, reason: str) -> None:
        """Mark this rank failed (the reason first, the state word last)."""
        data = reason.encode("utf-8", "replace")[:_SLOT - _HEAD.size]
        base = self.rank * _SLOT
        self.map[base + _HEAD.size:base + _HEAD.size + len(data)] = data
        _HEAD.pack_into(self.map, base, 1, len(data))

    def failed(self) -> tuple[int, str] | None:
        """(rank, reason) of the first failed rank, or None."""
        for r in range(self.world):
            state, length = _HEAD.unpack_from(self.map, r * _SLOT)
            if state:
                start = r * _SLOT + _HEAD.size
                return r, bytes(self.map[start:start + length]).decode("utf-8", "replace")
        return None


# --- per-group state ----------------------------------------------------------------------------------
@dataclass
class GroupState:
    """What this process knows about one group's collectives."""

    name: str
    world: int
    rank: int
    group: dist.ProcessGroup | None
    facts: dict[str, Any]
    board: FailureBoard | None = None
    failed: str | None = None            # this rank's own failure (the first)
    refused: set[str] = field(default_factory=set)
    initialized: bool = False            # torch.distributed was initialized at creation

    @property
    def disabled(self) -> bool:
        """The kill switch for this group's collective ops: the agreed one (a single rank has no
        peer to diverge from, so it follows its own switch)."""
        return runtime.is_disabled() if self.world == 1 else bool(self.facts.get(KILL_SWITCH))


    def describe(self) -> str:
        return f"rank {self.rank} of group {self.name!r}"

    def raise_if_failed(self, op: str) -> None:
        """Raise if this rank or a peer failed in a collective call on this group."""
        if self.failed is not None:
            raise CollectivePeerError(f"k3fuse.{op}: {self.describe()}: an earlier collective call "
                                      f"failed ({self.failed}); the group stays failed (its buffers may "
                                      "hold partial sums): restart the TP group")
        if self.board is None:
            return
        hit = self.board.failed()
        if hit is not None:
            peer, reason = hit
            self.failed = f"rank {peer} failed: {reason}"
            runtime.record_collective_error(op, "peer failure")
            raise CollectivePeerError(f"k3fuse.{op}: {self.describe()}: peer rank {peer} of the group "
                                      f"failed in a collective call ({reason}); no rank continues on "
                                      "partial data: restart the TP group")

    def fail(self, op: str, reason: str, kind: str = "failure") -> None:
        """This rank failed in a collective call: remember it and tell every peer (never raises)."""
        if self.failed is not None:
            return
        self.failed = reason
        runtime.record_collective_error(op, kind)
        if self.board is not None:
            try:
                self.board.post(f"k3fuse.{op}: {reason}"[:400])
            except Exception:
                pass
        # a failure outside the fused workspaces (e.g. before dispatch reached a kernel) still
        # stops the peers' current spins: every fused workspace of the group fails too
        import sys

        sw = sys.modules.get(__package__ + ".collective")
        if sw is not None:
            sw.fail_group(self.name, op, reason, kind)

    def check_toggles(self, op: str) -> None:
        """A path setting changed on this rank since the agreement: refused (warned once)."""
        if self.world == 1:
            return
        now = _mutable_facts()
        del now[STRICT]   # safe per rank: a collective op's strict fallback raises after its stock run
        for key, value in now.items():
            if key in self.facts and self.facts[key] != value and key not in self.refused:
                self.refused.add(key)
                warnings.warn(
                    f"k3fuse.{op}: {key} is {value!r} on {self.describe()} but the group agreed on "
                    f"{self.facts[key]!r} at its first collective call; refused for the collective ops "
                    "(a per-rank change would make the ranks take different paths). Change it on "
                    "every rank and call k3fuse.kernels.collective_guard.reagree(group_name) on every rank",
                    RuntimeWarning, stacklevel=4)


_lock = threading.Lock()
_groups: dict[str, GroupState] = {}


def size_mismatch(group_name: str, world_size: int, size: int | None) -> Exception:
    """The error of an op whose world_size is not its group's size (every path, every rank); a
    RuntimeError when there is no process group at all (as compat.resolve_group says)."""
    if size is None:
        return RuntimeError(f"k3fuse op was built for world_size={world_size} but torch.distributed is not "
                          f"initialized (no process group {group_name!r}); a collective op needs its TP group")
    return ValueError(f"k3fuse op was built for world_size {world_size} but process group {group_name!r} "
                      f"has {size} ranks")


def _size_error(op: str, group_name: str, world_size: int, size: int | None) -> Exception:
    runtime.record_collective_error(op, "world_size")
    return size_mismatch(group_name, world_size, size)


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def _create(op: str, group_name: str, world_size: int, device_type: str) -> GroupState:
    if not _initialized():
        if world_size != 1:
            raise _size_error(op, group_name, world_size, None)
        return GroupState(group_name, 1, 0, None, path_facts(device_type))
    from k3fuse.compat import resolve_group
    from k3fuse.dist import disagreements

    try:
        group = resolve_group(group_name)
    except RuntimeError:
        if world_size != 1:
            raise
        return GroupState(group_name, 1, 0, None, path_facts(device_type))
    size = dist.get_world_size(group)
    if size != world_size:
        raise _size_error(op, group_name, world_size, size)
    facts = path_facts(device_type)
    state = GroupState(group_name, size, dist.get_rank(group), group, facts)
    if size == 1:
        return state
    host = socket.gethostname()
    diffs = disagreements(group, {**facts, "host": host})
    setting_diffs = [d for d in diffs if not d.startswith("host:")]
    if setting_diffs:
        runtime.record_collective_error(op, "settings mismatch")
        raise CollectiveSettingsError(
            f"k3fuse.{op}: the ranks of group {group_name!r} disagree on what decides their path "
            f"({'; '.join(setting_diffs)}); every rank must run the same configuration (raised on "
            "every rank, before any collective)")
    if not diffs:   # one host: the board in host shared memory (else the device error words only)
        state.board = FailureBoard.create(group, state.rank, size)
    return state


def enter(op: str, group_name: str, world_size: int, device_type: str) -> GroupState:
    """Start a collective call: the group's agreed state (created collectively on first use);
    raises on a world size that differs from the group or on an earlier failure of any rank."""
    state = _groups.get(group_name)
    if state is None or state.initialized != _initialized():   # (a test may init a group later)
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"k3fuse.{op}: first collective call on group {group_name!r} during CUDA-graph "
                               "capture (the group agrees its settings collectively): warm the op up first")
        with _lock:
            state = _create(op, group_name, world_size, device_type)
            state.initialized = _initialized()
            _groups[group_name] = state
    if world_size != state.world:
        raise _size_error(op, group_name, world_size, state.world)
    state.raise_if_failed(op)
    state.check_toggles(op)
    return state


def group_state(group_name: str) -> GroupState | None:
    return _groups.get(group_name)


def fail(group_name: str, op: str, reason: str, kind: str = "failure") -> None:
    """Record a failure of this rank on `group_name` and tell its peers (fused workspaces call it)."""
    state = _groups.get(group_name)
    if state is None:
        runtime.record_collective_error(op, kind)
        return
    state.fail(op, reason, kind)


def reagree(group_name: str) -> None:
    """Re-read this rank's path settings and agree them across the group again (collective: every
    rank of the group calls it; a mismatch raises on every rank). How a change reaches the group."""
    state = _groups.get(group_name)
    if state is None:
        return
    if state.group is not None and state.world > 1:
        from k3fuse.dist import disagreements

        facts = {**state.facts, **_mutable_facts()}
        diffs = disagreements(state.group, facts)
        if diffs:
            raise CollectiveSettingsError(f"k3fuse.reagree: the ranks of group {group_name!r} disagree "
                                          f"({'; '.join(diffs)})")
        state.facts = facts
    else:
        state.facts = {**state.facts, **_mutable_facts()}
    state.refused.clear()


def check_collectives(sync: bool = False) -> None:
    """Raise if a collective call of this process failed, on this rank or on a peer: the failure
    board, then the device error words of every fused workspace (mirrored to pinned memory after
    each eager call and inside captured graphs; `sync` reads them after a device synchronisation).
    Run it after each step when replaying CUDA graphs (the torch.compile door does)."""
    for state in list(_groups.values()):
        state.raise_if_failed("check_collectives")
    import sys

    sw = sys.modules.get(__package__ + ".collective")
    if sw is not None:
        sw.check_errors(sync=sync)


from . import dispatch as _dispatch  # noqa: E402  (after enter is defined)

_dispatch.install_collective_guard(enter)


def _reset_for_tests() -> None:
    with _lock:
        _groups.clear()


__all__ = ["CollectiveError", "CollectiveTimeoutError", "CollectiveSettingsError", "CollectivePeerError", "PATH_SETTINGS", "path_facts", "enter", "fail",
           "reagree", "check_collectives", "group_state", "GroupState", "FailureBoard"]
