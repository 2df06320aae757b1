"""Per-call implementation choice for the fused ops, with counted fallbacks.

Each op (`torch.ops.k3fuse.<op>`) has an ordered list of implementations (`Impl`) and one *stock*
function: the unfused torch sequence the op replaced. `dispatch(op, *args)` runs, in order:

1. kill switch (`runtime.is_disabled()`): the stock sequence, counted as `fallback:disabled`
   (what the user asked for, so strict mode does not raise);
2. call guard: when the op has `max_tokens`, a token count T outside [1, max_tokens] runs the stock
   sequence, counted as `fallback:tokens T outside [1, max_tokens]`;
3. the highest-priority Impl for the tensors' device whose `supports(*args, **kw)` returns None.
   "reference" is the expected implementation on CPU. On CUDA, when every kernel declines, the op
   runs the stock sequence (the model's own bf16 ops, cuBLAS and NCCL), never the fp32 reference:
   a fallback that costs what the unfused model costs, counted with a reason that lists why every
   kernel declined (or failed to import).

GPU kernel modules register themselves when imported::

    from k3fuse.kernels.dispatch import Impl, register_impl
    register_impl("decode_gemm", Impl("cute.gemv", supports=_supports, run=_run, priority=100,
                                      warmup=_warmup))

`supports` and `run` receive the op's arguments exactly as the op received them, in schema order,
without `strict` (ops with a call guard also pass `max_tokens=` as a keyword). `run` returns what
the op returns (see kernels/ops.py). The modules under k3fuse.kernels.cute and
k3fuse.kernels.triton are imported lazily on the first CUDA call (or `warmup`), never at
`import k3fuse.kernels`; a module that fails to import simply registers nothing, and its error is
quoted in the fallback reason. A kernel whose `run` raises is disabled for that op (its error becomes
its decline reason) and the next implementation runs; in strict mode the error is raised instead.
Collective ops (`COLLECTIVE_OPS`) never fall back per rank: a raising implementation raises
`K3FuseCollectiveError` (or the kernel's own CollectiveError) on this rank, and the bounded spins of
the fused kernels make the peers raise as well.
"""
from __future__ import annotations

import importlib
import pkgutil
import threading
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from k3fuse import runtime, settings

REFERENCE = "reference"
ALL_DEVICES: tuple[str, ...] = ("cpu", "cuda")
KERNEL_PACKAGES: tuple[str, ...] = ("k3fuse.kernels.cute", "k3fuse.kernels.triton")
# K3FUSE_DISABLE_CUTE=1 / K3FUSE_DISABLE_TRITON=1 skip importing that family (e.g. a broken toolchain).
_PACKAGE_SWITCHES = {"k3fuse.kernels.cute": "K3FUSE_DISABLE_CUTE", "k3fuse.kernels.triton": "K3FUSE_DISABLE_TRITON"}


@dataclass(frozen=True)
class Impl:
    """One implementation of an op.

    supports(*args, **kw) -> None if it can run these arguments, else a short reason (shown in the
    fallback message). run(*args, **kw) -> the op's result. priority: higher is tried first.
    device_types: tensor device types it is considered for (kernels: cuda only).
    warmup(shapes) compiles ahead of CUDA-graph capture; `shapes` is op-specific (see `warmup`).
    covers(shape) answers at compile time, from one op-specific shape dict like warmup's (e.g.
    {"M": tokens, "N", "K", "dtype", "out_dtype", "bias"} for decode_gemm): None if the kernel
    serves that shape, else its limit. Rules ask it (`coverage`) before inserting the op, so a site
    no kernel serves stays stock instead of falling back on every call. None: no shape limits.
    """

    name: str
    supports: Callable[..., str | None]
    run: Callable[..., Any]
    priority: int = 0
    device_types: tuple[str, ...] = ("cuda",)
    warmup: Callable[[Sequence[Any]], None] | None = None
    covers: Callable[[dict[str, Any]], str | None] | None = None


@dataclass
class _OpEntry:
    impls: list[Impl] = field(default_factory=list)
    stock: Callable[..., Any] | None = None
    broken: dict[str, str] = field(default_factory=dict)  # impl name -> why it was disabled


# Collective ops: every rank must run the same implementation, so an implementation that raises
# (or whose supports() raises) fails the op on this rank with K3FuseCollectiveError instead of
# being disabled on this rank only and falling back (the peers would wait in another collective).
# Its peers fail too: the fused kernels' spins are bounded and a failing rank marks every peer's
# workspace failed (kernels/symm_workspace.py).
# Filled from the op declarations (kernels/ops.py, OpDecl.collective).
COLLECTIVE_OPS: set[str] = set()


class K3FuseCollectiveError(RuntimeError):
    """A collective op's implementation failed; raised instead of a per-rank fallback."""


_lock = threading.RLock()
_ops: dict[str, _OpEntry] = {}
_declared: set[str] = set()  # ops declared in kernels/ops.py; implementations register against these
_gpu_loaded = False
_import_errors: dict[str, str] = {}  # module -> "ExcType: message"


def _entry(op: str) -> _OpEntry:
    entry = _ops.get(op)  # the per-call path: no lock once the op has an entry
    if entry is not None:
        return entry
    with _lock:
        return _ops.setdefault(op, _OpEntry())


def declare(op: str) -> None:
    """Open `op` for implementations (kernels/ops.py `declare`, from the op's OpDecl)."""
    with _lock:
        _declared.add(op)


def _check_declared(op: str) -> None:
    if op not in _declared:
        raise KeyError(f"k3fuse op {op!r} is not declared: declare it once in kernels/ops.py (OpDecl), then "
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
    """Import every public module of the CuTe and Triton packages once, so they register.

    Guarded per module: an ImportError (or any error while importing, e.g. a broken driver) is
    recorded and that module registers nothing. Called on the first CUDA dispatch and by `warmup`.
    """
    global _gpu_loaded
    with _lock:
        if _gpu_loaded:
            return
        _gpu_loaded = True
        for package in KERNEL_PACKAGES:
            switch = _PACKAGE_SWITCHES.get(package)
            if switch and settings.get(switch):
                _import_errors[package] = f"disabled by {switch}=1"
                continue
            try:
                pkg = importlib.import_module(package)
            except Exception as exc:
                _import_errors[package] = _short_error(exc)
                continue
            for info in pkgutil.iter_modules(getattr(pkg, "__path__", [])):
                if info.name.startswith("_"):
                    continue
                name = f"{package}.{info.name}"
                try:
                    importlib.import_module(name)
                except Exception as exc:
                    _import_errors[name] = _short_error(exc)


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


def token_count(x: torch.Tensor) -> int:
    """Tokens of a decode activation [..., features]: the product of the leading dims."""
    n = 1
    for d in x.shape[:-1]:
        n *= int(d)
    return n


def _run_stock(op: str, entry: _OpEntry, args: tuple, kw: dict) -> Any:
    if entry.stock is None:
        raise RuntimeError(f"k3fuse op {op} has no stock implementation registered")
    return entry.stock(*args, **kw)


@torch.no_grad()
def dispatch(op: str, *args: Any, strict: bool = False, **kw: Any) -> Any:
    """Run `op` with the best implementation for these arguments and count what ran.

    Runs under no_grad: the ops are inference-only (their Autograd key falls through), so an
    implementation never records an autograd graph, even when the weights require grad.
    """
    entry = _entry(op)
    if runtime.is_disabled():  # the user asked for stock: counted, never a strict-mode error
        runtime.record(op, "fallback:disabled")
        return _run_stock(op, entry, args, kw)

    max_tokens = kw.get("max_tokens")
    if max_tokens is not None and args and isinstance(args[0], torch.Tensor):
        tokens = token_count(args[0])
        if not 1 <= tokens <= max_tokens:
            runtime.record_fallback(op, f"tokens {tokens} outside [1, {max_tokens}]", strict=strict)
            return _run_stock(op, entry, args, kw)

    device = _device_type(args)
    if device == "cuda":
        load_gpu_impls()

    declined: list[str] = []
    for impl in entry.impls:  # never mutated in place (register/unregister replace the list)
        if device not in impl.device_types:
            continue
        reason = entry.broken.get(impl.name)
        if reason is None:
            try:
                reason = impl.supports(*args, **kw)
            except Exception as exc:  # a buggy predicate declines instead of failing the op
                if op in COLLECTIVE_OPS:  # ... except where the ranks could then diverge
                    raise K3FuseCollectiveError(
                        f"k3fuse collective op {op}: {impl.name}.supports raised "
                        f"{_short_error(exc)}; not falling back on this rank only") from exc
                reason = f"supports raised {_short_error(exc)}"
        if reason is not None:
            declined.append(f"{impl.name}: {reason}")
            continue
        if impl.name == REFERENCE:
            if device == "cuda":  # no kernel serves these arguments: run what the model ran
                runtime.record_fallback(op, _no_kernel_reason(declined), strict=strict)
                return _run_stock(op, entry, args, kw)
            runtime.record(op, REFERENCE)
            return impl.run(*args, **kw)
        try:
            result = impl.run(*args, **kw)
        except Exception as exc:
            if op in COLLECTIVE_OPS:
                if isinstance(exc, K3FuseCollectiveError):
                    raise   # e.g. symm_workspace.CollectiveTimeoutError: names the op, rank, peer
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
        if impl.warmup is None:
            continue
        try:
            impl.warmup(shapes)
            result[impl.name] = None
        except Exception as exc:
            result[impl.name] = _short_error(exc)
    return result


def ops_without_kernel(ops: Iterable[str]) -> list[str]:
    """The ops among `ops` with no CUDA kernel registered (imports the GPU modules first)."""
    load_gpu_impls()
    return [op for op in ops
            if not any(i.name != REFERENCE and "cuda" in i.device_types for i in implementations(op))]


def coverage(op: str, shape: dict[str, Any], tokens: Iterable[int]) -> dict[int, list[str]]:
    """Token counts of `tokens` at which no CUDA kernel of `op` covers `shape`, each with every
    kernel's limit ({} when some kernel serves every count). `shape` is the op's shape dict without
    "M"; each token count is tried as "M". Imports the GPU modules first."""
    load_gpu_impls()
    kernels = [i for i in implementations(op) if i.name != REFERENCE and "cuda" in i.device_types]
    uncovered: dict[int, list[str]] = {}
    for m in tokens:
        limits = []
        for impl in kernels:
            why = impl.covers(dict(shape, M=m)) if impl.covers is not None else None
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
        for entry in _ops.values():
            entry.broken.clear()


__all__ = ["Impl", "REFERENCE", "COLLECTIVE_OPS", "K3FuseCollectiveError", "declare", "register_impl", "unregister_impl",
           "register_stock", "dispatch", "implementations", "import_errors", "load_gpu_impls", "warmup", "coverage",
           "token_count"]
