"""Pipeline, context, guards and log: decisions are made in order, guarded, logged and reversible."""
from __future__ import annotations

import json

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from engine_helpers import LINEAR_RESIDUAL, LinearResidualRule, RMSNormRule, op_counts
from torch.fx.experimental.proxy_tensor import make_fx

import k3fuse
from k3fuse import compat, guards
from k3fuse.context import ContextError, DecodeContext
from k3fuse.guards import GuardFailure
from k3fuse.log import RewriteLog
from k3fuse.matcher import decomposition_table
from k3fuse.pipeline import RuleRegistry, UnknownRuleError, parse_rules_env, run_pipeline
from k3fuse.rule import Rule

aten = torch.ops.aten


def layers_graph(n=3, bias=False, static=True):
    """make_fx graph of n residual linears; weights are placeholders marked static like a door does."""
    ws = [torch.randn(16, 16) / 4 for _ in range(n)]
    bs = [torch.randn(16) for _ in range(n)] if bias else [None] * n

    def fn(h, *params):
        for i in range(n):
            h = h + F.linear(torch.tanh(h), params[i], params[n + i] if bias else None)
        return h

    args = (torch.randn(4, 16), *ws, *([b for b in bs] if bias else []))
    gm = make_fx(fn, decomposition_table=decomposition_table(), tracing_mode="fake")(*args)
    for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        node.meta["k3fuse_static"] = static and i > 0
    real = make_fx(fn, decomposition_table=decomposition_table())(*args)
    return gm, real, args


def test_pipeline_counts_outputs_and_log():
    gm, real, args = layers_graph(3)
    before = op_counts(gm)
    log = run_pipeline(gm, DecodeContext(), rules=[LinearResidualRule()])
    after = op_counts(gm)
    assert before["aten::mm"] == 3 and after["aten::mm"] == 0
    assert after[LINEAR_RESIDUAL] == 3 and after["aten::tanh"] == 3
    assert log.applied("linear_residual") == 3 and log.active_rules() == ["linear_residual"]
    ev = log.select("linear_residual", "applied")[0]
    assert ev.variant == "plain" and ev.shapes["x"] == [4, 16] and ev.new_nodes


def test_rewritten_graph_equals_unrewritten():
    gm, real, args = layers_graph(2, bias=True)
    expected = real(*args)
    for n in real.graph.nodes:
        if n.op == "placeholder":
            n.meta["k3fuse_static"] = n.name != "h_1"
    log = run_pipeline(real, DecodeContext(), rules=[LinearResidualRule()])
    assert log.applied() == 2 and {e.variant for e in log.select(decision="applied")} == {"bias"}
    torch.testing.assert_close(real(*args), expected)


def test_site_guard_rejects_non_static_weight_and_logs_values():
    gm, _, _ = layers_graph(2, static=False)
    log = run_pipeline(gm, DecodeContext(), rules=[LinearResidualRule()])
    assert log.applied() == 0 and op_counts(gm)["aten::mm"] == 2
    rej = log.rejected("linear_residual")
    assert len(rej) == 2 and {e.guard for e in rej} == {"static_weight"} and rej[0].level == "site"
    assert rej[0].values["node_kind"] == "placeholder"
    assert log.active_rules() == []  # a rule that never fired is never reported active


def test_not_matched_is_logged_once():
    gm = make_fx(lambda x: torch.tanh(x) * 2)(torch.randn(3))
    log = run_pipeline(gm, DecodeContext(), rules=[LinearResidualRule(), RMSNormRule()])
    assert [(e.rule, e.decision) for e in log] == [("linear_residual", "not_matched"), ("rms_norm", "not_matched")]


def test_addmm_normalisation_is_reverted_when_no_rule_consumes_it():
    gm = make_fx(lambda x, w, b: torch.tanh(F.linear(x, w, b)), decomposition_table=decomposition_table())(
        torch.randn(4, 8), torch.randn(16, 8), torch.randn(16))
    run_pipeline(gm, DecodeContext(), rules=[LinearResidualRule()])
    assert op_counts(gm)["aten::addmm"] == 1 and op_counts(gm)["aten::mm"] == 0


def test_kill_switch_rewrites_nothing_and_logs_disabled():
    gm, _, _ = layers_graph(2)
    with k3fuse.disable():
        log = run_pipeline(gm, DecodeContext(), rules=[LinearResidualRule(), RMSNormRule()])
    assert op_counts(gm)["aten::mm"] == 2
    assert [(e.rule, e.decision, e.guard) for e in log] == [
        ("linear_residual", "rejected", "disabled"), ("rms_norm", "rejected", "disabled")]


class NeedsTP(Rule):
    name = "needs_tp"
    emits = ("allreduce_rmsnorm",)   # a collective op: multicast policy "require" refuses the rule

    def check_contract(self, ctx):
        return guards.failures(guards.tp_at_least(ctx, 2))


def test_contract_guards_log_level_and_values():
    gm, _, _ = layers_graph(1)
    log = run_pipeline(gm, DecodeContext(multicast="require"), rules=[NeedsTP()])
    assert [(e.level, e.guard) for e in log] == [("contract", "multicast"), ("contract", "tp_size")]
    assert log.events[0].values == {"policy": "require", "ops": ["allreduce_rmsnorm"]}
    assert "k3fuse never uses it" in log.events[0].reason
    assert log.events[1].values == {"tp_size": 1, "minimum": 2}


def test_multicast_is_one_guard_for_rules_that_fuse_a_collective():
    """"auto" and "off" never refuse; "require" refuses only rules that insert a collective op, saying why."""
    gm, _, _ = layers_graph(1)
    for policy in ("auto", "off"):
        assert guards.multicast_refusal(DecodeContext(multicast=policy), ["allreduce_rmsnorm"]) is None
    ctx = DecodeContext(multicast="require")
    assert guards.multicast_refusal(ctx, ["decode_gemm"]) is None
    refusal = guards.multicast_refusal(ctx, ["decode_gemm", "gemm_ar_residual"])
    assert refusal.guard == "multicast" and refusal.values["ops"] == ["gemm_ar_residual"]
    assert "unicast" in refusal.message


def test_rules_env_and_context_selection(monkeypatch):
    reg = RuleRegistry([LinearResidualRule(), RMSNormRule()])
    ctx = DecodeContext()
    assert parse_rules_env("-rms_norm") == (None, {"rms_norm"})
    assert parse_rules_env("linear_residual, rms_norm") == ({"linear_residual", "rms_norm"}, set())
    assert [why for _, why in reg.select(ctx, "-rms_norm")] == [None, "disabled by K3FUSE_RULES"]
    assert [why for _, why in reg.select(ctx, "rms_norm")] == ["disabled by K3FUSE_RULES", None]
    assert [why for _, why in reg.select(DecodeContext(disabled_rules={"linear_residual"}), "")] == [
        "disabled by DecodeContext", None]
    with pytest.raises(UnknownRuleError, match="unknown rule.*'nope'"):
        reg.select(ctx, "-nope")
    with pytest.raises(UnknownRuleError, match="unknown rule name.*'nope'"):
        reg.select(DecodeContext(enabled_rules={"nope"}), "")
    monkeypatch.setenv("K3FUSE_RULES", "-linear_residual")
    gm, _, _ = layers_graph(1)
    log = run_pipeline(gm, ctx, rules=reg)
    assert log.events[0].guard == "rule_disabled" and op_counts(gm)["aten::mm"] == 1


def test_context_validation_errors():
    with pytest.raises(ContextError, match="bad token range 0-64"):
        DecodeContext(tokens=(0, 64))
    with pytest.raises(ContextError, match="bad token range 1-128"):
        DecodeContext(tokens=(1, 128))
    with pytest.raises(ContextError, match="tp_size=2 needs a process group"):
        DecodeContext(tp_size=2)
    with pytest.raises(ContextError, match="multicast must be one of"):
        DecodeContext(multicast="sometimes")
    with pytest.raises(ContextError, match="torch.distributed is not initialized"):
        DecodeContext.from_process_group(tp_size=2)
    assert DecodeContext.from_process_group().tp_size == 1
    assert DecodeContext(tp_size=2, rank=1, group_name="0").describe()["tokens"] == [1, 64]


def test_unsupported_torch_version_is_a_clear_error():
    with pytest.raises(compat.UnsupportedTorchVersion, match="supports torch 2.11 to 2.14; found torch 2.10.0"):
        compat.check_torch_version("2.10.0")
    assert compat.check_torch_version("2.14.1+cu130") == (2, 14)
    with pytest.raises(compat.UnsupportedTorchVersion, match="found torch 2.15.0"):
        compat.check_torch_version("2.15.0")


def test_guard_predicates():
    ctx = DecodeContext(tokens=(1, 8))
    assert guards.divisible(12, 4, "rows") is None
    f = guards.divisible(10, 4, "rows")
    assert isinstance(f, GuardFailure) and f.values == {"rows": 10, "by": 4} and "[site:divisible]" in str(f)
    assert guards.tp_at_least(ctx, 2).values["tp_size"] == 1
    assert guards.device_capability_at_least(ctx, (9, 0)).values["device_capability"] is None
    node = make_fx(lambda x: x + 1, tracing_mode="fake")(torch.randn(16, 4))
    add = next(n for n in node.graph.nodes if n.op == "call_function")
    assert guards.token_count(add, ctx).values == {"tokens": 16, "range": (1, 8)}
    assert guards.token_count(add, DecodeContext(tokens=(1, 16))) is None
    node3 = make_fx(lambda x: x + 1, tracing_mode="fake")(torch.randn(2, 3, 4))  # [B, S, H]: 6 tokens
    add3 = next(n for n in node3.graph.nodes if n.op == "call_function")
    assert guards.token_count(add3, DecodeContext(tokens=(1, 4)), dim=None).values == {"tokens": 6, "range": (1, 4)}
    assert guards.token_count(add3, DecodeContext(tokens=(1, 4))) is None  # dim 0: 2 tokens
    assert guards.same_group("tp", DecodeContext()).values == {"group_name": "tp", "tp_group": None}
    assert guards.dtype_in(DecodeContext(dtype=torch.float16), [torch.bfloat16]).guard == "dtype"


def test_log_jsonl_roundtrip_and_cli(tmp_path, capsys):
    gm, _, _ = layers_graph(2)
    path = tmp_path / "rw.jsonl"
    log = run_pipeline(gm, DecodeContext(), rules=[LinearResidualRule(), RMSNormRule()], log=path, door="test")
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [(x["rule"], x["decision"]) for x in lines] == [("linear_residual", "applied")] * 2 + [
        ("rms_norm", "not_matched")]
    assert lines[0]["door"] == "test" and lines[0]["rank"] == 0 and lines[0]["graph_id"] == log.events[0].graph_id
    back = RewriteLog.from_jsonl(path)
    assert back.summary()["linear_residual"]["applied"] == 2
    from k3fuse.tools.cli import main
    assert main(["log", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["active_rules"] == ["linear_residual"] and out["summary"]["rms_norm"]["not_matched"] == 1
    assert main(["log", str(path)]) == 0
    table = capsys.readouterr().out
    assert "linear_residual" in table and "rms_norm" in table


def test_log_env_path_and_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("K3FUSE_LOG", str(tmp_path / "env.jsonl"))
    gm, _, _ = layers_graph(1)
    run_pipeline(gm, DecodeContext(tp_size=2, rank=1, group_name="0"), rules=[LinearResidualRule()])
    (line,) = (tmp_path / "env.jsonl").read_text().splitlines()
    assert json.loads(line)["rank"] == 1


class BrokenRule(Rule):
    name = "broken"

    def patterns(self):
        return LinearResidualRule().patterns()[:1]

    def rewrite(self, match, ctx):
        raise ValueError("boom")


def test_rule_bug_is_raised_with_rule_name():
    from k3fuse.pipeline import RuleFailure
    gm, _, _ = layers_graph(1)
    with pytest.raises(RuleFailure, match="rule broken failed rewriting.*boom"):
        run_pipeline(gm, DecodeContext(), rules=[BrokenRule()])


def test_graph_is_linted_and_dead_code_removed():
    gm, _, args = layers_graph(2)
    run_pipeline(gm, DecodeContext(), rules=[LinearResidualRule()])
    assert not [n for n in gm.graph.nodes if n.op == "call_function" and not n.users]
    assert isinstance(gm, fx.GraphModule) and "linear_residual" in gm.code


def test_off_by_default_rule_runs_only_when_named(monkeypatch):
    """weight_prefetch (Rule.default_on False) is skipped with its reason unless enabled by name."""
    from k3fuse.pipeline import default_registry, opt_in_rules_env

    def why(ctx, env=""):
        return dict((r.name, w) for r, w in default_registry().select(ctx, env=env))["weight_prefetch"]

    assert why(k3fuse.DecodeContext()).startswith("off by default (measured slower")
    assert "K3FUSE_RULES=+weight_prefetch" in why(k3fuse.DecodeContext())
    assert why(k3fuse.DecodeContext(), env="+weight_prefetch") is None
    assert why(k3fuse.DecodeContext(enabled_rules={"weight_prefetch", "decode_gemm"})) is None
    assert why(k3fuse.DecodeContext(), env="-decode_gemm,+weight_prefetch") is None
    assert why(k3fuse.DecodeContext(disabled_rules={"weight_prefetch"}), env="+weight_prefetch") == \
        "disabled by DecodeContext"
    assert opt_in_rules_env("a, +b,-c, + d") == {"b", "d"} and parse_rules_env("+b,c") == ({"c"}, set())
    with pytest.raises(UnknownRuleError, match="nope"):
        default_registry().select(k3fuse.DecodeContext(), env="+nope")
