"""Plain-torch implementations: the numerical oracle, the CPU path and the stock fallbacks.

Registers nothing: kernels/declare.py registers, from each op's declaration (kernels/ops/), the
"reference" Impl (priority -100, any device) and the stock sequence (stock.py) with kernels.dispatch.
"""
