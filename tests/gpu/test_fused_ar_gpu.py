"""GPU correctness of gemm_ar_residual(_rmsnorm) at TP 2 over symmetric memory (no multicast).

Two processes, one GPU each. Checks against a float64 reference (partials all-reduced in fp64
through NCCL), every token count 1..64, fresh random inputs, NaN-poisoned allocator blocks (an
unwritten output element fails), bitwise-identical outputs on both ranks, a late rank
(torch.cuda._sleep on one rank while the other spins), CUDA-graph capture with 1000 replays on
changing inputs, strict mode on and runtime.stats() showing only the kernel ran. Every test runs
for both all-reduce protocols (K3FUSE_AR_PROTOCOL=lamport, the default, and flags), and the stats
must name the protocol's implementation. K3FUSE_TEST_AR_TOKENS=1,2,7 limits the token sweep
(default: every count 1..64).
"""
from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA GPUs", allow_module_level=True)

from k3fuse.tools.bench.timing import median, slowest_rank, time_graph  # noqa: E402
from ar_helpers import poison, spawn, token_sweep  # noqa: E402
from k3fuse.model.shapes import gemm_site  # noqa: E402

_OPROJ = gemm_site("oproj_tp2")  # out-projection per rank at TP 2: [H, P/2] with P/2 = 6144
H, P = _OPROJ.n, _OPROJ.k
MAX_T = 64
EPS = 1e-5
PROTOCOLS = {"lamport": "cute.oneshot_ar", "flags": "cute.oneshot_ar.flags"}
TOKENS = token_sweep(MAX_T)


def _worker(rank: int, world: int, protocol: str) -> None:
    """One rank under k3fuse.dist.launch (NCCL group up, GPU `rank` current, env from ar_helpers.spawn)."""
    import torch.distributed as dist

    _body(rank, world, dist, protocol)
    dist.barrier()


def _body(rank, world, dist, protocol):
    import k3fuse.kernels  # noqa: F401
    from k3fuse import runtime

    dev = torch.device("cuda", rank)
    group = dist.group.WORLD.group_name
    torch.manual_seed(100 + rank)
    w = torch.randn(H, P, device=dev, dtype=torch.bfloat16) / P ** 0.5   # each rank its own shard
    nw = torch.randn(H, device=dev, dtype=torch.bfloat16)
    dist.broadcast(nw, 0)

    def inputs(T, seed):
        g = torch.Generator(device=dev).manual_seed(seed * 7 + rank)
        x = torch.randn(T, P, device=dev, dtype=torch.bfloat16, generator=g)
        g2 = torch.Generator(device=dev).manual_seed(seed)       # replicated on both ranks
        res = torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=g2)
        add = torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=g2)
        return x, res, add

    def reference(x, res, add, norm):
        part = x.double() @ w.double().T
        dist.all_reduce(part)
        tot = part + res.double() + (add.double() if add is not None else 0)
        if not norm:
            return tot, None
        return tot, tot * torch.rsqrt(tot.pow(2).mean(-1, keepdim=True) + EPS) * nw.double()

    def check(y, ref, what):
        assert not torch.isnan(y).any(), f"rank {rank} {what}: NaN (unwritten)"
        rel = ((y.double() - ref).norm() / ref.norm()).item()
        assert rel < 1e-2, f"rank {rank} {what}: rel err {rel:.2e}"

    def same_on_all_ranks(y, what):
        ys = [torch.empty_like(y) for _ in range(world)]
        dist.all_gather(ys, y.contiguous())
        for r in range(world):
            assert torch.equal(ys[r].view(torch.int16), ys[0].view(torch.int16)), \
                f"{what}: rank {r} differs bitwise from rank 0"

    def call(x, res, add, norm):
        if norm:
            return torch.ops.k3fuse.gemm_ar_residual_rmsnorm(x, w, res, add, nw, EPS, group, world, MAX_T)
        return torch.ops.k3fuse.gemm_ar_residual(x, w, res, add, group, world, MAX_T)

    runtime.reset_stats()
    with runtime.strict():
        # every token count (or K3FUSE_TEST_AR_TOKENS), both variants, with and without addend
        for T in TOKENS:
            for norm, use_add in ((True, False), (False, T % 3 == 0), (True, T % 5 == 0)):
                x, res, add = inputs(T, 1000 * T + 2 * norm + use_add)
                add = add if use_add else None
                poison((T, H), torch.bfloat16, dev)
                got = call(x, res, add, norm)
                tot, normed = reference(x, res, add, norm)
                if norm:
                    check(got[0], tot, f"T={T} out")
                    check(got[1], normed, f"T={T} normed")
                    same_on_all_ranks(got[0], f"T={T} out")
                    same_on_all_ranks(got[1], f"T={T} normed")
                else:
                    check(got, tot, f"T={T} out (plain, addend={use_add})")
                    same_on_all_ranks(got, f"T={T} plain")

        # the GEMV path with programmatic dependent launch (off by default; Lamport only: the flag
        # protocol ignores K3FUSE_AR_PDL)
        from k3fuse.kernels.collective_guard import reagree

        os.environ["K3FUSE_AR_PDL"] = "1"
        reagree(group)   # a path setting reaches the fused ops through the group's agreement (every rank)
        for T in ((1, 2) if protocol == "lamport" else ()):
            x, res, add = inputs(T, 555 + T)
            poison((T, H), torch.bfloat16, dev)
            got = call(x, res, add, True)
            tot, normed = reference(x, res, add, True)
            check(got[0], tot, f"PDL T={T} out")
            check(got[1], normed, f"PDL T={T} normed")
            same_on_all_ranks(got[1], f"PDL T={T}")
        os.environ.pop("K3FUSE_AR_PDL")
        reagree(group)

        # a late rank: rank 1 sleeps ~50 ms on its stream before the op, rank 0 waits in the kernel
        for T in (1, 17, 64):
            x, res, add = inputs(T, 77 + T)
            dist.barrier()
            if rank == 1:
                torch.cuda._sleep(100_000_000)
            got = call(x, res, None, True)
            tot, normed = reference(x, res, None, True)
            check(got[0], tot, f"late T={T}")
            check(got[1], normed, f"late T={T} normed")
            same_on_all_ranks(got[1], f"late T={T}")

        # CUDA graph: capture once, 1000 replays with changing inputs (generation advances in-kernel)
        for T in (1, 8, 64):
            x, res, _ = inputs(T, 5)
            call(x, res, None, True)   # warm-up (compile + workspace) before capture
            torch.cuda.synchronize()
            dist.barrier()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out, normed = call(x, res, None, True)
            torch.cuda.synchronize()
            dist.barrier()
            for i in range(1000):
                xi, ri, _ = inputs(T, 10_000 + i)
                x.copy_(xi)
                res.copy_(ri)
                g.replay()
                if i % 111 == 0 or i == 999:
                    tot, nref = reference(x, res, None, True)
                    check(out, tot, f"graph T={T} replay {i}")
                    check(normed, nref, f"graph T={T} replay {i} normed")
                    same_on_all_ranks(normed, f"graph T={T} replay {i}")
            torch.cuda.synchronize()
            # rough timing (not a benchmark: one op per graph, the same weight every replay):
            # median µs per replay over 200 (k3fuse.tools.bench.timing), the slower rank
            us = slowest_rank(median(time_graph(g, 1, 200)), dev)
            if rank == 0:
                print(f"TIMING {protocol} T={T}: {us:.2f} us per graph replay", flush=True)
            del g

    st = runtime.stats()
    for op in ("gemm_ar_residual", "gemm_ar_residual_rmsnorm"):
        impls = st.get(op, {})
        assert impls and set(impls) == {PROTOCOLS[protocol]}, f"{protocol} {op}: {impls}"


def _timeout_body(rank, world, dist):
    """Debug build: rank 1 never calls the op, rank 0's poll must give up and report it."""
    import k3fuse.kernels  # noqa: F401
    from k3fuse.kernels import collective as g

    os.environ["K3FUSE_AR_TIMEOUT_MS"] = "200"
    dev = torch.device("cuda", rank)
    group = dist.group.WORLD.group_name
    w = torch.randn(H, P, device=dev, dtype=torch.bfloat16) / P ** 0.5
    x = torch.randn(2, P, device=dev, dtype=torch.bfloat16)
    res = torch.randn(2, H, device=dev, dtype=torch.bfloat16)
    # both ranks: the group's agreement, the compile and the start barrier (so the 200 ms bound
    # holds while one rank compiles later than the other), a healthy call
    out = torch.ops.k3fuse.gemm_ar_residual(x, w, res, None, group, world, MAX_T)
    torch.cuda.synchronize()
    assert torch.isfinite(out.float()).all()
    dist.barrier()
    if rank == 0:
        out = torch.ops.k3fuse.gemm_ar_residual(x, w, res, None, group, world, MAX_T)
        torch.cuda.synchronize()
        with pytest.raises(RuntimeError, match="timed out"):
            g.check_timeout(group, MAX_T, H, dev)
        del out
    dist.barrier()


def _timeout_worker(rank, world, protocol):
    import torch.distributed as dist

    _timeout_body(rank, world, dist)


@pytest.mark.parametrize("protocol", ["flags", "lamport"])
def test_fused_ar_tp2(protocol):
    spawn(_worker, 2, (protocol,), K3FUSE_AR_PROTOCOL=protocol)


@pytest.mark.parametrize("protocol", ["flags", "lamport"])
def test_debug_spin_timeout(protocol):
    spawn(_timeout_worker, 2, (protocol,), K3FUSE_AR_PROTOCOL=protocol)
