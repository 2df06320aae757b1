"""The fused collectives' shared machinery: the symmetric-memory workspace (unicast peer buffers
only), the protocol words and their arithmetic, the protocol choice, the order of a call (every
kernel compiled, then the push, then the epilogue; a failure fails the workspace on every rank),
the staging of misaligned tensors and the bounded spin. The collective ops (kernels/ops/
oproj_allreduce.py, allreduce_rmsnorm.py, moe_front.py) run through `run_collective`.

Why the workspace is shared: the buffers must be allocated once per (group, device, max_tokens,
hidden, lane) before CUDA-graph capture, with every rank in the same order (rendezvous is
collective), and the peer views must be plain tensors the CuTe kernel can take. NVLink multicast is
never used: no multicast pointer is read, and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 is set before the
first symmetric allocation so that torch does not create a multicast object either.

Layout of the one symmetric fp32 allocation per rank (see kernels/lib/cute/oneshot_epilogue.py):
  data  [3 buffers, world (source rank), max_tokens, hidden] fp32, initialised to the sentinel -0.0
  flags [world (source rank), max_tokens] int64 after it, initialised to the start epoch (only the
        acquire/release flag protocol, K3FUSE_AR_PROTOCOL=flags, uses them)
  err   int32[4] after that: [0] 0 = ok, 1 = this rank timed out, 2 = a rank reported a failure;
        [1] the peer (group rank) that never arrived / that failed; [2] which op: 0 gemm_ar_residual,
        1 gemm_ar_residual_rmsnorm, 2 allreduce_rmsnorm, 3 moe_front_sharded (an all-gather);
        [3] the token row. In symmetric memory so that a failing rank can stop every peer's spin.
Local (not symmetric): gen int64[4] (epoch, arrival counter, rows written last call, buffer index
in {0, 1, 2}), ptrs int64[world] (each rank's data base address, for the Triton push epilogue).

Settings: the protocol (K3FUSE_AR_PROTOCOL), the spin bound and the start epoch are the values the
TP group agreed (k3fuse.runtime.path_setting); a workspace serves one protocol (part of its key).

Generation: 64-bit (2^63 calls) and compared by signed difference, so not even the wrap breaks
the flag protocol; the buffer index is its own word, rotated 0 -> 1 -> 2 -> 0 by the epilogue's
last CTA, never a remainder of a wrapping counter. `K3FUSE_AR_START_GENERATION` (tests) starts
the epoch anywhere, e.g. near 2^63 or near 2^31 / 2^32 (the int32 and uint32 wrap points).

Streams: a workspace serves one stream at a time. Each lane (`stream_lane(name)`, default "main")
has its own workspace; two streams that overlap (two-batch overlap) must use two lanes. A call
from a second stream while the first stream's last call may still run raises `WorkspaceStreamError`;
a call from another stream after the previous one finished (warm-up on a side stream, then serving
on another) rebinds the workspace. Inside CUDA-graph capture the check is skipped (a graph replays
on one stream).

Failures (what a serving process sees): the spin is bounded (K3FUSE_AR_TIMEOUT_S, default 5 s).
A kernel that times out writes err, NaN-fills its output and returns; every later fused
all-reduce on that workspace returns at once with NaN outputs (no further spin). A failure at any
point of a call on any rank (`run_collective`: staging, the stream check, compile, launch, a
timeout the host has seen) fails the workspace and the group (`fail`): err=2 in every peer's
symmetric words (their kernels stop spinning) and this rank's reason on the group's failure board
(kernels/collective_guard.py), so every peer's next call raises; no rank reads a partial sum as
fresh, since a failed workspace stays failed (restart the TP group). A timeout seen on the device
reaches the host at the next call on that workspace once the device has finished the failed call
(the error words are copied to pinned memory after each eager call and read without a sync), and
at `collective_guard.check_collectives()` after CUDA-graph replays (it reads the words copied at
its previous run and queues a fresh copy: one step late without `sync`, at once with it).
Start-up: the first call of each variant (op, path, tokens, ...: shared facts) waits at a barrier
of the group after compiling and before pushing (`start_barrier`), so the bound never starts while
a peer is still compiling; a new workspace's ranks meet after allocating and after initialising.
These barriers wait on the group's failure board, not in a collective: a rank whose compile or
allocation failed posted its reason there, and every peer raises at once, naming it.
"""
from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

import torch
import torch.distributed as dist

from k3fuse import runtime

from . import collective_guard
from .collective_guard import CollectiveError, CollectiveTimeoutError  # noqa: F401  (re-exported)

_lock = threading.Lock()
_workspaces: dict = {}
_lane = threading.local()


class WorkspaceStreamError(CollectiveError):
    """A second stream used a workspace while the first stream's call may still run."""

    kind = "stream"


def timeout_s() -> float:
    """Bound of every spin, in seconds (K3FUSE_AR_TIMEOUT_S, else K3FUSE_AR_TIMEOUT_MS, else the
    default), as the TP group agreed it: every rank waits as long. Read per call: a runtime kernel
    argument, no recompile."""
    return float(runtime.path_setting("K3FUSE_AR_TIMEOUT_S"))


def timeout_ns() -> int:
    """The spin bound as the kernels take it (%globaltimer nanoseconds)."""
    return int(timeout_s() * 1e9)


def start_generation() -> int:
    """K3FUSE_AR_START_GENERATION (default 0): the first epoch of a new workspace (tests)."""
    return int(runtime.path_setting("K3FUSE_AR_START_GENERATION"))


#: err[2] of a failure: which op the kernel ran (a timeout message names it)
OP_KINDS: dict[str, int] = {"gemm_ar_residual": 0, "gemm_ar_residual_rmsnorm": 1, "allreduce_rmsnorm": 2,
                            "moe_front_sharded": 3}
MAX_WORLD = 8  # ranks a fused collective serves (the epilogue's fixed peer arity)


def protocol() -> str:
    """K3FUSE_AR_PROTOCOL (lamport | flags) as the TP group agreed it (a `reagree` changes it on
    every rank at once). A workspace serves the protocol it was created for (the Lamport one needs
    its sentinel invariant): a change gets workspaces of its own (`get_workspace`)."""
    return str(runtime.path_setting("K3FUSE_AR_PROTOCOL"))


def flags_rank(rank: int) -> int | None:
    """The rank the epilogue's flag variant is specialised on, None under the Lamport protocol."""
    return rank if protocol() == "flags" else None


def staged(t: torch.Tensor | None) -> torch.Tensor | None:
    """`t` itself if contiguous and 16-byte aligned, else an aligned copy (fresh allocations are):
    layout is per rank, so it is staged, never a reason to decline."""
    if t is None or (t.is_contiguous() and t.data_ptr() % 16 == 0):
        return t
    return t.contiguous() if not t.is_contiguous() else t.clone()


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def dist_ready() -> bool:
    """A process group exists (a call-time fact: a rewrite is made for a group that will exist)."""
    return dist.is_available() and dist.is_initialized()


def run_collective(op: str, group_name: str, world_size: int, max_tokens: int, hidden: int,
                   device: torch.device, facts: dict, launch) -> object:
    """One fused collective call: the workspace for (group, max_tokens, hidden, lane, protocol),
    created collectively on first use, then `launch(ws)`, which stages its inputs, compiles every
    kernel, passes `ws.start_barrier`, pushes, runs the epilogue and returns the result. Every
    failure of it (the allocation of the workspace, the stream check, staging, compile, launch)
    fails the workspace and the group on every rank (`ArWorkspace.fail`, or the failure board when
    there is no workspace yet): the peers waiting at a barrier raise at once, naming this rank, no
    rank spins to its timeout or reads a partial sum as fresh later; the caller (dispatch) raises,
    never a per-rank fallback."""
    ws = None
    try:
        ws = get_workspace(group_name, world_size, max_tokens, hidden, device, facts=facts, op=op)
        ws.before_call(op)
        return launch(ws)
    except BaseException as exc:
        reason = f"{type(exc).__name__}: {exc}"
        if ws is not None:
            ws.fail(op, reason, getattr(exc, "kind", "failure"))
        else:
            state = collective_guard.group_state(group_name)
            who = state.describe() if state is not None else f"group {group_name!r}"
            collective_guard.fail(group_name, op, f"k3fuse.{op}: {who} failed: {reason}", getattr(exc, "kind", "failure"))
        raise


def warmup_rank(shape: dict) -> int:
    """The rank within the TP group for a warm-up shape: {"group": c10d group name} if given,
    else WORLD only when its size is the shape's world_size (a sub-group needs "group")."""
    W = shape.get("world_size", 2)
    if not dist_ready():
        return 0
    name = shape.get("group") or shape.get("group_name")
    if name is not None:
        from k3fuse.compat import resolve_group

        return dist.get_rank(resolve_group(name))
    if dist.get_world_size() != W:
        raise ValueError(f"fused all-reduce warm-up for world_size {W} in a process group of "
                         f"{dist.get_world_size()} ranks: pass the TP group's name as shape['group'] "
                         "(the kernels are specialised on the rank within that group)")
    return dist.get_rank()


def check_timeout(group_name: str, max_tokens: int, hidden: int, device: torch.device) -> None:
    """Raise CollectiveTimeoutError if a spin on this workspace timed out (synchronises)."""
    ws = _workspaces.get((group_name, device.index, max_tokens, hidden, current_lane(), protocol()))
    if ws is not None:
        ws.raise_if_failed(ws.last_op, sync=True)


# --- the protocol's generation arithmetic, as the kernels do it (pure Python, for CPU tests) -------
NBUF = 3  # data buffers the protocol rotates through (one written, one read, one being reset)
_I64 = 2**64


def wrap_i64(v: int) -> int:
    """Two's-complement int64 wrap (what add.s64 does on the device)."""
    v %= _I64
    return v - _I64 if v >= 2**63 else v


def advance(gen: tuple[int, int, int, int], rows: int) -> tuple[int, int, int, int]:
    """The epilogue's last CTA: (epoch, arrivals, rows, buf) -> the next call's words."""
    epoch, _, _, buf = gen
    nb = buf + 1
    if nb >= NBUF:
        nb -= NBUF
    return (wrap_i64(epoch + 1), 0, rows, nb)


def reset_buffer(buf: int) -> int:
    """The buffer the epilogue resets to the sentinel (used two calls ago), as the kernel computes it."""
    bc = buf + 2
    if bc >= NBUF:
        bc -= NBUF
    return bc


def flag_arrived(flag: int, epoch: int) -> bool:
    """Flag protocol: source arrived for call `epoch` (released epoch + 1) iff flag - (epoch+1) >= 0
    as a signed 64-bit difference (wrap-safe)."""
    return wrap_i64(flag - wrap_i64(epoch + 1)) >= 0


# --- lanes ----------------------------------------------------------------------------------------
def current_lane() -> str:
    return getattr(_lane, "name", "main")


@contextlib.contextmanager
def stream_lane(name: str) -> Iterator[None]:
    """Fused all-reduces called inside use the workspace of lane `name` (created collectively on
    first use, outside CUDA-graph capture). Give each concurrently running stream its own lane."""
    prev = current_lane()
    _lane.name = str(name)
    try:
        yield
    finally:
        _lane.name = prev


class ArWorkspace:
    """One rank's symmetric buffers of a group's fused collectives (see the module doc), created
    collectively: the ranks agree what the kernels assume, allocate, meet at a barrier on the
    failure board (a rank whose allocation failed makes the others raise, naming it), exchange
    handles, initialise the words and meet again."""

    def __init__(self, group_name: str, world_size: int, max_tokens: int, hidden: int,
                 device: torch.device, lane: str = "main", facts: dict | None = None, op: str = "fused all-reduce"):
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        from torch.distributed import _symmetric_memory as symm_mem

        from k3fuse.compat import resolve_group

        group = resolve_group(group_name)
        self.group, self.group_name, self.lane = group, group_name, lane
        self.world_pg = dist.group.WORLD     # a workspace of a destroyed process group is never reused
        self.rank = dist.get_rank(group)           # the rank within the TP group, never the global one
        self.world = dist.get_world_size(group)
        if self.world != world_size:
            raise ValueError(f"group {group_name!r} has {self.world} ranks, op says {world_size}")
        self.global_ranks = [dist.get_global_rank(group, r) for r in range(self.world)]
        self.max_tokens, self.hidden = max_tokens, hidden
        start = start_generation()
        # every rank must agree on what the kernels assume (protocol, shapes, start): once, here
        mine = dict(world=world_size, max_tokens=max_tokens, hidden=hidden, lane=lane, start=start,
                    **(facts or {}))
        _agree(group, mine, f"fused all-reduce workspace of group {group_name!r}")
        _one_gpu_per_rank(group, group_name, device)
        W, MT, H = self.world, max_tokens, hidden
        n_data = 3 * W * MT * H                    # even: hidden is a multiple of 4
        n_flags = (2 * W * MT + 3) // 4 * 4        # int64 words as fp32 words, 16-byte multiple
        n_err = 4
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # needed on some torch versions, a deprecated no-op on others
            try:
                import warnings

                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    enable(group_name)
            except Exception:
                pass
        n = n_data + n_flags + n_err
        buf = symm_mem.empty((n,), dtype=torch.float32, device=device)
        buf[:n_data].view(torch.int32).fill_(-2**31)   # 0x80000000 = -0.0: "not written yet"
        buf[n_data:n_data + n_flags].view(torch.int64).fill_(start)
        buf[n_data + n_flags:].view(torch.int32).zero_()
        # every rank allocated before the rendezvous, which a rank whose allocation failed never joins
        collective_guard.barrier(group_name, op, "the allocation of the fused collectives' workspace", device)
        hdl = symm_mem.rendezvous(buf, group_name)
        self.handle, self.buf = hdl, buf
        self.datas, self.flags, self.errs = [], [], []
        for r in range(W):
            peer = buf if r == self.rank else hdl.get_buffer(r, (n,), torch.float32)
            self.datas.append(peer[:n_data].view(3, W, MT, H))
            self.flags.append(peer[n_data:n_data + n_flags].view(torch.int64)[:W * MT].view(W, MT))
            self.errs.append(peer[n_data + n_flags:].view(torch.int32))
        self.err = self.errs[self.rank]
        self.ptrs = torch.tensor([d.data_ptr() for d in self.datas], dtype=torch.int64, device=device)
        self.gen = torch.tensor([start, 0, 0, 0], dtype=torch.int64, device=device)
        self.device = device
        self.err_host = torch.zeros(4, dtype=torch.int32, pin_memory=True)
        self.event = torch.cuda.Event()
        self.event_recorded = False
        self.stream: torch.cuda.Stream | None = None
        self.failed: str | None = None
        self.notify_stream: torch.cuda.Stream | None = None
        self.variants: set[tuple] = set()      # variants whose start barrier every rank passed
        self.last_op = op
        torch.cuda.synchronize(device)
        # every rank's buffer holds the sentinel before any peer writes it
        collective_guard.barrier(group_name, op, "the initialisation of the fused collectives' workspace", device)

    def padded(self, tensors: list[torch.Tensor], max_world: int) -> list[torch.Tensor]:
        """Per-peer views padded to the kernel's fixed arity with the local view (unused)."""
        return tensors + [tensors[self.rank]] * (max_world - len(tensors))

    # --- failures -------------------------------------------------------------------------------
    def describe(self, code: int, peer: int, norm: int, row: int, op: str | None = None) -> str:
        op = op or {kind: name for name, kind in OP_KINDS.items()}.get(norm, "gemm_ar_residual")
        me = f"rank {self.rank} (global {self.global_ranks[self.rank]}) of group {self.group_name!r}"
        if code == 1:
            g = self.global_ranks[peer] if 0 <= peer < self.world else "?"
            return (f"k3fuse.{op}: {me} timed out after {timeout_s():g} s (K3FUSE_AR_TIMEOUT_S) "
                    f"waiting for peer rank {peer} (global {g}), token row {row}: the peer never "
                    "arrived (it skipped the op, took another path, died or hangs)")
        g = self.global_ranks[peer] if 0 <= peer < self.world else "?"
        return (f"k3fuse.{op}: {me}: peer rank {peer} (global {g}) reported a failure of the fused "
                "all-reduce; see that rank's error")

    def raise_if_failed(self, op: str, sync: bool = False) -> None:
        """Raise if this workspace, or any rank of its group, failed. Without `sync` only reads
        what an earlier copy to pinned memory already delivered (no device sync)."""
        if self.failed is not None:
            raise CollectiveTimeoutError(self.failed + " (the workspace stays failed; restart the "
                                         "TP group)")
        state = collective_guard.group_state(self.group_name)
        if state is not None:
            state.raise_if_failed(op)
        if _capturing():
            return   # no sync / host read inside capture
        if sync:
            torch.cuda.synchronize(self.device)
            vals = [int(v) for v in self.err.tolist()]
        else:
            vals = [int(v) for v in self.err_host.tolist()]   # err only goes 0 -> set: never stale-set
        if vals[0] != 0:
            message = self.describe(vals[0], vals[1], vals[2], vals[3],
                                    None if vals[0] == 1 else self.last_op)
            self._mark_failed(op, message, "timeout" if vals[0] == 1 else "peer failure",
                              own_words=False)
            raise CollectiveTimeoutError(message)

    def fail(self, op: str, reason: str, kind: str = "failure") -> None:
        """This rank failed at some point of a call: mark the workspace failed and tell every peer
        (err=2 in their symmetric words, so no kernel keeps spinning, and the group's failure
        board, so their next call raises). Idempotent, never raises (the caller raises its own)."""
        self._mark_failed(op, f"k3fuse.{op}: rank {self.rank} of group {self.group_name!r} failed: "
                              f"{reason}", kind, own_words=True)

    def _mark_failed(self, op: str, message: str, kind: str, own_words: bool) -> None:
        first = self.failed is None
        if first:
            self.failed = message
        collective_guard.fail(self.group_name, op, message, kind)
        if not first or _capturing():
            return
        try:   # on a side stream: never queued behind a kernel of this rank that still spins
            if self.notify_stream is None:
                self.notify_stream = torch.cuda.Stream(self.device)
            with torch.cuda.stream(self.notify_stream):
                for r, e in enumerate(self.errs):
                    if r == self.rank and not own_words:
                        continue   # keep this rank's own record of the timeout
                    e[1:2].fill_(self.rank)
                    e[0:1].fill_(2)
        except Exception:
            pass

    def start_barrier(self, variant: tuple) -> None:
        """Before the first push of `variant` (shared facts only: op, path, tokens, flags...): every
        rank has compiled it, so the spin bound never covers a peer's compile. On the failure board
        (collective_guard.barrier): a peer whose compile failed makes this rank raise at once,
        naming it. Eager only (a captured call was warmed up eagerly first)."""
        if variant in self.variants or _capturing():
            return
        collective_guard.barrier(self.group_name, str(variant[0]), f"the first push of {variant}", self.device)
        self.variants.add(variant)

    # --- streams --------------------------------------------------------------------------------
    def before_call(self, op: str) -> None:
        """Raise on a recorded failure (here or on a peer); bind / check the stream (see module
        doc). Call it inside `run_collective`, so that its own errors fail the group too."""
        self.raise_if_failed(op)
        self.last_op = op
        if _capturing():
            return
        cur = torch.cuda.current_stream(self.device)
        if self.stream is None or cur == self.stream:
            self.stream = cur
            return
        if self.event_recorded and not self.event.query():
            raise WorkspaceStreamError(
                f"k3fuse.{op}: the fused all-reduce workspace (group {self.group_name!r}, lane "
                f"{self.lane!r}) is in use on stream {self.stream.cuda_stream:#x} and stream "
                f"{cur.cuda_stream:#x} called it before that call finished; two overlapping streams "
                "would corrupt its buffers. Give each stream its own workspace with "
                "`with k3fuse.kernels.collective.stream_lane(name):` (created collectively, "
                "same order on every rank), or order the streams (wait for the first)")
        self.stream = cur   # the previous stream's calls have finished: hand over

    def after_call(self) -> None:
        """Eager calls: mirror the error words to pinned memory and mark the call's end."""
        if _capturing():
            return
        self.mirror()

    def mirror(self) -> None:
        """Queue a copy of the error words to pinned memory (read later without a sync)."""
        self.err_host.copy_(self.err, non_blocking=True)
        self.event.record(torch.cuda.current_stream(self.device))
        self.event_recorded = True


def _agree(group, mine: dict, what: str) -> None:
    """All ranks of `group` hold the same `mine`, else every rank raises (names the differences)."""
    from k3fuse.dist import disagreements

    diffs = disagreements(group, mine)
    if diffs:
        raise CollectiveError(f"{what}: ranks disagree ({'; '.join(diffs)}); every rank must run "
                              "the same configuration")


def _one_gpu_per_rank(group, group_name: str, device: torch.device) -> None:
    """Every rank of `group` on its own GPU, else every rank raises the same error before the
    symmetric allocation (torch's rendezvous would refuse "overlapping devices" less clearly)."""
    import socket

    from k3fuse.dist import shared_values

    gpu = (socket.gethostname(), str(torch.cuda.get_device_properties(device).uuid))
    shared = shared_values(group, gpu)
    if shared:
        raise CollectiveError(f"fused all-reduce workspace of group {group_name!r}: ranks share a GPU "
                              f"({'; '.join(shared)}); the symmetric-memory collectives need one GPU per rank")


def get_workspace(group_name: str, world_size: int, max_tokens: int, hidden: int,
                  device: torch.device, facts: dict | None = None, op: str = "fused all-reduce") -> ArWorkspace:
    """The workspace for this group/device/shape/lane/protocol, created collectively on first use
    (and again for a process group initialised anew: its old buffers belong to a dead group)."""
    lane = current_lane()
    key = (group_name, device.index, max_tokens, hidden, lane, protocol())
    ws = _workspaces.get(key)
    if ws is None or ws.world_pg is not dist.group.WORLD:
        if _capturing():
            raise RuntimeError("one-shot all-reduce workspace first needed during CUDA-graph capture; "
                               "warm the op up before capturing")
        with _lock:
            ws = _workspaces.get(key)
            if ws is None or ws.world_pg is not dist.group.WORLD:
                for stale in [k for k, w in _workspaces.items() if w.world_pg is not dist.group.WORLD]:
                    del _workspaces[stale]
                ws = ArWorkspace(group_name, world_size, max_tokens, hidden, device, lane, facts, op)
                _workspaces[key] = ws
    return ws


def fail_group(group_name: str, op: str, reason: str, kind: str) -> None:
    """Fail every workspace of `group_name` in this process (err=2 in every peer's words: their
    kernels stop spinning); the collective guard calls it when the group fails."""
    for ws in _live_workspaces():
        if ws.group_name == group_name:
            ws.fail(op, reason, kind)


def _live_workspaces() -> list[ArWorkspace]:
    """The workspaces of today's process group (not of one destroyed and initialised again)."""
    return [ws for ws in list(_workspaces.values()) if ws.world_pg is dist.group.WORLD]


def check_errors(sync: bool = True) -> None:
    """Raise CollectiveTimeoutError if any fused all-reduce workspace of this process failed
    (synchronises the devices with `sync`; use after CUDA-graph replays). Without `sync` it reads
    the words copied at its previous run (or after the last eager call) and queues a new copy."""
    for ws in _live_workspaces():
        ws.raise_if_failed(ws.last_op, sync=sync)
        if not sync and not _capturing():
            ws.mirror()
