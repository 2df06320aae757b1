"""The checkpoint loader and writer on one GPU (k3fuse/model/checkpoint.py):

- test_load_onto_the_gpu_is_the_cpu_load: a small MXFP4 checkpoint (bf16 trunk, experts in block order) loaded
  onto the GPU, as one stand-in rank of TP 2 and whole, holds bit for bit what the CPU load holds, and its decode
  steps give the CPU-loaded model's tokens.
- test_writer_drawing_on_the_gpu_is_the_gpu_initialised_model: `write_checkpoint(..., device="cuda")` draws the
  hash weights `K3Model(cfg, seed, device="cuda", init_on_device=True)` holds; loading it gives them back.

Run: python -m pytest -m gpu -o addopts= -rA tests/gpu/test_checkpoint_gpu.py
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # collected on CPU CI only with -m gpu; skip cleanly there
    pytest.skip("needs CUDA", allow_module_level=True)

from k3fuse.model import K3Model, get_config  # noqa: E402
from k3fuse.model.checkpoint import load_checkpoint, write_checkpoint  # noqa: E402


def _cfg():
    return get_config("small", dtype="bfloat16", expert_format="mxfp4", latent=256, moe_inter=256, shared_inter=512,
                      expert_layout="blocks")


def test_load_onto_the_gpu_is_the_cpu_load(tmp_path):
    cfg = _cfg()
    write_checkpoint(tmp_path / "c", cfg, seed=3, max_shard_bytes=4_000_000)
    for kwargs in ({}, {"rank": 1, "tp_size": 2, "standin": True}):
        _, cpu, _ = load_checkpoint(tmp_path / "c", expert_layout="blocks", **kwargs)
        _, gpu, report = load_checkpoint(tmp_path / "c", expert_layout="blocks", device="cuda", **kwargs)
        for (name, a), b in zip(cpu.named_parameters(), gpu.parameters()):
            assert b.is_cuda and torch.equal(a, b.cpu()), name
        if not kwargs:
            tokens = torch.tensor([1, 2, 3])
            s_cpu, s_gpu = cpu.new_state(3, 16), gpu.new_state(3, 16)
            for _ in range(3):
                t_cpu, _ = cpu(tokens, s_cpu)
                t_gpu, _ = gpu(tokens.cuda(), s_gpu)
                assert torch.equal(t_cpu, t_gpu.cpu())
                tokens = t_cpu
        print(f"loaded {report.tensors} tensors, {report.bytes_read / 2**20:.1f} MiB on rank {report.rank}")


def test_writer_drawing_on_the_gpu_is_the_gpu_initialised_model(tmp_path):
    cfg = _cfg()
    write_checkpoint(tmp_path / "c", cfg, seed=4, device="cuda")
    drawn = K3Model(cfg, seed=4, device="cuda", init_on_device=True)
    _, loaded, _ = load_checkpoint(tmp_path / "c", expert_layout="blocks", device="cuda")
    for (name, a), b in zip(drawn.named_parameters(), loaded.parameters()):
        assert torch.equal(a, b), name
