"""A .pt2 from anyone: `k3fuse apply` runs no code from it and refuses a damaged one (issue 48 item 1,
issue 53 item 4).

Every forged archive carries a payload that writes a marker file when something executes it: a
pickle in the sample inputs (torch retries them with weights_only=False), a weight or constant
marked use_pickle, an "opaque object" constant (pickle.loads), a symbolic shape expression (sympy
parses it with eval), an operator target that resolves to os.system, an AOTInductor library, an
older-format pickle. The real command in a subprocess must exit 2 with one line naming the entry,
write nothing, and leave no marker; `k3fuse.offline.load_program` must raise ProgramRefused the same
way. Good programs (dynamic shapes, control flow, the K3 reference model with its DecodeState inputs,
a rewritten program) still load.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_helpers import k3fuse, one_line_error
from pt2_forge import EVIL, corrupt_weight

from k3fuse.archive import ProgramRefused, _expr_problem
from k3fuse.offline import load_program

pytestmark = pytest.mark.slow


class Program(torch.nn.Module):
    """A weight, a buffer, a lifted tensor constant and a dynamic token dimension: every kind of
    entry a payload can hide in."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(16, 16, generator=g))
        self.register_buffer("scale", torch.rand(16, generator=g) + 0.5)
        self.offset = torch.randn(16, generator=g)

    def forward(self, h):
        return h + torch.tanh(torch.nn.functional.linear(h, self.w)) * self.scale + self.offset


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("good") / "good.pt2"
    tokens = torch.export.Dim("tokens", min=1, max=64)
    torch.export.save(torch.export.export(Program(), (torch.randn(4, 16),), dynamic_shapes=({0: tokens},)), path)
    return path


@pytest.mark.parametrize("kind", sorted(EVIL))
def test_apply_runs_no_code_from_the_file(tmp_path, good, kind):
    forge, entry = EVIL[kind]
    marker = tmp_path / "payload_ran"
    evil = forge(good, tmp_path / "evil.pt2", marker)
    res = k3fuse("apply", "evil.pt2", "-o", "out.pt2", "--log", "rw.jsonl", cwd=tmp_path)
    assert not marker.exists(), f"the payload in {entry} ran"
    one_line_error(res, "refused evil.pt2", f"entry {entry}")
    assert not (tmp_path / "out.pt2").exists() and not (tmp_path / "rw.jsonl").exists()
    with pytest.raises(ProgramRefused) as err:
        load_program(evil)
    assert err.value.entry == entry and not marker.exists()


def test_a_corrupt_archive_is_refused_never_rewritten(tmp_path, good):
    """Issue 53.4: 5000 zeroed bytes inside a weight (the zip CRC fails) were carried into the output."""
    corrupt_weight(good, tmp_path / "bad.pt2", zeroed=40)  # the test program's weight is 1 KiB
    res = k3fuse("apply", "bad.pt2", "-o", "out.pt2", cwd=tmp_path)
    one_line_error(res, "refused bad.pt2", "entry data/weights/weight_0", "CRC")
    assert not (tmp_path / "out.pt2").exists()


def test_a_corrupt_k3_archive_is_refused(tmp_path):
    """The issue's own case: 5000 zeroed bytes inside a weight member of the K3 reference model."""
    code = ("import torch, k3fuse\nfrom k3fuse.model import K3DecodeStack, get_config\n"
            "m = K3DecodeStack(get_config('tiny', n_layers=1), seed=0).eval()\n"
            "x = torch.randn(2, m.config.hidden)\n"
            "k3fuse.offline.save_program(torch.export.export(m, (x, m.init_state(2))), 'k3.pt2')\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300, cwd=tmp_path, capture_output=True)
    corrupt_weight(tmp_path / "k3.pt2", tmp_path / "bad.pt2", zeroed=5000)
    res = k3fuse("apply", "bad.pt2", "-o", "out.pt2", cwd=tmp_path)
    one_line_error(res, "refused bad.pt2", "entry data/weights/weight_", "CRC")
    assert not (tmp_path / "out.pt2").exists()


def test_good_programs_still_load(tmp_path, good):
    class Branchy(torch.nn.Module):
        def forward(self, x):
            return torch.cond(x.sum() > 0, lambda x: x.sin(), lambda x: x.cos(), (x,))

    class Sizes(torch.nn.Module):
        def forward(self, x, y):
            n = x.shape[0]
            return x.reshape(-1, 2).sum() + torch.cat([x, y])[: n // 2 + 1].sum() + x.mean() * n ** 2

    torch.export.save(torch.export.export(Branchy(), (torch.randn(4),)), tmp_path / "cond.pt2")
    dims = ({0: torch.export.Dim("a", min=2, max=64)}, {0: torch.export.Dim("b", min=2, max=30)})
    torch.export.save(torch.export.export(Sizes(), (torch.randn(4, 4), torch.randn(6, 4)), dynamic_shapes=dims),
                      tmp_path / "sizes.pt2")
    for name in ("cond.pt2", "sizes.pt2"):
        ep = load_program(tmp_path / name)
        assert len(list(ep.graph.nodes)) > 2
    ep = load_program(good)
    x = torch.randn(5, 16)
    torch.testing.assert_close(ep.module()(x), Program()(x))


def test_a_rewritten_program_reloads_through_the_command(tmp_path, good):
    res = k3fuse("apply", str(good), "-o", "once.pt2", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    res = k3fuse("apply", "once.pt2", "-o", "twice.pt2", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert load_program(tmp_path / "twice.pt2") is not None


@pytest.mark.parametrize("expr", [
    "Symbol('s77', positive=True, integer=True)",
    "Add(FloorDiv(Symbol('s0', positive=True, integer=True), Integer(2)), Integer(1))",
    "Pow(Symbol('s0', positive=True, integer=True), Integer(2))",
    "Mul(Integer(-3), Symbol('u1', integer=True))",
    "StrictLessThan(Integer(0), Symbol('s3', integer=True))",
    "Float('1.5', precision=53)",
    "-oo",
    "s0 + 2*s1",
])
def test_shape_expressions_torch_writes_are_accepted(expr):
    assert _expr_problem(expr) is None


@pytest.mark.parametrize("expr,why", [
    ("__import__('os').system('true')", "not a sympy constructor"),
    ("Symbol('s0').__class__", "Attribute"),
    ("lambdify(Symbol('x'), Symbol('x'))", "calling 'lambdify'"),
    ("__builtins__", "naming '__builtins__'"),
    ("Symbol('s0; import os')", "malformed Symbol name"),
    ("Pow(Integer(9), Integer(999999999))", "exponent"),
    ("LShift(Integer(1), Integer(10**18))", "exponent"),
    ("Pow(Pow(Symbol('s0'), Integer(64)), Integer(64))", "power inside a power"),
    ("Float('1.0', precision=100000000)", "precision"),
    ("Symbol('s0', **{'positive': True})", "keyword None"),
    ("[" * 300 + "]" * 300, "does not parse"),
    ("x" * 20000, "characters"),
])
def test_shape_expressions_that_could_run_code_or_never_end_are_refused(expr, why):
    problem = _expr_problem(expr)
    assert problem is not None and why in problem, problem
