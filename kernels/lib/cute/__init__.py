"""CuTe DSL kernel bodies: the decode GEMV (and its tuned table) and the one-shot all-reduce epilogue."""
from __future__ import annotations


def unavailable() -> str | None:
    """None when the CuTe DSL imports, else why not (the dispatcher leaves the CuTe kernels out)."""
    from .compat import HAVE_CUTE, IMPORT_ERROR

    return None if HAVE_CUTE else f"CuTe DSL unavailable ({IMPORT_ERROR})"
