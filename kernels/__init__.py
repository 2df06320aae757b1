"""k3fuse.kernels: the fused custom ops torch.ops.k3fuse.* and their implementations.

Importing this package registers the ops and the plain-torch reference implementations. The CuTe
DSL and Triton modules are imported lazily by `dispatch` on the first CUDA call, never here.
(`k3fuse.kernels.dispatch` is the module; the function is `k3fuse.kernels.dispatch.dispatch`.)
"""
from . import ops  # noqa: F401  (declares torch.ops.k3fuse.* with their reference and stock paths)
from . import cuda_shared_expert  # noqa: F401  (the fork's side-stream implementation on CUDA)
from .dispatch import Impl, register_impl, warmup  # noqa: F401
