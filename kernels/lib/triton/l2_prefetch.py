"""l2_prefetch on CUDA: bulk L2 prefetch of the next static weights while a collective runs.

Why: between an all-reduce's launch and its wait the SMs and HBM idle for 6-10 us at decode; the
op after the wait is a weight read (e.g. W_up after the latent all-reduce). Each thread of this
kernel issues one `cp.async.bulk.prefetch.L2` (sm_90) for a chunk of the weights and exits: the
copy engine fills L2 while the collective is in flight, and nothing waits for it.

Weight-only: the kernel reads the static weights' addresses, never `anchor` (whose collective may
still be running). The chunk table is built once per (weights, budget) from the weights' data
pointers (static parameters do not move) and cached on the device, so CUDA-graph capture replays
the same prefetches; building it while capturing is refused (a host-to-device copy).
"""
from __future__ import annotations

import torch

from . import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

CHUNK_BYTES = 32 << 10   # one prefetch per thread: spreads a 24 MB budget over ~6 CTAs
BLOCK = 128
ALIGN = 16               # cp.async.bulk: address and size are multiples of 16 bytes

if HAVE_TRITON:

    @triton.jit
    def _prefetch_kernel(addr_ptr, size_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        addr = tl.load(addr_ptr + offs, mask=mask, other=0)
        size = tl.load(size_ptr + offs, mask=mask, other=0)
        # size 0 (the masked tail) issues nothing
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; "
            "mov.u32 $0, 0; }",
            "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)


def chunk_table(weights: list[torch.Tensor], budget_bytes: int) -> list[tuple[int, int]]:
    """(address, bytes) chunks covering the weights in list order up to `budget_bytes`.

    A weight larger than what is left of the budget is prefetched in part (its first bytes, which
    the next GEMM reads first); addresses and sizes are trimmed to 16-byte multiples.
    """
    chunks: list[tuple[int, int]] = []
    left = int(budget_bytes)
    for w in weights:
        if left < ALIGN:
            break
        start = -(-w.data_ptr() // ALIGN) * ALIGN
        end = w.data_ptr() + w.numel() * w.element_size()
        take = min(end - start, left) // ALIGN * ALIGN
        for off in range(0, take, CHUNK_BYTES):
            chunks.append((start + off, min(CHUNK_BYTES, take - off)))
        left -= take
    return chunks


_tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _table(weights: list[torch.Tensor], budget_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    key = (weights[0].device.index, budget_bytes, tuple((w.data_ptr(), w.numel() * w.element_size())
                                                        for w in weights))
    table = _tables.get(key)
    if table is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("k3fuse l2_prefetch: first call for these weights inside a CUDA-graph "
                               "capture; run the model once before capturing")
        chunks = chunk_table(weights, budget_bytes)
        device = weights[0].device
        table = (torch.tensor([a for a, _ in chunks], dtype=torch.int64, device=device),
                 torch.tensor([s for _, s in chunks], dtype=torch.int32, device=device))
        _tables[key] = table
    return table


def run(anchor: torch.Tensor, weights: list[torch.Tensor], budget_bytes: int) -> None:
    addrs, sizes = _table(weights, budget_bytes)
    n = addrs.numel()
    if n:
        _prefetch_kernel[(triton.cdiv(n, BLOCK),)](addrs, sizes, n, BLOCK=BLOCK, num_warps=4)

