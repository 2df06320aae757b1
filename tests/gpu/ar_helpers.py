"""What the 2-GPU tests of the fused all-reduce ops share: multicast kept off, ranks started with
k3fuse.dist.launch, and NaN-poisoned allocations."""
from __future__ import annotations

import pytest
import torch

from k3fuse.dist import RankFailedError, launch

#: NVLink multicast stays off on the shared H200 hosts; the ranks inherit these
MULTICAST_OFF = dict(TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NCCL_NVLS_ENABLE="0", NVSHMEM_DISABLE_NVLS="1")


def poison(shape, dtype, device) -> None:
    """Fill a block with NaN and free it: the caching allocator hands it to the next same-size
    allocation, so an output element the kernel does not write stays NaN."""
    t = torch.empty(shape, dtype=dtype, device=device)
    t.fill_(float("nan"))
    del t


def spawn_two_gpus(fn, protocol: str) -> None:
    """fn(rank, 2, protocol) on 2 GPUs (k3fuse.dist.launch, NCCL) under K3FUSE_AR_PROTOCOL=protocol;
    the ranks inherit the environment. A failing rank fails the test with its traceback."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in dict(MULTICAST_OFF, K3FUSE_AR_PROTOCOL=protocol).items():
            mp.setenv(key, value)
        try:
            launch(fn, 2, backend="nccl", args=(protocol,), timeout_s=900)
        except RankFailedError as exc:
            pytest.fail(f"worker failed:\n{exc}")
