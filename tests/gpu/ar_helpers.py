"""What the GPU tests of the fused collective ops share: multicast kept off, ranks started with
k3fuse.dist.launch (one GPU each), the token sweep and NaN-poisoned allocations."""
from __future__ import annotations

import os

import pytest
import torch

from k3fuse.dist import MULTICAST_OFF, RankFailedError, launch


def token_sweep(max_tokens: int) -> list[int]:
    """The token counts a fused all-reduce test sweeps: K3FUSE_TEST_AR_TOKENS (e.g. 1,2,64) if set,
    else every count 1..max_tokens."""
    return [int(t) for t in os.environ.get("K3FUSE_TEST_AR_TOKENS", "").split(",") if t.strip()] \
        or list(range(1, max_tokens + 1))


def poison(shape, dtype, device) -> None:
    """Fill a block with NaN and free it: the caching allocator hands it to the next same-size
    allocation, so an output element the kernel does not write stays NaN."""
    t = torch.empty(shape, dtype=dtype, device=device)
    t.fill_(float("nan"))
    del t


def spawn(fn, world: int, args: tuple = (), **env: str) -> None:
    """fn(rank, world, *args) on `world` GPUs (k3fuse.dist.launch, NCCL), with `env` and multicast
    off in the ranks' environment (K3FUSE_AR_PROTOCOL defaults to lamport). World 1 runs on one GPU:
    the push lands in the rank's own buffer, which exercises the kernels and the protocol words
    without a peer. Skips when fewer GPUs are visible; a failing rank fails the test with its
    traceback."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs")
    with pytest.MonkeyPatch.context() as mp:
        for key, value in {**MULTICAST_OFF, "K3FUSE_AR_PROTOCOL": "lamport", **env}.items():
            mp.setenv(key, value)
        try:
            launch(fn, world, backend="nccl", args=args, timeout_s=900)
        except RankFailedError as exc:
            pytest.fail(f"worker failed:\n{exc}")
