"""Every K3FUSE_* environment variable, parsed in one place into one typed object.

Why one module: a switch read in several files with several parsers drifts ("1" on, "true" off).
`get(name)` returns one variable's parsed value: a dict lookup plus a parse cached per raw string,
cheap enough for every fused-op call (the kill switch is read per call); a test or a user that
changes a variable sees the change on the next read. `current()` is all of them as a frozen
`Settings`. A value that does not parse raises `SettingsError` naming the variable, the value and
what it accepts; `import k3fuse` (and the CLI, before any verb) parses them all at once with
`check_environment`, so a bad value stops the process where it starts, not inside a compiled forward.

A leaf: imports nothing from k3fuse, so the kernels can read it without reaching into the
framework. The README's "Settings" table lists the same variables (`VARIABLES`); a test keeps them
in step.
"""
from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

ArProtocol = Literal["lamport", "flags"]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


class SettingsError(ValueError):
    """A K3FUSE_* variable holds a value k3fuse cannot use."""


@dataclass(frozen=True)
class Variable:
    """One environment variable: its Settings field, parser, default and what it does."""

    env: str
    field: str
    parse: Callable[[str, str], Any]
    default: Any
    doc: str


def _flag(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise SettingsError(f"{name}={raw!r}: expected 1/0 (or true/false, yes/no, on/off)")


def _optional_flag(name: str, raw: str) -> bool | None:
    """Unset or empty: None (the code's default), else a flag."""
    return _flag(name, raw) if raw.strip() else None


def _text(name: str, raw: str) -> str:
    return raw.strip()


def rules_spec_problem(spec: str) -> str | None:
    """What is wrong with a rule selection in the K3FUSE_RULES / --rules grammar, or None.

    The forms: "a,b" runs only a and b; "-a" all default rules but a; "+a" the default rules and a
    (an off-by-default rule). "-a" and "+b" may be combined ("-a,+b"); a list of bare names stands
    alone, since "a,-b" or "a,+b" has no single reading. No item may be empty."""
    items = [x.strip() for x in spec.split(",")]
    if not any(items):
        return "names no rule"
    if not all(items):
        return "has an empty item (two commas in a row, or one at an end)"
    lone = [x for x in items if x in ("-", "+")]
    if lone:
        return f"has a bare {lone[0]!r} without a rule name"
    bare = [x for x in items if x[0] not in "+-"]
    signed = [x for x in items if x[0] in "+-"]
    if bare and signed:
        return (f"mixes bare names {bare} with {signed}: 'a,b' (only these) stands alone, while '-a' (all but a) "
                f"and '+a' (the defaults and a) may be combined, e.g. '-a,+b'")
    return None


def _rules(name: str, raw: str) -> str:
    """K3FUSE_RULES: empty or unset is the defaults; otherwise the grammar of rules_spec_problem."""
    spec = raw.strip()
    if spec and (problem := rules_spec_problem(spec)) is not None:
        raise SettingsError(f"{name}={raw!r} {problem}")
    return spec


def _optional_path(name: str, raw: str) -> str | None:
    return raw.strip() or None


def _positive_int(name: str, raw: str) -> int | None:
    if not raw.strip():
        return None
    try:
        value = int(raw.strip(), 0)
    except ValueError:
        raise SettingsError(f"{name}={raw!r}: expected a positive integer") from None
    if value < 1:
        raise SettingsError(f"{name}={raw!r}: expected a positive integer")
    return value


def _protocol(name: str, raw: str) -> ArProtocol:
    value = raw.strip().lower() or "lamport"
    if value not in ("lamport", "flags"):
        raise SettingsError(f"{name}={raw!r}: expected 'lamport' or 'flags'")
    return value  # type: ignore[return-value]


#: the spin bound's accepted range in seconds (finite: the kernels take it as int64 nanoseconds)
AR_TIMEOUT_RANGE_S = (1e-3, 3600.0)


def _seconds(scale: float) -> Callable[[str, str], float | None]:
    def parse(name: str, raw: str) -> float | None:
        if not raw.strip():
            return None
        try:
            value = float(raw) * scale
        except ValueError:
            raise SettingsError(f"{name}={raw!r}: expected a number") from None
        low, high = AR_TIMEOUT_RANGE_S
        if not low <= value <= high:   # also refuses nan and inf
            unit = "s" if scale == 1.0 else "ms"
            raise SettingsError(f"{name}={raw!r}: the spin bound must be a finite number from "
                                f"{low / scale:g} to {high / scale:g} {unit} (1 ms to 1 h)")
        return value
    return parse


def _int64(name: str, raw: str) -> int:
    try:
        value = int(raw.strip() or "0", 0)
    except ValueError:
        raise SettingsError(f"{name}={raw!r}: expected an integer") from None
    if not -(2**63) <= value < 2**63:
        raise SettingsError(f"{name}={raw}: outside int64")
    return value


#: every variable k3fuse reads, in the order the README lists them
VARIABLES: tuple[Variable, ...] = (
    Variable("K3FUSE_RULES", "rules", _rules, "",
             'which rules run: "a,b" only a and b, "-a" all but a, "+a" adds an off-by-default rule'),
    Variable("K3FUSE_STRICT", "strict", _flag, False,
             "every fallback of a fused op raises K3FuseFallbackError (proves the fast path ran)"),
    Variable("K3FUSE_DISABLE", "disable", _flag, False,
             "kill switch: the passes rewrite nothing and fused ops run the stock sequence"),
    Variable("K3FUSE_LOG", "log_path", _optional_path, None,
             "append every rewrite decision to this JSONL file"),
    Variable("K3FUSE_DEBUG", "debug", _flag, False,
             "the CLI prints tracebacks (same as --debug)"),
    Variable("K3FUSE_DISABLE_CUTE", "disable_cute", _flag, False,
             "do not import the CuTe DSL kernels (a broken toolchain); Triton and cuBLAS remain"),
    Variable("K3FUSE_DISABLE_TRITON", "disable_triton", _flag, False,
             "do not import the Triton kernels"),
    Variable("K3FUSE_GEMV_MAX_M", "gemv_max_m", _positive_int, None,
             "largest token count the CuTe GEMV serves before split-K (default: measured per shape)"),
    Variable("K3FUSE_W4A16_CUTE_INT4", "w4a16_cute_int4", _flag, True,
             "int4 routed experts (bf16 scales) on the CuTe kernel, or on Triton (0)"),
    Variable("K3FUSE_AR_PROTOCOL", "ar_protocol", _protocol, "lamport",
             "fused all-reduce completion protocol: lamport (sentinels) or flags (acquire/release)"),
    Variable("K3FUSE_AR_PDL", "ar_pdl", _flag, False,
             "launch the all-reduce epilogue with programmatic dependent launch (lamport only)"),
    Variable("K3FUSE_AR_TIMEOUT_S", "ar_timeout_s", _seconds(1.0), None,
             "bound of every fused-collective spin in seconds (default 5): a missing peer raises"),
    Variable("K3FUSE_AR_TIMEOUT_MS", "ar_timeout_ms_as_s", _seconds(1e-3), None,
             "the same bound in milliseconds (older name; K3FUSE_AR_TIMEOUT_S wins)"),
    Variable("K3FUSE_AR_START_GENERATION", "ar_start_generation", _int64, 0,
             "first epoch of a new all-reduce workspace (tests start it near the int64 wrap)"),
    Variable("K3FUSE_VLLM_MODEL", "vllm_model", _optional_flag, None,
             "1: vLLM serves K3's architectures with k3fuse's compiled K3 model (the k3fuse_model plugin); 0: with "
             "vLLM's own class, whatever VLLM_PLUGINS says"),
)
DEFAULT_AR_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Settings:
    """The parsed K3FUSE_* environment (defaults where a variable is unset)."""

    rules: str = ""
    strict: bool = False
    disable: bool = False
    log_path: str | None = None
    debug: bool = False
    disable_cute: bool = False
    disable_triton: bool = False
    gemv_max_m: int | None = None
    w4a16_cute_int4: bool = True
    ar_protocol: ArProtocol = "lamport"
    ar_pdl: bool = False
    ar_timeout_s: float | None = None
    ar_timeout_ms_as_s: float | None = None
    ar_start_generation: int = 0
    vllm_model: bool | None = None

    @property
    def spin_timeout_s(self) -> float:
        """The fused collectives' spin bound: K3FUSE_AR_TIMEOUT_S, else _MS, else 5 s."""
        return _spin_bound(self.ar_timeout_s, self.ar_timeout_ms_as_s)


def parse(env: Mapping[str, str]) -> Settings:
    """Settings from an environment mapping; raises SettingsError on the first bad value."""
    values = {v.field: v.parse(v.env, env[v.env]) if v.env in env else v.default for v in VARIABLES}
    return Settings(**values)


_BY_ENV = {v.env: v for v in VARIABLES}


@functools.lru_cache(maxsize=256)
def _parse_one(name: str, raw: str | None) -> Any:
    var = _BY_ENV[name]
    return var.default if raw is None else var.parse(name, raw)


def get(name: str) -> Any:
    """The parsed value of one K3FUSE_* variable in the current environment (its default when unset)."""
    if name not in _BY_ENV:
        raise KeyError(f"{name} is not a k3fuse setting; known: {', '.join(_BY_ENV)}")
    return _parse_one(name, os.environ.get(name))


def current() -> Settings:
    """Every setting of the current environment."""
    return Settings(**{v.field: get(v.env) for v in VARIABLES})


#: K3FUSE_* names that are not settings on purpose: the test suite's own knobs
NOT_SETTINGS_PREFIX = "K3FUSE_TEST_"


class UnknownSettingWarning(UserWarning):
    """A K3FUSE_* variable k3fuse does not read (a misspelled setting is otherwise silently ignored)."""


def unknown_names(env: Mapping[str, str] | None = None) -> list[tuple[str, str | None]]:
    """Each K3FUSE_* variable of `env` that is not a setting, with the closest setting name (or None);
    K3FUSE_TEST_* variables (the tests' own) are not reported."""
    import difflib

    env = os.environ if env is None else env
    out = []
    for name in sorted(env):
        if name.startswith("K3FUSE_") and name not in _BY_ENV and not name.startswith(NOT_SETTINGS_PREFIX):
            # compared without the shared prefix, which would make every name look close
            close = difflib.get_close_matches(name[len("K3FUSE_"):], [n[len("K3FUSE_"):] for n in _BY_ENV], n=1,
                                              cutoff=0.6)
            out.append((name, "K3FUSE_" + close[0] if close else None))
    return out


def unknown_names_message(unknown: list[tuple[str, str | None]]) -> str:
    """One line for the unknown names (see `unknown_names`)."""
    parts = [f"{name} (did you mean {close}?)" if close else name for name, close in unknown]
    return (f"ignoring {', '.join(parts)}: not a k3fuse setting; the settings are listed in the README "
            f"and k3fuse.settings.VARIABLES")


def check_rule_names(known: list[str], env: Mapping[str, str] | None = None) -> None:
    """K3FUSE_RULES names only rules in `known` (the pipeline's): SettingsError naming the unknown
    ones, each with its closest known name. `import k3fuse` calls it once its rules are installed."""
    import difflib

    env = os.environ if env is None else env
    spec = _parse_one("K3FUSE_RULES", env.get("K3FUSE_RULES"))
    named = [x.strip().lstrip("+-").strip() for x in spec.split(",") if x.strip()]
    unknown = sorted(set(named) - set(known))
    if unknown:
        hints = [f"{u} -> {c[0]}" for u in unknown if (c := difflib.get_close_matches(u, known, n=1, cutoff=0.6))]
        hint = f" (did you mean {', '.join(hints)}?)" if hints else ""
        raise SettingsError(f"K3FUSE_RULES names unknown rule(s) {unknown}{hint}; known rules: {', '.join(known)}")


def check_environment(env: Mapping[str, str] | None = None, *, warn: bool = True) -> Settings:
    """Parse every K3FUSE_* variable now (k3fuse does on import, the CLI before any verb): one
    SettingsError, one line, naming each bad variable and what it accepts. A K3FUSE_* name that is
    not a setting is reported with an UnknownSettingWarning (unless `warn` is False: the CLI prints
    `unknown_names` itself, as one line)."""
    env = os.environ if env is None else env
    if warn and (unknown := unknown_names(env)):
        import warnings

        warnings.warn(unknown_names_message(unknown), UnknownSettingWarning, stacklevel=2)
    errors = []
    for var in VARIABLES:
        try:
            _parse_one(var.env, env.get(var.env))
        except SettingsError as exc:
            errors.append(str(exc))
    if errors:
        raise SettingsError("; ".join(errors))
    return parse(env)


def export(name: str, value: str) -> None:
    """Set one variable for this process and the ranks it starts (checked first): the CLI's
    `--rules` is K3FUSE_RULES, so the flag and the variable cannot mean different things."""
    _parse_one(name, value)
    os.environ[name] = value


@contextlib.contextmanager
def restored(*names: str) -> Iterator[None]:
    """Within the block `export` may change `names`; afterwards they are as before (the CLI's
    `main` runs in-process in tests and tools)."""
    before = {name: os.environ.get(name) for name in names}
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _spin_bound(seconds: float | None, ms_as_seconds: float | None) -> float:
    if seconds is not None:
        return seconds
    return DEFAULT_AR_TIMEOUT_S if ms_as_seconds is None else ms_as_seconds


def spin_timeout_s() -> float:
    """The fused collectives' spin bound (read per call): K3FUSE_AR_TIMEOUT_S, else _MS, else 5 s."""
    return _spin_bound(get("K3FUSE_AR_TIMEOUT_S"), get("K3FUSE_AR_TIMEOUT_MS"))


def is_on(env: Mapping[str, str], name: str) -> bool:
    """A flag variable read from another mapping (a child process's environment, a test's)."""
    return _flag(name, env.get(name, ""))


__all__ = ["Settings", "SettingsError", "Variable", "VARIABLES", "get", "current", "parse", "check_environment",
           "export", "restored", "is_on", "spin_timeout_s", "DEFAULT_AR_TIMEOUT_S", "AR_TIMEOUT_RANGE_S", "ArProtocol",
           "rules_spec_problem", "check_rule_names", "unknown_names", "unknown_names_message",
           "UnknownSettingWarning", "NOT_SETTINGS_PREFIX"]
