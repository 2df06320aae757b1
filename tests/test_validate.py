"""`k3fuse validate` on CPU (gloo): a correct run passes, a wrong fused all-reduce is reported as
unexplained (exit 1), flips near a tie are told apart from far ones, and bad input (no process
group, TP that differs across ranks, a dead peer) is a clear error instead of a hang."""
from __future__ import annotations

import json
import os
import time

import pytest
import torch

from k3fuse.tools import validate as v
from k3fuse.dist import RankFailedError, launch

FAST = dict(preset="tiny", layers=1, steps=2, stock="eager", compiler="eager", layer_outputs=False)


def test_cli_validate_passes_tp2(tmp_path, capfd):
    from k3fuse.tools.cli import main

    out = tmp_path / "v.json"
    rc = main(["validate", "--preset", "tiny", "--layers", "2", "--steps", "2", "--tp", "2",
               "--stock", "eager", "--compiler", "eager", "--skew", "0.5", "--temperature", "0.7",
               "--json", str(out), "--log", str(tmp_path / "rw.jsonl")])
    captured = capfd.readouterr()  # fd level: the ranks' progress lines too
    text = captured.out
    assert rc == 0, text
    assert "validate: PASS" in text and "per layer" in text
    # a line per step while it runs (rank 0), the first saying it compiles
    assert "validate: 2 layer(s), step 1/2: float64 copy, stock, k3fuse (the first step compiles)" in captured.err
    assert "validate: 2 layer(s), step 2/2: float64 copy, stock, k3fuse" in captured.err
    logged = [json.loads(line) for line in (tmp_path / "rw.jsonl").read_text().splitlines()]
    assert {e["rank"] for e in logged} == {0, 1} and any(e["decision"] == "applied" for e in logged)
    data = json.loads(out.read_text())
    r0 = data["ranks"][0]
    assert len(r0["layers"]) == 2 and len(r0["steps"]) == 2
    assert r0["layers"][0]["output_err_k3fuse"] is not None        # truncated-stack output error
    assert r0["runtime_stats"]["gemm_ar_residual_rmsnorm"] == {"reference": 8}   # what ran, strict
    assert "oproj_allreduce_residual" in r0["active_rules"]


def test_wrong_fused_op_is_unexplained():
    cfg = v.ValidateConfig(tp=2, inject=0.05, **FAST)
    reports = v.run_validate(cfg)
    assert not v.passed(reports)
    assert any("UNEXPLAINED" in u for r in reports for u in r["unexplained"])


def test_flip_analysis_near_and_far():
    scores = torch.tensor([[0.90, 0.80, 0.500, 0.499, 0.1]])
    ref = [(0, torch.tensor([[0, 1, 2]]), scores)]
    near = [(0, torch.tensor([[0, 1, 3]]))]          # 2 <-> 3: gap 0.001
    far = [(0, torch.tensor([[0, 1, 4]]))]           # 2 <-> 4: gap 0.4
    same = [(0, torch.tensor([[2, 1, 0]]))]
    agree, flips, n_near, m, far_steps, near_steps = v._flip_analysis(ref, near, 1, 1, 3, 0.01)[0]
    assert (agree, flips, n_near, far_steps, near_steps) == (0.0, 1, 1, set(), {0})
    assert m == pytest.approx(0.001, abs=1e-6)
    assert v._flip_analysis(ref, far, 1, 1, 3, 0.01)[0][4] == {0}
    assert v._flip_analysis(ref, same, 1, 1, 3, 0.01)[0][:3] == (1.0, 0, 0)


def test_missing_process_group_is_clear():
    with pytest.raises(v.ValidateError, match="process group"):
        v.validate_rank(0, 1, v.ValidateConfig(tp=2, **FAST))


def _mismatched(rank, world):
    return v.validate_rank(rank, world, v.ValidateConfig(tp=2 if rank == 0 else 4, **FAST))


def test_mismatched_tp_is_clear_on_every_rank():
    with pytest.raises(RankFailedError, match="disagree.*tp: rank 0=2, rank 1=4"):
        launch(_mismatched, 2, backend="gloo", timeout_s=120)


def _dead_peer(rank, world):
    if rank == 1:
        os._exit(3)
    return v.validate_rank(rank, world, v.ValidateConfig(tp=2, **FAST))


def test_dead_peer_does_not_hang():
    t0 = time.monotonic()
    with pytest.raises(RankFailedError, match="peer rank did not take part|ProcessDied"):
        launch(_dead_peer, 2, backend="gloo", timeout_s=120)
    assert time.monotonic() - t0 < 110


@pytest.mark.parametrize("fmt", ["mxfp4", "int4"])
def test_float64_copy_keeps_the_packed_experts_and_dequantizes_them_exactly(fmt):
    cfg = v.ValidateConfig(tp=1, overrides=(("expert_format", fmt),), **FAST)
    mcfg, model, ref = v._build(cfg, 1, 0, None, torch.device("cpu"))
    assert mcfg.expert_format == fmt and ref.dtype == torch.float64
    mine, theirs = model.layers[0].moe.routed, ref.layers[0].moe.routed
    for name in ("w1_packed", "w1_scale", "w2_packed", "w2_scale"):
        assert getattr(theirs, name).dtype == getattr(mine, name).dtype
        assert torch.equal(getattr(theirs, name), getattr(mine, name)), name
    for w64, w in zip(theirs.expert_weights(), mine.expert_weights(torch.float64)):
        assert w64.dtype == torch.float64 and torch.equal(w64, w)


def test_cli_validate_mxfp4_stack_tp2(tmp_path, capsys):
    from k3fuse.tools.cli import main

    out = tmp_path / "v.json"
    rc = main(["validate", "--preset", "small", "--set", "expert_format=mxfp4", "--layers", "1", "--steps", "2",
               "--tp", "2", "--stock", "eager", "--compiler", "eager", "--no-layer-outputs", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "validate: PASS" in text and "experts=mxfp4" in text
    r0 = json.loads(out.read_text())["ranks"][0]
    assert r0["model"]["expert_format"] == "mxfp4" and r0["model"]["moe_inter"] == 64
    assert r0["output_err_k3fuse"][0] < 1e-4 and r0["output_err_stock"][0] < 1e-4  # fp32 vs float64 copy


def test_quantized_width_tp_misfit_is_one_clear_error_before_any_rank_starts():
    cfg = v.ValidateConfig(tp=2, overrides=(("expert_format", "mxfp4"),), **FAST)  # tiny: I/2 = 16
    with pytest.raises(v.ValidateError, match="TP=2 leaves moe_inter/tp=16 .* mxfp4 group size 32"):
        v.run_validate(cfg)
