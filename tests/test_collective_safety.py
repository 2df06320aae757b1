"""Issue 10 on CPU: the fused all-reduce's protocol arithmetic, shared-facts decisions, timeouts,
group-rank warm-up, cross-rank agreement and the no-per-rank-fallback rule for collective ops.

The kernels themselves run only on GPUs (tests/gpu/test_collective_safety_gpu.py); what they
compute from the protocol words is mirrored in kernels/collective.py (`advance`,
`reset_buffer`, `flag_arrived`) and simulated here with several ranks in arbitrary interleavings,
starting the counter near every wrap point.
"""
from __future__ import annotations

import dataclasses

import random

import pytest
import torch

import k3fuse.kernels  # noqa: F401
from k3fuse.kernels import collective as sw
from k3fuse.kernels import dispatch

SENT = object()   # the Lamport sentinel (-0.0)


def _c_rem(a: int, b: int) -> int:
    """C / PTX rem.s32: the sign follows the dividend."""
    q = abs(a) // abs(b)
    return a - b * (q if (a >= 0) == (b > 0) else -q)


def _i32(v: int) -> int:
    v %= 2**32
    return v - 2**32 if v >= 2**31 else v


def test_old_int32_index_was_broken_new_rotation_is_not():
    """What the old code did: int32 g % 3 is negative after 2^31 calls and skips a buffer at the
    2^32 wrap. The new buffer index is a rotated word in {0, 1, 2}."""
    assert _c_rem(_i32(2**31), 3) < 0                       # negative index: stores before the buffer
    seq = [(g % 2**32) % 3 for g in range(2**32 - 2, 2**32 + 2)]   # even unsigned: 2^32 % 3 != 0
    assert seq == [2, 0, 0, 1]                               # buffer 0 twice in a row at the wrap
    gen = (2**63 - 2, 0, 0, 1)
    seen = []
    for _ in range(10):
        gen = sw.advance(gen, rows=1)
        seen.append(gen[3])
        assert gen[3] in (0, 1, 2) and sw.reset_buffer(gen[3]) in (0, 1, 2)
        assert sw.reset_buffer(gen[3]) == (gen[3] + 2) % 3
    assert seen == [(2 + i) % 3 for i in range(10)]
    assert gen[0] < 0                                        # the epoch itself wrapped ...


@pytest.mark.parametrize("start", [0, 2**31 - 3, 2**32 - 3, 2**63 - 3, -5])
def test_flag_epochs_are_wrap_safe(start):
    """... and the flag comparison is a signed 64-bit difference, right across the wrap."""
    e = start
    for _ in range(8):
        assert not sw.flag_arrived(e, e)                    # flag still at the previous epoch
        assert sw.flag_arrived(sw.wrap_i64(e + 1), e)       # released for this call
        assert sw.flag_arrived(sw.wrap_i64(e + 2), e)       # a peer one call ahead
        assert not sw.flag_arrived(sw.wrap_i64(e - 100), e)  # a row unused for 100 calls
        e = sw.wrap_i64(e + 1)


class _Rank:
    def __init__(self, r: int, world: int, start: int, H: int = 3):
        self.r, self.world, self.H = r, world, H
        self.data = [[[SENT] * H for _ in range(world)] for _ in range(3)]
        self.flags = [start] * world
        self.gen = (start, 0, 0, 0)
        self.call = 0
        self.phase = "push"
        self.results: list = []


def _simulate(world: int, start: int, protocol: str, calls: int, seed: int) -> None:
    """Every rank: push (GEMM epilogue: its slot of buffer gen[3] on every rank), then the
    all-reduce epilogue (Lamport: reset buffer reset_buffer(b), wait for no sentinel; flags:
    release epoch+1 to every rank, wait for flag_arrived). A random scheduler interleaves the
    ranks; a waiting rank cannot advance. The sums must be exactly each call's values."""
    rng = random.Random(seed)
    ranks = [_Rank(r, world, start) for r in range(world)]
    value = lambda call, r, i: 1000 * call + 10 * r + i   # noqa: E731

    def can_finish(me: _Rank) -> bool:
        b = me.gen[3]
        if protocol == "lamport":
            return all(x is not SENT for s in range(world) for x in me.data[b][s])
        return all(sw.flag_arrived(me.flags[s], me.gen[0]) for s in range(world))

    steps = 0
    while any(k.call < calls for k in ranks):
        steps += 1
        assert steps < 100_000, "deadlock"
        me = rng.choice([k for k in ranks if k.call < calls])
        b = me.gen[3]
        if me.phase == "push":
            for peer in ranks:   # remote stores into slot [me.r] of buffer b
                assert peer.data[b][me.r] == [SENT] * me.H or protocol == "flags", \
                    f"rank {me.r} overwrote unread data of rank {peer.r}"
                peer.data[b][me.r] = [value(me.call, me.r, i) for i in range(me.H)]
            me.phase = "release"
        elif me.phase == "release":
            if protocol == "lamport":
                bc = sw.reset_buffer(b)
                me.data[bc] = [[SENT] * me.H for _ in range(world)]
            else:
                for peer in ranks:
                    peer.flags[me.r] = sw.wrap_i64(me.gen[0] + 1)
            me.phase = "wait"
        elif can_finish(me):
            got = [sum(me.data[b][s][i] for s in range(world)) for i in range(me.H)]
            want = [sum(value(me.call, s, i) for s in range(world)) for i in range(me.H)]
            assert got == want, f"rank {me.r} call {me.call}: read {got}, want {want}"
            me.gen = sw.advance(me.gen, rows=1)
            me.call += 1
            me.phase = "push"


@pytest.mark.parametrize("protocol", ["lamport", "flags"])
@pytest.mark.parametrize("start", [0, 2**31 - 4, 2**32 - 4, 2**63 - 4])
def test_protocol_simulation_across_the_wrap(protocol, start):
    for seed in range(6):
        _simulate(world=3 if seed % 2 else 2, start=start, protocol=protocol, calls=12, seed=seed)


# --- settings ---------------------------------------------------------------------------------------
def test_timeout_setting(monkeypatch):
    monkeypatch.delenv("K3FUSE_AR_TIMEOUT_S", raising=False)
    monkeypatch.delenv("K3FUSE_AR_TIMEOUT_MS", raising=False)
    assert sw.timeout_s() == sw.DEFAULT_TIMEOUT_S and 1 <= sw.DEFAULT_TIMEOUT_S <= 10
    monkeypatch.setenv("K3FUSE_AR_TIMEOUT_MS", "200")
    assert sw.timeout_s() == pytest.approx(0.2)
    monkeypatch.setenv("K3FUSE_AR_TIMEOUT_S", "2.5")        # the own setting wins
    assert sw.timeout_s() == 2.5 and sw.timeout_ns() == 2_500_000_000
    for bad in ("0", "-1", "soon"):
        monkeypatch.setenv("K3FUSE_AR_TIMEOUT_S", bad)
        with pytest.raises(ValueError, match="K3FUSE_AR_TIMEOUT_S"):
            sw.timeout_s()


def test_start_generation_setting(monkeypatch):
    monkeypatch.setenv("K3FUSE_AR_START_GENERATION", hex(2**63 - 10))
    assert sw.start_generation() == 2**63 - 10
    monkeypatch.setenv("K3FUSE_AR_START_GENERATION", str(2**63))
    with pytest.raises(ValueError):
        sw.start_generation()


def test_stream_lane_is_scoped():
    assert sw.current_lane() == "main"
    with sw.stream_lane("overlap1"):
        assert sw.current_lane() == "overlap1"
    assert sw.current_lane() == "main"


# --- decisions from shared facts ------------------------------------------------------------------
def test_predicate_uses_shared_facts_only(monkeypatch):
    from k3fuse.kernels.ops import oproj_allreduce as g

    dispatch.load_gpu_impls()
    accepts = g._accepts("lamport")
    bf = torch.bfloat16
    spec = g.OProjSpec(H=7168, K=6144, dtype=bf, res_dtype=bf, addend=False, norm_dtype=bf, world_size=2,
                       max_tokens=64)
    assert accepts(spec) is None
    assert accepts(dataclasses.replace(spec, tokens=64, addend=True, norm_dtype=None)) is None
    assert "tokens" in accepts(spec.with_tokens(65))
    assert "dtype" in accepts(dataclasses.replace(spec, dtype=torch.float32, res_dtype=torch.float32))
    assert "world_size" in accepts(dataclasses.replace(spec, world_size=9))
    assert "K3FUSE_AR_PROTOCOL" in g._accepts("flags")(spec)
    from k3fuse.kernels.lib.cute import compat

    monkeypatch.setattr(compat, "available", lambda: False)
    assert "CuTe" in accepts(spec)
    import inspect

    src = inspect.getsource(g.OProjSpec) + inspect.getsource(g._accepts) + inspect.getsource(g.gemm_path)
    assert "data_ptr" not in src and "broken" not in src    # no pointers, no per-rank state


def test_spec_ignores_alignment():
    """Misaligned views (same shapes) get the same Spec, so the same answer: they are staged."""
    from k3fuse.kernels import collective
    from k3fuse.kernels.ops import oproj_allreduce as g

    H, K = 512, 256
    w = torch.zeros(H, K, dtype=torch.bfloat16)
    base = torch.zeros(2 * H + 8, dtype=torch.bfloat16)
    res_al, res_mis = base[:2 * H].view(2, H), base[1:2 * H + 1].view(2, H)   # 2-byte offset
    xb = torch.zeros(2 * K + 8, dtype=torch.bfloat16)
    x_al, x_mis = xb[:2 * K].view(2, K), xb[3:2 * K + 3].view(2, K)
    assert res_mis.data_ptr() % 16 and x_mis.data_ptr() % 16
    a = g.OProjSpec.from_call(x_al, w, res_al, None, "0", 2, max_tokens=64)
    b = g.OProjSpec.from_call(x_mis, w, res_mis, None, "0", 2, max_tokens=64)
    assert a == b
    st = collective.staged(res_mis)
    assert st.data_ptr() % 16 == 0 and torch.equal(st, res_mis)
    assert collective.staged(res_al) is res_al


# --- collective ops never fall back per rank ------------------------------------------------------
@pytest.fixture
def raising_impl():
    names = []

    def add(op, run=None, accepts=None):
        def boom(*a, **k):
            raise ValueError("kernel exploded")
        impl = dispatch.Impl("test.raising", accepts=accepts or (lambda spec: None), run=run or boom,
                             priority=10_000, device_types=("cpu",))
        dispatch.register_impl(op, impl)
        names.append(op)
    yield add
    for op in names:
        dispatch.unregister_impl(op, "test.raising")


def _ar_args():
    x = torch.randn(2, 16)
    w = torch.randn(8, 16)
    res = torch.randn(2, 8)
    return (x, w, res, None, "0", 1)


def test_collective_impl_failure_raises_not_falls_back(raising_impl):
    raising_impl("gemm_ar_residual")
    with pytest.raises(dispatch.K3FuseCollectiveError, match="gemm_ar_residual.*test.raising.*kernel exploded"):
        dispatch.dispatch("gemm_ar_residual", *_ar_args(), max_tokens=64)
    assert "test.raising" not in dispatch._entry("gemm_ar_residual").broken   # not disabled per rank
    with pytest.raises(dispatch.K3FuseCollectiveError):                       # and again next call
        dispatch.dispatch("gemm_ar_residual", *_ar_args(), max_tokens=64)


def test_collective_predicate_failure_raises(raising_impl):
    def bad_accepts(spec):
        raise KeyError("rank-local state")
    raising_impl("gemm_ar_residual", accepts=bad_accepts)
    with pytest.raises(dispatch.K3FuseCollectiveError, match="accepts raised"):
        dispatch.dispatch("gemm_ar_residual", *_ar_args(), max_tokens=64)


def test_collective_error_passes_through(raising_impl):
    def timeout(*a, **k):
        raise sw.CollectiveTimeoutError("k3fuse.gemm_ar_residual: rank 0 timed out waiting for peer rank 1")
    raising_impl("gemm_ar_residual", run=timeout)
    with pytest.raises(sw.CollectiveTimeoutError, match="peer rank 1"):
        dispatch.dispatch("gemm_ar_residual", *_ar_args(), max_tokens=64)


def test_non_collective_op_still_falls_back(raising_impl):
    raising_impl("decode_gemm")
    try:
        with pytest.warns(RuntimeWarning, match="disabled for this process"):
            y = dispatch.dispatch("decode_gemm", torch.randn(2, 16), torch.randn(8, 16), None, None)
        assert y.shape == (2, 8)
    finally:
        dispatch._entry("decode_gemm").broken.clear()


# --- multi-rank (gloo): group-rank warm-up and agreement ------------------------------------------
def _ranks_body(rank, world):
    import torch.distributed as dist

    from k3fuse.kernels import collective as g

    out = {}
    sub_a = dist.new_group([0, 1])
    sub_b = dist.new_group([2, 3])
    mine = sub_a if rank < 2 else sub_b
    name = mine.group_name
    out["warm_rank"] = g.warmup_rank({"world_size": 2, "group": name})
    try:
        g.warmup_rank({"world_size": 2})
        out["no_group"] = "no error"
    except ValueError as exc:
        out["no_group"] = str(exc)
    out["world_rank"] = g.warmup_rank({"world_size": 4})
    # agreement: identical facts pass, a differing fact raises on every rank of the group
    sw._agree(mine, {"protocol": "lamport", "hidden": 7168}, "test")
    try:
        sw._agree(mine, {"protocol": "flags" if rank % 2 else "lamport"}, "test workspace")
        out["agree"] = "no error"
    except sw.CollectiveError as exc:
        out["agree"] = str(exc)
    return out


def test_group_rank_warmup_and_agreement_on_sub_groups():
    from k3fuse.dist import launch

    res = launch(_ranks_body, 4, backend="gloo", timeout_s=240)
    for rank, r in enumerate(res):
        assert r["warm_rank"] == rank % 2, r               # the rank within the TP sub-group
        assert r["world_rank"] == rank
        assert "pass the TP group's name" in r["no_group"]
        assert "ranks disagree" in r["agree"] and "protocol" in r["agree"], r
        assert "rank 0=" in r["agree"] and "rank 1=" in r["agree"]
