"""A rule's fingerprint, and so K3FusePass.uuid() (Inductor's cache key), covers everything its
rewrite depends on: its module, the pattern helpers and K3 spelling it uses, the framework modules
that match and place it, and its settings (issue 12, item 2).

Editing a file is simulated by changing what `k3fuse.rule.module_source` reads for one module: the
dependency discovery under test (which modules a rule depends on) is the real one.
"""
from __future__ import annotations

import pytest

import k3fuse
from k3fuse import rule as rule_module
from k3fuse.context import ContextError, DecodeContext
from k3fuse.patterns import OProjAllReduceResidual, WeightPrefetch
from k3fuse.patterns.weight_prefetch import PrefetchSettings


def _edited(monkeypatch, module: str) -> None:
    real = rule_module.module_source

    def source(name: str) -> bytes:
        data = real(name)
        return data + b"\ndef _appended_helper():\n    return 1\n" if name == module else data

    monkeypatch.setattr(rule_module, "module_source", source)


def _uuid(**ctx) -> bytes:
    return k3fuse.inductor_pass(DecodeContext(**ctx)).uuid()


@pytest.mark.parametrize("module", ["k3fuse.patterns._pattern_tools", "k3fuse.patterns.oproj_allreduce_residual",
                                    "k3fuse.spelling", "k3fuse.matcher"])
def test_editing_a_module_a_rule_uses_changes_the_pass_uuid(monkeypatch, module):
    before = _uuid()
    assert module in OProjAllReduceResidual().source_modules()
    _edited(monkeypatch, module)
    assert _uuid() != before


def test_editing_an_unrelated_module_keeps_the_uuid(monkeypatch):
    before = _uuid()
    _edited(monkeypatch, "k3fuse.tools.cli")
    assert _uuid() == before


def test_the_kda_rule_depends_on_the_spelling_it_traces():
    from k3fuse.patterns import KDADeltaRule

    assert "k3fuse.spelling" in KDADeltaRule().source_modules()


def test_settings_change_the_fingerprint_and_the_uuid():
    assert WeightPrefetch().fingerprint() != WeightPrefetch(budget_bytes=1 << 20).fingerprint()
    assert WeightPrefetch(PrefetchSettings(1 << 20)).fingerprint() == WeightPrefetch(budget_bytes=1 << 20).fingerprint()
    small = {"weight_prefetch": PrefetchSettings(budget_bytes=1 << 20)}
    assert _uuid(rule_settings=small) != _uuid()


def test_rule_selection_changes_the_uuid(monkeypatch):
    before = _uuid()
    monkeypatch.setenv("K3FUSE_RULES", "-decode_gemm")
    assert _uuid() != before


def test_rule_settings_are_typed():
    with pytest.raises(ContextError, match="not a rule's settings object"):
        DecodeContext(rule_settings={"weight_prefetch": {"budget_bytes": 1}})
    with pytest.raises(ContextError, match="budget_bytes must be a positive int"):
        PrefetchSettings(budget_bytes=0)
    ctx = DecodeContext(rule_settings={"decode_gemm": PrefetchSettings()})
    from k3fuse.patterns import DecodeGemm

    with pytest.raises(ContextError, match="rule decode_gemm takes no settings"):
        DecodeGemm().settings_in(ctx)
    with pytest.raises(ContextError, match="unknown rule name"):
        DecodeContext(rule_settings={"nope": PrefetchSettings()}).check_rule_names(["decode_gemm"])
