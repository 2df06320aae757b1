"""Plain-torch implementations: the numerical oracle, the CPU path and the stock fallbacks.

Registers nothing: kernels/declare.py registers, from each op's declaration (kernels/ops/), the
"reference" Impl (priority -100, any device) and the stock sequence (stock.py) with kernels.dispatch. The shared-expert fork also gets
"torch.side_stream" on CUDA (kernels/ops/shared_expert.py): the model's own sequence in the model
dtype launched on the side stream, projections by the decode-GEMM kernels (cuBLAS where none
supports the shape); a real implementation (the op exists for the overlap), not a fallback.
"""
