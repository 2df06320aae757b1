"""Launch sequences across toolchains: a CuTe kernel between Triton ones (the routed experts' W4A16 MLP).

The only library package that imports both `cute` and `triton` (tests/test_layering.py): it holds launch
orders and their configurations, never a kernel body, and registers nothing.
"""
from __future__ import annotations


def unavailable() -> str | None:
    """None when both toolchains import (each is loaded, or switched off, as its own package: an Impl names
    their modules in `needs` beside this one's)."""
    from .. import cute, triton

    return cute.unavailable() or triton.unavailable()
