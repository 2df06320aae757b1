"""Issue 48 on CPU (gloo ranks): ranks that would rewrite differently, failures at start-up, toggles
after the agreement, and the smaller collective findings.

- 48.2: k3fuse's Inductor pass (the engines' door) on 2 gloo ranks, rank 1 with the kill switch or
  another K3FUSE_RULES: every rank raises one ContextError at compile time, within seconds (it
  used to hang in different collectives until the launcher killed both).
- 48.4: a rank whose compile or workspace allocation fails: every peer raises within the bound
  (seconds, not the process group's timeout), naming that rank and its reason. The barriers are
  the real ones (`ArWorkspace.start_barrier`, `collective.run_collective`, the failure board); the
  workspace's device memory is stood in for on CPU (the GPU tests run the real one).
- 48.5: after the agreement, K3FUSE_DISABLE_CUTE / _GEMV_MAX_M / _AR_PDL changed on one rank is
  refused, and so it changes none of that rank's predicates.
- 48.8: K3FUSE_AR_TIMEOUT_S agreed; protocol() follows reagree(); the guard's table re-checked
  under its lock; the failure board names the earliest failure; states and workspaces of a
  destroyed process group are not reused; the pass's uuid() covers the GPU path settings; the CuTe
  DSL's file cache in a directory this user owns.
"""
from __future__ import annotations

import mmap
import os
import subprocess
import sys
import threading
import time
import warnings
from datetime import timedelta

import pytest
import torch
import torch.nn.functional as F

import k3fuse
from k3fuse.kernels import collective as sw
from k3fuse.kernels import collective_guard as cg
from k3fuse.kernels import dispatch

EPS = 1e-6
H = 16


def _error(fn):
    """The error fn raised as (type name, message, seconds), or None."""
    t0 = time.monotonic()
    try:
        fn()
    except Exception as exc:   # noqa: BLE001 - the scenarios compare what each rank raised
        return type(exc).__name__, str(exc), time.monotonic() - t0
    return None


def _tail(x, group, world=2):
    return torch.ops.k3fuse.allreduce_rmsnorm(x, torch.ones(H), EPS, group.group_name, world, 64)


# --- 48.2: the engines' door -------------------------------------------------------------------------
class _OutProj(torch.nn.Module):
    """A row-parallel out-projection, its all-reduce and the residual RMSNorm (what the
    oproj_allreduce_residual rule fuses)."""

    def __init__(self, w: torch.Tensor, norm_w: torch.Tensor, group_name: str):
        super().__init__()
        self.w = torch.nn.Parameter(w, requires_grad=False)
        self.norm_w = torch.nn.Parameter(norm_w, requires_grad=False)
        self.group_name = group_name

    def forward(self, x, residual):
        from torch.distributed import _functional_collectives as funcol

        from k3fuse.spelling import rms_norm

        r = residual + funcol.all_reduce(F.linear(x, self.w), "sum", self.group_name)
        return r, rms_norm(r, self.norm_w, EPS)


def _compile_door(rank: int, world: int, case: str) -> dict:
    import torch.distributed as dist
    from torch._inductor import config as inductor_config

    if case == "rules" and rank == 1:
        os.environ["K3FUSE_RULES"] = "-oproj_allreduce_residual"   # a per-worker environment
    gen = torch.Generator().manual_seed(0)
    model = _OutProj(torch.randn(H, 8, generator=gen), torch.rand(H, generator=gen) + 0.5, dist.group.WORLD.group_name)
    x, residual = torch.randn(4, 8, generator=gen), torch.randn(4, H, generator=gen)
    log = k3fuse.RewriteLog()
    pass_ = k3fuse.inductor_pass({"tokens": (1, 64)}, group="torch", log=log)
    t0 = time.monotonic()
    try:
        with inductor_config.patch(post_grad_custom_post_pass=pass_, force_disable_caches=True), torch.no_grad(), \
                k3fuse.disable(case == "kill" and rank == 1):
            torch.compile(model)(x, residual)
        error = None
    except Exception as exc:   # noqa: BLE001
        error = str(exc)
    return {"error": error, "seconds": time.monotonic() - t0, "applied": log.applied()}


@pytest.mark.slow
@pytest.mark.parametrize(("case", "setting"), [("kill", "kill switch (K3FUSE_DISABLE / k3fuse.disable()): rank 0=False, "
                                                        "rank 1=True"),
                                               ("rules", "K3FUSE_RULES: rank 0='', rank 1='-oproj_allreduce_residual'")])
def test_ranks_that_would_rewrite_differently_raise_at_compile_time(case, setting):
    from k3fuse.dist import launch

    results = launch(_compile_door, 2, backend="gloo", args=(case,), timeout_s=150)
    for r in results:
        assert r["error"] is not None and "disagree on what decides their rewrites" in r["error"], r
        assert setting in r["error"], r
        assert r["seconds"] < 60, r


# --- one gloo launch: start-up failures, toggles, the smaller findings ----------------------------------
class _HostWorkspace(sw.ArWorkspace):
    """The parts of a fused workspace a CPU rank has: its group, its start barriers, its failure
    path (the device buffers are the GPU tests' business)."""

    def __init__(self, group_name: str, world: int, rank: int):   # noqa: D107 - no device allocation
        import torch.distributed as dist

        from k3fuse.compat import resolve_group

        self.group, self.group_name, self.world, self.rank, self.lane = (resolve_group(group_name), group_name, world,
                                                                         rank, "main")
        self.world_pg = dist.group.WORLD
        self.variants, self.failed, self.last_op = set(), None, "?"
        self.errs, self.notify_stream, self.device = [], None, torch.device("cpu")
        self.err_host = torch.zeros(4, dtype=torch.int32)

    def before_call(self, op: str) -> None:   # no CUDA stream to bind on a CPU rank
        self.raise_if_failed(op)
        self.last_op = op


def _start_up_failure(rank: int, group, what: str) -> tuple:
    """Both ranks make one fused call through run_collective; rank 1 fails in its compile (before
    the start barrier) or in allocating its workspace; rank 0 reaches the barrier."""
    op = "allreduce_rmsnorm"
    name = group.group_name

    def run(x, norm_weight, eps, group_name, world_size, max_tokens=64, **_):
        def launch(ws):
            if rank == 1 and what == "compile":
                raise RuntimeError("injected compile failure (the CuTe epilogue did not build)")
            ws.start_barrier((op, "test", x.shape[0]))
            return x, x
        return sw.run_collective(op, group_name, world_size, max_tokens, H, x.device, {}, launch)

    def workspace(group_name, world_size, max_tokens, hidden, device, lane="main", facts=None, op=op):
        if rank == 1 and what == "allocation":
            raise MemoryError("injected allocation failure (symmetric memory exhausted)")
        # what ArWorkspace does after its allocation: meet on the board before the rendezvous
        cg.barrier(group_name, op, "the allocation of the fused collectives' workspace")
        return _HostWorkspace(group_name, world_size, rank)

    impl = dispatch.Impl("test.run_collective", lambda spec: None, run, priority=10_000, device_types=("cpu",))
    saved = sw.get_workspace, sw.ArWorkspace, torch.cuda.is_current_stream_capturing
    torch.cuda.is_current_stream_capturing = lambda: False   # a CPU build's raises: nothing is ever captured here
    if what == "compile":
        sw.get_workspace = lambda *a, **k: _HostWorkspace(name, 2, rank)
    else:
        sw.ArWorkspace = workspace
    dispatch.register_impl(op, impl)
    try:
        first = _error(lambda: _tail(torch.ones(2, H), group))
        later = _error(lambda: _tail(torch.ones(2, H), group))
    finally:
        dispatch.unregister_impl(op, impl.name)
        sw.get_workspace, sw.ArWorkspace, torch.cuda.is_current_stream_capturing = saved
    return first, later


def _scenarios(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from k3fuse.kernels.lib.cute import compat
    from k3fuse.kernels.ops import decode_gemm, oproj_allreduce

    out: dict = {}
    # a rank blocked in a gloo collective gives up after 20 s: the old barriers waited that long
    groups = [dist.new_group([0, 1], timeout=timedelta(seconds=20)) for _ in range(4)]
    x = torch.ones(2, H)

    # 48.8: the spin bound is agreed like every path setting (first: before any agreement fixed them)
    if rank == 1:
        os.environ["K3FUSE_AR_TIMEOUT_S"] = "2"
    out["timeout"] = _error(lambda: _tail(x, groups[3]))
    os.environ.pop("K3FUSE_AR_TIMEOUT_S", None)

    # 48.4: a failed compile, a failed allocation
    out["compile"] = _start_up_failure(rank, groups[0], "compile")
    dist.barrier()
    out["allocation"] = _start_up_failure(rank, groups[1], "allocation")
    dist.barrier()

    # 48.5 / 48.8: agreed, then toggled on rank 1 only: refused, the predicates do not move
    g = groups[2]
    _tail(x, g)
    dispatch.load_gpu_impls()

    def predicates():
        return {"cute": compat.available(), "gemm_path": oproj_allreduce.gemm_path(2, 7168, 6144, torch.bfloat16),
                "gemv_max_m": decode_gemm.gemv_max_m(7168, 6144), "pdl": oproj_allreduce._pdl("gemv"),
                "protocol": sw.protocol(), "timeout": sw.timeout_s()}

    out["before"] = predicates()
    if rank == 1:
        os.environ.update(K3FUSE_DISABLE_CUTE="1", K3FUSE_GEMV_MAX_M="1", K3FUSE_AR_PDL="1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _tail(x, g)
    out["refused"] = sorted({str(w.message).split(" is ")[0].split(": ", 1)[1] for w in caught
                             if "refused" in str(w.message)})
    out["toggled"] = predicates()
    for name in ("K3FUSE_DISABLE_CUTE", "K3FUSE_GEMV_MAX_M", "K3FUSE_AR_PDL"):
        os.environ.pop(name, None)
    # a change every rank makes reaches the group through reagree: protocol() follows it
    os.environ["K3FUSE_AR_PROTOCOL"] = "flags"
    out["protocol_refused"] = sw.protocol()
    cg.reagree(g.group_name)
    out["protocol_reagreed"] = sw.protocol()
    del os.environ["K3FUSE_AR_PROTOCOL"]
    cg.reagree(g.group_name)
    return out


@pytest.fixture(scope="module")
def ranks():
    from k3fuse.dist import launch

    return launch(_scenarios, 2, backend="gloo", timeout_s=240)


@pytest.mark.slow
@pytest.mark.parametrize("what", ["compile", "allocation"])
def test_a_failed_start_up_on_one_rank_raises_on_every_rank_naming_it(ranks, what):
    injected = {"compile": "injected compile failure", "allocation": "injected allocation failure"}[what]
    r0, r1 = ranks
    kind, message, seconds = r0[what][0]
    assert kind == "CollectivePeerError", r0[what]
    assert "peer rank 1 of the group failed" in message and injected in message, message
    assert seconds < 10, seconds                                 # not the group's 20 s timeout
    assert injected in r1[what][0][1]
    for r in ranks:                                              # the group stays failed on every rank
        kind, message, _ = r[what][1]
        assert kind == "CollectivePeerError" and injected in message, r[what]


@pytest.mark.slow
def test_a_path_setting_changed_on_one_rank_changes_none_of_its_predicates(ranks):
    r0, r1 = ranks
    assert r1["refused"] == ["K3FUSE_AR_PDL", "K3FUSE_DISABLE_CUTE", "K3FUSE_GEMV_MAX_M"], r1["refused"]
    assert r0["refused"] == []
    for r in ranks:
        assert r["toggled"] == r["before"] == r0["before"], r
    assert r0["before"]["gemv_max_m"] == 2 and r0["before"]["pdl"] is False


@pytest.mark.slow
def test_protocol_follows_reagree(ranks):
    for r in ranks:
        assert (r["protocol_refused"], r["protocol_reagreed"]) == ("lamport", "flags"), r


@pytest.mark.slow
def test_the_spin_bound_is_agreed_across_ranks(ranks):
    for r in ranks:
        kind, message, _ = r["timeout"]
        assert kind == "CollectiveSettingsError", r["timeout"]
        assert "K3FUSE_AR_TIMEOUT_S: rank 0=5.0, rank 1=2.0" in message, message


# --- one process ---------------------------------------------------------------------------------------
def test_the_failure_board_names_the_earliest_failure():
    """Rank 1 fails first (its peer then times out waiting for it): the board names rank 1, the root
    cause, not rank 0, the lowest."""
    mapping = mmap.mmap(-1, 512 * 3)
    boards = [cg.FailureBoard(r, 3, mapping) for r in range(3)]
    assert boards[0].failed() is None
    boards[1].post("k3fuse.op: rank 1 failed: compile error")
    time.sleep(0.01)
    boards[0].post("k3fuse.op: rank 0 timed out waiting for peer rank 1")
    assert boards[2].failed() == (1, "k3fuse.op: rank 1 failed: compile error")


def test_the_group_table_is_created_once_under_concurrent_first_calls(monkeypatch):
    created = []
    create = cg._create

    def slow_create(*args):
        created.append(args)
        time.sleep(0.2)
        return create(*args)

    monkeypatch.setattr(cg, "_create", slow_create)
    name = f"lock-test-{os.getpid()}"
    threads = [threading.Thread(target=cg.enter, args=("allreduce_rmsnorm", name, 1, "cpu")) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(created) == 1, created
    cg._groups.pop(name, None)


def test_state_and_workspaces_of_a_destroyed_process_group_are_not_reused(tmp_path):
    """A process group destroyed and initialised again (same c10d names): the guard's state and the
    fused workspaces are made anew, not served from the dead group."""
    import torch.distributed as dist

    class Workspace:
        def __init__(self, *args, **kwargs):
            self.world_pg, self.group_name = dist.group.WORLD, args[0]

    seen = []
    saved = sw.ArWorkspace
    sw.ArWorkspace = Workspace
    try:
        for i in range(2):
            dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / f"store{i}"), 1), rank=0, world_size=1)
            name = dist.group.WORLD.group_name
            state = cg.enter("allreduce_rmsnorm", name, 1, "cpu")
            ws = sw.get_workspace(name, 1, 64, H, torch.device("cpu"))
            seen.append((state, state.group, ws, dist.group.WORLD))
            dist.destroy_process_group()
    finally:
        sw.ArWorkspace = saved
        cg._reset_for_tests()
        sw._workspaces.clear()
    (s1, g1, w1, _), (s2, g2, w2, world2) = seen
    assert s2 is not s1 and g2 is world2 and g2 is not g1
    assert w2 is not w1 and w2.world_pg is world2


@pytest.mark.parametrize("name,value", [("K3FUSE_DISABLE_CUTE", "1"), ("K3FUSE_DISABLE_TRITON", "1"),
                                        ("K3FUSE_AR_PROTOCOL", "flags"), ("K3FUSE_GEMV_MAX_M", "3")])
def test_the_pass_uuid_covers_every_setting_that_decides_a_gpu_rewrite(monkeypatch, name, value):
    """An Inductor cache entry written under one setting is never served under another."""
    monkeypatch.delenv(name, raising=False)
    base = k3fuse.inductor_pass(k3fuse.DecodeContext(), rules=[]).uuid()
    monkeypatch.setenv(name, value)
    assert k3fuse.inductor_pass(k3fuse.DecodeContext(), rules=[]).uuid() != base


def _cute_cache(tmp_path, **env) -> tuple[str, str]:
    code = ("import os, k3fuse.kernels.lib.cute.compat as c\n"
            "from cutlass.base_dsl import cache_helpers as h\n"
            "print(h.default_generated_ir_path, os.environ.get('CUTE_DSL_DISABLE_FILE_CACHING'))\n")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("CUTE_DSL_", "XDG_CACHE"))}
    res = subprocess.run([sys.executable, "-c", code], env={**clean, "HOME": str(tmp_path), **env},
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout.split()[-2], res.stdout.split()[-1] + "|" + res.stderr


def test_the_cute_dsl_file_cache_lives_where_only_this_user_writes(tmp_path):
    pytest.importorskip("cutlass")
    path, rest = _cute_cache(tmp_path)
    assert path == str(tmp_path / ".cache" / "k3fuse" / "cute-dsl") and rest.startswith("None"), (path, rest)
    st = os.stat(path)
    assert st.st_uid == os.geteuid() and st.st_mode & 0o077 == 0, oct(st.st_mode)
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)   # another user could plant a kernel here: the file cache goes off
    _, rest = _cute_cache(tmp_path, CUTE_DSL_CACHE_DIR=str(shared))
    assert rest.startswith("1|") and "kernel file cache is off" in rest, rest
