"""Cross-rank safety of every collective op (fused kernels, reference and stock paths alike).

Why a module of its own: the ranks of a TP group must take the same path through each collective
call and must all stop when one of them fails; that is one protocol for every collective op, so
dispatch and the fused workspaces (collective.py) call it instead of each op keeping a copy.

- Agreement: the first collective call on a group (every rank makes it: the graphs are the same)
  gathers everything that decides a rank's path (`path_facts`: the kill switch, strict mode, the
  path settings of k3fuse.runtime: K3FUSE_DISABLE_CUTE / _TRITON, K3FUSE_AR_PROTOCOL, the spin
  bound K3FUSE_AR_TIMEOUT_S, ...; kernel modules that failed to import) and raises one
  `CollectiveSettingsError` on every rank naming each setting and the ranks' values when they
  differ. After that the agreed values decide the group's path: the kernels' predicates and
  builders read them (`runtime.path_setting`), a later change of the kill switch or a path variable
  on a rank is refused, with one warning naming it, and `reagree(group_name)` (collective: every
  rank calls it) applies a change to the whole group. Strict mode may change per rank later: a
  collective op's strict fallback raises after its stock sequence ran, so its collective has paired
  on every rank either way.
- World size: an op whose world_size differs from its group's size raises on every rank and every
  path (stock, reference, fused), before any collective.
- Failure board: a few bytes of host shared memory per group (the ranks of a symmetric-memory group
  share a host), one slot per rank. A rank whose collective call fails at any point posts the
  reason there with the time; every rank checks the board at the start of each collective call and
  raises `CollectivePeerError` naming the rank that failed first (the root cause: later failures are
  often peers that timed out waiting for it) and its reason. A failed group stays failed (its
  buffers may hold partial sums): restart the TP group.
- Barriers (`GroupState.barrier`): the fused workspaces' start barrier (every rank compiled a
  variant before any rank pushes) and allocation barrier wait on the board, not in a collective,
  so a rank whose compile or allocation failed makes every peer raise at once, naming it.
- `check_collectives()`: the post-step check (after CUDA-graph replays: the device error words of
  the fused workspaces are copied to pinned memory and read without a sync); the torch.compile door
  runs it after every compiled call, the engines' adapters after every engine step
  (k3fuse/engines/step_check.py), bench / validate / the examples after each step.
Every collective error is counted in `k3fuse.stats()` as "error:<kind>" under its op.
"""
from __future__ import annotations

import importlib.metadata
import mmap
import os
import socket
import struct
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from k3fuse import runtime

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


#: the K3FUSE_* settings that decide which path a collective op takes (k3fuse.runtime reads them)
PATH_SETTINGS: tuple[str, ...] = runtime.PATH_SETTINGS
KILL_SWITCH = "kill switch (K3FUSE_DISABLE / k3fuse.disable())"
STRICT = "strict mode (K3FUSE_STRICT / k3fuse.strict())"
IMPORTS = "kernel modules that failed to import"
TOOLCHAIN = "kernel toolchain versions"
#: how long a barrier waits for a rank that neither arrives nor reports a failure (a peer may still
#: be compiling a kernel: minutes on a cold cache)
BARRIER_BOUND_S = 600.0


def path_facts(device_type: str) -> dict[str, Any]:
    """Everything that decides this rank's path through a collective op on `device_type`."""
    facts: dict[str, Any] = {KILL_SWITCH: runtime.is_disabled(), STRICT: runtime.is_strict(), **runtime.path_settings()}
    if device_type == "cuda":
        from . import dispatch

        dispatch.load_gpu_impls()
        facts[IMPORTS] = sorted(dispatch.import_errors())
        facts[TOOLCHAIN] = _toolchain()
    return facts


def _toolchain() -> str:
    versions = [f"torch {torch.__version__}"]
    for module, dist_name in (("triton", "triton"), ("cutlass", "nvidia-cutlass-dsl")):
        try:
            versions.append(f"{module} {importlib.metadata.version(dist_name)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{module} absent")
    return ", ".join(versions)


def _live_facts() -> dict[str, Any]:
    """The facts a process can change after the agreement, as they are now (read per call: cheap)."""
    return {KILL_SWITCH: runtime.is_disabled(), STRICT: runtime.is_strict(), **runtime.live_path_settings()}


# --- the failure board ------------------------------------------------------------------------------
_SLOT = 512            # bytes per rank: the head, then the reason (utf-8)
_HEAD = struct.Struct("<iiq")   # state (0 ok, 1 failed), reason length, CLOCK_MONOTONIC ns of the failure
_ARRIVALS = struct.Struct("<q")   # barriers this rank has reached, after the head
_REASON = _HEAD.size + _ARRIVALS.size


class FailureBoard:
    """Host shared memory with one slot per rank of a group (created collectively).

    A file under /dev/shm (or the temp dir), mapped by every rank and unlinked once every rank
    has mapped it, so nothing is left behind however the processes end. The failure times are
    CLOCK_MONOTONIC, which every process of a host shares."""

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
        """Mark this rank failed (the reason and the time first, the state word last)."""
        data = reason.encode("utf-8", "replace")[:_SLOT - _REASON]
        base = self.rank * _SLOT
        self.map[base + _REASON:base + _REASON + len(data)] = data
        struct.pack_into("<q", self.map, base + 8, time.monotonic_ns())
        struct.pack_into("<ii", self.map, base, 1, len(data))

    def failed(self) -> tuple[int, str] | None:
        """(rank, reason) of the rank that failed first (the root cause), or None."""
        first: tuple[int, int] | None = None   # (time, rank)
        for r in range(self.world):
            state, _, when = _HEAD.unpack_from(self.map, r * _SLOT)
            if state and (first is None or when < first[0]):
                first = (when, r)
        if first is None:
            return None
        r = first[1]
        _, length, _ = _HEAD.unpack_from(self.map, r * _SLOT)
        start = r * _SLOT + _REASON
        return r, bytes(self.map[start:start + length]).decode("utf-8", "replace")

    def arrive(self, n: int) -> None:
        """This rank reached the group's n-th barrier."""
        _ARRIVALS.pack_into(self.map, self.rank * _SLOT + _HEAD.size, n)

    def behind(self, n: int) -> list[int]:
        """The ranks that have not reached the n-th barrier yet."""
        return [r for r in range(self.world) if _ARRIVALS.unpack_from(self.map, r * _SLOT + _HEAD.size)[0] < n]


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
    world_pg: Any = None                 # torch's default group when this state was created
    barriers: int = 0                    # barriers this rank has passed on the group

    @property
    def disabled(self) -> bool:
        """The kill switch for this group's collective ops: the agreed one (a single rank has no
        peer to diverge from, so it follows its own switch)."""
        return runtime.is_disabled() if self.world == 1 else bool(self.facts.get(KILL_SWITCH))

    def current(self) -> bool:
        """Created under the process group torch has now (not one destroyed and initialised again)."""
        return self.world_pg is _world_pg()

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
                self.board.post((reason if reason.startswith("k3fuse.") else f"k3fuse.{op}: {reason}")[:400])
            except Exception:
                pass
        # a failure outside the fused workspaces (e.g. before dispatch reached a kernel) still
        # stops the peers' current spins: every fused workspace of the group fails too
        import sys

        sw = sys.modules.get(__package__ + ".collective")
        if sw is not None:
            sw.fail_group(self.name, op, reason, kind)

    def barrier(self, op: str, what: str, device: torch.device | None = None,
                bound_s: float | None = None) -> None:
        """Wait until every rank of the group reached this point (its next barrier on the group).
        On the failure board, not in a collective: a rank that failed (its compile, its allocation)
        makes every peer raise at once, naming it and its reason; a rank that neither arrives nor
        fails within `bound_s` (BARRIER_BOUND_S) fails the group. Without a board (ranks on several
        hosts, no shared memory) it is the group's own barrier."""
        if self.world == 1:
            return
        self.raise_if_failed(op)
        if self.board is None:
            if device is not None and device.type == "cuda" and dist.get_backend(self.group) == "nccl":
                dist.barrier(self.group, device_ids=[device.index])
            else:
                dist.barrier(self.group)
            return
        self.barriers += 1
        self.board.arrive(self.barriers)
        bound = BARRIER_BOUND_S if bound_s is None else bound_s
        deadline = time.monotonic() + bound
        pause = 1e-4
        while True:
            self.raise_if_failed(op)   # a peer posted its failure: raises, naming it
            behind = self.board.behind(self.barriers)
            if not behind:
                return
            if time.monotonic() > deadline:
                reason = (f"{self.describe()}: rank(s) {behind} did not reach {what} within {bound:g} s and reported no "
                          "failure (a rank died, hangs or took another path)")
                self.fail(op, reason, "timeout")
                raise CollectiveTimeoutError(f"k3fuse.{op}: {reason}")
            time.sleep(pause)
            pause = min(2 * pause, 0.01)

    def check_toggles(self, op: str) -> None:
        """A path setting changed on this rank since the agreement: refused (warned once)."""
        if self.world == 1:
            return
        now = _live_facts()
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


def _world_pg() -> Any:
    """torch's default process group now (None without one): a group state or a workspace made
    under another one belongs to a process group that was destroyed."""
    return dist.group.WORLD if _initialized() else None


def _create(op: str, group_name: str, world_size: int, device_type: str) -> GroupState:
    world_pg = _world_pg()
    if world_pg is None:
        if world_size != 1:
            raise _size_error(op, group_name, world_size, None)
        return GroupState(group_name, 1, 0, None, path_facts(device_type), world_pg=world_pg)
    from k3fuse.compat import resolve_group
    from k3fuse.dist import disagreements

    try:
        group = resolve_group(group_name)
    except RuntimeError:
        if world_size != 1:
            raise
        return GroupState(group_name, 1, 0, None, path_facts(device_type), world_pg=world_pg)
    size = dist.get_world_size(group)
    if size != world_size:
        raise _size_error(op, group_name, world_size, size)
    facts = path_facts(device_type)
    state = GroupState(group_name, size, dist.get_rank(group), group, facts, world_pg=world_pg)
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
    runtime.pin_path_settings(facts)   # from now on the kernels read the agreed values
    if not diffs:   # one host: the board in host shared memory (else the device error words only)
        state.board = FailureBoard.create(group, state.rank, size)
    return state


def enter(op: str, group_name: str, world_size: int, device_type: str) -> GroupState:
    """Start a collective call: the group's agreed state (created collectively on first use, once:
    two threads making the first call create it once); raises on a world size that differs from
    the group or on an earlier failure of any rank."""
    state = _groups.get(group_name)
    if state is None or not state.current():
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"k3fuse.{op}: first collective call on group {group_name!r} during CUDA-graph "
                               "capture (the group agrees its settings collectively): warm the op up first")
        with _lock:
            state = _groups.get(group_name)   # another thread may have created it meanwhile
            if state is None or not state.current():
                state = _create(op, group_name, world_size, device_type)
                _groups[group_name] = state
    if world_size != state.world:
        raise _size_error(op, group_name, world_size, state.world)
    state.raise_if_failed(op)
    state.check_toggles(op)
    return state


def group_state(group_name: str) -> GroupState | None:
    """The group's state, if this process made a collective call on it under today's process group."""
    state = _groups.get(group_name)
    return state if state is not None and state.current() else None


def fail(group_name: str, op: str, reason: str, kind: str = "failure") -> None:
    """Record a failure of this rank on `group_name` and tell its peers (fused workspaces call it)."""
    state = group_state(group_name)
    if state is None:
        runtime.record_collective_error(op, kind)
        return
    state.fail(op, reason, kind)


def barrier(group_name: str, op: str, what: str, device: torch.device | None = None) -> None:
    """`GroupState.barrier` of `group_name` (the fused workspaces' start and allocation barriers)."""
    state = group_state(group_name)
    if state is None:
        raise RuntimeError(f"k3fuse.{op}: no collective state for group {group_name!r}: a fused collective "
                           "runs inside dispatch (its guard creates the state)")
    state.barrier(op, what, device)


def reagree(group_name: str) -> None:
    """Re-read this rank's path settings and agree them across the group again (collective: every
    rank of the group calls it; a mismatch raises on every rank). How a change reaches the group:
    the kernels read the new values from then on (with several groups, reagree each)."""
    state = group_state(group_name)
    if state is None:
        return
    facts = {**state.facts, **_live_facts()}
    if state.group is not None and state.world > 1:
        from k3fuse.dist import disagreements

        diffs = disagreements(state.group, facts)
        if diffs:
            raise CollectiveSettingsError(f"k3fuse.reagree: the ranks of group {group_name!r} disagree "
                                          f"({'; '.join(diffs)})")
        runtime.pin_path_settings(facts)
    state.facts = facts
    state.refused.clear()


def check_collectives(sync: bool = False) -> None:
    """Raise if a collective call of this process failed, on this rank or on a peer: the failure
    board (the first failure), then the device error words of every fused workspace (copied to
    pinned memory after each eager call and by this check: without `sync` it reads the copy its
    previous run queued, one step late; `sync` reads them after a device synchronisation). Run it
    after each step when replaying CUDA graphs (the torch.compile door and the engines' adapters do)."""
    for state in list(_groups.values()):
        if state.current():
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
    runtime.unpin_path_settings()


__all__ = ["CollectiveError", "CollectiveTimeoutError", "CollectiveSettingsError", "CollectivePeerError", "PATH_SETTINGS", "path_facts", "enter", "fail", "barrier", "BARRIER_BOUND_S",
           "reagree", "check_collectives", "group_state", "GroupState", "FailureBoard"]
