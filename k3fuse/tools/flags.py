"""The flags several verbs share, each defined once so it means one thing everywhere.

  --tokens LO-HI   the token range the rewrites are guarded for (DecodeContext.tokens): `apply`
  --batch N        tokens decoded per step, one per sequence (`bench` takes a list: N,N,...)
  --tp N           tensor-parallel ranks                    --steps N   decode steps
  --rules SPEC     which rules run, the K3FUSE_RULES grammar: "a,b" only these, "-a" all but a,
                   "+a" the defaults plus an off-by-default rule; an unknown name is an error
  --log FILE       append the rewrite log (JSONL)            --json FILE  write the result

The parsers import nothing heavy: `k3fuse --help` must answer without torch.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from ..usage_error import UsageError

#: the K3FUSE_RULES grammar, as `--help` states it
RULES_HELP = ('which rules run, as K3FUSE_RULES: "a,b" only these, "-a" all but a, '
              '"+a" also an off-by-default rule')
BATCH_HELP = "tokens decoded per step (one per sequence), 1-64"


def decode_tokens() -> tuple[int, int]:
    """The token range the decode rewrites cover (k3fuse.token_range, the one definition)."""
    from ..token_range import DECODE_TOKENS

    return DECODE_TOKENS


def parse_tokens(text: str) -> tuple[int, int]:
    """--tokens: "1-64" -> (1, 64); "8" -> (8, 8); inside the decode range, min <= max."""
    try:
        if "-" in text:
            lo, hi = text.split("-", 1)
            rng = int(lo), int(hi)
        else:
            rng = int(text), int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"tokens must look like 1-64 or 8, got {text!r}") from None
    low, high = decode_tokens()
    if not low <= rng[0] <= rng[1] <= high:
        raise argparse.ArgumentTypeError(f"bad token range {text}: decode rewrites cover "
                                         f"{low}-{high} tokens per step, min <= max")
    return rng


def _bounded(name: str, convert: Callable[[str], Any], least: float, strict: bool, what: str) -> Callable[[str], Any]:
    """An argparse type named `name`: `convert(text)`, then >= least (> least when strict); NaN and
    the infinities never pass."""
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not (value > least if strict else value >= least) or value in (float("inf"), float("-inf")):
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value
    parse.__name__ = name  # what argparse names in its own messages
    return parse


def finite_float(text: str) -> float:
    """A number that is neither NaN nor infinite (float() accepts "nan" and "inf")."""
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


positive_int = _bounded("positive_int", int, 1, False, "a positive integer")
non_negative_int = _bounded("non_negative_int", int, 0, False, "an integer >= 0")
non_negative_float = _bounded("non_negative_float", float, 0, False, "a finite number >= 0")
positive_float = _bounded("positive_float", float, 0, True, "a finite number > 0")


def _batch_value(text: str) -> int:
    value = positive_int(text)
    low, high = decode_tokens()
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"--batch {value}: the decode rewrites cover {low}-{high} tokens per step")
    return value


def batch(text: str) -> int:
    """--batch N: tokens per decode step, inside the decode range."""
    if "-" in text.strip().lstrip("-") or "," in text:
        raise argparse.ArgumentTypeError(f"--batch takes one count (tokens per step), got {text!r}; "
                                         f"a guarded token range is `k3fuse apply --tokens LO-HI`")
    return _batch_value(text)


def batches(text: str) -> tuple[int, ...]:
    """--batch N,N,...: several token counts per step (bench sweeps them)."""
    values = tuple(_batch_value(t.strip()) for t in text.split(",") if t.strip())
    if not values:
        raise argparse.ArgumentTypeError("expected at least one token count, e.g. 1,8,64")
    return values


def add_moved_tokens_flag(parser: Any, example: str) -> None:
    """`--tokens` on a verb that counts tokens per step: answered with the flag to use instead."""
    parser.add_argument("--tokens", dest="moved_tokens", default=None, help=argparse.SUPPRESS)
    parser.set_defaults(moved_tokens_example=example)


def check_moved_tokens(args: argparse.Namespace, verb: str) -> None:
    if getattr(args, "moved_tokens", None) is not None:
        raise UsageError(f"{verb} --tokens: here the tokens per decode step are --batch (--tokens is the guarded "
                         f"token range of `k3fuse apply`)", f"pass {args.moved_tokens_example}")


def add_moved_batch_flag(parser: Any) -> None:
    """`--batch` on `apply`, which guards a token range: answered with --tokens."""
    parser.add_argument("--batch", dest="moved_batch", default=None, help=argparse.SUPPRESS)


def check_moved_batch(args: argparse.Namespace, verb: str) -> None:
    if getattr(args, "moved_batch", None) is not None:
        raise UsageError(f"{verb} --batch: {verb} rewrites for a range of tokens per step, not one batch",
                         f"pass --tokens LO-HI (e.g. --tokens 1-64, or --tokens {args.moved_batch} for that count "
                         f"alone)")


def add_rules_flag(parser: Any) -> None:
    parser.add_argument("--rules", default=None, metavar="SPEC", help=RULES_HELP)


def rule_selection(spec: str) -> list[str]:
    """The rules a --rules SPEC runs, in pipeline order (the same reading as K3FUSE_RULES in the
    pipeline); an empty or mixed spec, or an unknown name, is a UsageError."""
    import k3fuse
    from k3fuse.pipeline import all_rules, opt_in_rules_env, parse_rules_env

    from .. import settings

    problem = settings.rules_spec_problem(spec)
    if problem is not None:
        raise UsageError(f"--rules {spec!r} {problem}", "leave --rules out for the default rules" if not spec.strip()
                         else 'e.g. --rules a,b (only these), --rules=-a (all but a), --rules=+a (also a)')
    k3fuse.load()  # the pipeline's rules (the command defers loading until a verb needs it)
    rules = all_rules()
    known = [r.name for r in rules]
    only, minus = parse_rules_env(spec)
    plus = opt_in_rules_env(spec)
    unknown = sorted(((only or set()) | minus | plus) - set(known))
    if unknown:
        raise UsageError(f"--rules {spec!r} names unknown rule name(s) {unknown}", f"known rules: {', '.join(known)}")
    return [r.name for r in rules
            if r.name not in minus and (only is None or r.name in only)
            and (r.default_on or r.name in (only or set()) or r.name in plus)]


def use_rules(spec: str | None) -> None:
    """--rules SPEC for this run: checked, then set as K3FUSE_RULES (the ranks inherit it), so the
    flag and the variable cannot mean different things. `main` restores the variable afterwards.
    Without --rules, the K3FUSE_RULES of the environment is checked against the rules instead."""
    from .. import settings

    if spec is None:
        import k3fuse
        from k3fuse.pipeline import all_rules

        k3fuse.load()
        settings.check_rule_names([r.name for r in all_rules()])
        return
    rule_selection(spec)
    settings.export("K3FUSE_RULES", spec)


__all__ = ["parse_tokens", "finite_float", "positive_int", "non_negative_int", "non_negative_float", "positive_float",
           "batch", "batches", "add_rules_flag", "rule_selection", "use_rules", "add_moved_tokens_flag",
           "add_moved_batch_flag", "check_moved_batch", "check_moved_tokens", "decode_tokens", "RULES_HELP",
           "BATCH_HELP"]
