"""The whole-model verbs on CPU: `k3fuse generate`, `k3fuse validate --model`, `k3fuse bench --model`, and the one
line each bad input gets (TP that does not divide a width, --as-rank outside --of, a context past the cache or
K3's positions, a batch past 64, a checkpoint that is missing or of another model); a written checkpoint read
back decodes the tokens of the model it was drawn from."""
from __future__ import annotations

import json

import pytest

from k3fuse.tools.cli import main


@pytest.mark.parametrize("argv,message", [
    (["generate", "--preset", "k3", "--as-rank", "0", "--of", "64"], "--of 64: TP=64 does not divide kda_heads=96"),
    (["generate", "--preset", "k3", "--as-rank", "16", "--of", "16"], "--as-rank 16 is outside --of 16"),
    (["generate", "--as-rank", "0"], "--as-rank and --of go together"),
    (["generate", "--tp", "3"], "--tp 3: TP=3 does not divide kda_heads=16"),
    (["generate", "--context", "1048576"], "longer than K3's 1048576 positions"),
    (["generate", "--batch", "65"], "--batch 65: the decode rewrites cover 1-64"),
    (["generate", "--prompt-ids", "1,2,x"], "prompt 1 is not token ids"),
    (["generate", "--prompt-ids", "1,99999"], "token id 99999 is outside the vocabulary of 512"),
    (["generate", "--checkpoint", "/nonexistent"], "checkpoint config /nonexistent/config.json does not exist"),
    (["validate", "--model", "--preset", "k3", "--as-rank", "2", "--of", "2"], "--as-rank 2 is outside --of 2"),
    (["bench", "--model", "--tp", "2"], "the model bench runs one process"),
    (["bench", "--model", "--arms", "peer,k3fuse"], "the peer takes the model's expert tables over"),
    (["bench", "--as-rank", "0", "--of", "2"], "--as-rank is a flag of the whole-model bench"),
    (["validate", "--as-rank", "0", "--of", "2"], "--as-rank is a flag of validate --model"),
])
def test_bad_input_is_one_line(argv, message, capsys):
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse's own checks (a --batch past 64) exit from the parser
        rc = exc.code
    assert rc == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_a_checkpoint_of_another_model_is_one_line(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    assert main(["generate", "--checkpoint", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "not Kimi K3" in err and len(err.strip().splitlines()) == 1, err


def _tokens(argv: list[str], tmp_path, name: str) -> list:
    out = tmp_path / f"{name}.json"
    assert main(argv + ["--json", str(out)]) == 0
    return json.loads(out.read_text())["ranks"][0]["arms"]["eager"]["tokens"]


@pytest.mark.slow
def test_a_written_checkpoint_decodes_the_tokens_of_its_model(tmp_path):
    ckpt = tmp_path / "ckpt"
    assert main(["generate", "--preset", "tiny", "--seed", "3", "--write-checkpoint", str(ckpt)]) == 0
    assert (ckpt / "config.json").exists() and (ckpt / "model.safetensors.index.json").exists()
    run = ["generate", "--tp", "1", "--arms", "eager", "--steps", "4", "--batch", "2", "--seed", "3"]
    drawn = _tokens(run + ["--preset", "tiny"], tmp_path, "drawn")
    loaded = _tokens(run + ["--checkpoint", str(ckpt)], tmp_path, "loaded")
    assert loaded == drawn and len(drawn) == 2 and len(drawn[0]) == 4


def test_as_rank_at_tp16_holds_the_experts_in_row_order():
    from k3fuse.tools.model_args import ModelArgs, check_model_args

    ma = check_model_args(ModelArgs(preset="k3", as_rank=3, of=16))
    assert dict(ma.overrides)["expert_layout"] == "rows" and "192" in ma.notes[0]
    cfg = ma.config()
    assert cfg.moe_inter // 16 == 192 and cfg.expert_layout == "rows"
    assert check_model_args(ModelArgs(preset="k3", as_rank=0, of=8)).notes == ()  # 384 = 3 steps: blocks stay


@pytest.mark.slow
def test_generate_stock_and_k3fuse_agree_on_two_ranks(tmp_path, capfd):
    out = tmp_path / "g.json"
    rc = main(["generate", "--preset", "tiny", "--steps", "4", "--batch", "3", "--context", "9",
               "--prompt-ids", "5,6", "--block-size", "4", "--json", str(out)])
    text = capfd.readouterr().out
    assert rc == 0, text
    assert "tokens: every arm and every rank agree" in text
    data = json.loads(out.read_text())
    arms = data["ranks"][0]["arms"]
    assert set(arms) == {"stock", "k3fuse"} and arms["k3fuse"]["fallbacks"] == {}
    assert len(arms["k3fuse"]["tokens"]) == 3 and len(arms["k3fuse"]["tokens"][0]) == 4
    assert "oproj_allreduce_residual" in arms["k3fuse"]["active_rules"]  # TP 2: the collective rules fire
    assert data["ranks"][0]["lengths"] == [9, 8, 7] and data["agreement"]["agree"]


@pytest.mark.slow
def test_generate_as_rank_reports_one_ranks_compute_and_projected_collectives(capfd):
    rc = main(["generate", "--preset", "tiny", "--as-rank", "1", "--of", "2", "--steps", "3", "--arms", "eager,k3fuse",
               "--temperature", "0.8", "--top-p", "0.9"])
    text = capfd.readouterr().out
    assert rc == 0, text
    assert "rank 1 of TP 2 alone" in text and "one rank's compute, collectives not included" in text
    assert "PROJECTED" in text and "(projected)" in text


@pytest.mark.slow
def test_validate_model_runs_every_check(tmp_path, capfd):
    out = tmp_path / "v.json"
    rc = main(["validate", "--model", "--preset", "tiny", "--steps", "6", "--batch", "2", "--tp", "2",
               "--stock", "eager", "--compiler", "eager", "--json", str(out), "--plots", str(tmp_path)])
    text = capfd.readouterr().out
    assert rc == 0, text
    assert "validate --model: PASS" in text and (tmp_path / "drift.png").exists()
    r0 = json.loads(out.read_text())["ranks"][0]
    assert len(r0["curves"]["k3fuse_kv"]) == 6 and r0["missing_rules"] == [] and r0["fallbacks"] == {}
    assert 0 < r0["curves"]["k3fuse_kv"][-1] < 0.05  # bf16 against the float32 copy


def test_validate_model_verdict_names_far_flips_and_missing_rules():
    from k3fuse.tools.validate_model import verdict

    flip = {"step": 2, "layer": 1, "sequence": 1, "gap": 0.3, "near_tie": False, "carried": False}
    report = {"tie_tol": 0.1, "route_tie": 0.02, "greedy": {"stock": [], "k3fuse": [
        {"step": 7, "sequence": 0, "tokens": [3, 4], "margin": 0.5, "explained": False}], "k3fuse_vs_stock": []},
        "routing_flips": {"stock": [dict(flip, carried=True)], "k3fuse": [flip]},
        "sampled": {"stock": [], "k3fuse": []}, "missing_rules": ["kda_delta_rule"], "fallbacks": {}}
    problems = verdict(report)
    assert problems[0].startswith("k3fuse: 1 sequence(s) whose first routing flip is far from a tie")
    assert "first at step 7 (tokens [3, 4], float32 margin 0.5)" in problems[1]
    assert "did not fire: ['kda_delta_rule']" in problems[2] and len(problems) == 3


@pytest.mark.slow
def test_bench_model_cpu_smoke(tmp_path, capfd):
    out = tmp_path / "m.json"
    rc = main(["bench", "--model", "--preset", "tiny", "--as-rank", "0", "--of", "2", "--batch", "2",
               "--context", "32", "--block-size", "8", "--arms", "stock,k3fuse", "--steps", "2", "--replays", "2",
               "--json", str(out)])
    text = capfd.readouterr().out
    assert rc == 0, text
    result = json.loads(out.read_text())
    rows = {r["arm"]: r for r in result["rows"]}
    assert rows["k3fuse"]["us"] > 0 and rows["k3fuse"]["bytes"]["kv"] > 0
    assert result["arms"]["k3fuse"]["fallbacks"] == {} and result["missing_collectives"]
