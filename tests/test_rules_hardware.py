"""Hardware guard: on a GPU a rule fires only if every op it emits has a CUDA kernel.

Without one the op would run its reference fallback on every call (slower than stock, and an
error in strict mode), so the rule is rejected at the contract level and the log says which op.
"""
import pytest
import torch

import k3fuse
from k3fuse.guards import kernels_available
from k3fuse.kernels import dispatch
from k3fuse.kernels.dispatch import Impl
from k3fuse.model import K3DecodeStack, get_config

H100 = (9, 0)


@pytest.fixture
def registry_without_cuda_kernels(monkeypatch):
    """Only the reference impls (and the side-stream fork), whatever kernel packages are installed."""
    monkeypatch.setattr(dispatch, "load_gpu_impls", lambda: None)
    for entry in list(dispatch._ops.values()):
        monkeypatch.setattr(entry, "impls", [i for i in entry.impls
                                             if i.name in (dispatch.REFERENCE, "torch.side_stream")])
    yield
    dispatch.unregister_impl("decode_gemm", "test.cuda_gemm")


def _exported_tp1():
    model = K3DecodeStack(get_config("tiny", n_layers=1), seed=0)
    state = model.init_state(2)
    x = torch.randn(2, model.config.hidden)
    return torch.export.export(model, (x, state))


def test_guard_passes_on_cpu_and_names_missing_cuda_kernels(registry_without_cuda_kernels):
    assert kernels_available(k3fuse.DecodeContext(), ("decode_gemm", "l2_prefetch")) is None
    f = kernels_available(k3fuse.DecodeContext(device_capability=H100), ("decode_gemm", "shared_expert_fork"))
    assert f is not None and f.level == "contract" and f.guard == "kernel"
    assert f.values["ops"] == ["decode_gemm"] and f.values["device_capability"] == H100


def test_rule_without_cuda_kernel_is_rejected_and_fires_once_one_is_registered(registry_without_cuda_kernels):
    ep = _exported_tp1()
    _, log = k3fuse.apply(ep, k3fuse.DecodeContext(device_capability=H100))
    (rejected,) = log.rejected("decode_gemm")
    assert (rejected.level, rejected.guard, rejected.values["ops"]) == ("contract", "kernel", ["decode_gemm"])
    assert log.applied("decode_gemm") == 0
    assert log.applied("shared_expert_stream") == 1  # the fork has its CUDA implementation

    dispatch.register_impl("decode_gemm", Impl("test.cuda_gemm", lambda *a: None, lambda *a: None, 10))
    _, log = k3fuse.apply(_exported_tp1(), k3fuse.DecodeContext(device_capability=H100))
    assert log.applied("decode_gemm") == 14 and not log.rejected("decode_gemm")  # the shared gate/up/down too
