"""The collective guard on CPU (kernels/collective_guard.py): agreement of the path-deciding settings
across gloo ranks, refused per-rank toggles, world sizes that differ from the group, the failure
board (a rank that fails at any point of a call: every peer raises at its next call), collective
errors in `k3fuse.stats()`, and the compile-time decline of weights no fused collective reads.

Every multi-rank scenario runs in one 2-rank gloo launch, each on its own `new_group` (a failed group
stays failed), under the launcher's timeout: a hang fails the test instead of blocking it.
"""
from __future__ import annotations

import contextlib
import os
import warnings
from datetime import timedelta

import pytest
import torch
import torch.fx as fx

import k3fuse
from k3fuse.kernels import collective_guard as cg
from k3fuse.kernels import dispatch

EPS = 1e-6
L = 16


def _tail(x, group, world=2):
    return torch.ops.k3fuse.allreduce_rmsnorm(x, torch.ones(L), EPS, group.group_name, world, 64)


def _error(fn):
    """The error fn raised as (type name, message), or None."""
    try:
        fn()
    except Exception as exc:   # noqa: BLE001 - the scenarios compare what each rank raised
        return type(exc).__name__, str(exc)
    return None


@contextlib.contextmanager
def _winning_impl(name: str, run):
    """`run` registered as allreduce_rmsnorm's CPU impl, ahead of every other, for the block."""
    impl = dispatch.Impl(name, accepts=lambda spec: None, run=run, priority=10_000, device_types=("cpu",))
    dispatch.register_impl("allreduce_rmsnorm", impl)
    try:
        yield
    finally:
        dispatch.unregister_impl("allreduce_rmsnorm", impl.name)


def _scenarios(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from k3fuse import runtime

    out: dict = {}
    x = torch.full((2, L), float(rank + 1))
    # a rank blocked in a gloo collective of groups[6] gives up after 5 s; the others wait longer
    # (the two ranks share two busy cores: their first calls can be seconds apart)
    groups = [dist.new_group([0, 1], timeout=timedelta(seconds=5 if i == 6 else 120)) for i in range(7)]

    # 0. at compile time: a context from the group agrees what decides the rewrites
    with k3fuse.disable(rank == 0):
        out["context"] = _error(lambda: k3fuse.DecodeContext.from_process_group())
    # 1. the kill switch on one rank only: one clear error on every rank, before any collective
    with k3fuse.disable(rank == 0):
        out["kill"] = _error(lambda: _tail(x, groups[0]))
    # 2. strict mode on one rank only, and K3FUSE_AR_PROTOCOL differing (read from the environment)
    with k3fuse.strict(rank == 1):
        out["strict"] = _error(lambda: _tail(x, groups[1]))
    os.environ["K3FUSE_AR_PROTOCOL"] = "flags" if rank else "lamport"
    out["protocol"] = _error(lambda: _tail(x, groups[2]))
    del os.environ["K3FUSE_AR_PROTOCOL"]

    # 3. agreed, then a per-rank toggle: refused (warned), both ranks keep the agreed path
    g = groups[3]
    s0, _ = _tail(x, g)
    with warnings.catch_warnings(record=True) as caught, k3fuse.disable(rank == 0):
        warnings.simplefilter("always")
        s1, _ = _tail(x, g)
    out["refused_warning"] = [str(w.message) for w in caught if "refused" in str(w.message)]
    out["refused_sums"] = (s0[0, 0].item(), s1[0, 0].item())
    # ... and applied to the whole group: every rank changes it, then reagree (collective)
    runtime.reset_stats()
    with k3fuse.disable():
        cg.reagree(g.group_name)
        _tail(x, g)
    cg.reagree(g.group_name)
    out["applied"] = runtime.stats().get("allreduce_rmsnorm")
    # strict mode may differ per rank later: the fallback (3 tokens > max_tokens 2: the stock
    # sequence) runs its all-reduce on both ranks, then raises on the strict rank only
    with k3fuse.strict(rank == 1):
        out["late_strict"] = _error(lambda: torch.ops.k3fuse.allreduce_rmsnorm(
            torch.ones(3, L), torch.ones(L), EPS, g.group_name, 2, 2))

    # 4. world_size differing from the group: every path raises on every rank
    g = groups[4]
    out["ws_reference"] = _error(lambda: _tail(x, g, world=1))
    with k3fuse.disable():
        out["ws_stock"] = _error(lambda: _tail(x, g, world=1))
    from k3fuse.kernels.lib.reference import allreduce

    out["ws_direct_reference"] = _error(lambda: allreduce.allreduce_rmsnorm(x, torch.ones(L), EPS,
                                                                            g.group_name, 1))

    # 5. a rank fails after its collective (the peer's call completed): the peer's next call raises,
    #    naming the failed rank and its reason; the failed rank's later calls raise too
    g = groups[5]
    _tail(x, g)
    with _winning_impl("test.fails_on_rank1", _fail_after_reduce):
        out["after_call"] = _error(lambda: _tail(x, g))
    dist.barrier()    # WORLD: rank 1 has posted its failure (it does so as it raises)
    out["after_next"] = _error(lambda: _tail(x, g))
    out["after_check"] = _error(cg.check_collectives)

    # 6. a rank fails before its collective: the peer's reduce gives up at the group's timeout, and
    #    from then on every call of every rank raises (no rank continues out of step)
    g = groups[6]
    dist.barrier()
    _tail(x, g)
    with _winning_impl("test.fails_early_on_rank1", _fail_before_reduce):
        out["before_call"] = _error(lambda: _tail(x, g))
    dist.barrier()    # WORLD: both ranks are past the failed call
    out["before_next"] = _error(lambda: _tail(x, g))
    out["errors"] = runtime.collective_errors()
    return out


def _fail_after_reduce(x, norm_weight, eps, group_name, world_size, max_tokens=64, **_):
    import torch.distributed as dist

    from k3fuse.kernels.lib.reference import allreduce

    result = allreduce.allreduce_rmsnorm(x, norm_weight, eps, group_name, world_size)
    if dist.get_rank() == 1:
        raise RuntimeError("injected failure after the reduce")
    return result


def _fail_before_reduce(x, norm_weight, eps, group_name, world_size, max_tokens=64, **_):
    import torch.distributed as dist

    from k3fuse.kernels.lib.reference import allreduce

    if dist.get_rank() == 1:
        raise MemoryError("injected staging failure before the reduce")
    return allreduce.allreduce_rmsnorm(x, norm_weight, eps, group_name, world_size)


@pytest.fixture(scope="module")
def ranks():
    from k3fuse.dist import launch

    return launch(_scenarios, 2, backend="gloo", timeout_s=180)


def test_a_setting_on_one_rank_is_one_clear_error_on_every_rank(ranks):
    for rank, r in enumerate(ranks):
        for key, setting, values in (("kill", "kill switch", "rank 0=True, rank 1=False"),
                                     ("strict", "strict mode", "rank 0=False, rank 1=True"),
                                     ("protocol", "K3FUSE_AR_PROTOCOL", "rank 0='lamport', rank 1='flags'")):
            kind, message = r[key]
            assert kind == "CollectiveSettingsError", (rank, key, r[key])
            assert setting in message and values in message, (rank, key, message)
            assert "group" in message and "every rank" in message


def test_a_context_from_the_group_agrees_the_rewrite_settings(ranks):
    for r in ranks:
        kind, message = r["context"]
        assert kind == "ContextError" and "kill switch" in message and "rank 0=True, rank 1=False" in message


def test_a_later_per_rank_toggle_is_refused_and_a_group_wide_one_applied(ranks):
    assert ranks[0]["refused_warning"] and "kill switch" in ranks[0]["refused_warning"][0]
    assert "reagree" in ranks[0]["refused_warning"][0]
    assert ranks[1]["refused_warning"] == []
    for r in ranks:
        assert r["refused_sums"] == (3.0, 3.0)          # both calls summed over both ranks
        assert r["applied"] == {"fallback:disabled": 1}  # the stock path, on every rank, together


def test_strict_mode_toggled_on_one_rank_later_raises_there_without_a_hang(ranks):
    assert ranks[0]["late_strict"] is None
    kind, message = ranks[1]["late_strict"]
    assert kind == "K3FuseFallbackError" and "tokens 3 outside [1, 2]" in message


def test_a_world_size_that_differs_from_the_group_raises_on_every_path(ranks):
    for rank, r in enumerate(ranks):
        for key in ("ws_reference", "ws_stock", "ws_direct_reference"):
            kind, message = r[key]
            assert kind == "ValueError", (rank, key, r[key])
            assert "world_size 1" in message and "2 ranks" in message, (rank, key, message)


def test_a_failure_after_the_collective_reaches_every_rank_at_its_next_call(ranks):
    r0, r1 = ranks
    assert r0["after_call"] is None                               # its call completed
    assert "injected failure after the reduce" in r1["after_call"][1]
    kind, message = r0["after_next"]
    assert kind == "CollectivePeerError", r0["after_next"]
    assert "peer rank 1 of the group failed" in message and "injected failure after the reduce" in message
    assert r0["after_check"][0] == "CollectivePeerError"          # the post-step check says it too
    kind, message = r1["after_next"]
    assert kind == "CollectivePeerError" and "earlier collective call failed" in message


def test_a_failure_before_the_collective_fails_every_rank(ranks):
    r0, r1 = ranks
    assert "injected staging failure" in r1["before_call"][1]
    assert r0["before_call"] is not None                          # gave up at the group's timeout
    for r in ranks:
        assert r["before_next"][0] == "CollectivePeerError", r["before_next"]


def test_collective_errors_are_in_stats(ranks):
    r0, r1 = ranks
    assert r0["errors"]["allreduce_rmsnorm"].get("error:peer failure", 0) >= 1, r0["errors"]
    assert r1["errors"]["allreduce_rmsnorm"].get("error:failure", 0) >= 1, r1["errors"]
    for r in ranks:   # the two dispatched calls with a wrong world_size (reference, stock)
        assert r["errors"]["allreduce_rmsnorm"].get("error:world_size") == 2, r["errors"]


# --- one process ---------------------------------------------------------------------------------
def test_world_size_above_one_without_a_process_group_raises():
    with pytest.raises(RuntimeError, match="world_size=2 but torch.distributed is not initialized"):
        torch.ops.k3fuse.allreduce_rmsnorm(torch.randn(2, L), torch.ones(L), EPS, "nowhere", 2, 64)
    with k3fuse.disable(), pytest.raises(RuntimeError, match="world_size=2"):   # the stock path too
        torch.ops.k3fuse.allreduce_rmsnorm(torch.randn(2, L), torch.ones(L), EPS, "nowhere", 2, 64)


@pytest.mark.parametrize("bad", ["inf", "-inf", "nan", "1e10", "1e-10", "0", "-1"])
def test_timeout_outside_1ms_to_1h_names_the_variable_and_the_range(monkeypatch, bad):
    from k3fuse.kernels import collective as sw

    monkeypatch.delenv("K3FUSE_AR_TIMEOUT_MS", raising=False)
    monkeypatch.setenv("K3FUSE_AR_TIMEOUT_S", bad)
    with pytest.raises(ValueError, match=r"K3FUSE_AR_TIMEOUT_S=.*0\.001 to 3600 s \(1 ms to 1 h\)"):
        sw.timeout_ns()
    monkeypatch.delenv("K3FUSE_AR_TIMEOUT_S")
    monkeypatch.setenv("K3FUSE_AR_TIMEOUT_MS", "5e6")
    with pytest.raises(ValueError, match=r"K3FUSE_AR_TIMEOUT_MS=.*1 to 3.6e\+06 ms"):
        sw.timeout_ns()


@pytest.mark.parametrize("seconds", ["0.001", "3600", "5"])
def test_timeout_in_range_fits_int64_nanoseconds(monkeypatch, seconds):
    from k3fuse.kernels import collective as sw

    monkeypatch.setenv("K3FUSE_AR_TIMEOUT_S", seconds)
    ns = sw.timeout_ns()
    assert ns == round(float(seconds) * 1e9) and 0 < ns < 2**63


def test_the_kernels_decline_weights_they_cannot_read(monkeypatch):
    from k3fuse.kernels.lib.cute import compat
    from k3fuse.kernels.ops import oproj_allreduce as op

    monkeypatch.setattr(compat, "available", lambda: True)   # the predicate past its toolchain check
    accepts = op._accepts("lamport")
    bf = torch.bfloat16
    site = dict(H=7168, K=6144, dtype=bf, res_dtype=bf, addend=False, norm_dtype=None, world_size=2, max_tokens=64)
    ok = accepts(op.OProjSpec(**site, w_dtype=bf))
    assert ok is None or "weight" not in ok, ok        # (CPU: the GEMM path may be missing, never the weight)
    for w_dtype in (torch.float8_e4m3fn, torch.int8, torch.float32):
        why = accepts(op.OProjSpec(**site, w_dtype=w_dtype))
        assert why is not None and str(w_dtype) in why, why
    assert "3-D" in accepts(op.OProjSpec(**site, w_dtype=bf, w_dims=3))


def _node(val) -> fx.Node:
    graph = fx.Graph()
    node = graph.placeholder("w")
    node.meta["val"] = val
    return node


def test_the_rules_decline_unsupported_weights_at_compile_time_with_the_reason():
    from k3fuse.patterns._pattern_tools import collective_weight

    bf = torch.bfloat16
    assert collective_weight(_node(torch.empty(8, 4, dtype=bf)), "weight", bf) is None
    fp8 = collective_weight(_node(torch.empty(8, 4, dtype=torch.float8_e4m3fn)), "weight", bf)
    assert fp8.guard == "weight_dtype" and "float8_e4m3fn" in str(fp8.values), fp8
    transposed = collective_weight(_node(torch.empty(4, 8, dtype=bf).t()), "weight", bf)
    assert transposed.guard == "weight_layout" and "contiguous" in transposed.message, transposed
    assert collective_weight(_node(torch.empty(8, dtype=torch.float32)), "norm_weight", bf, dims=1) is None
    int8 = collective_weight(_node(torch.empty(8, dtype=torch.int8)), "norm_weight", bf, dims=1)
    assert int8.guard == "weight_dtype"


def test_the_compile_door_checks_the_collectives_after_each_call(monkeypatch):
    """backend="k3fuse" at TP > 1 wraps each compiled graph: after every call, check_collectives
    (a collective that failed inside a replayed graph, here or on a peer, raises there)."""
    from k3fuse import backend

    calls = []
    run = backend._with_collective_check(lambda *a: calls.append(a) or "y")
    assert run(1) == "y" and k3fuse.check_collectives is cg.check_collectives
    state = cg.GroupState("test-failed", 2, 0, None, {})
    state.failed = "rank 1 failed: injected"
    monkeypatch.setitem(cg._groups, "test-failed", state)
    with pytest.raises(cg.CollectivePeerError, match="injected"):
        run(2)
    assert calls == [(1,), (2,)]


def test_run_collective_fails_the_workspace_on_an_error_before_the_push(monkeypatch):
    """collective.run_collective: an error anywhere in the call (the stream check, staging,
    compile, launch) fails the workspace (err words to every peer, the failure board) and re-raises;
    the fused ops call it (a stand-in workspace here: the real one needs GPUs)."""
    from k3fuse.kernels import collective as sw

    calls: list = []

    class Workspace:
        def before_call(self, op):
            calls.append("before_call")

        def fail(self, op, reason, kind="failure"):
            calls.append(("fail", op, reason, kind))

    class BusyWorkspace(Workspace):
        def before_call(self, op):
            raise sw.WorkspaceStreamError("in use on another stream")

    def staging(ws):
        raise torch.cuda.OutOfMemoryError("staging copy")

    for ws, body, want in ((Workspace(), staging, ("fail", "op", "OutOfMemoryError: staging copy", "failure")),
                           (BusyWorkspace(), staging,
                            ("fail", "op", "WorkspaceStreamError: in use on another stream", "stream"))):
        calls.clear()
        monkeypatch.setattr(sw, "get_workspace", lambda *a, ws=ws, **k: ws)
        with pytest.raises((torch.cuda.OutOfMemoryError, sw.WorkspaceStreamError)):
            sw.run_collective("op", "g", 2, 64, 16, torch.device("cpu"), {}, body)
        assert calls[-1] == want, calls
    calls.clear()
    monkeypatch.setattr(sw, "get_workspace", lambda *a, **k: Workspace())
    assert sw.run_collective("op", "g", 2, 64, 16, torch.device("cpu"), {}, lambda ws: "out") == "out"
    assert calls == ["before_call"]
