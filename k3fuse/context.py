"""DecodeContext: what the passes may assume about the deployment, and the multicast probe.

Everything a guard checks comes from here (TP size and group, device, dtype, decode token range,
multicast policy, which rules run), so a rewrite decision can be reproduced from the context
alone. `DecodeContext.from_process_group` fills it from a live process group; it is collective
(every rank of the group must call it) because the multicast probe agrees across ranks.
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
import torch.distributed as dist

from . import settings
from .token_range import DECODE_TOKENS
from .usage_error import UsageError

MulticastPolicy = Literal["auto", "off", "require"]
_POLICIES = ("auto", "off", "require")

#: switches that turn NVLink multicast off, checked in this order
MULTICAST_SWITCHES: tuple[tuple[str, str], ...] = (
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NCCL_NVLS_ENABLE", "0"),
    ("K3FUSE_DISABLE_MULTICAST", "1"),
)
#: CUdevice_attribute value of CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED
CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED = 132


class ContextError(UsageError, ValueError):
    """A DecodeContext that cannot describe a real deployment (bad TP, tokens, group, a field of
    the wrong type). A UsageError, so the CLI reports it as one line (exit 2)."""


#: what decides which rewrites a rank makes (the runtime path is agreed again at the first
#: collective call: kernels/collective_guard.py)
_REWRITE_SETTINGS = ("K3FUSE_RULES", "K3FUSE_DISABLE_CUTE", "K3FUSE_DISABLE_TRITON", "K3FUSE_AR_PROTOCOL")


def _agree_rewrite_settings(group: dist.ProcessGroup, size: int, kw: dict[str, Any]) -> None:
    """Every rank of `group` rewrites under the same settings, else every rank raises the same
    error naming them (collective, like the multicast probe): ranks whose graphs differ would run
    different collectives."""
    if size == 1:
        return
    from . import runtime

    mine: dict[str, Any] = {name: settings.get(name) for name in _REWRITE_SETTINGS}
    mine["kill switch (K3FUSE_DISABLE / k3fuse.disable())"] = runtime.is_disabled()
    mine["strict"] = kw.get("strict", False)
    mine["disabled_rules"] = sorted(kw.get("disabled_rules", ()) or ())
    got: list = [None] * size
    dist.all_gather_object(got, mine, group=group)
    diffs = [f"{key}: " + ", ".join(f"rank {r}={g[key]!r}" for r, g in enumerate(got))
             for key in mine if len({repr(g[key]) for g in got}) > 1]
    if diffs:
        raise ContextError(f"the ranks of the TP group disagree on what decides their rewrites ({'; '.join(diffs)})",
                           "run every rank with the same configuration")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _rule_names(field_name: str, value: Any) -> frozenset[str]:
    """A set of rule names from any iterable of str; a bare str is a mistake (it would become a
    set of characters)."""
    if isinstance(value, str):
        raise ContextError(f"{field_name}={value!r} is a string, not a collection of rule names",
                           f"pass {field_name}={{{value!r}}}")
    try:
        names = frozenset(value)
    except TypeError:
        raise ContextError(f"{field_name} must be a collection of rule names, got {value!r}",
                           f"pass e.g. {field_name}={{'decode_gemm'}}") from None
    bad = sorted(repr(n) for n in names if not isinstance(n, str))
    if bad:
        raise ContextError(f"{field_name} holds non-string rule names {', '.join(bad)}", "pass rule names as str")
    return names


def _rule_settings(value: Any) -> tuple[tuple[str, Any], ...]:
    """{name: settings} (or pairs) -> sorted pairs; each settings object a frozen dataclass."""
    pairs = list(value.items()) if isinstance(value, dict) else list(value or ())
    out = []
    for item in pairs:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise ContextError(f"rule_settings must map rule names to settings objects, got {value!r}",
                               "pass e.g. rule_settings={'weight_prefetch': PrefetchSettings(budget_bytes=1 << 20)}")
        name, settings = item
        params = getattr(type(settings), "__dataclass_params__", None)
        if params is None or not params.frozen:
            raise ContextError(f"rule_settings[{name!r}] is {settings!r}, not a rule's settings object",
                               "pass the rule's settings dataclass (Rule.settings_type)")
        out.append((name, settings))
    return tuple(sorted(out, key=lambda p: p[0]))


@dataclass(frozen=True)
class MulticastStatus:
    """Whether NVLink multicast may be used, and why (e.g. "unavailable: NCCL_NVLS_ENABLE=0")."""

    available: bool
    reason: str

    def __bool__(self) -> bool:
        return self.available


def _switch_reason(env: dict[str, str] | os._Environ[str]) -> str | None:
    for name, off_value in MULTICAST_SWITCHES:
        if name.startswith("K3FUSE_"):  # k3fuse's own flag: parsed like every K3FUSE_* variable
            if settings.is_on(env, name):
                return f"unavailable: {name}={off_value}"
        elif env.get(name, "").strip() == off_value:
            return f"unavailable: {name}={off_value}"
    return None


def _device_supports_multicast(device: torch.device | None) -> MulticastStatus:
    """Ask the driver for CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED; never creates a multicast object."""
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return MulticastStatus(False, "unavailable: no CUDA device")
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:  # cuda-python, if installed: a pure attribute query
        try:
            from cuda.bindings import driver  # type: ignore[import-not-found]
        except ImportError:
            from cuda import cuda as driver  # type: ignore[import-not-found,no-redef]
        (err,) = driver.cuInit(0)
        err, dev = driver.cuDeviceGet(index)
        err2, value = driver.cuDeviceGetAttribute(
            driver.CUdevice_attribute(CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED), dev
        )
        if int(err2) == 0:
            if value:
                return MulticastStatus(True, "available")
            return MulticastStatus(False, "unavailable: CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED=0")
    except Exception:  # not installed or an old binding: try torch
        pass
    try:  # torch's own query (attribute + driver entry point check, no allocation)
        from torch._C._distributed_c10d import _SymmetricMemory

        if _SymmetricMemory.has_multicast_support(torch._C._autograd.DeviceType.CUDA, index):
            return MulticastStatus(True, "available")
        return MulticastStatus(False, "unavailable: device reports no multicast support")
    except Exception:
        return MulticastStatus(False, "unavailable: cannot query the device "
                                      "(no cuda-python, no torch symmetric memory)")


def probe_multicast(policy: MulticastPolicy = "auto", *, device: torch.device | None = None,
                    group: dist.ProcessGroup | None = None,
                    env: dict[str, str] | os._Environ[str] | None = None) -> MulticastStatus:
    """Multicast availability under `policy`; with `group`, all ranks agree (MIN all_reduce).

    Collective when `group` is given: every rank of the group must call it.
    """
    env = os.environ if env is None else env
    if policy == "off":
        local = MulticastStatus(False, "policy off")
    else:
        reason = _switch_reason(env)
        local = MulticastStatus(False, reason) if reason else _device_supports_multicast(device)
    if group is None or dist.get_world_size(group) == 1:
        return local
    on_cuda = "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available()  # "nccl" or "cpu:gloo,cuda:nccl"
    flag = torch.tensor([1 if local.available else 0], dtype=torch.int32,
                        device=torch.device("cuda", torch.cuda.current_device()) if on_cuda else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    if local.available and int(flag.item()) == 0:
        return MulticastStatus(False, "unavailable: another rank reports multicast unavailable")
    return local


@dataclass(frozen=True)
class DecodeContext:
    """The deployment a decode graph is rewritten for.

    tp_size/rank/group_name: tensor parallelism (group_name is the c10d name in the graph's
    collectives; required when tp_size > 1). device_capability: (major, minor) or None on CPU.
    dtype: the trunk dtype the rules expect (site guard `dtype`: a site whose activation has another
    dtype is rejected), or None for any dtype the fused ops support. tokens: inclusive token range per decode step
    (within 1..64). multicast: "auto" (probe and report it), "off" (report "policy off"), "require"
    (rules under the multicast policy, `Rule.uses_multicast`, fail their contract guard when it is
    unavailable; no k3fuse kernel uses multicast, the fused all-reduce is a unicast one-shot).
    strict: fused ops raise instead of falling back.
    enabled_rules: only these (None: all); disabled_rules: never these.
    rule_settings: {rule name: its typed settings object} (e.g. {"weight_prefetch":
        PrefetchSettings(budget_bytes=...)}), replacing the rule's own for this context; stored as
        sorted (name, settings) pairs so the context stays hashable and is part of cache keys.
    """

    tp_size: int = 1
    rank: int = 0
    group_name: str | None = None
    device_capability: tuple[int, int] | None = None
    dtype: torch.dtype | None = None
    tokens: tuple[int, int] = DECODE_TOKENS
    multicast: MulticastPolicy = "auto"
    strict: bool = False
    enabled_rules: frozenset[str] | None = None
    disabled_rules: frozenset[str] = frozenset()
    rule_settings: Any = ()
    multicast_info: MulticastStatus | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        tokens = self.tokens
        if _is_int(tokens):
            tokens = (tokens, tokens)
        if (not isinstance(tokens, (tuple, list)) or len(tokens) != 2
                or not all(_is_int(t) for t in tokens)):
            raise ContextError(f"tokens must be an int or (min, max) ints, got {self.tokens!r}",
                               "pass e.g. tokens=(1, 64)")
        object.__setattr__(self, "tokens", tuple(tokens))
        if self.enabled_rules is not None:
            object.__setattr__(self, "enabled_rules", _rule_names("enabled_rules", self.enabled_rules))
        object.__setattr__(self, "disabled_rules", _rule_names("disabled_rules", self.disabled_rules))
        object.__setattr__(self, "rule_settings", _rule_settings(self.rule_settings))
        if self.device_capability is not None:
            cap = self.device_capability
            if (not isinstance(cap, (tuple, list)) or len(cap) != 2 or not all(_is_int(c) for c in cap)
                    or cap[0] < 1 or cap[1] < 0):
                raise ContextError(f"device_capability must be (major, minor) ints or None, got {cap!r}",
                                   "pass e.g. (9, 0) for sm90, or None on CPU")
            object.__setattr__(self, "device_capability", tuple(cap))
        self._validate()
        if self.multicast_info is None:  # probed once, here: the context never changes after it is built
            on_gpu = self.device_capability is not None and torch.cuda.is_available()
            object.__setattr__(self, "multicast_info",
                               probe_multicast(self.multicast, device=torch.device("cuda") if on_gpu else None))

    def _validate(self) -> None:
        if not _is_int(self.tp_size) or self.tp_size < 1:
            raise ContextError(f"tp_size must be a positive int, got {self.tp_size!r}", "pass e.g. tp_size=2")
        if not _is_int(self.rank) or not 0 <= self.rank < self.tp_size:
            raise ContextError(f"rank {self.rank!r} is outside tp_size {self.tp_size}",
                               f"pass a rank in 0..{self.tp_size - 1}")
        if self.group_name is not None and not isinstance(self.group_name, str):
            raise ContextError(f"group_name must be the c10d group name (str), got {self.group_name!r}",
                               "pass group.group_name, or use DecodeContext.from_process_group()")
        if self.dtype is not None and not (isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point):
            raise ContextError(f"dtype must be a floating torch.dtype or None, got {self.dtype!r}",
                               "pass e.g. dtype=torch.bfloat16")
        lo, hi = self.tokens
        if not DECODE_TOKENS[0] <= lo <= hi <= DECODE_TOKENS[1]:
            raise ContextError(
                f"bad token range {lo}-{hi}: decode rewrites cover {DECODE_TOKENS[0]}..{DECODE_TOKENS[1]} "
                f"tokens per step, min <= max", f"pass a range inside {DECODE_TOKENS[0]}-{DECODE_TOKENS[1]}"
            )
        if self.multicast not in _POLICIES:
            raise ContextError(f"multicast must be one of {_POLICIES}, got {self.multicast!r}")
        if not isinstance(self.strict, bool):
            raise ContextError(f"strict must be True or False, got {self.strict!r}", "pass a bool")
        if self.multicast_info is not None and not isinstance(self.multicast_info, MulticastStatus):
            raise ContextError(f"multicast_info must be a MulticastStatus or None, got {self.multicast_info!r}")
        if self.tp_size > 1 and not self.group_name:
            raise ContextError(
                f"tp_size={self.tp_size} needs a process group: pass group_name=... or build the context with "
                f"DecodeContext.from_process_group() after torch.distributed.init_process_group"
            )
        if self.tp_size > 1 and dist.is_available() and dist.is_initialized():
            self._check_group_size()

    def _check_group_size(self) -> None:
        from .compat import resolve_group

        try:
            group = resolve_group(self.group_name or "")
        except RuntimeError:
            return  # a group of another process (offline rewrite of a captured graph)
        size = dist.get_world_size(group)
        if size != self.tp_size:
            raise ContextError(
                f"tp_size={self.tp_size} does not match process group {self.group_name!r} of size {size}"
            )

    @classmethod
    def from_process_group(cls, group: dist.ProcessGroup | None = None, **kw: Any) -> DecodeContext:
        """Context for `group` (default: WORLD); collective, because of the multicast probe.

        Any field can be overridden by keyword; tp_size, if given, must equal the group size.
        """
        if not (dist.is_available() and dist.is_initialized()):
            tp = kw.get("tp_size", 1)
            if tp > 1:
                raise ContextError(
                    f"tp_size={tp} but torch.distributed is not initialized: call init_process_group first"
                )
            return cls(**kw)
        from .compat import group_name_of

        group = group if group is not None else dist.group.WORLD
        size = dist.get_world_size(group)
        if "tp_size" in kw and kw["tp_size"] != size:
            raise ContextError(f"tp_size={kw['tp_size']} does not match the process group size {size}")
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        kw.setdefault("device_capability", torch.cuda.get_device_capability(device) if device is not None else None)
        policy = kw.get("multicast", "auto")
        kw.setdefault("multicast_info", probe_multicast(policy, device=device, group=group))
        _agree_rewrite_settings(group, size, kw)
        return cls(tp_size=size, rank=dist.get_rank(group), group_name=group_name_of(group),
                   **{k: v for k, v in kw.items() if k != "tp_size"})

    @classmethod
    def coerce(cls, value: DecodeContext | dict[str, Any] | None) -> DecodeContext:
        """A context from a context, a dict of fields, or None (from the process group if any)."""
        if isinstance(value, DecodeContext):
            return value
        if value is not None and not isinstance(value, dict):
            raise ContextError(f"a decode context must be a DecodeContext or a dict of its fields, got "
                               f"{type(value).__name__} {value!r}"[:200], "pass DecodeContext(tp_size=..., ...) or "
                               "{'tp_size': ..., 'tokens': (1, 64)}")
        kw = dict(value or {})
        if dist.is_available() and dist.is_initialized():
            return cls.from_process_group(**kw)
        return cls(**kw)

    def multicast_status(self) -> MulticastStatus:
        """The status probed when the context was built (collectively by `from_process_group`, else
        on this rank alone)."""
        assert self.multicast_info is not None
        return self.multicast_info

    def rule_enabled(self, name: str) -> bool:
        if name in self.disabled_rules:
            return False
        return self.enabled_rules is None or name in self.enabled_rules

    def check_rule_names(self, known: Iterable[str]) -> None:
        """Raise for enabled/disabled names that are not rules of the pipeline."""
        known = set(known)
        named = (self.enabled_rules or set()) | self.disabled_rules | {n for n, _ in self.rule_settings}
        unknown = sorted(named - known)
        if unknown:
            raise ContextError(f"unknown rule name(s) {unknown}", f"known rules: {', '.join(sorted(known))}")

    def settings_for(self, rule_name: str) -> Any:
        """The settings object this context gives rule `rule_name`, or None."""
        return dict(self.rule_settings).get(rule_name)

    def with_(self, **changes: Any) -> DecodeContext:
        return replace(self, **changes)

    def describe(self) -> dict[str, Any]:
        """Plain-value view for logs and cache keys."""
        return {
            "tp_size": self.tp_size,
            "rank": self.rank,
            "group_name": self.group_name,
            "device_capability": list(self.device_capability) if self.device_capability else None,
            "dtype": str(self.dtype) if self.dtype is not None else None,
            "tokens": list(self.tokens),
            "multicast": self.multicast,
            "strict": self.strict,
            "enabled_rules": sorted(self.enabled_rules) if self.enabled_rules is not None else None,
            "disabled_rules": sorted(self.disabled_rules),
            "rule_settings": {name: repr(s) for name, s in self.rule_settings},
        }


__all__ = ["DecodeContext", "MulticastPolicy", "MulticastStatus", "ContextError", "probe_multicast",
           "MULTICAST_SWITCHES"]
