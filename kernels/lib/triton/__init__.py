"""Triton kernel bodies: split-K GEMM (and its tuned table), Lamport push, the MoE front's gather,
routing, routed experts, the MoE combine, KDA short conv, KDA delta rule, L2 prefetch, the SiTU-GLU
activation.

`HAVE_TRITON` is decided here once; every module imports triton only under it.
"""
from __future__ import annotations

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
    IMPORT_ERROR: str | None = None
except Exception as exc:  # pragma: no cover - CPU CI without triton
    HAVE_TRITON = False
    IMPORT_ERROR = f"{type(exc).__name__}: {exc}"


def unavailable() -> str | None:
    """None when triton imports, else why not (the dispatcher leaves the Triton kernels out)."""
    return None if HAVE_TRITON else f"triton unavailable ({IMPORT_ERROR})"
