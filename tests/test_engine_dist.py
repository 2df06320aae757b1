"""Context against a live process group (2 gloo ranks): built with the rewrite settings the ranks agreed;
`k3fuse apply --tp 2`."""
from __future__ import annotations

import json

import pytest
import torch

from k3fuse.dist import launch

pytestmark = pytest.mark.slow


def _worker(rank: int, world_size: int, out_dir: str) -> dict:
    import torch.distributed as dist

    from k3fuse.context import KILL_SWITCH, ContextError, DecodeContext
    from k3fuse.model import K3DecodeStack, get_config

    out: dict = {}
    ctx = DecodeContext.from_process_group()
    agreed = dict(ctx.agreed_settings)
    out["ctx"] = (ctx.tp_size, ctx.rank, ctx.group_name == dist.group.WORLD.group_name, agreed[KILL_SWITCH],
                  agreed["K3FUSE_RULES"])
    for kwargs in ({"tp_size": 4},):
        try:
            DecodeContext.from_process_group(**kwargs)
        except ContextError as exc:
            out["from_pg_mismatch"] = str(exc)
    try:
        DecodeContext(tp_size=4, rank=rank, group_name=dist.group.WORLD.group_name)
    except ContextError as exc:
        out["ctor_mismatch"] = str(exc)
    model = K3DecodeStack(get_config("tiny", n_layers=1), tp_size=world_size, rank=rank, seed=0).eval()
    x = torch.randn(2, model.config.hidden)
    ep = torch.export.export(model, (x, model.init_state(2)))
    torch.export.save(ep, f"{out_dir}/tp2_rank{rank}.pt2")
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("dist")
    return launch(_worker, 2, backend="gloo", args=(str(out_dir),), timeout_s=300), out_dir


def test_context_from_process_group(ranks):
    results, _ = ranks
    for rank, r in enumerate(results):
        assert r["ctx"] == (2, rank, True, False, "")


def test_tp_mismatch_with_process_group_is_a_clear_error(ranks):
    results, _ = ranks
    for r in results:
        assert r["from_pg_mismatch"] == "tp_size=4 does not match the process group size 2"
        assert "tp_size=4 does not match process group" in r["ctor_mismatch"] and "of size 2" in r["ctor_mismatch"]


def test_cli_apply_tp2_takes_group_from_graph(ranks, tmp_path, capsys):
    from k3fuse.tools.cli import main
    from k3fuse.pipeline import default_rules

    _, out_dir = ranks
    log = tmp_path / "apply.jsonl"
    assert main(["apply", str(out_dir / "tp2_rank0.pt2"), "-o", str(tmp_path / "out.pt2"), "--tp", "2",
                 "--tokens", "1-64", "--log", str(log)]) == 0
    events = [json.loads(x) for x in log.read_text().splitlines()]
    applied = {e["rule"] for e in events if e["decision"] == "applied"}
    assert applied == {r.name for r in default_rules()} - {"mla_decode"}  # the tiny KDA + MoE stack has no MLA
    rewritten = torch.export.load(tmp_path / "out.pt2")
    assert any(str(n.target).startswith("k3fuse.") for n in rewritten.graph.nodes)
    # an explicit group name that is not the graph's: refused up front, naming the graph's groups
    assert main(["apply", str(out_dir / "tp2_rank0.pt2"), "-o", str(tmp_path / "x.pt2"), "--tp", "2",
                 "--group-name", "not_in_graph"]) == 2
    err = capsys.readouterr().err
    assert "--group-name 'not_in_graph' is not a group the graph's collectives use; they use '0'" in err
    assert not (tmp_path / "x.pt2").exists()
