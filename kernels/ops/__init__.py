"""The fused ops, one module per op (its Spec, declaration and implementations); importing this
package declares torch.ops.k3fuse.* and registers every implementation (the kernels' library
modules are imported on the first CUDA call, never here).

Adding an op: one module here that declares it (`OpDecl`: schema, fake, stock, reference, traits,
Spec) and registers its implementations (`Impl(name, accepts, run, needs=...)`), its line below,
and its kernel bodies under kernels/lib/.
"""
from __future__ import annotations

from . import (allreduce_rmsnorm, decode_gemm, kda_conv, kda_delta, l2_prefetch, moe_combine, moe_front, oproj_allreduce,
               route_topk, routed_experts, routed_experts_w4a16, shared_expert)
from . import mla_decode

MODULES = (oproj_allreduce, allreduce_rmsnorm, moe_front, shared_expert, l2_prefetch, decode_gemm, kda_conv,
           kda_delta, route_topk, routed_experts, routed_experts_w4a16, moe_combine, mla_decode)
#: every fused op's declaration, in MODULES order
DECLARATIONS = tuple(d for m in MODULES for d in m.DECLS)
OPS: tuple[str, ...] = tuple(d.name for d in DECLARATIONS)

__all__ = ["DECLARATIONS", "OPS", "MODULES"]
