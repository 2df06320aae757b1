"""`--tp` is checked against the group size the program records (issue 11, item 2).

A TP program's collectives are all-reduces, `all_reduce(t, "sum", group_name)`, which name their
group but not its size. `k3fuse.offline.save_program` (run on a rank, with the process group live)
records the size in each collective's node.meta["custom"], torch.export.save/load keep it, and
`k3fuse apply` reads it: a wrong `--tp` is one line and exit 2, a missing one is read from the
graph. A program saved by plain torch.export (nothing recorded) is rewritten for the `--tp` given,
and the summary says it could not be checked; the fused ops then check the live group at run time.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cli_helpers import AllReduceStep, digest, k3fuse, one_line_error

from k3fuse.offline import (GROUP_SIZE_KEY, collective_group_sizes, load_program, record_group_sizes,
                            strip_group_sizes)

pytestmark = pytest.mark.slow


def _export_worker(rank: int, world_size: int, out: str) -> dict:
    """Export the tiny K3 stack's TP shard; rank 0 saves it with k3fuse. Then call a fused op built
    for twice the live group's size, on the reference implementation and on the stock fallback."""
    import torch.distributed as dist

    import k3fuse.kernels  # noqa: F401  registers torch.ops.k3fuse.* (import k3fuse alone does not)
    from k3fuse import runtime
    from k3fuse.model import K3DecodeStack, get_config
    from k3fuse.offline import save_program

    model = K3DecodeStack(get_config("tiny", n_layers=1), tp_size=world_size, rank=rank, seed=0).eval()
    x = torch.randn(2, model.config.hidden)
    ep = torch.export.export(model, (x, model.init_state(2)))
    if rank == 0:
        save_program(ep, out)
    group = dist.group.WORLD.group_name
    args = (torch.randn(2, 8), torch.randn(16, 8), torch.randn(2, 16), None, group, 2 * world_size)
    try:
        torch.ops.k3fuse.gemm_ar_residual(*args)
        fused_error = None
    except ValueError as exc:
        fused_error = str(exc)
    try:
        with runtime.disable():  # the stock sequence checks the size too (it would skip no reduction)
            torch.ops.k3fuse.gemm_ar_residual(*args)
        stock_error = None
    except ValueError as exc:
        stock_error = str(exc)
    return {"group": group, "fused_error": fused_error, "stock_error": stock_error}


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict:
    """tp2.pt2 (saved by k3fuse on a 2-rank gloo group: size recorded) and plain.pt2 (the same
    program with the record stripped, saved by plain torch.export.save)."""
    from k3fuse.dist import launch

    d = tmp_path_factory.mktemp("tp")
    results = launch(_export_worker, 2, backend="gloo", args=(str(d / "tp2.pt2"),), timeout_s=300)
    torch.export.save(strip_group_sizes(load_program(d / "tp2.pt2")), d / "plain.pt2")
    return {"dir": d, "results": results}


@pytest.fixture()
def work(tmp_path: Path, exported: dict) -> Path:
    for name in ("tp2.pt2", "plain.pt2"):
        (tmp_path / name).write_bytes((exported["dir"] / name).read_bytes())
    return tmp_path


def test_group_size_survives_save_and_load(exported):
    d = exported["dir"]
    ep = load_program(d / "tp2.pt2")
    reduces = [n for n in ep.graph.nodes if n.op == "call_function" and "all_reduce" in str(n.target)]
    assert reduces and all(n.meta["custom"][GROUP_SIZE_KEY] == 2 for n in reduces)
    assert all(isinstance(a, str) for n in reduces for a in n.args[1:])  # the op itself has no size
    assert collective_group_sizes(ep.graph) == {"0": 2}
    # ... and survives the decomposition k3fuse.apply runs first
    assert collective_group_sizes(ep.run_decompositions().graph) == {"0": 2}
    plain = load_program(d / "plain.pt2")
    assert collective_group_sizes(plain.graph) == {"0": None}
    assert collective_group_sizes(record_group_sizes(plain, {"0": 2}).graph) == {"0": 2}


def test_wrong_tp_is_one_line_naming_both_sizes_and_writes_nothing(work):
    before = {p.name: digest(p) for p in work.iterdir()}
    one_line_error(k3fuse("apply", "tp2.pt2", "-o", "out.pt2", "--tp", "4", cwd=work),
                   "--tp 4", "group '0' (size 2)", "pass --tp 2")
    assert not (work / "out.pt2").exists()
    assert {p.name: digest(p) for p in work.iterdir()} == before


def test_tp_is_read_from_the_graph_and_the_output_records_it(work):
    res = k3fuse("apply", "tp2.pt2", "-o", "out.pt2", cwd=work)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "TP 2 read from the graph" in res.stdout
    out = load_program(work / "out.pt2")
    assert any(str(n.target).startswith("k3fuse.") for n in out.graph.nodes)
    assert collective_group_sizes(out.graph) == {"0": 2}  # applying the output again checks --tp too
    # even with every record stripped, the fused ops carry the world_size they were built for
    assert collective_group_sizes(strip_group_sizes(out).graph) == {"0": 2}


def test_unrecorded_size_needs_tp_and_says_it_could_not_check(work):
    one_line_error(k3fuse("apply", "plain.pt2", "-o", "out.pt2", cwd=work), "whose size it does not record",
                   "pass --tp N")
    res = k3fuse("apply", "plain.pt2", "-o", "out.pt2", "--tp", "2", cwd=work)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "TP 2 from --tp, which could not be checked: the graph does not record the size of group '0'" \
        in " ".join(res.stdout.split())
    assert any(str(n.target).startswith("k3fuse.") for n in load_program(work / "out.pt2").graph.nodes)


def test_fused_op_checks_the_live_group_size(exported):
    """A fused op built for world_size 4 on a 2-rank group raises on every rank, naming both sizes,
    on the stock fallback too (a wrong size must never run a different reduction)."""
    for r in exported["results"]:
        assert r["fused_error"] == f"k3fuse op was built for world_size 4 but process group {r['group']!r} has 2 ranks"
        assert r["stock_error"] == r["fused_error"]


def test_record_group_sizes_refuses_a_size_the_graph_contradicts():
    h = torch.randn(4, 16)
    ep = torch.export.export(AllReduceStep(gather=True).eval(), (h,))  # all_gather_into_tensor(y, 2, "0")
    with pytest.raises(ValueError, match="given size 4 but .* gathers over 2 ranks"):
        record_group_sizes(ep, {"0": 4})
    assert collective_group_sizes(record_group_sizes(ep).graph) == {"0": 2}
    ep = torch.export.export(AllReduceStep().eval(), (h,))  # no live group, no record: nothing written
    assert collective_group_sizes(record_group_sizes(ep).graph) == {"0": None}
    with pytest.raises(ValueError, match="positive int"):
        record_group_sizes(ep, {"0": 0})
