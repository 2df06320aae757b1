"""Offline door: ExportedProgram -> rewritten ExportedProgram that runs, saves, loads and re-exports."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from engine_helpers import LINEAR_RESIDUAL, LinearResidualRule, ResidualStack, op_counts

import k3fuse
from k3fuse.offline import static_placeholder_names


@pytest.fixture(scope="module")
def exported():
    model = ResidualStack(layers=3).eval()
    h = torch.randn(4, 16)
    return model, h, torch.export.export(model, (h,))


def test_apply_rewrites_every_site_and_keeps_outputs(exported):
    model, h, ep = exported
    before = op_counts(ep.run_decompositions(k3fuse.offline.decomposition_table()).graph)
    new_ep, log = k3fuse.apply(ep, k3fuse.DecodeContext(), rules=[LinearResidualRule()])
    after = op_counts(new_ep.graph)
    assert before["aten::mm"] == 3 and after["aten::mm"] == 0 and after[LINEAR_RESIDUAL] == 3
    assert log.applied("linear_residual") == 3 and log.events[0].door == "offline"
    assert all(e.source and "engine_helpers.py" in e.source for e in log.select(decision="applied"))
    torch.testing.assert_close(new_ep.module()(h), model(h))
    assert op_counts(ep.graph)[LINEAR_RESIDUAL] == 0  # the input program is untouched
    assert all("val" in n.meta for n in new_ep.graph.nodes if n.op != "output")


def test_save_load_and_reexport(exported, tmp_path):
    model, h, ep = exported
    new_ep, _ = k3fuse.apply(ep, rules=[LinearResidualRule()])
    path = tmp_path / "rw.pt2"
    torch.export.save(new_ep, path)
    loaded = torch.export.load(path)
    torch.testing.assert_close(loaded.module()(h), model(h))
    again = torch.export.export(loaded.module(), (h,))
    assert op_counts(again.graph)[LINEAR_RESIDUAL] == 3


class MutatedWeight(nn.Module):
    """A buffer the step mutates is decode state, not a weight: the rule must not treat it as static."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 16))
        self.register_buffer("state", torch.randn(16, 16))

    def forward(self, h):
        self.state.mul_(0.5)
        h = h + F.linear(torch.tanh(h), self.w)
        return h + F.linear(torch.tanh(h), self.state)


def test_statics_come_from_the_signature_minus_mutated_buffers():
    model = MutatedWeight()
    h = torch.randn(4, 16)
    ep = torch.export.export(model, (h,))
    assert static_placeholder_names(ep) == {"p_w"}
    expected = MutatedWeight()
    expected.load_state_dict(model.state_dict())
    new_ep, log = k3fuse.apply(ep, rules=[LinearResidualRule()])
    assert log.applied() == 1
    (rej,) = log.rejected("linear_residual")
    assert rej.guard == "static_weight" and rej.values["w"] == "mul"
    torch.testing.assert_close(new_ep.module()(h), expected(h))


def test_cli_apply_and_log(exported, tmp_path, monkeypatch, capsys):
    _, h, ep = exported
    monkeypatch.setattr("k3fuse.pipeline.all_rules", lambda: [LinearResidualRule()])  # the CLI's registry
    src, dst, logf = tmp_path / "in.pt2", tmp_path / "out.pt2", tmp_path / "log.jsonl"
    torch.export.save(ep, src)
    from k3fuse.tools.cli import main
    assert main(["apply", str(src), "-o", str(dst), "--tokens", "1-8", "--log", str(logf)]) == 0
    assert op_counts(torch.export.load(dst).graph)[LINEAR_RESIDUAL] == 3
    events = [json.loads(x) for x in logf.read_text().splitlines()]
    assert [e["decision"] for e in events] == ["applied"] * 3
    assert "linear_residual" in capsys.readouterr().out


def test_cli_rejects_bad_token_range(exported, tmp_path, capsys):
    # issue 11: a bad range is one line and exit 2 (was a ContextError traceback after loading)
    from k3fuse.tools.cli import main
    with pytest.raises(SystemExit) as exc:
        main(["apply", "x.pt2", "-o", "y.pt2", "--tokens", "a-b"])
    assert exc.value.code == 2
    _, _, ep = exported
    torch.export.save(ep, tmp_path / "in.pt2")
    with pytest.raises(SystemExit) as exc:
        main(["apply", str(tmp_path / "in.pt2"), "-o", str(tmp_path / "o.pt2"), "--tokens", "1-100"])
    assert exc.value.code == 2
    assert "bad token range 1-100" in capsys.readouterr().err
    assert not (tmp_path / "o.pt2").exists()


def test_cli_tp2_without_collectives_in_graph_is_a_clear_error(exported, tmp_path, capsys):
    # issue 11: --tp is checked against the graph (was: "--tp 2 needs --group-name: ... groups []")
    from k3fuse.tools.cli import main
    _, _, ep = exported
    torch.export.save(ep, tmp_path / "in.pt2")
    assert main(["apply", str(tmp_path / "in.pt2"), "-o", str(tmp_path / "o.pt2"), "--tp", "2"]) == 2
    assert "--tp 2 but the graph has no collectives" in capsys.readouterr().err
