"""Benchmark arms: what one compiled variant of the model is, and how to build it.

An arm is stock `torch.compile` (no k3fuse) or the k3fuse backend with a set of rules. The per-rule
arms answer "what does this rule buy in the whole layer": `only:<rule>` runs that rule alone,
`without:<rule>` every default rule but that one, `with:<rule>` the defaults plus a rule that is off
by default. Arm specs are strings so they travel on the
command line and in JSON unchanged.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

STOCK = "stock"
K3FUSE = "k3fuse"


@dataclass(frozen=True)
class Arm:
    """One variant: `rules` None is stock torch.compile; else the k3fuse rules that may run."""

    name: str
    rules: frozenset[str] | None

    @property
    def is_stock(self) -> bool:
        return self.rules is None


def rule_names() -> list[str]:
    """The K3 rules, in pipeline order."""
    from k3fuse.patterns import RULE_CLASSES

    return [cls.name for cls in RULE_CLASSES]


def default_on_rules() -> list[str]:
    """The rules `k3fuse` runs unless told otherwise (Rule.default_on)."""
    from k3fuse.patterns import RULE_CLASSES

    return [cls.name for cls in RULE_CLASSES if cls.default_on]


def parse_arms(specs: Iterable[str], known_rules: Sequence[str] | None = None,
               default_rules: Sequence[str] | None = None) -> list[Arm]:
    """Arms from specs: `stock`, `k3fuse` (the default rules), `only:<rule>`, `without:<rule>`,
    `with:<rule>` (the defaults plus an off-by-default rule), or `rules` (`only:` for every rule,
    `without:` for every default rule, `with:` for the others). Order is kept, duplicates dropped;
    unknown names raise ValueError."""
    known = list(known_rules) if known_rules is not None else rule_names()
    defaults = list(default_rules) if default_rules is not None else (
        default_on_rules() if known_rules is None else known)
    arms: list[Arm] = []

    def add(arm: Arm) -> None:
        if arm.name not in {a.name for a in arms}:
            arms.append(arm)

    for spec in specs:
        spec = spec.strip()
        if not spec:
            continue
        if spec == STOCK:
            add(Arm(STOCK, None))
        elif spec == K3FUSE:
            add(Arm(K3FUSE, frozenset(defaults)))
        elif spec == "rules":
            for r in known:
                add(Arm(f"only:{r}", frozenset({r})))
            for r in known:
                if r in defaults:
                    add(Arm(f"without:{r}", frozenset(defaults) - {r}))
                else:
                    add(Arm(f"with:{r}", frozenset(defaults) | {r}))
        elif spec.startswith(("only:", "without:", "with:")):
            kind, _, rule = spec.partition(":")
            if rule not in known:
                raise ValueError(f"unknown rule {rule!r} in arm {spec!r}; rules are {known}")
            rules = {"only": {rule}, "without": set(defaults) - {rule}, "with": set(defaults) | {rule}}[kind]
            add(Arm(spec, frozenset(rules)))
        else:
            raise ValueError(f"unknown arm {spec!r}; use stock, k3fuse, only:<rule>, without:<rule>, "
                             "with:<rule> or rules")
    return arms


__all__ = ["Arm", "STOCK", "K3FUSE", "parse_arms", "rule_names"]
