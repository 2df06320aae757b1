"""Per-call implementation choice for the fused ops, with counted fallbacks.

Each op (`torch.ops.k3fuse.<op>`) has an ordered list of implementations (`Impl`), one *stock*
function (the unfused torch sequence the op replaced) and a `Spec` type (kernels/spec.py).
`dispatch(op, *args)` runs, in order:

1. kill switch (`runtime.is_disabled()`): the stock sequence, counted as `fallback:disabled`
   (what the user asked for, so strict mode does not raise);
2. call guard: when the op has `max_tokens`, a token count T outside [1, max_tokens] runs the stock
   sequence, counted as `fallback:tokens T outside [1, max_tokens]`;
3. the highest-priority Impl for the tensors' device whose `accepts(spec)` returns None, `spec`
   being the op's Spec built from these arguments. "reference" is the expected implementation on
   CPU. On CUDA, when every kernel declines, the op runs the stock sequence (the model's own ops,
   cuBLAS and NCCL), never the fp32 reference, counted with every kernel's reason.

An op module (kernels/ops/<op>.py) registers its implementations on import. A kernel names the
library modules it runs (`Impl.needs`, e.g. ("cute.gemv",) for k3fuse.kernels.lib.cute.gemv);
they are imported on the first CUDA call (or `warmup`, `coverage`), never at `import
k3fuse.kernels`, and a kernel whose modules fail to import (or whose toolchain is missing or
switched off) is left out, its error quoted in the fallback reason. A kernel whose `run` raises is
disabled for that op and the next implementation runs; in strict mode the error is raised.
Collective ops (`COLLECTIVE_OPS`) never fall back per rank: a raising implementation raises
`K3FuseCollectiveError` (or the kernel's own CollectiveError) on this rank, and the group's guard
(kernels/collective_guard.py) makes the peers raise at their next call (the bounded spins of the
fused kernels stop the current one). The guard also agrees the path settings (kill switch, strict
mode, ...) across the group at its first collective call and checks world_size against the group
on every path; a strict-mode fallback of a collective op raises after its stock sequence ran.
"""
from __future__ import annotations

import importlib
import threading
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from k3fuse import runtime

from .spec import token_count

REFERENCE = "reference"
ALL_DEVICES: tuple[str, ...] = ("cpu", "cuda")
LIBRARY = "k3fuse.kernels.lib"
# K3FUSE_DISABLE_CUTE=1 / K3FUSE_DISABLE_TRITON=1 skip importing that toolchain (e.g. a broken one).
_TOOLCHAIN_SWITCHES = {"cute": "K3FUSE_DISABLE_CUTE", "triton": "K3FUSE_DISABLE_TRITON"}


@dataclass(frozen=True)
class Impl:
    """One implementation of an op.

    accepts(spec) -> None if it can run the op's Spec (kernels/spec.py), else a short reason. The
    same predicate answers the compile-time coverage guard (a Spec built by the rule, once per
    token count) and each call (a Spec built from the arguments), so its reason is what the log
    and the fallback counters print. run(*args, **kw) -> the op's result, from the op's arguments
    in schema order without `strict`. priority: higher is tried first. device_types: tensor device
    types it is considered for (kernels: cuda only). warmup(shapes) compiles ahead of CUDA-graph
    capture; `shapes` is op-specific (see `warmup`). needs: the library modules it runs, relative
    to k3fuse.kernels.lib ("cute.gemv", "triton.splitk_gemm"), imported on first CUDA use.
    """

    name: str
    accepts: Callable[[Any], str | None]
    run: Callable[..., Any]
    priority: int = 0
    device_types: tuple[str, ...] = ("cuda",)
    warmup: Callable[[Sequence[Any]], None] | None = None
    needs: tuple[str, ...] = ()


@dataclass
class _OpEntry:
    impls: list[Impl] = field(default_factory=list)
    stock: Callable[..., Any] | None = None
    spec_type: Callable[..., Any] | None = None  # Spec.from_call of the op (kernels/spec.py)
    broken: dict[str, str] = field(default_factory=dict)  # impl name -> why it was disabled


# Collective ops: every rank must run the same implementation, so an implementation that raises
# (or whose accepts() raises) fails the op on this rank with K3FuseCollectiveError instead of
# being disabled on this rank only and falling back (the peers would wait in another collective).
# Its peers fail too: the fused kernels' spins are bounded and a failing rank marks every peer's
# workspace failed (kernels/collective.py).
# Filled from the op declarations (OpDecl.collective).
COLLECTIVE_OPS: set[str] = set()
#: collective op -> positions of (group_name, world_size) among dispatch's arguments
COLLECTIVE_ARGS: dict[str, tuple[int, int]] = {}
# enter(op, group_name, world_size, device_type) -> the group's state (kernels/collective_guard.py
# installs itself on import: it builds on this module, so this one cannot import it)
_collective_guard: Callable[[str, str, int, str], Any] | None = None


def install_collective_guard(enter: Callable[[str, str, int, str], Any]) -> None:
    global _collective_guard
    _collective_guard = enter


class K3FuseCollectiveError(RuntimeError):
    """A collective op's implementation failed; raised instead of a per-rank fallback."""


_lock = threading.RLock()
_ops: dict[str, _OpEntry] = {}
_declared: set[str] = set()  # ops declared (kernels/declare.py); implementations register against these
_gpu_loaded = False
_import_errors: dict[str, str] = {}  # module -> "ExcType: message"
_loaded: set[str] = set()  # library modules ("cute.gemv") that imported on a usable toolchain


def _entry(op: str) -> _OpEntry:
    entry = _ops.get(op)  # the per-call path: no lock once the op has an entry
    if entry is not None:
        return entry
    with _lock:
        return _ops.setdefault(op, _OpEntry())


def declare(op: str, spec_type: Callable[..., Any] | None = None) -> None:
    """Open `op` for implementations (kernels/declare.py, from the op's OpDecl); `spec_type`
    builds the op's Spec from a call's arguments (`Spec.from_call`)."""
    with _lock:
        _declared.add(op)
        _entry(op).spec_type = spec_type


def _check_declared(op: str) -> None:
    if op not in _declared:
        raise KeyError(f"k3fuse op {op!r} is not declared: declare it once in its module under kernels/ops/ (OpDecl), then "
                       f"register implementations against it; declared ops: {', '.join(sorted(_declared))}")


def register_impl(op: str, impl: Impl) -> None:
    """Add (or replace, by name) an implementation of declared `op`; order is by priority, then age."""
    _check_declared(op)
    with _lock:
        entry = _entry(op)
        # a new list, sorted before it is published: dispatch iterates entry.impls without the lock
        entry.impls = sorted([i for i in entry.impls if i.name != impl.name] + [impl],
                             key=lambda i: -i.priority)  # stable: equal priorities keep their order
        entry.broken.pop(impl.name, None)


def unregister_impl(op: str, name: str) -> None:
    """Remove an implementation (tests, or a kernel that found its toolchain broken)."""
    with _lock:
        entry = _entry(op)
        entry.impls = [i for i in entry.impls if i.name != name]
        entry.broken.pop(name, None)


def register_stock(op: str, fn: Callable[..., Any]) -> None:
    """The unfused torch sequence `op` replaced; run by the kill switch and the call guard."""
    _check_declared(op)
    _entry(op).stock = fn


def implementations(op: str) -> list[Impl]:
    """The registered implementations of `op`, highest priority first."""
    with _lock:
        return list(_entry(op).impls)


def import_errors() -> dict[str, str]:
    """Kernel modules that failed to import: {module: "ExcType: message"}."""
    with _lock:
        return dict(_import_errors)


def load_gpu_impls() -> None:
    """Import the library modules every registered kernel needs, once, so they can run.

    Guarded per module: a toolchain that is missing or switched off (K3FUSE_DISABLE_CUTE=1,
    K3FUSE_DISABLE_TRITON=1) or a module that fails to import (e.g. a broken driver) is recorded,
    and the kernels that need it are left out. Called on the first CUDA dispatch, by `warmup` and
    by `coverage`.
    """
    global _gpu_loaded
    with _lock:
        if _gpu_loaded:
            return
        _gpu_loaded = True
        needed = sorted({m for entry in _ops.values() for impl in entry.impls for m in impl.needs})
        for module in needed:
            toolchain = module.split(".")[0]
            package = f"{LIBRARY}.{toolchain}"
            if package in _import_errors:
                continue
            switch = _TOOLCHAIN_SWITCHES.get(toolchain)
            if switch and runtime.path_setting(switch):
                _import_errors[package] = f"disabled by {switch}=1"
                continue
            try:
                missing = importlib.import_module(package).unavailable()
            except Exception as exc:
                _import_errors[package] = _short_error(exc)
                continue
            if missing is not None:
                _import_errors[package] = missing
                continue
            try:
                importlib.import_module(f"{LIBRARY}.{module}")
            except Exception as exc:
                _import_errors[f"{LIBRARY}.{module}"] = _short_error(exc)
                continue
            _loaded.add(module)


def loaded(module: str) -> bool:
    """Library module `module` ("triton.splitk_gemm") imported on a usable toolchain (after
    `load_gpu_impls`): for a kernel with an optional second path."""
    return module in _loaded


def _usable(impl: Impl) -> bool:
    """Every library module `impl` needs imported (on CPU: no kernel module is ever loaded)."""
    return all(m in _loaded for m in impl.needs)


def _short_error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]


def _device_type(args: Iterable[Any]) -> str:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device.type
        if isinstance(a, (list, tuple)):
            for t in a:
                if isinstance(t, torch.Tensor):
                    return t.device.type
    return "cpu"


def _run_stock(op: str, entry: _OpEntry, args: tuple, kw: dict) -> Any:
    if entry.stock is None:
        raise RuntimeError(f"k3fuse op {op} has no stock implementation registered")
    return entry.stock(*args, **kw)


@torch.no_grad()
def dispatch(op: str, *args: Any, strict: bool = False, **kw: Any) -> Any:
    """Run `op` with the best implementation for these arguments and count what ran.

    Runs under no_grad: the ops are inference-only (their Autograd key falls through), so an
    implementation never records an autograd graph, even when the weights require grad.
    Collective ops first pass the group's guard (kernels/collective_guard.py): the group's agreed
    kill switch decides their path, and a failure fails the group on every rank.
    """
    entry = _entry(op)
    where = COLLECTIVE_ARGS.get(op)
    if where is None:
        return _dispatch(op, entry, args, kw, strict, runtime.is_disabled(), collective=False)
    if _collective_guard is None:
        raise RuntimeError(f"k3fuse collective op {op}: no collective guard installed (import k3fuse.kernels)")
    state = _collective_guard(op, args[where[0]], args[where[1]], _device_type(args))
    try:
        return _dispatch(op, entry, args, kw, strict, state.disabled, collective=True)
    except runtime.K3FuseFallbackError:
        raise   # raised after the stock sequence ran (its collective paired on every rank)
    except BaseException as exc:
        reason = f"{state.describe()}: {_short_error(exc)}"
        if state.world > 1:
            state.fail(op, reason, getattr(exc, "kind", "failure"))   # every peer raises next call
        else:
            runtime.record_collective_error(op, getattr(exc, "kind", "failure"))
        raise


def _fallback(op: str, entry: _OpEntry, args: tuple, kw: dict, reason: str, strict: bool, collective: bool) -> Any:
    """Run the stock sequence and count the fallback. Strict mode raises: before the stock
    sequence, except for a collective op, where it raises after it, so that its collective has
    paired with the peers' whatever this rank's strict mode (strict may differ per rank)."""
    if not collective:
        runtime.record_fallback(op, reason, strict=strict)
        return _run_stock(op, entry, args, kw)
    result = _run_stock(op, entry, args, kw)
    runtime.record_fallback(op, reason, strict=strict)
    return result


def _dispatch(op: str, entry: _OpEntry, args: tuple, kw: dict, strict: bool, disabled: bool,
              collective: bool) -> Any:
    if disabled:  # the user asked for stock: counted, never a strict-mode error
        runtime.record(op, "fallback:disabled")
        return _run_stock(op, entry, args, kw)

    max_tokens = kw.get("max_tokens")
    if max_tokens is not None and args and isinstance(args[0], torch.Tensor):
        tokens = token_count(args[0])
        if not 1 <= tokens <= max_tokens:
            return _fallback(op, entry, args, kw, f"tokens {tokens} outside [1, {max_tokens}]", strict, collective)

    device = _device_type(args)
    if device == "cuda":
        load_gpu_impls()

    declined: list[str] = []
    spec: Any = None
    for impl in entry.impls:  # never mutated in place (register/unregister replace the list)
        if device not in impl.device_types or not _usable(impl):
            continue
        reason = entry.broken.get(impl.name)
        if reason is None and impl.name != REFERENCE:
            try:
                if spec is None and entry.spec_type is not None:
                    spec = entry.spec_type(*args, **kw)
                reason = impl.accepts(spec)
            except Exception as exc:  # a buggy predicate declines instead of failing the op
                if op in COLLECTIVE_OPS:  # ... except where the ranks could then diverge
                    raise K3FuseCollectiveError(
                        f"k3fuse collective op {op}: {impl.name}.accepts raised "
                        f"{_short_error(exc)}; not falling back on this rank only") from exc
                reason = f"accepts raised {_short_error(exc)}"
        if reason is not None:
            declined.append(f"{impl.name}: {reason}")
            continue
        if impl.name == REFERENCE:
            if device == "cuda":  # no kernel serves these arguments: run what the model ran
                return _fallback(op, entry, args, kw, _no_kernel_reason(declined), strict, collective)
            runtime.record(op, REFERENCE)
            return impl.run(*args, **kw)
        try:
            result = impl.run(*args, **kw)
        except Exception as exc:
            if op in COLLECTIVE_OPS:
                if isinstance(exc, K3FuseCollectiveError):
                    raise   # e.g. collective.CollectiveTimeoutError: names the op, rank, peer
                raise K3FuseCollectiveError(
                    f"k3fuse collective op {op}: {impl.name} failed: {_short_error(exc)} (no "
                    "per-rank fallback: the other ranks fail too, see their errors)") from exc
            if strict or runtime.is_strict():
                raise runtime.K3FuseFallbackError(
                    f"k3fuse op {op} fell back in strict mode: {impl.name} failed: "
                    f"{_short_error(exc)}") from exc
            reason = f"failed: {_short_error(exc)}"
            with _lock:
                entry.broken[impl.name] = reason
            warnings.warn(f"k3fuse: {op} implementation {impl.name} {reason}; disabled for this "
                          "process, falling back", RuntimeWarning, stacklevel=2)
            return dispatch(op, *args, strict=strict, **kw)
        runtime.record(op, impl.name)
        return result
    raise RuntimeError(f"k3fuse op {op}: no implementation accepts these arguments on {device}: "
                       + "; ".join(declined or ["none registered"]))


def _no_kernel_reason(declined: list[str]) -> str:
    parts = list(declined) or ["no kernel registered"]
    errors = import_errors()
    if errors:
        parts.append("import failed: " + ", ".join(f"{m} ({e})" for m, e in sorted(errors.items())))
    return "; ".join(parts)


def warmup(op: str, shapes: Sequence[Any]) -> dict[str, str | None]:
    """Let every implementation of `op` compile for `shapes` before CUDA-graph capture.

    `shapes` is op-specific and passed through unchanged (the engine and the kernels agree on it,
    e.g. a list of {"M": 1, "N": 7168, "K": 6144, "dtype": torch.bfloat16} for decode_gemm).
    Returns {impl name: None if warmed up, else the error}; imports the GPU modules first when CUDA
    is available.
    """
    if torch.cuda.is_available():
        load_gpu_impls()
    result: dict[str, str | None] = {}
    for impl in implementations(op):
        if impl.warmup is None or not _usable(impl):
            continue
        try:
            impl.warmup(shapes)
            result[impl.name] = None
        except Exception as exc:
            result[impl.name] = _short_error(exc)
    return result


def cuda_kernels(op: str) -> list[Impl]:
    """The CUDA kernels of `op` that can run in this build (imports the library modules first)."""
    load_gpu_impls()
    return [i for i in implementations(op) if i.name != REFERENCE and "cuda" in i.device_types and _usable(i)]


def ops_without_kernel(ops: Iterable[str]) -> list[str]:
    """The ops among `ops` with no CUDA kernel that can run in this build."""
    return [op for op in ops if not cuda_kernels(op)]


def coverage(spec: Any, tokens: Iterable[int]) -> dict[int, list[str]]:
    """Token counts of `tokens` at which no CUDA kernel of `spec.op` accepts `spec` (with that
    token count), each with every kernel's reason ({} when some kernel serves every count)."""
    kernels = cuda_kernels(spec.op)
    uncovered: dict[int, list[str]] = {}
    for m in tokens:
        at = spec.with_tokens(m)
        limits = []
        for impl in kernels:
            why = impl.accepts(at)
            if why is None:
                break
            limits.append(f"{impl.name}: {why}")
        else:
            uncovered[m] = limits or ["no CUDA kernel registered"]
    return uncovered


def _reset_for_tests() -> None:
    """Forget the lazy GPU import and disabled kernels (tests only)."""
    global _gpu_loaded
    with _lock:
        _gpu_loaded = False
        _import_errors.clear()
        _loaded.clear()
        for entry in _ops.values():
            entry.broken.clear()


__all__ = ["Impl", "REFERENCE", "COLLECTIVE_OPS", "K3FuseCollectiveError", "declare", "register_impl", "unregister_impl",
           "register_stock", "dispatch", "implementations", "import_errors", "load_gpu_impls", "warmup", "coverage",
           "cuda_kernels", "ops_without_kernel"]
