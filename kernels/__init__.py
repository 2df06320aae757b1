"""k3fuse.kernels: the fused custom ops torch.ops.k3fuse.* and their implementations.

ops/ holds one module per fused op (its Spec, declaration and implementations); lib/ the kernel
bodies (cute/, triton/, reference/), which register nothing; collective.py the machinery the fused
collectives share; dispatch.py the per-call choice. Importing this package declares the ops and
registers their implementations; the CuTe DSL and Triton modules are imported lazily by `dispatch`
on the first CUDA call, never here.
"""
from . import ops  # noqa: F401  (declares torch.ops.k3fuse.* and registers their implementations)
from .dispatch import Impl, register_impl, warmup  # noqa: F401
