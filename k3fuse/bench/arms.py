"""Benchmark arms: what one compiled variant of the model is, and how to build it.

An arm is stock `torch.compile` (no k3fuse) or the k3fuse backend with a set of rules. The per-rule
arms answer "what does this rule buy in the whole layer": `only:<rule>` runs that rule alone,
`without:<rule>` every default rule but that one. Arm specs are strings so they travel on the
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
    """The default K3 rules, in pipeline order."""
    from k3fuse.patterns import describe

    return [name for name, _ in describe()]


def parse_arms(specs: Iterable[str], known_rules: Sequence[str] | None = None) -> list[Arm]:
    """Arms from specs: `stock`, `k3fuse`, `only:<rule>`, `without:<rule>`, or `rules` (every
    `only:` and `without:` arm). Order is kept, duplicates dropped; unknown names raise ValueError."""
    known = list(known_rules) if known_rules is not None else rule_names()
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
            add(Arm(K3FUSE, frozenset(known)))
        elif spec == "rules":
            for r in known:
                add(Arm(f"only:{r}", frozenset({r})))
            for r in known:
                add(Arm(f"without:{r}", frozenset(known) - {r}))
        elif spec.startswith(("only:", "without:")):
            kind, _, rule = spec.partition(":")
            if rule not in known:
                raise ValueError(f"unknown rule {rule!r} in arm {spec!r}; rules are {known}")
            add(Arm(spec, frozenset({rule}) if kind == "only" else frozenset(known) - {rule}))
        else:
            raise ValueError(f"unknown arm {spec!r}; use stock, k3fuse, only:<rule>, without:<rule> or rules")
    return arms


__all__ = ["Arm", "STOCK", "K3FUSE", "parse_arms", "rule_names"]
