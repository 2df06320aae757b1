"""What a rule is: patterns traced from plain torch functions, guards, and a rewrite.

A rule author imports what a rule may use from `k3fuse.rule_api`, subclasses `Rule` and fills in
`patterns()` (plain torch functions: `residual + F.linear(x, w)` and its example inputs),
`check_site()` (`failures(static_weight(match["w"]))`) and `rewrite()` (usually one
`match.replace_with(op, x=match["x"], ...)`, the op's arguments by its schema's names); a complete
small rule is `LinearResidualRule` in tests/engine_helpers.py, the K3 rules are in patterns/.

The engine traces each PatternSpec to ATen with the doors' decomposition table, matches it in
every spelling (see vocabulary.py) and hands each match to the guards and then to `rewrite`.
"""
from __future__ import annotations

import hashlib
import sys
import types
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch.fx as fx

from .guards import GuardFailure
from .rewrite_site import Match, PatternSpec, RewriteError, Variant
from .matcher import compiled_patterns, find_matches, near_miss

if TYPE_CHECKING:
    from .context import DecodeContext


#: framework modules whose code shapes every rule's rewrite (matching, normalisation, placement)
FRAMEWORK_SOURCES = ("k3fuse.guards", "k3fuse.graph_facts", "k3fuse.rewrite_site", "k3fuse.matcher", "k3fuse.vocabulary",
                     "k3fuse.engine_ops", "k3fuse.fp32_residual", "k3fuse.rule", "k3fuse.rule_api")
#: module prefixes a rule's own dependencies are followed into
_RULE_SIDE = ("k3fuse.patterns", "k3fuse.spelling", "k3fuse.model")


def module_source(name: str) -> bytes:
    """The source bytes of an imported module (its repr when it has no file)."""
    module = sys.modules.get(name)
    path = getattr(module, "__file__", None)
    if path:
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError:
            pass
    return repr(module).encode()


class Rule:
    """Base class: a K3 decode rewrite. Subclasses set `name`, `description` and override hooks."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    #: names of the torch.ops.k3fuse ops the rewrite inserts (contract guards: a kernel exists for
    #: the context's device; a collective among them refuses multicast policy "require")
    emits: ClassVar[tuple[str, ...]] = ()
    #: False: the rule runs only when named (K3FUSE_RULES=+name, enabled_rules): kept for users who
    #: measure a gain on their setup, off by default because the layer benchmark measured none
    default_on: ClassVar[bool] = True
    default_off_reason: ClassVar[str] = ""
    #: the op a site of this rule is built around (e.g. the all_reduce); near-miss reports start
    #: from it. None: the op of each pattern's first output
    site_op: ClassVar[Any] = None
    #: a configurable rule's settings type (a frozen dataclass); None: the rule has no settings
    settings_type: ClassVar[type | None] = None
    #: this instance's settings (an instance of settings_type), replaced per context by
    #: DecodeContext(rule_settings={name: ...}); see `settings_in`
    settings: Any = None

    def settings_in(self, ctx: DecodeContext) -> Any:
        """The settings this rule runs with under `ctx`: the context's, else the rule's own."""
        given = ctx.settings_for(self.name)
        if given is None:
            return self.settings
        if self.settings_type is None or not isinstance(given, self.settings_type):
            from .context import ContextError

            want = self.settings_type.__name__ if self.settings_type else "no settings"
            raise ContextError(f"rule_settings[{self.name!r}] is a {type(given).__name__}; rule {self.name} takes "
                               f"{want}", f"pass {want}(...)" if self.settings_type else "drop it")
        return given

    def patterns(self) -> Sequence[PatternSpec]:
        """Spelling variants of this rule's pattern (genuinely different computations only)."""
        return ()

    def check_contract(self, ctx: DecodeContext) -> list[GuardFailure]:
        """Once per graph: TP size, device, dtype... Empty list means the rule may run."""
        return []

    def check_site(self, match: Match, ctx: DecodeContext) -> list[GuardFailure]:
        """Per match: shapes, divisibility by TP, static weights. Empty list means rewrite it."""
        return []

    def rewrite(self, match: Match, ctx: DecodeContext) -> list[fx.Node]:
        """Insert the fused op (with `match.insert`), rewire users (`match.replace`), return new nodes."""
        raise NotImplementedError(f"rule {self.name!r} does not implement rewrite()")

    def find(self, graph: fx.Graph, ctx: DecodeContext) -> list[Match]:
        """Sites to consider. Default: every non-overlapping match of `patterns()`.

        Structural rules (stream placement, prefetch) override this and build Matches themselves.
        """
        return find_matches(graph, compiled_patterns(self))

    def explain_miss(self, graph: fx.Graph, ctx: DecodeContext) -> tuple[str, dict[str, Any]] | None:
        """Why `find` returned nothing: (reason, values) naming the closest candidate and the first
        node where it diverged from the pattern, or why there was no candidate at all.

        Default: the matcher's near-miss search from the rule's `site_op`. Structural rules
        override it. The pipeline puts the answer on the rule's `not_matched` event.
        """
        return near_miss(graph, compiled_patterns(self), site_op=self.site_op)

    def fingerprint(self) -> str:
        """Hash of everything this rule's rewrite depends on, for compile-cache keys
        (K3FusePass.uuid(), so Inductor never serves a rewrite made by older code): the source of
        every module in `source_modules()` and the rule's settings."""
        h = hashlib.sha256()
        for name in self.source_modules():
            h.update(name.encode() + b"\0" + module_source(name) + b"\0")
        h.update(repr(self.settings).encode())
        return h.hexdigest()[:16]

    def source_modules(self) -> list[str]:
        """The modules whose code decides what this rule rewrites: its class's modules, the
        rule-side modules they use (pattern helpers, the K3 spelling, the model code a pattern
        traces), found transitively through module globals, and the framework modules that match
        and place rewrites."""
        seen: set[str] = set(FRAMEWORK_SOURCES)
        work = [c.__module__ for c in type(self).__mro__ if c is not object]
        while work:
            name = work.pop()
            if name in seen or name not in sys.modules:
                continue
            seen.add(name)
            for value in vars(sys.modules[name]).values():
                dep = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None)
                if isinstance(dep, str) and dep.startswith(_RULE_SIDE) and dep not in seen:
                    work.append(dep)
        return sorted(seen)

    def __repr__(self) -> str:
        return f"<Rule {self.name}>"


__all__ = ["PatternSpec", "Match", "Rule", "RewriteError", "Variant"]
