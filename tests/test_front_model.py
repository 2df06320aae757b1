"""The MoE-front projection model (bench/front_model.py) and `bench_moe_front.py --project`, on CPU.

* the bytes per rank are the shape table's (k3fuse.model.shapes), the exchange T x (E + L) / W fp32
  to each of W - 1 peers;
* the least-squares fit recovers known parameters exactly from noiseless points, and with one
  byte count (today's as-tp 2 only) falls back to the stated assumption (copy bandwidth);
* TP 1 is the replicated path (the rule does not fire there); the saving at 1 token grows with TP;
* `--project` on the real one-GPU JSON prints the table the model computes and says there is no
  TP 2 measurement; with a world-2 JSON it compares against it instead.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from k3fuse.model.shapes import gemm_site

from bench import front_model as M  # the model belongs to one benchmark, not the installed package

ROOT = Path(__file__).resolve().parents[1]
SLICE_JSON = ROOT / "bench" / "results" / "h200_moe_front_slice.json"
SHAPE = M.FrontShape()


def test_bytes_per_rank_are_the_shape_tables():
    router, down = gemm_site("router"), gemm_site("w_down")
    assert (SHAPE.E, SHAPE.L, SHAPE.H) == (router.n, down.n, router.k) and down.k == router.k
    replicated = router.n * router.k * 2 + down.n * down.k * 2        # bf16 W_r and W_down
    assert SHAPE.weight_bytes(1) == replicated == 64_225_280
    for W in (1, 2, 4, 8, 16):
        assert SHAPE.weight_bytes(W) * W == replicated
        assert SHAPE.rows(W) == router.n // W + down.n // W
        # each rank pushes its T x (E + L) / W fp32 results to each of its W - 1 peers
        assert SHAPE.push_bytes_per_peer(W, 1) == (router.n + down.n) // W * 4
        assert SHAPE.pushed_bytes(W, 64) == (W - 1) * 64 * (router.n + down.n) // W * 4
    assert SHAPE.push_bytes_per_peer(2, 1) == 8960      # "9 KB at one token" (kernel docstring)
    assert SHAPE.pushed_bytes(1, 64) == 0
    assert SHAPE.activation_bytes(8) == 8 * router.k * 2
    # the real op gathers W slots; a one-GPU slice only its own
    assert SHAPE.gather_bytes(4, 8, 4) == 4 * SHAPE.gather_bytes(4, 8, 1)
    assert SHAPE.stock_bytes(1) - SHAPE.replicated_bytes(1) == router.n * router.k * 8 + router.k * 8
    with pytest.raises(ValueError, match="not divisible by TP 3"):
        SHAPE.rows(3)


def test_fit_recovers_known_parameters_exactly():
    fixed, gbps = 3.7, 3500.0
    pts = [(b, fixed + b / (gbps * 1e3)) for b in (SHAPE.push_gemm_bytes(W, 8) for W in (2, 4, 8, 16))]
    fit = M.fit_line(pts, prior_GBps=4000.0)       # the prior is ignored with several byte counts
    assert fit.fixed_us == pytest.approx(fixed, rel=1e-12)
    assert fit.GBps == pytest.approx(gbps, rel=1e-12)
    assert fit.n_points == 4 and fit.method.startswith("least squares")
    assert all(fit.us(b) == pytest.approx(t, rel=1e-12) for b, t in pts)


def test_fit_is_least_squares_on_noisy_points():
    pts = [(1e6, 2.0), (2e6, 3.2), (3e6, 3.8)]         # slope 0.9 us/MB, intercept 1.2 us
    fit = M.fit_line(pts)
    assert fit.fixed_us == pytest.approx(1.2) and fit.GBps == pytest.approx(1e6 / 0.9 / 1e3)


def test_one_byte_count_assumes_the_copy_bandwidth():
    b, t = SHAPE.push_gemm_bytes(2, 1), 11.28
    fit = M.fit_line([(b, t)], prior_GBps=4028.0)
    assert fit.GBps == 4028.0 and fit.fixed_us == pytest.approx(t - b / 4028e3)
    assert fit.us(b) == pytest.approx(t)
    assert "bandwidth assumed = copy bandwidth" in fit.method
    # two runs at the same byte count: still one byte count, the fixed cost is their mean residual
    two = M.fit_line([(b, 11.0), (b, 12.0)], prior_GBps=4028.0)
    assert two.fixed_us == pytest.approx(11.5 - b / 4028e3) and two.n_points == 2
    with pytest.raises(ValueError, match="pass prior_GBps"):
        M.fit_line([(b, t)])
    # a slope the noise made non-positive falls back to the assumption and says so
    back = M.fit_line([(1e6, 5.0), (2e6, 4.0)], prior_GBps=4000.0)
    assert back.GBps == 4000.0 and "not positive" in back.method


def _synthetic_runs(as_tps=(2, 4, 8), fixed=3.5, gbps=3600.0, gather=1.4, copy=4000.0, tp2=None):
    slices = []
    for T in (1, 8, 64):
        for n in as_tps:
            push = fixed + T * 0.01 + SHAPE.push_gemm_bytes(n, T) / (gbps * 1e3)
            sl = push + gather + SHAPE.gather_bytes(n, T, 1) / (copy * 1e3)
            slices.append(M.SlicePoint(n, T, sl, push, "synthetic"))
    per_T = {1: 19.0, 8: 23.0, 64: 29.0}
    return M.Runs(SHAPE, copy, {T: 2 * v for T, v in per_T.items()}, per_T, tuple(slices), {}, tp2 or {},
                  ("synthetic",), ("tp2",) if tp2 else ())


def test_fit_params_recovers_push_and_gather_from_slices():
    runs = _synthetic_runs()
    p = M.fit_params(runs)
    for T in (1, 8, 64):
        assert p.push[T].fixed_us == pytest.approx(3.5 + T * 0.01, rel=1e-9)
        assert p.push[T].GBps == pytest.approx(3600.0, rel=1e-9)
        assert p.gather_fixed_us[T] == pytest.approx(1.4, rel=1e-9)
    checks = M.compute_checks(p, runs)
    assert len(checks) == 9 and all(abs(c.error) < 1e-9 for c in checks)
    # every parameter says where it comes from, and the assumed ones say "assumed"
    assert set(p.provenance) >= {"copy_GBps", "push", "gather_fixed_us", "stock_us", "replicated_us",
                                 "nvlink_GBps", "nvlink_latency_us", "push_overlap", "bracket_us"}
    assert all(p.provenance[k].startswith("assumed") for k in ("nvlink_GBps", "nvlink_latency_us", "push_overlap"))
    with pytest.raises(ValueError, match="without provenance"):
        M.FrontParams(SHAPE, 4000.0, p.push, p.gather_fixed_us, p.stock_us, p.replicated_us, provenance={})


def test_tp1_is_the_replicated_path():
    p = M.fit_params(M.load_runs([str(SLICE_JSON)]))
    for T in (1, 8, 64):
        r = M.project(p, 1, T)
        assert r.sharded_us == r.replicated_us == p.replicated_us[T]
        assert r.exchange_us == 0.0 and r.saving_us == 0.0 and r.push_bytes_per_peer == 0
        assert r.weight_bytes == SHAPE.weight_bytes(1)
    assert M.exchange_us(p, 1, 64) == 0.0


def test_exchange_is_latency_plus_pushes_over_nvlink():
    p = M.fit_params(_synthetic_runs())
    for W in (2, 8):
        want = p.nvlink_latency_us + (W - 1) * 64 * SHAPE.rows(W) * 4 / (p.nvlink_GBps * 1e3)
        assert M.exchange_us(p, W, 64) == pytest.approx(want)
    r = M.project(p, 4, 8)
    assert r.sharded_us == pytest.approx(r.compute_us + r.exchange_us)
    assert r.saving_us == pytest.approx(r.replicated_us - r.sharded_us)


@pytest.mark.parametrize("source", ["real", "synthetic"])
def test_saving_grows_with_tp_at_one_token(source):
    runs = M.load_runs([str(SLICE_JSON)]) if source == "real" else _synthetic_runs()
    p = M.fit_params(runs)
    savings = [M.project(p, W, 1).saving_us for W in (1, 2, 4, 8, 16)]
    assert savings[0] == 0.0
    assert all(b > a for a, b in zip(savings, savings[1:])), savings


def test_legacy_json_reads_as_tp_2_from_the_floors():
    runs = M.load_runs([str(SLICE_JSON)])
    assert {s.as_tp for s in runs.slices} == {2}
    assert sorted(s.T for s in runs.slices) == [1, 2, 4, 8, 16, 32, 64]
    assert runs.tp2_us == {} and runs.tp2_sources == ()
    p = M.fit_params(runs)
    # one as-tp: every per-T fit took the copy bandwidth measured in that run
    assert all(f.GBps == pytest.approx(runs.copy_GBps) for f in p.push.values())
    one = next(s for s in runs.slices if s.T == 1)
    assert M.compute_us(p, 2, 1, slots=1) == pytest.approx(one.slice_us)


def _run_project(*paths, out):
    proc = subprocess.run([sys.executable, "-m", "bench.bench_moe_front", "--project", *map(str, paths),
                           "--json", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text())


def _table_row(text, W, T):
    m = re.search(rf"^\| {W} \| {T} \| (.*)$", text, re.M)
    assert m, f"no row TP {W} tokens {T}"
    return [c.strip().strip("*") for c in m.group(1).rstrip(" |").split("|")]


def test_project_on_the_real_json_prints_the_models_table(tmp_path):
    text, js = _run_project(SLICE_JSON, out=tmp_path / "proj.json")
    assert "No TP 2 measurement" in text and js["tp2_measurement"] is False and js["tp2_checks"] == []
    p = M.fit_params(M.load_runs([str(SLICE_JSON)]))
    for W in M.TABLE_TP:
        for T in M.TABLE_TOKENS:
            cells = _table_row(text, W, T)
            r = M.project(p, W, T)
            assert cells[6] == f"{r.sharded_us:.1f}" and cells[7] == f"{r.saving_us:+.1f}"
            assert cells[3] == f"{r.replicated_us:.1f}" and cells[0] == f"{r.weight_bytes / 1e6:.1f}"
            assert cells[-1] == ("declines (below)" if W == 16 else "covers")
    assert len(js["projection"]) == len(M.TABLE_TP) * len(M.TABLE_TOKENS)
    assert "world_size 16 outside [1, 8]" in text   # the kernel's own reason at TP 16
    # the bracket (the fused-AR overhead, docs/perf/2026-11-30-decode-gemm-fused-ar.md section 2) is in the table
    assert set(js["params"]["bracket_us"]) >= {"1", "8", "64"}
    tp2_t1 = next(r for r in js["projection"] if r["W"] == 2 and r["T"] == 1)
    assert tp2_t1["bracket_sharded_us"] == pytest.approx(tp2_t1["compute_us"] + js["params"]["bracket_us"]["1"])
    # in-fit slices reproduce exactly; the world-1 op over all rows is an out-of-fit check
    checks = js["compute_checks"]
    assert all(abs(c["error"]) < 1e-12 for c in checks if c["what"] == "slice")
    assert {c["W"] for c in checks if c["what"] == "world-1 op"} == {1}
    assert any(c["what"].startswith("triton.splitk router") for c in js["splitk_checks"])


def _bench_json(path, world, rows):
    path.write_text(json.dumps({"conditions": {"world": world, "copy_GBps": 4000.0}, "E": SHAPE.E, "L": SHAPE.L,
                                "H": SHAPE.H, "as_tp": [2, 4, 16] if world == 1 else [], "rows": rows}))
    return path


def test_project_reads_several_as_tp_and_compares_with_a_tp2_run(tmp_path):
    runs = _synthetic_runs(as_tps=(2, 4))
    rows1, rows2 = [], []
    for T in (1, 8, 64):
        sl = {str(s.as_tp): {"slice": s.slice_us, "slice_push_only": s.push_only_us, "slice_no_pdl": None,
                             "slice_stacked_gemm": None, "floor_slice": 1.0}
              for s in runs.slices if s.T == T}
        sl["16"] = {"skipped": "no split-K tile"}
        rows1.append({"M": T, "stock": runs.stock_us[T], "gemv": runs.replicated_us[T], "sharded": 20.0,
                      "floor_replicated": 16.0, "floor_sharded": 16.0, "slices": sl, **sl["2"]})
        rows2.append({"M": T, "stock": 1.0, "gemv": 1.0, "sharded": 15.0 + T / 64, "floor_replicated": 16.0,
                      "floor_sharded": 8.0})
    one = _bench_json(tmp_path / "one.json", 1, rows1)
    two = _bench_json(tmp_path / "two.json", 2, rows2)
    got = M.load_runs([str(one), str(two)])
    assert {s.as_tp for s in got.slices} == {2, 4} and got.tp2_us == {1: 15.0 + 1 / 64, 8: 15.125, 64: 16.0}
    text, js = _run_project(one, two, out=tmp_path / "proj.json")
    assert "No TP 2 measurement" not in text and js["tp2_measurement"] is True
    p = M.fit_params(got)
    assert p.push[8].GBps == pytest.approx(3600.0, rel=1e-9)      # both as-tp points fitted, not the prior
    for c in js["tp2_checks"]:
        assert c["W"] == 2 and c["predicted_us"] == pytest.approx(M.project(p, 2, c["T"]).sharded_us)
        assert c["measured_us"] == got.tp2_us[c["T"]]
    assert "TP 2 on two GPUs, measured against the projection" in text


def test_bench_times_every_as_tp_and_skips_what_the_kernel_declines(monkeypatch, tmp_path):
    """The benchmark's per-as-tp plumbing on CPU (timings faked, the op the CPU reference): every N
    gets its keys, TP 16 is skipped with the kernel's reason, and the JSON rows load as slices."""
    import types

    import torch

    pytest.importorskip("triton")
    from bench import bench_moe_front
    from k3fuse.kernels import collective
    from k3fuse.kernels.lib.triton import moe_gather as K
    from k3fuse.kernels.lib.triton import splitk_gemm

    fills = []
    data = types.SimpleNamespace(view=lambda dt: types.SimpleNamespace(fill_=fills.append))
    monkeypatch.setattr(collective, "get_workspace", lambda *a, **k: types.SimpleNamespace(
        ptrs=None, gen=None, datas=[data]))
    monkeypatch.setattr(splitk_gemm, "run", lambda *a, **k: None)
    monkeypatch.setattr(collective, "protocol", lambda: "lamport")
    pdl_seen = []

    def fake_replay(fn, steps):
        fn(0)
        pdl_seen.append(K.USE_PDL)
        return 10.0 + len(pdl_seen)

    monkeypatch.setattr(bench_moe_front, "graph_replay_us", fake_replay)
    monkeypatch.setattr(bench_moe_front, "COPIES", 1)
    g = torch.Generator().manual_seed(0)
    wrs = [torch.randn(bench_moe_front.E, bench_moe_front.H, generator=g).bfloat16()]
    wds = [torch.randn(bench_moe_front.L, bench_moe_front.H, generator=g).bfloat16()]
    xs = [torch.randn(1, bench_moe_front.H, generator=g).bfloat16()]
    floor = lambda rows: rows * bench_moe_front.H * 2 / 4e12 * 1e6
    got = {str(n): bench_moe_front._time_slice(n, 1, xs, wrs, wds, "", torch.device("cpu"), floor)
           for n in (2, 4, 8, 16)}
    assert "router slice 56" in got["16"]["skipped"] and set(got["16"]) == {"skipped"}
    keys = {"floor_slice", "slice", "slice_no_pdl", "slice_push_only", "slice_stacked_gemm"}
    for n in ("2", "4", "8"):
        assert keys <= set(got[n]), got[n]
        assert got[n]["floor_slice"] == pytest.approx(floor((bench_moe_front.E + bench_moe_front.L) // int(n)))
        assert "errors" not in got[n]            # every side arm ran (the CPU reference serves all)
    assert pdl_seen.count(False) == 3 and K.USE_PDL is True      # the no-PDL arm only, then restored
    assert len(fills) == 3                                       # the workspace back to the sentinel each time
    rows = bench_moe_front.E + bench_moe_front.L
    row = {"M": 1, "stock": 38.0, "gemv": 19.0, "sharded": 21.0, "floor_replicated": floor(rows),
           "floor_sharded": floor(rows), "slices": got, **{k: got["2"][k] for k in keys}}
    path = _bench_json(tmp_path / "b.json", 1, [row])
    runs = M.load_runs([str(path)])
    assert sorted(s.as_tp for s in runs.slices) == [2, 4, 8]
    # the legacy reader (top-level keys only) still finds the first N
    del row["slices"]
    assert [s.as_tp for s in M.load_runs([str(_bench_json(tmp_path / "old.json", 1, [row]))]).slices] == [2]
