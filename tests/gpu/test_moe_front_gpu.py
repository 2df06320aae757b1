"""GPU correctness of moe_front_sharded (sharded router + latent down-projection, NVLink gather).

K3 widths: router W_r [896, 7168] (fp32 logits), W_down [3584, 7168], bf16. Ranks started with
k3fuse.dist.launch (NCCL), one GPU each; world 1 runs on one GPU (the push lands in the rank's own
buffer: the kernels and the protocol words, no peer), world 2 needs two (NVLink, no multicast).
Checks: logits and latent against float64 at every token count 1..64 (K3FUSE_TEST_AR_TOKENS
limits the sweep), NaN-poisoned allocations (an unwritten element fails), logits bitwise identical on
every rank, the router-only form, a late rank, CUDA-graph capture with 1000 replays on changing
inputs, the protocol's epoch started near 2^63, strict mode with runtime.stats() naming only the
Triton kernel, and a bounded spin: a gather whose peer never pushed raises CollectiveTimeoutError
naming the op and the missing rank, the missing source's columns NaN.
"""
from __future__ import annotations

import os

import pytest
import torch

from ar_helpers import poison, spawn

from k3fuse.model.shapes import gemm_site

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

E, H = gemm_site("router").n, gemm_site("router").k
L = gemm_site("w_down").n
MAX_T = 64
IMPL = "triton.moe_front_sharded"
TOKENS = [int(t) for t in os.environ.get("K3FUSE_TEST_AR_TOKENS", "").split(",") if t.strip()] \
    or list(range(1, MAX_T + 1))


def _setup(rank):
    import torch.distributed as dist

    import k3fuse.kernels  # noqa: F401

    dev = torch.device("cuda", rank)
    g = torch.Generator(device=dev).manual_seed(5)   # the same replicated weights on every rank
    wr = (torch.randn(E, H, device=dev, generator=g) * H ** -0.5).to(torch.bfloat16)
    wd = (torch.randn(L, H, device=dev, generator=g) * H ** -0.5).to(torch.bfloat16)
    return dev, dist.group.WORLD.group_name, wr, wd


def _inputs(dev, T, seed):
    g = torch.Generator(device=dev).manual_seed(seed)   # the same activations on every rank
    return torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=g)


def _check(rank, world, x, wr, wd, logits, latent, what):
    import torch.distributed as dist

    ref_l = x.double() @ wr.double().T
    assert logits.dtype == torch.float32 and tuple(logits.shape) == (x.shape[0], E), what
    assert not torch.isnan(logits).any(), f"rank {rank} {what}: NaN logits (unwritten or timed out)"
    rel = ((logits.double() - ref_l).norm() / ref_l.norm()).item()
    # fp32 accumulation over K = 7168 products (split-K tiles reorder the sum): ~1e-5 seen
    assert rel < 1e-4, f"rank {rank} {what}: logits rel err {rel:.2e}"
    if wd is not None:
        ref_d = x.double() @ wd.double().T
        assert latent.dtype == x.dtype and tuple(latent.shape) == (x.shape[0], L), what
        assert not torch.isnan(latent).any(), f"rank {rank} {what}: NaN latent"
        err = ((latent.double() - ref_d).abs() - 2 ** -8 * ref_d.abs()).max().item()
        assert err <= 1e-4, f"rank {rank} {what}: latent beyond one bf16 rounding ({err:.2e})"
    else:
        assert tuple(latent.shape) == (x.shape[0], 0), what
    if world > 1:   # routing must be identical on every rank: the logits bit for bit
        got = [torch.empty_like(logits) for _ in range(world)]
        dist.all_gather(got, logits.contiguous())
        for r in range(world):
            assert torch.equal(got[r].view(torch.int32), got[0].view(torch.int32)), f"{what}: rank {r} differs"


def _correctness(rank, world):
    import torch.distributed as dist

    from k3fuse import runtime
    from k3fuse.kernels.collective import check_errors

    dev, group, wr, wd = _setup(rank)
    op = torch.ops.k3fuse.moe_front_sharded
    runtime.reset_stats()
    with runtime.strict():
        for T in TOKENS:
            x = _inputs(dev, T, 100 + T)
            poison((T, E), torch.float32, dev)
            poison((T, L), torch.bfloat16, dev)
            logits, latent = op(x, wr, wd, group, world, MAX_T)
            _check(rank, world, x, wr, wd, logits, latent, f"T={T}")
        for T in (1, 5, 64):   # router-only form (no latent projection)
            x = _inputs(dev, T, 7 + T)
            logits, latent = op(x, wr, None, group, world, MAX_T)
            _check(rank, world, x, wr, None, logits, latent, f"router-only T={T}")
        for T in (1, 17, 64):  # a late rank: the other polls in the gather kernel meanwhile
            x = _inputs(dev, T, 33 + T)
            dist.barrier()
            if rank == world - 1:
                torch.cuda._sleep(100_000_000)
            logits, latent = op(x, wr, wd, group, world, MAX_T)
            _check(rank, world, x, wr, wd, logits, latent, f"late T={T}")
        for T in (1, 8, 64):   # CUDA graph: buffer index and epoch advance on the device
            x = _inputs(dev, T, 5)
            op(x, wr, wd, group, world, MAX_T)
            torch.cuda.synchronize()
            dist.barrier()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                logits, latent = op(x, wr, wd, group, world, MAX_T)
            torch.cuda.synchronize()
            dist.barrier()
            for i in range(1000):
                x.copy_(_inputs(dev, T, 10_000 + i))
                graph.replay()
                if i % 111 == 0 or i == 999:
                    _check(rank, world, x, wr, wd, logits, latent, f"graph T={T} replay {i}")
            torch.cuda.synchronize()
            check_errors()
            del graph
    impls = runtime.stats().get("moe_front_sharded", {})
    assert set(impls) == {IMPL}, impls
    dist.barrier()


@pytest.mark.parametrize("world", [1, 2])
def test_moe_front_sharded_matches_float64(world):
    spawn(_correctness, world)


def _near_wrap(rank, world):
    import torch.distributed as dist

    from k3fuse.kernels.collective import _workspaces

    dev, group, wr, wd = _setup(rank)
    for i in range(12):   # past 2^63 - 1: the epoch wraps, the buffer index keeps rotating
        x = _inputs(dev, 3, i)
        logits, latent = torch.ops.k3fuse.moe_front_sharded(x, wr, wd, group, world, MAX_T, True)
        _check(rank, world, x, wr, wd, logits, latent, f"near wrap call {i}")
    ws = next(w for k, w in _workspaces.items() if k[3] == (E + L) // world)
    epoch, _, rows, buf = ws.gen.tolist()
    assert epoch == -2**63 + 7 and rows == 3 and buf == 12 % 3, ws.gen.tolist()
    dist.barrier()


@pytest.mark.parametrize("world", [1, 2])
def test_epoch_started_near_the_wrap(world):
    spawn(_near_wrap, world, K3FUSE_AR_START_GENERATION=str(2**63 - 5))


def _missing_peer(rank, world):
    """The gather of a call whose push never happened (no rank pushed): each program spins to the
    bound, writes the error words naming a missing source, NaN-fills its outputs, and the host
    raises CollectiveTimeoutError; the workspace stays failed and never spins again."""
    import time

    from k3fuse.kernels.collective import CollectiveTimeoutError, get_workspace, timeout_ns
    from k3fuse.kernels.lib.triton import moe_gather as K

    dev, group, wr, wd = _setup(rank)
    x = _inputs(dev, 2, 1)
    torch.ops.k3fuse.moe_front_sharded(x, wr, wd, group, world, MAX_T, True)   # compiles, creates it
    e1, l1 = E // world, L // world
    ws = get_workspace(group, world, MAX_T, e1 + l1, dev)
    logits = torch.zeros(2, E, device=dev)
    latent = torch.zeros(2, L, device=dev, dtype=torch.bfloat16)
    t0 = time.perf_counter()
    K._gather_kernel[(2, world)](ws.datas[ws.rank].view(torch.int32), ws.gen, ws.err, logits, latent, 2,
                                 timeout_ns(), WORLD=world, MAXT=MAX_T, NB=e1 + l1, E1=e1, L1=l1,
                                 BLOCK=K._block(e1 + l1), KIND=K.ERR_KIND, num_warps=K._num_warps(K._block(e1 + l1)))
    torch.cuda.synchronize()
    took = time.perf_counter() - t0
    assert 0.2 <= took < 5, took                          # K3FUSE_AR_TIMEOUT_S=0.3 bounds it
    assert torch.isnan(logits).all() and torch.isnan(latent).all()
    code, peer, kind, row = ws.err.tolist()
    assert code == 1 and 0 <= peer < world and kind == K.ERR_KIND and row in (0, 1), ws.err.tolist()
    with pytest.raises(CollectiveTimeoutError, match=r"moe_front_sharded.*timed out.*peer rank"):
        ws.raise_if_failed("moe_front_sharded", sync=True)
    with pytest.raises(CollectiveTimeoutError):           # failed stays failed: no second spin
        torch.ops.k3fuse.moe_front_sharded(x, wr, wd, group, world, MAX_T, True)


def test_gather_spin_is_bounded():
    spawn(_missing_peer, 1, K3FUSE_AR_TIMEOUT_S="0.3")


def _skipping_rank(rank, world):
    """Rank 1 skips the op: rank 0 raises within the bound (it names rank 1), never hangs."""
    import torch.distributed as dist

    from k3fuse.kernels.collective import CollectiveTimeoutError, check_errors

    dev, group, wr, wd = _setup(rank)
    x = _inputs(dev, 4, 1)
    torch.ops.k3fuse.moe_front_sharded(x, wr, wd, group, world, MAX_T, True)
    torch.cuda.synchronize()
    check_errors()                 # the healthy call, under the long bound (ranks compile at their pace)
    dist.barrier()
    os.environ["K3FUSE_AR_TIMEOUT_S"] = "0.5"   # read per call, as the group agreed it: every rank reagrees
    from k3fuse.kernels.collective_guard import reagree

    reagree(group)
    if rank == 0:
        logits, latent = torch.ops.k3fuse.moe_front_sharded(x, wr, wd, group, world, MAX_T, True)
        with pytest.raises(CollectiveTimeoutError, match=r"moe_front_sharded.*peer rank 1"):
            check_errors()
        # one gather program per (row, source): rank 0's own slot arrived, rank 1's columns are NaN
        e1, l1 = E // world, L // world
        assert torch.isnan(logits[:, e1:]).all() and not torch.isnan(logits[:, :e1]).any()
        assert torch.isnan(latent[:, l1:]).all() and not torch.isnan(latent[:, :l1]).any()
    dist.barrier()


def test_a_rank_that_skips_the_op_raises_within_the_timeout():
    spawn(_skipping_rank, 2, K3FUSE_AR_TIMEOUT_S="60")
