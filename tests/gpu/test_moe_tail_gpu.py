"""GPU correctness of allreduce_rmsnorm (the MoE tail) over symmetric memory (no multicast).

One process per GPU (k3fuse.dist.launch, NCCL): world 2 on two GPUs (NVLink), world 1 on one GPU
(the push lands in the rank's own buffer: the kernels, the sentinel and the protocol words without
a peer). The K3 latent width L = 3584 in bf16.
Checks against a float64 reference (partials all-reduced in fp64 through NCCL) at every token count
1..64 (K3FUSE_TEST_AR_TOKENS=1,2,7 limits the sweep), NaN-poisoned allocator blocks (an unwritten
output element fails), bitwise-identical outputs on both ranks, partials holding -0.0 (the Lamport
sentinel must never be pushed), a late rank, CUDA-graph capture with 1000 replays on changing
inputs (the push reads its buffer index from gen[3] on the device), strict mode, and
runtime.stats() naming only the protocol's kernel. Both protocols (K3FUSE_AR_PROTOCOL=lamport,
flags). A push that never happens (lamport): the epilogue stops at the bound with NaN outputs and
the host raises CollectiveTimeoutError naming the op.
"""
from __future__ import annotations


import pytest
import torch

from ar_helpers import poison, spawn, token_sweep

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

L = 3584
MAX_T = 64
EPS = 1e-5
PROTOCOLS = {"lamport": "cute.allreduce_rmsnorm", "flags": "cute.allreduce_rmsnorm.flags"}
TOKENS = token_sweep(MAX_T)


def _worker(rank: int, world: int, protocol: str) -> None:
    import torch.distributed as dist

    _body(rank, world, dist, protocol)
    dist.barrier()


def _body(rank, world, dist, protocol):
    import k3fuse.kernels  # noqa: F401
    from k3fuse import runtime
    from k3fuse.kernels.collective import check_errors

    dev = torch.device("cuda", rank)
    group = dist.group.WORLD.group_name
    nw = (torch.randn(L, device=dev) * 0.1 + 1).to(torch.bfloat16)
    dist.broadcast(nw, 0)

    def inputs(T, seed, zeros=False):
        g = torch.Generator(device=dev).manual_seed(seed * 7 + rank)
        x = torch.randn(T, L, device=dev, dtype=torch.bfloat16, generator=g)
        if zeros:   # -0.0 and +0.0 in the partial: the push must write +0.0 for both
            x[:, ::3] = -0.0
            x[:, 1::3] = 0.0
        return x

    def reference(x):
        tot = x.double()
        dist.all_reduce(tot)
        return tot, tot * torch.rsqrt(tot.pow(2).mean(-1, keepdim=True) + EPS) * nw.double()

    def check(y, ref, what):
        assert not torch.isnan(y).any(), f"rank {rank} {what}: NaN (unwritten or timed out)"
        rel = ((y.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        assert rel < 1e-2, f"rank {rank} {what}: rel err {rel:.2e}"
        # one bf16 rounding of the fp32 result: elementwise within 2 bf16 ulps (+ fp32 slack)
        err = ((y.double() - ref).abs() - (2 ** -7) * ref.abs()).max().item()
        assert err <= 1e-3, f"rank {rank} {what}: elementwise error {err:.2e} beyond 1 bf16 ulp"

    def same_on_all_ranks(y, what):
        ys = [torch.empty_like(y) for _ in range(world)]
        dist.all_gather(ys, y.contiguous())
        for r in range(world):
            assert torch.equal(ys[r].view(torch.int16), ys[0].view(torch.int16)), \
                f"{what}: rank {r} differs bitwise from rank 0"

    def call(x):
        return torch.ops.k3fuse.allreduce_rmsnorm(x, nw, EPS, group, world, MAX_T)

    def verify(got, x, what):
        tot, normed = reference(x)
        check(got[0], tot, f"{what} summed")
        check(got[1], normed, f"{what} normed")
        same_on_all_ranks(got[0], f"{what} summed")
        same_on_all_ranks(got[1], f"{what} normed")

    runtime.reset_stats()
    with runtime.strict():
        for T in TOKENS:
            x = inputs(T, 1000 + T, zeros=T % 4 == 0)
            poison((T, L), torch.bfloat16, dev)
            verify(call(x), x, f"T={T}")

        # a late rank: rank 1 sleeps on its stream before the op, rank 0 polls in the kernel
        for T in (1, 17, 64):
            x = inputs(T, 77 + T)
            dist.barrier()
            if rank == world - 1:
                torch.cuda._sleep(100_000_000)
            verify(call(x), x, f"late T={T}")

        # CUDA graph: capture once, 1000 replays with changing inputs; the buffer index and the
        # generation advance on the device
        for T in (1, 8, 64):
            x = inputs(T, 5)
            call(x)   # warm-up (compile + workspace) before capture
            torch.cuda.synchronize()
            dist.barrier()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                summed, normed = call(x)
            torch.cuda.synchronize()
            dist.barrier()
            for i in range(1000):
                x.copy_(inputs(T, 10_000 + i, zeros=i % 50 == 0))
                g.replay()
                if i % 111 == 0 or i == 999:
                    verify((summed, normed), x, f"graph T={T} replay {i}")
            torch.cuda.synchronize()
            check_errors()
            del g

    impls = runtime.stats().get("allreduce_rmsnorm", {})
    assert impls and set(impls) == {PROTOCOLS[protocol]}, f"{protocol}: {impls}"


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("protocol", ["lamport", "flags"])
def test_allreduce_rmsnorm_matches_float64(protocol, world):
    spawn(_worker, world, (protocol,), K3FUSE_AR_PROTOCOL=protocol)


def _no_push(rank, world):
    """The op with its push left out (lamport): the epilogue polls sentinels until the bound, writes
    NaN and the error words; the host raises CollectiveTimeoutError, and the workspace stays failed."""
    import time

    import torch.distributed as dist

    import k3fuse.kernels  # noqa: F401
    from k3fuse.kernels.collective import CollectiveTimeoutError, check_errors
    from k3fuse.kernels.lib.triton import lamport_push

    dev = torch.device("cuda", rank)
    group = dist.group.WORLD.group_name
    nw = torch.ones(L, device=dev, dtype=torch.bfloat16)
    x = torch.randn(2, L, device=dev, dtype=torch.bfloat16)
    torch.ops.k3fuse.allreduce_rmsnorm(x, nw, EPS, group, world, MAX_T, True)   # compiles, creates it
    torch.cuda.synchronize()
    lamport_push.run = lambda *args, **kwargs: None
    t0 = time.perf_counter()
    summed, normed = torch.ops.k3fuse.allreduce_rmsnorm(x, nw, EPS, group, world, MAX_T, True)
    torch.cuda.synchronize()
    took = time.perf_counter() - t0
    assert 0.2 <= took < 5, took                          # K3FUSE_AR_TIMEOUT_S=0.3 bounds it
    assert torch.isnan(summed).all() and torch.isnan(normed).all()
    with pytest.raises(CollectiveTimeoutError, match=r"allreduce_rmsnorm.*timed out.*peer rank 0"):
        check_errors()
    with pytest.raises(CollectiveTimeoutError):           # failed stays failed: no second spin
        torch.ops.k3fuse.allreduce_rmsnorm(x, nw, EPS, group, world, MAX_T, True)


def test_a_missing_push_stops_at_the_bound():
    spawn(_no_push, 1, K3FUSE_AR_TIMEOUT_S="0.3")
