"""Symmetric-memory workspace of the one-shot all-reduce: unicast peer buffers only.

Why a module of its own: the buffers must be allocated once per (group, device, max_tokens,
hidden) before CUDA-graph capture, with every rank in the same order (rendezvous is collective),
and the peer views must be plain tensors the CuTe kernel can take. NVLink multicast is never
used: no multicast pointer is read, and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 is set before the first
symmetric allocation so that torch does not create a multicast object either.

Layout of the one symmetric fp32 buffer per rank (Lamport, see kernels/cute/oneshot_ar.py):
  data [3 buffers, world (source rank), max_tokens, hidden] fp32, initialised to the sentinel -0.0
  flags [world (source rank), max_tokens] int32 after it, initialised to 0 (only the acquire/release
  flag protocol, K3FUSE_AR_PROTOCOL=flags, uses them: epoch per source rank and token row)
Local (not symmetric): gen int32[4] (generation, arrival counter, rows written last generation,
spare), ptrs int64[world] (each rank's data base address as seen from this process, for the Triton
push epilogue), err int32[1] (debug timeout report).
"""
from __future__ import annotations

import os
import threading

import torch
import torch.distributed as dist

_lock = threading.Lock()
_workspaces: dict = {}


class ArWorkspace:
    def __init__(self, group_name: str, world_size: int, max_tokens: int, hidden: int,
                 device: torch.device):
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        from torch.distributed import _symmetric_memory as symm_mem

        from k3fuse.compat import resolve_group

        group = resolve_group(group_name)
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        if self.world != world_size:
            raise ValueError(f"group {group_name!r} has {self.world} ranks, op says {world_size}")
        self.max_tokens, self.hidden = max_tokens, hidden
        W, MT, H = self.world, max_tokens, hidden
        n_data = 3 * W * MT * H
        n_flags = (W * MT + 3) // 4 * 4   # int32 words, a multiple of 16 bytes
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # needed on some torch versions, a deprecated no-op on others
            try:
                import warnings

                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    enable(group_name)
            except Exception:
                pass
        n = n_data + n_flags
        buf = symm_mem.empty((n,), dtype=torch.float32, device=device)
        buf[:n_data].view(torch.int32).fill_(-2**31)   # 0x80000000 = -0.0: "not written yet"
        buf[n_data:].view(torch.int32).zero_()
        hdl = symm_mem.rendezvous(buf, group_name)
        self.handle, self.buf = hdl, buf
        self.datas, self.flags = [], []
        for r in range(W):
            peer = buf if r == self.rank else hdl.get_buffer(r, (n,), torch.float32)
            self.datas.append(peer[:n_data].view(3, W, MT, H))
            self.flags.append(peer[n_data:].view(torch.int32)[:W * MT].view(W, MT))
        self.ptrs = torch.tensor([d.data_ptr() for d in self.datas], dtype=torch.int64, device=device)
        self.gen = torch.zeros(4, dtype=torch.int32, device=device)
        self.err = torch.zeros(1, dtype=torch.int32, device=device)
        torch.cuda.synchronize(device)
        dist.barrier(group)  # every rank's buffer holds the sentinel before any peer writes it

    def padded(self, tensors: list[torch.Tensor], max_world: int) -> list[torch.Tensor]:
        """Per-peer views padded to the kernel's fixed arity with the local view (unused)."""
        return tensors + [tensors[self.rank]] * (max_world - len(tensors))


def get_workspace(group_name: str, world_size: int, max_tokens: int, hidden: int,
                  device: torch.device) -> ArWorkspace:
    """The workspace for this group/device/shape, created collectively on first use."""
    key = (group_name, device.index, max_tokens, hidden)
    ws = _workspaces.get(key)
    if ws is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("one-shot all-reduce workspace first needed during CUDA-graph capture; "
                               "warm the op up before capturing")
        with _lock:
            ws = _workspaces.get(key)
            if ws is None:
                ws = ArWorkspace(group_name, world_size, max_tokens, hidden, device)
                _workspaces[key] = ws
    return ws


def multicast_used() -> bool:
    """Always False: this module never asks for a multicast pointer (kept for guards/tests)."""
    return False
