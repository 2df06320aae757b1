"""`k3fuse bench` on CPU: the layer benchmark's own code path on 2 gloo ranks (a smoke run).

The numbers are host-clock and meaningless; what is checked is that both arms ran through the
same harness, the k3fuse arm rewrote the model in strict mode with no fallback, and the JSON and
plot a user reads are written.
"""
import json
import os
import re
import subprocess
import sys

import pytest

from k3fuse.tools.bench import parse_arms
from k3fuse.tools.bench.runner import weight_floor
from k3fuse.model import K3DecodeStack, get_config

RULES = ["oproj_allreduce_residual", "moe_tail_allreduce_norm", "moe_front_sharded", "fused_routing",
         "routed_experts", "moe_combine", "shared_expert_stream", "kda_short_conv", "kda_delta_rule", "mla_decode",
         "decode_gemm", "weight_prefetch"]
# measured slower (docs/perf.md) / not measured yet
OFF_BY_DEFAULT = {"weight_prefetch", "moe_tail_allreduce_norm"}
# default rules with no site in the KDA + MoE layer the bench times
NO_SITE_IN_LAYER = {"mla_decode"}


def test_arms_parse_in_order_and_expand_rules():
    arms = parse_arms(["stock", "k3fuse", "without:decode_gemm", "rules", "stock"])
    names = [a.name for a in arms]
    assert names[:3] == ["stock", "k3fuse", "without:decode_gemm"]
    assert len(names) == 3 + 2 * len(RULES) - 1  # `rules`: only: per rule, without:/with: per rule, once
    defaults = frozenset(RULES) - OFF_BY_DEFAULT
    assert arms[0].is_stock and arms[1].rules == defaults
    assert arms[2].rules == defaults - {"decode_gemm"}
    assert next(a for a in arms if a.name == "only:weight_prefetch").rules == {"weight_prefetch"}
    assert next(a for a in arms if a.name == "with:weight_prefetch").rules == defaults | {"weight_prefetch"}
    assert "without:weight_prefetch" not in names
    with pytest.raises(ValueError, match="unknown rule 'nope'"):
        parse_arms(["only:nope"])
    with pytest.raises(ValueError, match="unknown arm"):
        parse_arms(["fastest"])


def test_weight_floor_counts_only_the_experts_the_tokens_touch():
    model = K3DecodeStack(get_config("tiny", n_layers=1), seed=0)
    all_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    one, many = weight_floor(model, 1), weight_floor(model, 64)
    cfg = model.config
    assert one["experts_touched"] == pytest.approx(cfg.top_k)
    assert one["dense_bytes"] + one["expert_bytes_touched"] < all_bytes
    assert many["dense_bytes"] + many["expert_bytes_touched"] == pytest.approx(all_bytes, rel=1e-3)


@pytest.mark.slow
def test_bench_cli_smoke_on_two_gloo_ranks(tmp_path):
    out = tmp_path / "bench.json"
    plots = tmp_path / "plots" / "run1"  # a directory, created
    cmd = [sys.executable, "-m", "k3fuse.tools.cli", "bench", "--device", "cpu", "--preset", "tiny",
           "--compiler", "eager", "--batch", "1,3", "--steps", "2", "--replays", "2",
           "--arms", "stock,k3fuse,without:shared_expert_stream", "--rule-arm-batch", "3",
           "--json", str(out), "--plots", str(plots), "--log", str(tmp_path / "rw.jsonl")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, "COLUMNS": "120"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "µs per decode step" in proc.stdout
    # a line per arm and token count while it runs
    for arm, T in (("stock", 1), ("stock", 3), ("k3fuse", 1), ("k3fuse", 3), ("without:shared_expert_stream", 3)):
        assert re.search(rf"^  {re.escape(arm)} T={T}: [0-9.]+ µs/step", proc.stdout, re.M), (arm, T)
    # the plots: the files written, and the one CPU cannot draw, with why
    assert f"wrote {plots / 'latency.png'}" in proc.stdout
    assert "skipped timeline.png: no kernel timeline was recorded: it comes from the CUDA profiler (this run " \
           "was on CPU)" in proc.stdout
    assert sorted(p.name for p in plots.iterdir()) == ["latency.png"]
    # the tables: no raw {} in the header, every applied rule name whole, the replays' spread shown
    header = next(line for line in proc.stdout.splitlines() if line.startswith("k3fuse bench: preset"))
    assert "{" not in header
    assert "p10-p90" in proc.stdout and re.search(r"[0-9.]+-[0-9.]+ │", proc.stdout)
    table_lines = [line for line in proc.stdout.splitlines() if line[:1] in "┏┃┡│└"]
    assert table_lines and max(map(len, table_lines)) <= 120  # COLUMNS=120: every table fits
    result = json.loads(out.read_text())
    arms = result["arms"]
    assert list(arms) == ["stock", "k3fuse", "without:shared_expert_stream"]
    assert [r["tokens"] for r in arms["k3fuse"]["rows"]] == [1, 3]
    assert [r["tokens"] for r in arms["without:shared_expert_stream"]["rows"]] == [3]
    assert all(r["us"] > 0 for a in arms.values() for r in a["rows"])
    assert arms["k3fuse"]["rows"][0]["speedup_vs_stock"] > 0
    # fp32 on CPU: the rewritten layer computes what stock computes on the same inputs
    assert all(r["rel_err_vs_stock"] < 1e-4 for a in ("k3fuse", "without:shared_expert_stream")
               for r in arms[a]["rows"]), arms["k3fuse"]["rows"]
    assert all(r["rel_err_vs_stock"] is None for r in arms["stock"]["rows"])
    applied = {rule: s["applied"] for rule, s in arms["k3fuse"]["rewrites"].items()}
    defaults = [r for r in RULES if r not in OFF_BY_DEFAULT | NO_SITE_IN_LAYER]
    assert all(applied[r] > 0 for r in defaults), applied  # every default rule fired (strict mode held)
    assert applied["weight_prefetch"] == 0 and arms["k3fuse"]["rewrites"]["weight_prefetch"]["why"] == {
        "contract:rule_disabled": 2}
    assert arms["without:shared_expert_stream"]["rewrites"]["shared_expert_stream"]["applied"] == 0
    assert arms["k3fuse"]["fallbacks"] == {} and arms["k3fuse"]["error"] is None
    # per token count: the first (compiling) call, one warm-up and 2 timed calls of 2 steps each,
    # with 2 fused norm sites per step (the MoE norm after the out-projection, the final norm)
    calls = 2 * (1 + 1 + 2) * 2 * 2
    assert arms["k3fuse"]["stats"]["gemm_ar_residual_rmsnorm"] == {"reference": calls}
    assert arms["k3fuse"]["passes_ms"] > 0 and arms["k3fuse"]["graphs"] == 2
    assert result["conditions"]["tp"] == 2 and result["model"]["hidden"] == 128
    for rule, n in applied.items():
        if n:
            assert f"{rule}:{n}" in proc.stdout, rule  # never cut in the rewrites table
    logged = [json.loads(line) for line in (tmp_path / "rw.jsonl").read_text().splitlines()]
    assert {e["rank"] for e in logged} == {0, 1} and any(e["decision"] == "applied" for e in logged)
    pytest.importorskip("matplotlib")
    assert (plots / "latency.png").stat().st_size > 1000


@pytest.mark.slow
def test_bench_rules_sets_the_k3fuse_arm():
    from argparse import Namespace

    from k3fuse.tools.bench.cli import register_bench
    from k3fuse.tools.cli import OneLineParser

    parser = OneLineParser(prog="k3fuse")
    register_bench(parser.add_subparsers(dest="command"))
    from k3fuse.tools.bench.cli import config_from_args

    args = parser.parse_args(["bench", "--device", "cpu", "--rules", "+weight_prefetch,-decode_gemm",
                              "--arms", "k3fuse,without:fused_routing"])
    assert isinstance(args, Namespace)
    cfg = config_from_args(args)
    k3, without = cfg.arm_list()
    defaults = frozenset(RULES) - OFF_BY_DEFAULT
    assert k3.rules == defaults - {"decode_gemm"} | {"weight_prefetch"}
    assert without.rules == k3.rules - {"fused_routing"}


def test_side_stream_overlap_counts_only_time_under_main_stream_work():
    from k3fuse.tools.bench.profile import KernelEvent, side_stream_overlap

    main = [KernelEvent("mm", 7, 0.0, 10.0), KernelEvent("topk", 7, 12.0, 8.0)]  # busy 0-10, 12-20
    side = [KernelEvent("gemv", 9, 5.0, 10.0)]  # 5-15: overlaps 5-10 and 12-15
    got = side_stream_overlap(main + side)
    assert got == {"side_us": 10.0, "overlapped_us": 8.0, "share": 0.8}
    assert side_stream_overlap(main)["side_us"] == 0.0


def test_concurrency_needs_no_stream_ids():
    from k3fuse.tools.bench.profile import KernelEvent, concurrency

    # a graph replay's stream ids mean nothing: the same timeline under any ids gives the same answer
    timeline = [(0.0, 10.0), (12.0, 8.0), (5.0, 10.0), (30.0, 2.0)]  # 0-10, 12-20, 5-15, 30-32
    for ids in ((1, 1, 1, 1), (7, 7, 9, 7), (3, 4, 5, 6)):
        got = concurrency([KernelEvent("k", i, s, d) for i, (s, d) in zip(ids, timeline)])
        assert got == {"busy_us": 30.0, "wall_us": 22.0, "concurrent_us": 8.0}
    assert concurrency([KernelEvent("k", 1, 0.0, 4.0), KernelEvent("k", 1, 4.0, 4.0)])["concurrent_us"] == 0.0
    assert concurrency([])["concurrent_us"] == 0.0


def test_routing_specs_parse_and_bad_ones_are_named():
    from k3fuse.tools.bench.routing import Routing, parse_routing

    assert parse_routing("uniform") == Routing("uniform")
    assert parse_routing("zipf:1.1") == Routing("zipf", 1.1) and str(parse_routing("zipf:1.1")) == "zipf:1.1"
    for bad in ("zipf", "zipf:-1", "zipf:x", "skewed", "zipf:inf"):
        with pytest.raises(ValueError, match="unknown routing .* use one of"):
            parse_routing(bad)


def test_zipf_routing_concentrates_the_experts_a_step_touches():
    """Measured on the bench's own inputs: uniform routing touches about the uniform expectation,
    Zipf-shaped biases fewer experts the steeper they are, and one token always its top_k."""
    import torch

    from k3fuse.tools.bench import routing
    from k3fuse.tools.bench.runner import BenchConfig, _inputs

    cfg = get_config("tiny", n_layers=1, n_experts=64, top_k=8)
    bench = BenchConfig(preset="tiny", steps=3)
    touched = {}
    for spec in ("uniform", "zipf:0.6", "zipf:1.1", "zipf:2"):
        model = K3DecodeStack(cfg, seed=0)
        routing.apply_routing(model, routing.parse_routing(spec), seed=0)
        for T in (1, 32):
            _, xs, state = _inputs(model, T, bench, torch.device("cpu"))
            got = routing.distinct_experts(model, xs, state)
            assert len(got["per_step_layer"]) == bench.steps  # one count per (step, layer)
            touched[spec, T] = got["mean"]
    assert all(touched[spec, 1] == cfg.top_k for spec in ("uniform", "zipf:0.6", "zipf:1.1", "zipf:2"))
    uniform = routing.expected_uniform(64, 8, 32)
    assert 0.85 * uniform < touched["uniform", 32] <= 64
    assert touched["uniform", 32] > touched["zipf:0.6", 32] > touched["zipf:1.1", 32] > touched["zipf:2", 32]
    model = K3DecodeStack(cfg, seed=0)
    floor = weight_floor(model, 32, touched=touched["zipf:1.1", 32])
    assert floor["experts_touched"] == touched["zipf:1.1", 32]
    assert floor["experts_touched_uniform"] == pytest.approx(uniform)


def test_bench_defaults_are_published_widths_and_set_repeats():
    import argparse

    from k3fuse.tools.bench.cli import CUDA_DEFAULTS, register_bench
    from k3fuse.tools.bench.runner import BenchConfig

    assert CUDA_DEFAULTS == {"preset": "k3", "set": "", "tp": 1}
    cfg = BenchConfig().model_config()
    assert (cfg.moe_inter, cfg.expert_format) == (3072, "mxfp4")
    narrow = BenchConfig(preset="k3_moe_inter128").model_config()
    assert (narrow.moe_inter, narrow.expert_format, narrow.latent) == (128, "bf16", 3584)
    parser = argparse.ArgumentParser()
    register_bench(parser.add_subparsers())
    args = parser.parse_args(["bench", "--set", "moe_inter=128", "--set", "expert_format=bf16,latent=512"])
    assert args.overrides == {"moe_inter": 128, "expert_format": "bf16", "latent": 512}


@pytest.mark.slow
def test_bench_cli_mxfp4_experts_with_zipf_routing(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "k3fuse.tools.cli", "bench", "--device", "cpu", "--preset", "tiny", "--tp", "1",
           "--set", "expert_format=mxfp4", "--routing", "zipf:1.1", "--compiler", "eager", "--batch", "1,8",
           "--steps", "2", "--replays", "2", "--arms", "stock,k3fuse", "--no-profile", "--json", str(out)]
    # a kernel choice set in the environment is recorded with the figures (on CPU it changes nothing)
    env = {**os.environ, "K3FUSE_W4A16_CUTE_INT4": "0"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "mxfp4 experts, zipf:1.1 routing" in proc.stdout and "distinct experts/step" in proc.stdout
    result = json.loads(out.read_text())
    assert result["model"]["expert_format"] == "mxfp4" and result["conditions"]["routing"] == "zipf:1.1"
    assert result["conditions"]["settings"]["K3FUSE_W4A16_CUTE_INT4"] == "0"
    assert result["distinct_experts"]["1"]["mean"] == 4  # one token: its top_k
    assert 4 <= result["distinct_experts"]["8"]["min"] <= result["distinct_experts"]["8"]["max"] <= 16
    assert result["weight_read_floor"]["8"]["experts_touched"] == result["distinct_experts"]["8"]["mean"]
    assert all(r["rel_err_vs_stock"] < 1e-4 for r in result["arms"]["k3fuse"]["rows"])
    assert result["arms"]["k3fuse"]["error"] is None and result["arms"]["k3fuse"]["fallbacks"] == {}


def test_the_floor_is_the_bytes_at_the_cards_nominal_bandwidth(capsys):
    """docs/perf.md, Floors: the bytes divided by the card's nominal HBM bandwidth (found by its device name),
    never by the copy rate the run measured; a card not listed has no floor and keeps its bytes; the table says
    what the floor divides by and prints the measured read beside it."""
    from k3fuse.tools.bench.report import merge, nominal_bandwidth, print_tables
    from k3fuse.tools.bench.runner import BenchConfig

    assert nominal_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert nominal_bandwidth("NVIDIA H200") == nominal_bandwidth("NVIDIA H200 NVL") == 4.8e12
    assert nominal_bandwidth("NVIDIA H100 PCIe") == 2.0e12 and nominal_bandwidth("NVIDIA H100 NVL") == 3.9e12
    assert nominal_bandwidth("NVIDIA GH200 480GB") is None and nominal_bandwidth(None) is None
    floor = {1: {"dense_bytes": 1.5e9, "expert_bytes_touched": 5e7, "experts_touched": 16.0,
                 "state_bytes_read_write": 1.3e7}}
    report = {"arms": {}, "floor": floor, "model": {}, "gpu": "NVIDIA H100 80GB HBM3",
              "copy_bandwidth_Bps": 2.8e12, "read_bandwidth_Bps": 3.2e12}
    f = merge(BenchConfig(device="cpu"), [report])["weight_read_floor"][1]
    assert f["us"] == pytest.approx(1.55e9 / 3.35e12 * 1e6)
    assert f["us_with_state"] == pytest.approx(1.563e9 / 3.35e12 * 1e6)
    unknown = merge(BenchConfig(device="cpu"), [{**report, "gpu": "NVIDIA A100-SXM4-80GB"}])["weight_read_floor"][1]
    assert unknown["us"] is None and unknown["bytes"] == 1.55e9

    conditions = {"preset": "k3", "overrides": {}, "layers": 1, "residual": "plain", "tp": 1, "device": "cuda",
                  "steps_per_graph": 4, "replays": 10, "gpu": "NVIDIA H100 80GB HBM3", "nominal_bandwidth_TBps": 3.35,
                  "read_bandwidth_TBps": 3.2, "copy_bandwidth_TBps": 2.8}
    print_tables({"conditions": conditions, "model": {}, "arms": {}, "weight_read_floor": {1: f}})
    out = " ".join(capsys.readouterr().out.split())
    assert ("floor: bytes at the NVIDIA H100 80GB HBM3's nominal 3.35 TB/s; a read-only kernel measured 3.2 TB/s "
            "here (a copy 2.8)") in out


def test_tables_print_when_every_arm_failed(capsys):
    from k3fuse.tools.bench.report import print_tables

    result = {"conditions": {"preset": "k3", "overrides": {}, "layers": 1, "residual": "plain", "tp": 1,
                             "device": "cuda", "steps_per_graph": 10, "replays": 20, "routing": "uniform"},
              "model": {"moe_inter": 3072, "expert_format": "mxfp4"}, "weight_read_floor": {},
              "arms": {"k3fuse": {"rows": [], "error": "OutOfMemoryError: CUDA out of memory", "compile_s": 0.0}}}
    print_tables(result)
    out = capsys.readouterr().out
    assert "mxfp4 experts" in out and "k3fuse (error)" in out


def test_the_layer_report_names_the_w4a16_launch_at_each_token_count(capsys):
    """The K3 preset's 4-bit experts at TP 2 (I = 1536 a rank): per token count, the CuTe launch the op takes
    (W4A16Launch.for_call over the model's block-ordered tables), printed under the latency table; bf16
    experts have none."""
    import dataclasses

    pytest.importorskip("triton")
    from k3fuse.kernels.lib.composite.routed_experts_w4a16 import W4A16Launch
    from k3fuse.model import get_config
    from k3fuse.tools.bench.report import print_tables
    from k3fuse.tools.bench.runner import w4a16_launches

    cfg = get_config("k3")
    launches = w4a16_launches(cfg, 2, (1, 8, 64))
    assert launches[1]["layout"] == "blocks"  # the k3 preset's experts are held in block order
    assert launches[1]["config"] == dataclasses.asdict(
        W4A16Launch.for_call(cfg.expert_format, 1, cfg.n_experts, 1536, cfg.latent, cfg.top_k, "blocks"))
    assert launches[1]["config"]["split"] == 1 and launches[1]["config"]["blocked"]  # measured faster unsplit
    assert w4a16_launches(get_config("k3_moe_inter128"), 1, (1,)) is None  # bf16 experts
    result = {"conditions": {"preset": "k3", "overrides": {}, "layers": 1, "residual": "plain", "tp": 2,
                             "device": "cuda", "steps_per_graph": 10, "replays": 20, "routing": "uniform"},
              "model": {"moe_inter": 3072, "expert_format": "mxfp4"}, "weight_read_floor": {}, "arms": {},
              "w4a16_launch": launches}
    print_tables(result)
    out = " ".join(capsys.readouterr().out.split())  # the console wraps long lines
    assert "launch over blocks tables" in out and ("T=1 pairwise, split 1, 1 row tiles a down CTA; T=8 grouped, "
                                                   "split 1, 4 row tiles a down CTA; T=64 grouped, split 1, 8") in out


def test_the_gemm_sweep_keeps_the_tuned_entries_of_sites_it_did_not_sweep():
    """bench/sweep_decode_gemm.py --sites sweeps a few K3 sites (the TP 1 q/k/v/g projection, say):
    its --emit replaces those (N, K) shapes' entries in splitk_tuned.py, keeps every other, and the
    file it writes is the table."""
    from bench import sweep_decode_gemm as sweep

    from k3fuse.kernels.lib.triton.splitk_tuned import TUNED
    from k3fuse.model.shapes import gemm_site

    _, n, k, _ = gemm_site("qkvg_tp1")
    new = {(n, k, bm): {"BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 1, "num_warps": 4, "num_stages": 5}
           for bm in (16, 32, 64)}
    old_key = next(iter(TUNED))
    table = sweep.merged({**TUNED, (n, k, 16): {"stale": True}}, new)
    assert table[(n, k, 16)] == new[(n, k, 16)] and table[old_key] == TUNED[old_key]
    assert len(table) == len(TUNED) + 3
    written = {}
    exec(sweep.tuned_source(table), written)
    assert written["TUNED"] == table
