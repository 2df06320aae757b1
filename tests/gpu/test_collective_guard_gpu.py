"""The collective guard on GPUs (kernels/collective_guard.py, kernels/collective.py), at world 1 on
one H200 and at world 2 on two (skipped, saying so, with fewer GPUs):

- test_failure_before_the_push_fails_every_rank: the last rank's staging raises (an injected
  out-of-memory) before it pushes; that rank raises, every later call of every rank raises (never a
  sum of a stale partial read as fresh), within the bound, and stats count the error.
- test_cold_start_under_the_default_bound: empty Triton cache, no K3FUSE_AR_TIMEOUT_S (the 5 s
  default); at world 2 the last rank compiles 6 s slower (each first compile delayed). The first
  calls of every variant pass (the start barrier), the results match float64; prints the start-up
  time of the first calls (docs/perf.md asks for it).
- test_replayed_graph_whose_peer_never_arrives: a captured graph whose push is missing (world 1:
  the push left out of the capture; world 2: the peer stops replaying); `check_collectives()`
  raises on the host, naming the op and the peer, on every rank, and stats count it.
- test_two_graphs_replayed_concurrently_match_sequential_replays: two graphs with split-K GEMMs
  (K3's N = 3584 / 2240 decode shapes, split > 1), captured without an explicit stream, replayed
  concurrently on two streams: bitwise the outputs of sequential replays (private scratch).
- test_a_setting_that_differs_between_ranks_raises_on_every_rank (2 GPUs): K3FUSE_AR_PROTOCOL, then
  the kill switch, differing between the ranks: one CollectiveSettingsError on each rank naming the
  setting and both ranks' values, before any push; nothing hangs.
- test_weights_the_kernels_cannot_read_are_declined_at_compile_time: the kernels' coverage names
  the weight dtype for fp8 / int8 / fp32 weights with a bf16 x, at every token count.

Run (one H200: the world-1 cases; two: all):
  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
      python -m pytest -m gpu -o addopts= -rA tests/gpu/test_collective_guard_gpu.py
"""
from __future__ import annotations

import os
import time

import pytest
import torch

from ar_helpers import captured_rmsnorm_tail, check_stopped_rank_learns, spawn

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

H, K, MAX_T, EPS = 4096, 2048, 64, 1e-5
WORLDS = [pytest.param(1, id="world1"), pytest.param(2, id="world2")]


def _weights(dev, rank, world, dist):
    g = torch.Generator(device=dev).manual_seed(5 + rank)
    w = torch.randn(H, K, device=dev, dtype=torch.bfloat16, generator=g) / K ** 0.5
    nw = torch.randn(H, device=dev, dtype=torch.bfloat16)
    dist.broadcast(nw, 0)
    return w, nw


def _inputs(dev, rank, T, seed, dist):
    g = torch.Generator(device=dev).manual_seed(seed * 7 + rank)
    x = torch.randn(T, K, device=dev, dtype=torch.bfloat16, generator=g)
    res = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    dist.broadcast(res, 0)
    return x, res


def _check(dist, x, w, res, nw, out, normed, what):
    p = x.double() @ w.double().T
    dist.all_reduce(p)
    t = p + res.double()
    n = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + EPS) * nw.double()
    for y, ref, name in ((out, t, "out"), (normed, n, "normed")):
        assert torch.isfinite(y.float()).all(), f"{what} {name}: not finite"
        rel = ((y.double() - ref).norm() / ref.norm()).item()
        assert rel < 1e-2, f"{what} {name}: rel err {rel:.2e}"


def _op(x, w, res, nw, group, world):
    return torch.ops.k3fuse.gemm_ar_residual_rmsnorm(x, w, res, None, nw, EPS, group, world, MAX_T)


# --- item 1: a rank-local failure before the push ---------------------------------------------------
def _failure_before_push(rank, world):
    import torch.distributed as dist

    import k3fuse.kernels  # noqa: F401
    from k3fuse import runtime
    from k3fuse.kernels import collective as sw, dispatch

    dev = torch.device("cuda", rank)
    group = dist.group.WORLD.group_name
    w, nw = _weights(dev, rank, world, dist)
    x, res = _inputs(dev, rank, 1, 1, dist)
    out, normed = _op(x, w, res, nw, group, world)          # healthy: workspace and kernels exist
    _check(dist, x, w, res, nw, out, normed, "healthy")
    torch.cuda.synchronize()
    dist.barrier()
    runtime.reset_stats()
    failing = rank == world - 1
    if failing:
        def oom(t):
            raise torch.cuda.OutOfMemoryError("injected out-of-memory while staging")
        sw.staged = oom
    x2, res2 = _inputs(dev, rank, 1, 2, dist)
    t0 = time.perf_counter()
    first = None
    try:
        got = _op(x2, w, res2, nw, group, world)
        torch.cuda.synchronize()
        # a peer that pushed: this call's outputs are NaN (never the stale partial as a value)
        assert torch.isnan(got[0].float()).all(), f"rank {rank}: a finite result after a peer failed"
    except dispatch.K3FuseCollectiveError as exc:
        first = str(exc)
    if failing:
        assert first is not None and "injected out-of-memory" in first, first
    later = []
    for _ in range(3):        # every later call of every rank raises: the group stays failed
        try:
            _op(x2, w, res2, nw, group, world)
            torch.cuda.synchronize()
            sw.check_errors()
        except dispatch.K3FuseCollectiveError as exc:
            later.append(str(exc))
    took = time.perf_counter() - t0
    assert len(later) == 3, f"rank {rank}: {later}"
    if world > 1 and not failing:
        assert any(f"rank {world - 1}" in e for e in later), later   # names the failed peer
    assert took < 3 * (sw.timeout_s() + 3), f"rank {rank}: {took:.1f} s"
    errors = runtime.collective_errors()
    assert errors.get("gemm_ar_residual_rmsnorm"), errors


@pytest.mark.parametrize("world", WORLDS)
def test_failure_before_the_push_fails_every_rank(world):
    spawn(_failure_before_push, world, K3FUSE_AR_TIMEOUT_S="2")


# --- item 3: a cold start under the default bound ----------------------------------------------------
SLOW_S = 6.0   # longer than the 5 s default bound


def _cold_start(rank, world):
    import torch.distributed as dist

    import k3fuse.kernels  # noqa: F401
    from k3fuse import runtime
    from k3fuse.kernels import collective as sw
    from k3fuse.kernels.lib.cute import compat
    from k3fuse.kernels.lib.triton import splitk_gemm

    assert "K3FUSE_AR_TIMEOUT_S" not in os.environ and sw.timeout_s() == 5.0
    compat._cache.clear()
    if world > 1 and rank == world - 1:     # this rank compiles SLOW_S later than its peers
        slow_cute, slow_triton = compat.compiled, splitk_gemm.precompile

        def late_cute(key, build, *a, **k):
            if key not in compat._cache:
                time.sleep(SLOW_S)
            return slow_cute(key, build, *a, **k)

        def late_triton(*a, **k):
            time.sleep(SLOW_S)
            return slow_triton(*a, **k)
        compat.compiled, splitk_gemm.precompile = late_cute, late_triton
    dev = torch.device("cuda", rank)
    group = dist.group.WORLD.group_name
    w, nw = _weights(dev, rank, world, dist)
    t0 = time.perf_counter()
    with runtime.strict():
        for T in (1, 24):                   # the CuTe GEMV push and the Triton split-K push
            x, res = _inputs(dev, rank, T, T, dist)
            out, normed = _op(x, w, res, nw, group, world)
            _check(dist, x, w, res, nw, out, normed, f"cold T={T}")
        x = torch.randn(2, H, device=dev, dtype=torch.bfloat16)
        summed, _ = torch.ops.k3fuse.allreduce_rmsnorm(x, nw, EPS, group, world, MAX_T)
        ref = x.double()
        dist.all_reduce(ref)
        assert ((summed.double() - ref).norm() / ref.norm()).item() < 1e-2
    torch.cuda.synchronize()
    sw.check_errors()
    if rank == 0:
        print(f"world {world}: first calls of 3 variants (cold caches) took {time.perf_counter() - t0:.1f} s",
              flush=True)


@pytest.mark.parametrize("world", WORLDS)
def test_cold_start_under_the_default_bound(world, tmp_path):
    env = {"TRITON_CACHE_DIR": str(tmp_path / "triton")}
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("K3FUSE_AR_TIMEOUT_S", raising=False)
        mp.delenv("K3FUSE_AR_TIMEOUT_MS", raising=False)
        spawn(_cold_start, world, **env)


# --- item 4: a replayed graph whose peer never arrives ------------------------------------------------
def _graph_peer_missing(rank, world):
    import torch.distributed as dist

    import k3fuse.kernels  # noqa: F401
    from k3fuse import runtime
    from k3fuse.kernels import collective_guard as cg, dispatch

    g, summed = captured_rmsnorm_tail(rank, world, H, EPS, MAX_T)
    runtime.reset_stats()
    if world > 1:    # healthy replays first, each followed by the post-step check
        for _ in range(20):
            g.replay()
            cg.check_collectives()
        torch.cuda.synchronize()
        cg.check_collectives(sync=True)
        assert torch.isfinite(summed.float()).all()
        dist.barrier()
    stopped = world > 1 and rank == world - 1
    if not stopped:
        g.replay()                           # world 1: no push; world 2: the peer stops replaying
    errors = []
    for sync in (False, True):               # without a sync one step late, with it at once
        try:
            torch.cuda.synchronize()
            cg.check_collectives(sync=sync)
        except dispatch.K3FuseCollectiveError as exc:
            errors.append(str(exc))
    if not stopped:
        assert errors and "allreduce_rmsnorm" in errors[0] and "timed out" in errors[0], errors
        assert "peer rank" in errors[0], errors
        assert torch.isnan(summed.float()).all()
        assert runtime.collective_errors(), runtime.stats()
    check_stopped_rank_learns(world, stopped, cg.check_collectives)


@pytest.mark.parametrize("world", WORLDS)
def test_replayed_graph_whose_peer_never_arrives(world):
    spawn(_graph_peer_missing, world, K3FUSE_AR_TIMEOUT_S="0.5")


# --- item 7: two graphs replayed concurrently ------------------------------------------------------------
def _concurrent_graphs(rank, world):
    from k3fuse.kernels.lib.triton import splitk_gemm

    dev = torch.device("cuda", rank)
    cases = [(8, 3584, 7168), (8, 2240, 7168), (24, 3584, 7168)]
    graphs, outs, ins = [], [], []
    for i, (M, N, Kd) in enumerate(cases):
        cfg = splitk_gemm.pick_config(M, N, Kd)
        assert cfg is not None and cfg["SPLIT_K"] > 1, (M, N, Kd, cfg)
        pair = []
        for j in range(2):
            x = torch.randn(M, Kd, device=dev, dtype=torch.bfloat16)
            w = torch.randn(N, Kd, device=dev, dtype=torch.bfloat16) / Kd ** 0.5
            splitk_gemm.run(x, w)                 # warm-up
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):              # no explicit stream: one capture stream for all
                y = splitk_gemm.run(x, w)
            pair.append((g, y, x, w))              # w too: a graph holds no reference to its inputs
        graphs.append(pair)
    torch.cuda.synchronize()

    def sequential():
        bits = []
        for pair in graphs:
            for g, y, _, _ in pair:
                g.replay()
                torch.cuda.synchronize()
                bits.append(y.clone())
        return bits

    def differs(a, b):
        bad = a.view(torch.int16) != b.view(torch.int16)
        return (f"{int(bad.sum())} of {bad.numel()} elements, max |diff| "
                f"{(a.float() - b.float()).abs().max().item():.3e}, first at {bad.nonzero()[0].tolist()}")

    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    for it in range(200):
        for pair in graphs:
            for _, _, x, _ in pair:
                x.normal_()
        torch.cuda.synchronize()
        want = sequential()                        # the reference bits
        if it < 3:                                 # the reference itself is reproducible
            for k, (a, b) in enumerate(zip(sequential(), want)):
                assert torch.equal(a.view(torch.int16), b.view(torch.int16)), \
                    f"iteration {it}: graph {k} {cases[k // 2]}, sequential replays differ: {differs(a, b)}"
        for pair in graphs:                        # the two graphs of a pair at once, two streams
            for (g, _, _, _), s in zip(pair, (s1, s2)):
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    g.replay()
        torch.cuda.synchronize()
        got = [y for pair in graphs for _, y, _, _ in pair]
        for k, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), \
                f"iteration {it}: graph {k} {cases[k // 2]} differs from its sequential replay: {differs(a, b)}"


def test_two_graphs_replayed_concurrently_match_sequential_replays():
    spawn(_concurrent_graphs, 1)


# --- item 2: a setting that differs between the ranks --------------------------------------------------
def _settings_differ(rank, world):
    import torch.distributed as dist

    os.environ["K3FUSE_AR_PROTOCOL"] = "flags" if rank else "lamport"   # before the first read
    import k3fuse
    import k3fuse.kernels  # noqa: F401
    from k3fuse.kernels import collective_guard as cg

    dev = torch.device("cuda", rank)
    w, nw = _weights(dev, rank, world, dist)
    x, res = _inputs(dev, rank, 1, 1, dist)
    t0 = time.perf_counter()
    with pytest.raises(cg.CollectiveSettingsError) as info:
        _op(x, w, res, nw, dist.group.WORLD.group_name, world)
    message = str(info.value)
    assert "K3FUSE_AR_PROTOCOL" in message and "rank 0='lamport'" in message and "rank 1='flags'" in message
    # the kill switch on one rank only, on a group of its own (a failed agreement is not retried)
    group = dist.new_group([0, 1])
    with k3fuse.disable(rank == 0), pytest.raises(cg.CollectiveSettingsError, match=r"kill switch.*rank 0=True"):
        _op(x, w, res, nw, group.group_name, world)
    assert time.perf_counter() - t0 < 60


def test_a_setting_that_differs_between_ranks_raises_on_every_rank():
    spawn(_settings_differ, 2)


# --- item 5: weights no kernel reads, declined at compile time ----------------------------------------------
def test_weights_the_kernels_cannot_read_are_declined_at_compile_time():
    import k3fuse.kernels  # noqa: F401
    from k3fuse.kernels import dispatch
    from k3fuse.kernels.ops.oproj_allreduce import OProjNormSpec

    bf = torch.bfloat16
    site = dict(H=7168, K=6144, dtype=bf, res_dtype=bf, addend=False, norm_dtype=bf, world_size=2, max_tokens=64)
    assert dispatch.coverage(OProjNormSpec(**site, w_dtype=bf), range(1, 65)) == {}
    for w_dtype in (torch.float8_e4m3fn, torch.int8, torch.float32):
        uncovered = dispatch.coverage(OProjNormSpec(**site, w_dtype=w_dtype), range(1, 65))
        assert sorted(uncovered) == list(range(1, 65)), (w_dtype, sorted(uncovered)[:5])
        assert all(str(w_dtype) in " ".join(why) for why in uncovered.values()), uncovered[1]
