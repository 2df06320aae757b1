"""The CuTe W4A16 op's tuned launch table and the tuner that writes it (bench/tune_w4a16.py), on CPU.

* every entry of the shipped table is a launch pick_config accepts, at K3's shapes, with the run that
  decided it in bench/results/, and that run's arms spell it;
* the op's configuration takes the entry at the nearest measured token count of its own mode; an empty
  entry (the rule measured best) is nearer than another count's; the warmup compiles what the call runs;
* the table steps aside for K3FUSE_W4A16_TUNED=0, any launch-form switch, imposed choices, tuned=False;
* the tuner keeps a launch only past the margin over the rule's arm, keeps entries it has no rule arm
  for, leaves out arms of another mode or skipped by name, spells launches as the fewest choices, writes a
  module that reads back, and refuses to weigh arms while a launch-form switch is set.
"""
from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest

pytest.importorskip("triton")

from k3fuse.kernels.lib.cute import routed_experts_w4a16_tuned as shipped  # noqa: E402
from k3fuse.kernels.ops import routed_experts_w4a16 as op  # noqa: E402
from k3fuse.kernels.ops.routed_experts_w4a16 import LAUNCH_FORM_SETTINGS, cute_config, tuned_choices  # noqa: E402

from bench import tune_w4a16 as tuner  # noqa: E402  (a benchmark tool, not part of the installed package)

ROOT = Path(__file__).resolve().parents[1]

E, L, K = 896, 3584, 16


@pytest.fixture(autouse=True)
def _rule_environment(monkeypatch):
    for name in (*LAUNCH_FORM_SETTINGS, "K3FUSE_W4A16_TUNED"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def table(monkeypatch):
    """A table of the test's own (the module's dict replaced, so the op reads it)."""
    mine: dict = {}
    monkeypatch.setattr(shipped, "TUNED", mine)
    return mine


def test_shipped_entries_are_accepted_launches_decided_by_runs_that_spell_them():
    assert shipped.TUNED and set(shipped.SOURCES) == set(shipped.TUNED) and shipped.DEVICES
    for key, choices in shipped.TUNED.items():
        fmt, e, I, l, k, T = key
        assert fmt in op.FORMATS and (e, l, k) == (E, L, K), key  # K3's table: 896 experts, latent 3584, top 16
        tuned = cute_config(T, e, I, l, k, format=fmt)
        assert tuned == cute_config(T, e, I, l, k, tuned=False, **choices)  # accepted: no ValueError
        run = json.loads((ROOT / "bench" / "results" / shipped.SOURCES[key]).read_text())
        row = next(r for r in run["rows"] if (r["format"], r["inter"], r["tokens"]) == (fmt, I, T))
        timed = [a["config"] for a in row.get("cute_choices", {}).values() if "config" in a]
        timed += [row["cute_config"]] if "cute_config" in row else []  # the op's own arm, where recorded
        assert any(tuner.same_launch(c, tuned) for c in timed), f"{key}: no arm of its run timed {choices}"


def test_nearest_measured_count_of_the_calls_mode(table):
    table[("mxfp4", E, 1536, L, K, 1)] = {"split": 1}
    table[("mxfp4", E, 1536, L, K, 8)] = {"n_tiles": 2}
    table[("mxfp4", E, 1536, L, K, 32)] = {}
    assert tuned_choices("mxfp4", 1, E, 1536, L, K) == {"split": 1}
    assert tuned_choices("mxfp4", 2, E, 1536, L, K) == {"split": 1}  # pairwise: the pairwise entry
    assert tuned_choices("mxfp4", 3, E, 1536, L, K) == {"n_tiles": 2}  # grouped: never the pairwise entry
    assert tuned_choices("mxfp4", 20, E, 1536, L, K) == {"n_tiles": 2}  # 12 from both: the lower count
    assert tuned_choices("mxfp4", 64, E, 1536, L, K) == {}  # measured: the rule, no other count's entry
    assert cute_config(64, E, 1536, L, K, format="mxfp4") == cute_config(64, E, 1536, L, K)
    assert tuned_choices("int4", 1, E, 1536, L, K) is None  # another format, width, or table
    assert tuned_choices("mxfp4", 1, E, 3072, L, K) is None
    assert tuned_choices("mxfp4", 1, 256, 1536, L, K) is None
    rule = cute_config(1, E, 1536, L, K)
    assert rule["split"] == 2 and cute_config(1, E, 1536, L, K, format="mxfp4")["split"] == 1
    assert cute_config(8, E, 1536, L, K, format="mxfp4")["n_tiles"] == 2


def test_ring_depth_entries_set_the_stages(table):
    table[("mxfp4", E, 3072, L, K, 64)] = {"stages": 4}
    config = cute_config(64, E, 3072, L, K, format="mxfp4")
    assert config["gate_up_stages"] == config["down_stages"] == 4
    assert cute_config(64, E, 3072, L, K)["gate_up_stages"] == 3
    assert table[("mxfp4", E, 3072, L, K, 64)] == {"stages": 4}  # the lookup copies, never pops the table's


@pytest.mark.parametrize("switch", ["K3FUSE_W4A16_TUNED=0", *(f"{v}=1" for v in LAUNCH_FORM_SETTINGS),
                                    *(f"{v}=0" for v in LAUNCH_FORM_SETTINGS)])
def test_table_steps_aside_for_the_off_switch_and_every_launch_form_switch(table, monkeypatch, switch):
    table[("mxfp4", E, 1536, L, K, 1)] = {"split": 1}
    assert tuned_choices("mxfp4", 1, E, 1536, L, K) == {"split": 1}
    name, value = switch.split("=")
    monkeypatch.setenv(name, value)
    assert tuned_choices("mxfp4", 1, E, 1536, L, K) is None


def test_imposed_choices_and_tuned_false_get_the_rule_alone(table):
    table[("mxfp4", E, 1536, L, K, 1)] = {"split": 1, "stages": 4}
    rule = cute_config(1, E, 1536, L, K)
    assert cute_config(1, E, 1536, L, K, format="mxfp4", tuned=False) == rule
    assert cute_config(1, E, 1536, L, K, format="mxfp4", x_stage=True) == cute_config(1, E, 1536, L, K, x_stage=True)
    assert cute_config(1, E, 1536, L, K, format="mxfp4", stages=3) == rule  # an imposed depth is a choice too
    assert cute_config(1, E, 1536, L, K, format="mxfp4", pairwise=True) == rule
    tuned = cute_config(1, E, 1536, L, K, format="mxfp4")
    assert (tuned["split"], tuned["gate_up_stages"]) == (1, 4)


def test_warmup_compiles_the_tuned_launch_the_call_runs(table, monkeypatch):
    """The compile caches key on the configuration: warmup (ahead of capture) and the call must agree."""
    table[("mxfp4", E, 384, L, K, 2)] = {"split": 1}
    ran = []
    monkeypatch.setattr(op, "cute_accepts", lambda spec: None)
    monkeypatch.setattr(op, "cute_run", lambda *args, config=None, **kw: ran.append(config))
    op.cute_warmup([{"M": 2, "E": E, "I": 384, "L": L, "top_k": K, "format": "mxfp4", "device": "cpu"}])
    assert ran == [cute_config(2, E, 384, L, K, format="mxfp4")] and ran[0]["split"] == 1
    assert cute_config(2, E, 384, L, K)["split"] == 4


def _row(T: int, I: int = 1536, fmt: str = "mxfp4", **arms: tuple[float, dict]) -> dict:
    """A benchmark row: arms name -> (µs, choices), each timed at cute_config's launch for its choices."""
    choices = {n: {"us": us, "config": cute_config(T, E, I, L, K, tuned=False, **c)} for n, (us, c) in arms.items()}
    return {"format": fmt, "inter": I, "tokens": T, "cute_choices": choices}


def _run(*rows: dict) -> tuple[str, dict]:
    return "run.json", {"E": E, "top_k": K, "latent": L, "device": "NVIDIA H200", "rows": list(rows)}


def test_tuner_keeps_a_launch_only_past_the_margin_over_the_rule():
    table, sources = {}, {}
    lines = tuner.tune([_run(_row(1, rule=(55.0, {}), s1=(52.0, {"split": 1}), four=(57.0, {"x_stage": False})),
                             _row(2, rule=(95.0, {}), four=(94.0, {"x_stage": False})))],
                       table, sources, 0.02, set())
    assert table == {("mxfp4", E, 1536, L, K, 1): {"split": 1}, ("mxfp4", E, 1536, L, K, 2): {}}
    assert sources == {key: "run.json" for key in table}
    assert lines[0].startswith("mxfp4 I=1536 T=1: {'split': 1} (s1, +5.8% over the rule)")
    assert lines[1] == "mxfp4 I=1536 T=2: the rule (best four, +1.1%)"


def test_tuner_keeps_entries_without_a_rule_arm_and_leaves_out_other_modes_and_skipped_arms():
    old = {("mxfp4", E, 1536, L, K, 1): {"split": 1}, ("mxfp4", E, 3072, L, K, 64): {"stages": 4}}
    table, sources = dict(old), {key: "old.json" for key in old}
    grouped_at_one = cute_config(1, E, 1536, L, K, pairwise=False)
    row = _row(1, s1=(50.0, {"split": 1}))  # no rule arm: nothing to weigh it against
    lines = tuner.tune([_run(row)], table, sources, 0.02, set())
    assert table == old and sources[("mxfp4", E, 1536, L, K, 1)] == "old.json"
    assert lines == ["mxfp4 I=1536 T=1: kept (no arm ran the rule)"]
    row = _row(1, rule=(55.0, {}), s1=(54.5, {"split": 1}), fast=(40.0, {"split": 1}))
    row["cute_choices"]["grouped"] = {"us": 30.0, "config": grouped_at_one}  # another mode: no choices spell it
    lines = tuner.tune([_run(row)], table, sources, 0.02, {"fast"})  # "fast": code changed since the run
    assert table[("mxfp4", E, 1536, L, K, 1)] == {} and table[("mxfp4", E, 3072, L, K, 64)] == {"stages": 4}
    assert lines == ["mxfp4 I=1536 T=1: the rule (best s1, +0.9%)",
                     "    arm grouped: another mode or a launch no choices spell, left out"]


def test_tuner_never_writes_a_blocked_launch():
    """A blocked arm ran over block_order's tables; the op's tables are the checkpoint's, so however fast, the
    arm is left out (no choice spells it) and the best row-major launch decides."""
    blocked = cute_config(1, E, 1536, L, K, tuned=False, split=1, blocked=True)
    row = _row(1, rule=(55.0, {}), s1=(52.0, {"split": 1}))
    row["cute_choices"]["blk"] = {"us": 40.0, "config": blocked}
    table: dict = {}
    lines = tuner.tune([_run(row)], table, {}, 0.02, set())
    assert table == {("mxfp4", E, 1536, L, K, 1): {"split": 1}}
    assert "    arm blk: another mode or a launch no choices spell, left out" in lines


def test_the_ops_own_arm_counts_where_its_launch_is_recorded():
    row = _row(1, s1=(54.0, {"split": 1}))
    row.update(cute=50.0, cute_config=cute_config(1, E, 1536, L, K))  # the op's arm ran the rule
    table: dict = {}
    tuner.tune([_run(row)], table, {}, 0.02, set())
    assert table == {("mxfp4", E, 1536, L, K, 1): {}}
    old_run = _row(1, s1=(54.0, {"split": 1}))
    old_run.update(cute=50.0)  # a run from before the row recorded its launch: the arm is not weighed
    assert tuner.tune([_run(old_run)], table, {}, 0.02, set())[0].endswith("kept (no arm ran the rule)")


@pytest.mark.parametrize("shape,choices", [
    ((1, 1536), {"split": 1}),
    ((1, 3072), {"gate_up_tiles": 2, "split": 1, "stages": 4, "x_stage": True, "pdl": True}),
    ((2, 3072), {"balanced": True}),
    ((1, 384), {"x_stage": False, "x_quads": True}),
    ((64, 3072), {"stages": 4, "down_stages": 2, "n_tiles": 2}),
    ((8, 1536), {"scale_steps": 4, "rows_first": False}),
])
def test_launches_are_spelled_as_the_fewest_choices_that_reproduce_them(shape, choices):
    T, I = shape
    config = cute_config(T, E, I, L, K, tuned=False, **choices)
    spelled = tuner.as_choices(config, (T, E, I, L, K))
    assert spelled is not None and cute_config(T, E, I, L, K, tuned=False, **spelled) == config
    assert len(spelled) <= len(choices)
    assert tuner.as_choices(cute_config(T, E, I, L, K), (T, E, I, L, K)) == {}


def test_tuner_writes_a_module_that_reads_back_and_merges(tmp_path, capsys):
    out = tmp_path / "tuned.py"
    out.write_text(tuner.render({("int4", E, 384, L, K, 8): {"n_tiles": 2}}, {("int4", E, 384, L, K, 8): "a.json"},
                                {"NVIDIA H100 80GB HBM3"}))
    run = tmp_path / "h200_run.json"
    run.write_text(json.dumps(_run(_row(1, rule=(55.0, {}), s1=(50.0, {"split": 1})))[1]))
    assert tuner.main([str(run), "-o", str(out), "--check"]) == 0
    assert "not written" in capsys.readouterr().out and "h200_run" not in out.read_text()
    assert tuner.main([str(run), "-o", str(out)]) == 0
    module = runpy.run_path(str(out))
    assert module["TUNED"] == {("int4", E, 384, L, K, 8): {"n_tiles": 2}, ("mxfp4", E, 1536, L, K, 1): {"split": 1}}
    assert module["SOURCES"] == {("int4", E, 384, L, K, 8): "a.json", ("mxfp4", E, 1536, L, K, 1): "h200_run.json"}
    assert module["DEVICES"] == ("NVIDIA H100 80GB HBM3", "NVIDIA H200")
    assert max(len(line) for line in out.read_text().splitlines()) <= 120


def test_tuner_refuses_while_a_launch_form_switch_is_set(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("K3FUSE_W4A16_X_STAGE", "0")
    out = tmp_path / "tuned.py"
    assert tuner.main([str(tmp_path / "missing.json"), "-o", str(out)]) == 2
    assert "unset K3FUSE_W4A16_X_STAGE" in capsys.readouterr().err and not out.exists()
