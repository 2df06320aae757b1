"""torch.compile door: backend="k3fuse" with Inductor and eager compilers, found via the entry point."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from engine_helpers import LINEAR_RESIDUAL, Capture, LinearResidualRule, ResidualStack

import k3fuse
from k3fuse.backend import BackendOptionError, k3fuse_backend
from k3fuse.log import RewriteLog


def compile_run(model, h, **options):
    torch._dynamo.reset()
    before, after = Capture("before"), Capture("after")
    log = RewriteLog()
    options = {"rules": [before, LinearResidualRule(), after], "log": log, **options}
    with torch.no_grad():
        out = torch.compile(model, backend="k3fuse", options=options)(h)
    return out, log, (before.counts or [None])[-1], (after.counts or [None])[-1]


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_backend_rewrites_and_matches_eager(compiler):
    model, h = ResidualStack(layers=3, bias=True).eval(), torch.randn(4, 16)
    out, log, before, after = compile_run(model, h, compiler=compiler)
    assert before["aten::mm"] == 3 and before[LINEAR_RESIDUAL] == 0  # as the rules see it: addmm split
    assert after[LINEAR_RESIDUAL] == 3 and after["aten::mm"] == 0 and after["aten::addmm"] == 0
    assert log.applied("linear_residual") == 3
    assert {e.door for e in log.select("linear_residual")} == {f"backend.{compiler}"}
    assert {e.variant for e in log.select(decision="applied")} == {"bias"}
    with torch.no_grad():
        torch.testing.assert_close(out, model(h))


def test_backend_3d_input_and_log_file(tmp_path):
    model, h = ResidualStack(layers=2).eval(), torch.randn(2, 3, 16)
    path = tmp_path / "rw.jsonl"
    out, _, _, after = compile_run(model, h, compiler="eager", log=str(path), context={"tokens": (1, 8)})
    assert after[LINEAR_RESIDUAL] == 2
    events = [json.loads(x) for x in path.read_text().splitlines()]
    assert sum(e["decision"] == "applied" for e in events) == 2
    assert all(e["source"] and "engine_helpers.py" in e["source"] for e in events if e["decision"] == "applied")
    with torch.no_grad():
        torch.testing.assert_close(out, model(h))


def test_backend_kill_switch():
    model, h = ResidualStack(layers=2).eval(), torch.randn(4, 16)
    with k3fuse.disable():
        out, log, before, _ = compile_run(model, h, compiler="eager")
    assert before is None and log.applied() == 0 and {e.guard for e in log} == {"disabled"}
    with torch.no_grad():
        torch.testing.assert_close(out, model(h))


def test_backend_option_errors():
    gm = torch.fx.symbolic_trace(torch.nn.Identity())
    with pytest.raises(BackendOptionError, match="unknown k3fuse backend option"):
        k3fuse_backend(gm, [torch.randn(2)], {"compilr": "eager"})
    with pytest.raises(BackendOptionError, match="compiler must be one of"):
        k3fuse_backend(gm, [torch.randn(2)], {"compiler": "tvm"})
    with pytest.raises(k3fuse.context.ContextError, match="bad token range"):
        k3fuse_backend(gm, [torch.randn(2)], {"context": {"tokens": (0, 4)}})


def test_backend_found_by_name_without_importing_k3fuse(tmp_path):
    script = textwrap.dedent("""
        import sys, torch
        assert "k3fuse" not in sys.modules
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
        x = torch.randn(2, 8)
        with torch.no_grad():
            out = torch.compile(model, backend="k3fuse", options={"compiler": "eager"})(x)
            torch.testing.assert_close(out, model(x))
        assert "k3fuse.backend" in sys.modules
        print("ok")
    """)
    env = {**os.environ, "K3FUSE_LOG": str(tmp_path / "sub.jsonl")}
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().endswith("ok")
    events = [json.loads(x) for x in (tmp_path / "sub.jsonl").read_text().splitlines()]
    from k3fuse.pipeline import all_rules
    assert {e["door"] for e in events} == {"backend.eager"}
    # every K3 rule decided something (weight_prefetch: refused, off by default)
    assert {e["rule"] for e in events} == {r.name for r in all_rules()}
