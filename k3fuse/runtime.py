"""Runtime clarity: which implementation each fused op ran, strict mode, the kill switch, and the
path settings every rank of a TP group runs with.

Every fused op reports each call here. A *fallback* is any call that did not run the
implementation the op exists for (a kernel on GPU, the reference path on CPU), with its reason.
Strict mode turns a fallback into an error, so a test can prove the fast path ran.

Path settings (`PATH_SETTINGS`) decide which kernel a fused op runs and how it synchronises; the
kernels' predicates and builders read them with `path_setting`, never from the environment. Until
a TP group agrees them (kernels/collective_guard.py, at its first collective call) they are this
process's live values; from then on the agreed ones, which only `reagree` changes (collective), so a
variable changed on one rank cannot send it down another path than its peers.
"""
from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from collections.abc import Iterator

from . import settings

_lock = threading.Lock()
_counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
_strict_override: bool | None = None
_disabled_override: bool | None = None

#: K3FUSE_* settings that decide a rank's path through the fused ops (K3FUSE_AR_TIMEOUT_S stands
#: for the spin bound however it is given: K3FUSE_AR_TIMEOUT_S, else _MS, else the default)
PATH_SETTINGS: tuple[str, ...] = ("K3FUSE_RULES", "K3FUSE_DISABLE_CUTE", "K3FUSE_DISABLE_TRITON",
                                  "K3FUSE_AR_PROTOCOL", "K3FUSE_AR_PDL", "K3FUSE_GEMV_MAX_M",
                                  "K3FUSE_AR_START_GENERATION", "K3FUSE_AR_TIMEOUT_S")
_agreed: dict[str, object] = {}


class K3FuseFallbackError(RuntimeError):
    """A fused op fell back while strict mode was on."""


def is_strict() -> bool:
    """Strict mode from `strict()` or, if unset, from K3FUSE_STRICT."""
    return _strict_override if _strict_override is not None else settings.get("K3FUSE_STRICT")


def is_disabled() -> bool:
    """The kill switch from `disable()` or, if unset, from K3FUSE_DISABLE."""
    return _disabled_override if _disabled_override is not None else settings.get("K3FUSE_DISABLE")


@contextlib.contextmanager
def strict(enabled: bool = True) -> Iterator[None]:
    """Within the block, every fallback of a fused op raises K3FuseFallbackError."""
    global _strict_override
    previous, _strict_override = _strict_override, enabled
    try:
        yield
    finally:
        _strict_override = previous


@contextlib.contextmanager
def disable(disabled: bool = True) -> Iterator[None]:
    """Within the block, fused ops run the stock sequence and the passes rewrite nothing; this wins
    over strict mode (the stock sequence is what was asked for, so it is no fallback error)."""
    global _disabled_override
    previous, _disabled_override = _disabled_override, disabled
    try:
        yield
    finally:
        _disabled_override = previous


def live_path_setting(name: str) -> object:
    """Path setting `name` as this process's environment says now."""
    if name not in PATH_SETTINGS:
        raise KeyError(f"{name} is not a path setting; path settings: {', '.join(PATH_SETTINGS)}")
    return settings.spin_timeout_s() if name == "K3FUSE_AR_TIMEOUT_S" else settings.get(name)


def live_path_settings() -> dict[str, object]:
    return {name: live_path_setting(name) for name in PATH_SETTINGS}


def path_setting(name: str) -> object:
    """Path setting `name` as this rank runs it: the value its TP group agreed, else the live one."""
    try:
        return _agreed[name]
    except KeyError:
        return live_path_setting(name)


def path_settings() -> dict[str, object]:
    return {name: path_setting(name) for name in PATH_SETTINGS}


def pin_path_settings(values: dict[str, object]) -> None:
    """Fix the path settings to what a TP group agreed (the collective guard calls it)."""
    with _lock:
        _agreed.update({k: v for k, v in values.items() if k in PATH_SETTINGS})


def unpin_path_settings() -> None:
    """Back to the live values (tests; a process whose TP groups are all gone)."""
    with _lock:
        _agreed.clear()


def record(op: str, impl: str) -> None:
    """Count one call of `op` that ran implementation `impl`."""
    with _lock:
        _counts[op][impl] += 1


def record_fallback(op: str, reason: str, *, strict: bool = False) -> None:
    """Count a fallback; raise instead if strict mode is on (globally or for this call)."""
    if strict or is_strict():
        raise K3FuseFallbackError(f"k3fuse op {op} fell back in strict mode: {reason}")
    record(op, f"fallback:{reason}")


ERROR_PREFIX = "error:"


def record_collective_error(op: str, kind: str) -> None:
    """Count a collective error of `op` on this rank (timeout, peer failure, settings mismatch, ...)."""
    record(op, f"{ERROR_PREFIX}{kind}")


def stats() -> dict[str, dict[str, int]]:
    """{op: {implementation, "fallback:<reason>" or "error:<kind>": calls}} since the last reset
    ("error:" entries count the collective errors this rank saw: timeout, peer failure, ...)."""
    with _lock:
        return {op: dict(impls) for op, impls in _counts.items()}


def fallbacks() -> dict[str, dict[str, int]]:
    """Only the fallback entries of `stats()`."""
    return {
        op: {k: v for k, v in impls.items() if k.startswith("fallback:")}
        for op, impls in stats().items()
        if any(k.startswith("fallback:") for k in impls)
    }


def collective_errors() -> dict[str, dict[str, int]]:
    """Only the collective-error entries of `stats()` ("error:<kind>")."""
    return {
        op: {k: v for k, v in impls.items() if k.startswith(ERROR_PREFIX)}
        for op, impls in stats().items()
        if any(k.startswith(ERROR_PREFIX) for k in impls)
    }


def reset_stats() -> None:
    with _lock:
        _counts.clear()
