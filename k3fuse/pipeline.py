"""The rewrite pipeline every door runs: ordered rules, guards, rewrites, log, verifier, cleanup.

    translate engine ops -> split addmm -> for rule in order: [kill switch] -> [enabled?] -> contract guards -> find
              -> per match: site guards -> rewrite -> log  -> verifier
              -> restore the translations and the split -> lint -> dead-code elimination -> recompile

Rules come from the installed provider (k3fuse.plugins installs the K3 rules of k3fuse.patterns)
unless the caller passes its own. Each can be switched by the context (enabled_rules / disabled_rules) and by the environment variable
K3FUSE_RULES: "a,b" runs only a and b, "-a" runs all but a, "+a" adds a rule that is off by
default (Rule.default_on False); "-a" and "+b" combine, a list of bare names stands alone (k3fuse.settings
refuses a mix).
"""
from __future__ import annotations

import hashlib
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch.fx as fx

from . import engine_ops, fp32_residual, verify, vocabulary
from .context import KILL_SWITCH, ContextError, DecodeContext
from .guards import GuardFailure, kernels_available, multicast_refusal
from .log import RewriteEvent, RewriteLog
from .matcher import trace_aten
from .rule import Rule, RewriteError

logger = logging.getLogger("k3fuse")


class UnknownRuleError(ContextError):
    """A rule name (context or K3FUSE_RULES) that the pipeline does not have."""


class RuleFailure(RuntimeError):
    """A rule raised while rewriting: a bug in the rule, reported with its name and site."""


class RuleRegistry:
    """Rules in pipeline order, addressable by name.

    `explicit`: the rules were handed over by name (rules=[...]), so an off-by-default rule among
    them runs; the default registry (explicit=False) runs such a rule only when it is named."""

    def __init__(self, rules: Iterable[Rule] = (), *, explicit: bool = True):
        self.explicit = explicit
        self._rules: list[Rule] = []
        for rule in rules:
            self.add(rule)

    def add(self, rule: Rule) -> None:
        if not rule.name:
            raise ValueError(f"{type(rule).__name__} has no name")
        if rule.name in self.names():
            raise ValueError(f"duplicate rule name {rule.name!r}")
        self._rules.append(rule)

    def names(self) -> list[str]:
        return [r.name for r in self._rules]

    def __iter__(self) -> Iterator[Rule]:
        return iter(self._rules)

    def __len__(self) -> int:
        return len(self._rules)

    def select(self, ctx: DecodeContext, env: str | None = None) -> list[tuple[Rule, str | None]]:
        """Each rule with None if it runs, else why not; unknown names raise UnknownRuleError."""
        known = self.names()
        try:
            ctx.check_rule_names(known)
        except ContextError as exc:
            raise UnknownRuleError(str(exc)) from None
        spec = ctx.setting("K3FUSE_RULES") if env is None else env
        only, minus = parse_rules_env(spec)
        plus = opt_in_rules_env(spec)
        unknown = sorted(((only or set()) | minus | plus) - set(known))
        if unknown:
            raise UnknownRuleError(f"K3FUSE_RULES names unknown rule(s) {unknown}; known rules: {known}")
        out: list[tuple[Rule, str | None]] = []
        for rule in self._rules:
            why = None
            named = (self.explicit or rule.name in (ctx.enabled_rules or ()) or rule.name in (only or ())
                     or rule.name in plus)
            if not ctx.rule_enabled(rule.name):
                why = "disabled by DecodeContext"
            elif rule.name in minus or (only is not None and rule.name not in only):
                why = "disabled by K3FUSE_RULES"
            elif not rule.default_on and not named:
                why = (f"off by default ({rule.default_off_reason}); enable it by name: "
                       f"K3FUSE_RULES=+{rule.name} or DecodeContext(enabled_rules=...)")
            out.append((rule, why))
        return out

    @classmethod
    def coerce(cls, rules: RuleRegistry | Iterable[Rule] | None) -> RuleRegistry:
        """A registry from a registry, a list of rules, or None (the K3 rules)."""
        if isinstance(rules, RuleRegistry):
            return rules
        return default_registry() if rules is None else cls(rules)

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for r in self._rules:
            h.update(r.name.encode())
            h.update(r.fingerprint().encode())
        return h.hexdigest()[:16]


def parse_rules_env(value: str) -> tuple[set[str] | None, set[str]]:
    """K3FUSE_RULES -> (only these or None, never these); "+a" items are opt-ins (opt_in_rules_env)."""
    only: set[str] = set()
    minus: set[str] = set()
    for item in (x.strip() for x in value.split(",")):
        if not item or item.startswith("+"):
            continue
        if item.startswith("-"):
            minus.add(item[1:].strip())
        else:
            only.add(item)
    return (only or None), minus


def opt_in_rules_env(value: str) -> set[str]:
    """K3FUSE_RULES "+a": run rule a besides the default ones (for rules that are off by default)."""
    return {x.strip()[1:].strip() for x in value.split(",") if x.strip().startswith("+")}


RuleProvider = Callable[[], Sequence[Rule]]
_rule_provider: RuleProvider | None = None


def install_rule_provider(provider: RuleProvider) -> None:
    """Set where the default rules come from: fresh instances of every rule, in pipeline order.
    k3fuse.plugins installs the K3 rules (k3fuse.patterns.all_rules); the pipeline knows none."""
    global _rule_provider
    _rule_provider = provider


def all_rules() -> list[Rule]:
    """Every default rule in pipeline order, the off-by-default ones included (the K3 rules). A missing
    provider raises: silently running no rules would look like a model without K3 sites."""
    if _rule_provider is None:
        raise RuntimeError("no default rules installed: call k3fuse.plugins.install_plugins() (import k3fuse does)")
    return list(_rule_provider())


def default_rules() -> list[Rule]:
    """The default rules that run unless told otherwise (Rule.default_on), in pipeline order."""
    return [r for r in all_rules() if r.default_on]


def default_registry() -> RuleRegistry:
    """Every K3 rule; the off-by-default ones run only when named (K3FUSE_RULES=+name, enabled_rules)."""
    return RuleRegistry(all_rules(), explicit=False)


def graph_fingerprint(graph: fx.Graph) -> str:
    """Short stable id of a graph's code: equal on every rank for the same step."""
    return hashlib.sha1(str(graph).encode()).hexdigest()[:10]


def run_pipeline(
    graph_or_module: fx.Graph | fx.GraphModule,
    ctx: DecodeContext,
    *,
    rules: RuleRegistry | Sequence[Rule] | None = None,
    door: str = "direct",
    graph_id: str | None = None,
    log: RewriteLog | str | os.PathLike[str] | None = None,
    verify_each_rule: bool = True,
) -> RewriteLog:
    """Rewrite the graph in place with every enabled rule and return the log of decisions."""
    gm = graph_or_module if isinstance(graph_or_module, fx.GraphModule) else None
    graph = gm.graph if gm is not None else graph_or_module
    registry = RuleRegistry.coerce(rules)
    rlog = RewriteLog.coerce(log, rank=ctx.rank)
    if rlog.rank == 0 and ctx.rank:
        rlog.rank = ctx.rank
    gid = graph_id or graph_fingerprint(graph)
    selection = registry.select(ctx)

    def event(rule: Rule, decision: str, **kw: object) -> RewriteEvent:
        return rlog.add(RewriteEvent(rule=rule.name, decision=decision,  # type: ignore[arg-type]
                                     graph_id=gid, door=door, rank=ctx.rank, **kw))  # type: ignore[arg-type]

    if ctx.setting(KILL_SWITCH):
        for rule, _ in selection:
            event(rule, "rejected", level="contract", guard="disabled",
                  reason="kill switch on (K3FUSE_DISABLE=1 or k3fuse.disable())")
        return rlog

    active = [r for r, why in selection if why is None]
    translated = engine_ops.translate_engine_ops(graph, trace_aten) if active else []
    fp32_residuals = fp32_residual.translate_fp32_residual_norms(graph, {t.engine for t in translated})
    split = vocabulary.split_addmm(graph) if active else 0
    changed = False
    for rule, why in selection:
        t0 = time.perf_counter()
        if why is not None:
            event(rule, "rejected", level="contract", guard="rule_disabled", reason=why)
            continue
        contract = _contract_failures(rule, ctx)
        if contract:
            for f in contract:
                event(rule, "rejected", level=f.level, guard=f.guard, reason=f.message, values=f.values)
            rlog.rule_time_ms[rule.name] += (time.perf_counter() - t0) * 1e3
            continue
        before = verify.snapshot(graph) if verify_each_rule else None
        counts = _run_rule(rule, graph, ctx, event)
        changed |= counts["applied"] > 0
        if before is not None and counts["applied"]:
            verify.check_reordering(before, graph, rule=rule.name)
        elapsed = (time.perf_counter() - t0) * 1e3
        rlog.rule_time_ms[rule.name] += elapsed
        why_counts = Counter(f"{e.level}:{e.guard}" for e in rlog.select(rule.name, "rejected") if e.graph_id == gid)
        logger.info("k3fuse[%s] %s: applied=%d rejected=%d%s%s in %.1f ms", door, rule.name, counts["applied"],
                    counts["rejected"], f" {dict(why_counts)}" if why_counts else "",
                    " (not matched)" if counts["matches"] == 0 else "", elapsed)

    if split:
        vocabulary.restore_addmm(graph)
    rebuilt = fp32_residual.restore_fp32_residual_norms(graph, fp32_residuals) if fp32_residuals else set()
    if translated:
        engine_ops.restore_engine_ops(graph, translated, rebuilt)
    if translated or fp32_residuals:
        graph.lint()
    if changed:
        graph.lint()
        graph.eliminate_dead_code()  # keeps impure nodes: collectives, has_side_effect ops, mutations
        if gm is not None:
            gm.recompile()
    return rlog


def _contract_failures(rule: Rule, ctx: DecodeContext) -> list[GuardFailure]:
    out = [f for f in (multicast_refusal(ctx, rule.emits), kernels_available(ctx, rule.emits)) if f is not None]
    out.extend(rule.check_contract(ctx))
    return out


def _run_rule(rule: Rule, graph: fx.Graph, ctx: DecodeContext, event) -> Counter:  # type: ignore[no-untyped-def]
    """Find, guard and rewrite every site of one rule; rescans when a rewrite staled a match."""
    counts: Counter = Counter()
    decided: set[frozenset[fx.Node]] = set()
    t_find = time.perf_counter()
    for _scan in range(len(graph.nodes) + 2):  # each rescan follows a rewrite, which removes nodes
        try:
            found = rule.find(graph, ctx)
        except Exception as exc:
            raise RuleFailure(f"rule {rule.name} failed finding its sites: {exc}") from exc
        matches = [m for m in found if frozenset(m.outputs) not in decided]
        counts["matches"] += len(matches)
        if not matches:
            break
        rescan = False
        for m in matches:
            if m.is_stale():
                rescan = True
                continue
            decided.add(frozenset(m.outputs))
            t0 = time.perf_counter()
            failures = [m.refused] if m.refused is not None else list(rule.check_site(m, ctx))
            if not failures:
                try:
                    new_nodes = rule.rewrite(m, ctx)
                except RewriteError as exc:
                    m.discard_new_nodes()
                    failures = [GuardFailure("site", "placement", str(exc))]
                except Exception as exc:
                    site = m.source() or m.outputs[0].name
                    raise RuleFailure(f"rule {rule.name} failed rewriting the site at {site}: {exc}") from exc
            ms = (time.perf_counter() - t0) * 1e3
            base = dict(variant=m.variant, nodes=[n.name for n in m.nodes], shapes=m.shapes(), source=m.source(),
                        time_ms=ms)
            if failures:
                counts["rejected"] += 1
                f0 = failures[0]
                values: dict[str, object] = {}
                for f in failures:
                    values.update({k: v for k, v in f.values.items() if k not in values})
                if len(failures) > 1:
                    values["failed_guards"] = [f"{f.level}:{f.guard}" for f in failures]
                event(rule, "rejected", level=f0.level, guard=f0.guard,
                      reason="; ".join(f.message for f in failures), values=values, **base)
            else:
                counts["applied"] += 1
                event(rule, "applied", new_nodes=[n.name for n in new_nodes], reason=m.reason,
                      values=dict(m.values), **base)
        if not rescan:
            break
    else:
        raise RuleFailure(f"rule {rule.name}: find() keeps returning stale matches")
    if counts["matches"] == 0:
        reason, values = _explain_miss(rule, graph, ctx)
        event(rule, "not_matched", reason=reason, values=values, time_ms=(time.perf_counter() - t_find) * 1e3)
    return counts


def _explain_miss(rule: Rule, graph: fx.Graph, ctx: DecodeContext) -> tuple[str | None, dict[str, object]]:
    """The rule's near-miss report; a failing explanation never fails the rewrite (it is logged).
    Sites an engine's own fusion already took (engine_ops.PriorFusion) are named first."""
    taken = engine_ops.prior_fusions(graph, rule.site_op) if rule.site_op is not None else []
    try:
        miss = rule.explain_miss(graph, ctx)
    except Exception as exc:  # diagnostics only
        logger.warning("k3fuse: %s: near-miss explanation failed: %s", rule.name, exc)
        miss = None
    reason, values = (None, {}) if miss is None else (miss[0], dict(miss[1]))
    if taken:
        reason = "; ".join(f"{fusion.advice} ({node.name})" for node, fusion in taken[:3]) + (
            f"; {reason}" if reason else "")
        values["taken_by"] = [f"{fusion.engine} {fusion.qualname} ({node.name})" for node, fusion in taken]
    return reason, values


__all__ = ["RuleRegistry", "run_pipeline", "all_rules", "default_rules", "default_registry", "parse_rules_env",
           "opt_in_rules_env", "install_rule_provider", "UnknownRuleError", "RuleFailure", "graph_fingerprint"]
