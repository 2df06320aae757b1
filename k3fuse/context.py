"""DecodeContext: what the passes may assume about the deployment, as plain data.

Everything a guard checks comes from here (TP size and group, device, dtype, decode token range,
multicast policy, which rules run, the rewrite settings the TP group agreed), so a rewrite decision
can be reproduced from the context alone. Building one validates it and nothing else: no device,
driver or process-group query. `DecodeContext.from_process_group` is the one place a context is
built from a live group (every door goes through it): it fills the group's facts and has the ranks
agree what decides their rewrites (`agree_rewrite_settings`), so ranks that would rewrite their
graphs differently, and then run different collectives, stop with one error on every rank instead.
"""
from __future__ import annotations

import json
import threading
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
import torch.distributed as dist

from . import runtime, settings
from .token_range import DECODE_TOKENS
from .usage_error import UsageError

#: NVLink multicast: "auto" and "off" never use it (no k3fuse kernel does), "require" makes every
#: rule that fuses a collective refuse, saying why (guards.multicast_refusal)
MulticastPolicy = Literal["auto", "off", "require"]
_POLICIES = ("auto", "off", "require")


class ContextError(UsageError, ValueError):
    """A DecodeContext that cannot describe a real deployment (bad TP, tokens, group, a field of
    the wrong type), or ranks of a TP group that disagree on what decides their rewrites. A
    UsageError, so the CLI reports it as one line (exit 2)."""


#: K3FUSE_* variables that act only at run time or on the tools, never on what a pass rewrites
_RUN_TIME_ONLY = frozenset({"K3FUSE_STRICT", "K3FUSE_DISABLE", "K3FUSE_LOG", "K3FUSE_DEBUG", "K3FUSE_AR_TIMEOUT_S",
                            "K3FUSE_AR_TIMEOUT_MS", "K3FUSE_AR_START_GENERATION"})
KILL_SWITCH = "kill switch (K3FUSE_DISABLE / k3fuse.disable())"
#: how long a rank building its context waits for its peers to build theirs (they compile the
#: same step at about the same time; a rank that never builds one has no k3fuse pass installed)
AGREE_TIMEOUT_S = 300.0


def rewrite_settings() -> dict[str, Any]:
    """What decides which rewrites this process makes, read now: every K3FUSE_* setting except the
    run-time and tool ones (K3FUSE_RULES, the toolchain switches, K3FUSE_AR_PROTOCOL,
    K3FUSE_GEMV_MAX_M, ... all decide a GPU rewrite through the kernels' coverage), and the kill
    switch."""
    out: dict[str, Any] = {v.env: settings.get(v.env) for v in settings.VARIABLES if v.env not in _RUN_TIME_ONLY}
    out[KILL_SWITCH] = runtime.is_disabled()
    return out


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
class DecodeContext:
    """The deployment a decode graph is rewritten for.

    tp_size/rank/group_name: tensor parallelism (group_name is the c10d name in the graph's
    collectives; required when tp_size > 1). device_capability: (major, minor) or None on CPU.
    dtype: the trunk dtype the rules expect (site guard `dtype`: a site whose activation has another
    dtype is rejected), or None for any dtype the fused ops support. tokens: inclusive token range per decode step
    (within 1..64). multicast: "auto" or "off" (k3fuse never uses NVLink multicast: its fused
    collectives are unicast), "require" (every rule that fuses a collective refuses, saying why).
    strict: fused ops raise instead of falling back.
    enabled_rules: only these (None: all); disabled_rules: never these.
    rule_settings: {rule name: its typed settings object} (e.g. {"weight_prefetch":
        PrefetchSettings(budget_bytes=...)}), replacing the rule's own for this context; stored as
        sorted (name, settings) pairs so the context stays hashable and is part of cache keys.
    agreed_settings: the rewrite settings (`rewrite_settings()`) every rank of the TP group agreed
        when `from_process_group` built the context, as sorted (name, value) pairs; None (a single
        rank, or a context built by hand): the live values are read (`setting`).
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
    agreed_settings: tuple[tuple[str, Any], ...] | None = None

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
        if self.agreed_settings is not None:
            object.__setattr__(self, "agreed_settings", _agreed_settings(self.agreed_settings))
        if self.device_capability is not None:
            cap = self.device_capability
            if (not isinstance(cap, (tuple, list)) or len(cap) != 2 or not all(_is_int(c) for c in cap)
                    or cap[0] < 1 or cap[1] < 0):
                raise ContextError(f"device_capability must be (major, minor) ints or None, got {cap!r}",
                                   "pass e.g. (9, 0) for sm90, or None on CPU")
            object.__setattr__(self, "device_capability", tuple(cap))
        self._validate()

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
        """The context for `group` (default: WORLD): its size, this rank within it, its c10d name,
        this rank's device capability and the rewrite settings, which every rank of the group
        agrees (`agree_rewrite_settings`). Every rank of the group must build it (within
        AGREE_TIMEOUT_S of the others); a difference raises ContextError on every rank. Any field
        can be given by keyword; tp_size, if given, must equal the group size.
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
        kw = {k: v for k, v in kw.items() if k != "tp_size"}
        if "device_capability" not in kw:
            kw["device_capability"] = (torch.cuda.get_device_capability(torch.cuda.current_device())
                                       if torch.cuda.is_available() else None)
        peers = size > 1 and dist.get_backend(group) != "fake"   # torch's test-only group has none to agree with
        if peers:
            kw.setdefault("agreed_settings", tuple(sorted(rewrite_settings().items())))
        ctx = cls(tp_size=size, rank=dist.get_rank(group), group_name=group_name_of(group), **kw)
        if peers:
            agree_rewrite_settings(group, ctx)
        return ctx

    @classmethod
    def coerce(cls, value: DecodeContext | dict[str, Any] | None) -> DecodeContext:
        """A context from a context, a dict of fields, or None (from the process group if any)."""
        if isinstance(value, DecodeContext):
            return value
        kw = context_fields(value)
        if dist.is_available() and dist.is_initialized():
            return cls.from_process_group(**kw)
        return cls(**kw)

    def setting(self, name: str) -> Any:
        """A rewrite setting (a K3FUSE_* name of `rewrite_settings()`, or KILL_SWITCH) as this
        context decides it: the value its TP group agreed, else the live one. A live value that
        differs from the agreed one is refused, with one warning: a rank that changed it alone
        would rewrite its graph unlike its peers (change it on every rank and build new contexts)."""
        live = runtime.is_disabled() if name == KILL_SWITCH else settings.get(name)
        if self.agreed_settings is None:
            return live
        agreed = dict(self.agreed_settings)[name]
        if live != agreed:
            _warn_refused(self.group_name, name, live, agreed)
        return agreed

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
            "agreed_settings": dict(self.agreed_settings) if self.agreed_settings is not None else None,
        }


def context_fields(value: dict[str, Any] | None) -> dict[str, Any]:
    """The fields a context is built with, from a dict of them or None; anything else is an error."""
    if value is not None and not isinstance(value, dict):
        raise ContextError(f"a decode context must be a DecodeContext or a dict of its fields, got "
                           f"{type(value).__name__} {value!r}"[:200], "pass DecodeContext(tp_size=..., ...) or "
                           "{'tp_size': ..., 'tokens': (1, 64)}")
    return dict(value or {})


def _agreed_settings(value: Any) -> tuple[tuple[str, Any], ...]:
    pairs = list(value.items()) if isinstance(value, dict) else list(value)
    if not all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in pairs):
        raise ContextError(f"agreed_settings must be (name, value) pairs, got {value!r}"[:200],
                           "leave it out: from_process_group fills it")
    return tuple(sorted(pairs))


_refused: set[tuple[str | None, str]] = set()


def _warn_refused(group_name: str | None, name: str, live: Any, agreed: Any) -> None:
    if (group_name, name) in _refused:
        return
    _refused.add((group_name, name))
    warnings.warn(f"k3fuse: {name} is {live!r} on this rank but its TP group {group_name!r} agreed on {agreed!r} when "
                  "its context was built; refused for the rewrites (one rank alone would rewrite its graph unlike "
                  "its peers): change it on every rank and build new contexts", RuntimeWarning, stacklevel=3)


# --- the ranks agree their rewrite settings ------------------------------------------------------------
_STORE_PREFIX = "k3fuse/context"
_builds_lock = threading.Lock()
_builds: dict[str, tuple[Any, int]] = {}   # group name -> (its store, contexts this process built for it)


def agree_rewrite_settings(group: dist.ProcessGroup, ctx: DecodeContext) -> None:
    """Every rank of `group` builds its context under the same rewrite settings and fields (all but
    the rank), else every rank raises the same ContextError naming each difference and the ranks'
    values: ranks whose graphs differ would run different collectives and hang.

    Through the group's store, not a collective: a compile-time collective could pair with a
    peer's collective of the step it is compiling. A rank publishes its n-th context of the group,
    then waits for the peers' n-th (every rank builds the same contexts in the same order: the
    doors build them once per pass, engine TP group and options); a peer that has published a
    different one fails it at once, one that publishes none within AGREE_TIMEOUT_S too."""
    from .compat import group_store

    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    store = group_store(group)
    name = ctx.group_name or ""
    with _builds_lock:
        seen, n = _builds.get(name, (None, 0))
        n = n if seen is store else 0   # a re-initialised group: a new store, counted afresh
        _builds[name] = (store, n + 1)
    mine = {**dict(ctx.agreed_settings or ()), **{k: v for k, v in ctx.describe().items()
                                                  if k not in ("rank", "agreed_settings")}}
    key = f"{_STORE_PREFIX}/{name}/{n}/"
    store.set(key + str(rank), json.dumps(mine, sort_keys=True, default=repr))
    views: dict[int, dict[str, Any]] = {rank: json.loads(json.dumps(mine, sort_keys=True, default=repr))}
    deadline = time.monotonic() + AGREE_TIMEOUT_S
    pause = 0.001
    while len(views) < world:
        for peer in range(world):
            if peer not in views and store.check([key + str(peer)]):
                views[peer] = json.loads(store.get(key + str(peer)))
        if len(views) == world:
            break
        if time.monotonic() > deadline:
            missing = sorted(set(range(world)) - set(views))
            raise ContextError(f"rank(s) {missing} of TP group {name!r} built no k3fuse context within "
                               f"{AGREE_TIMEOUT_S:g} s of this rank (rank {rank}, its context #{n} of the group)",
                               "install k3fuse's pass on every rank, with the same configuration")
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    keys = sorted({k for v in views.values() for k in v})
    diffs = [f"{k}: " + ", ".join(f"rank {r}={views[r].get(k)!r}" for r in range(world))
             for k in keys if len({json.dumps(views[r].get(k), sort_keys=True) for r in range(world)}) > 1]
    if diffs:
        raise ContextError(f"the ranks of TP group {name!r} disagree on what decides their rewrites "
                           f"({'; '.join(diffs)})", "run every rank with the same configuration")


__all__ = ["DecodeContext", "MulticastPolicy", "ContextError", "KILL_SWITCH", "rewrite_settings", "context_fields",
           "agree_rewrite_settings", "AGREE_TIMEOUT_S"]
