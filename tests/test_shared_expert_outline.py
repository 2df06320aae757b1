"""The backend outlines each bracketed shared-expert region before Inductor lowers the graph
(kernels/ops/shared_expert.py, `outline_regions`), on small hand-made brackets traced with make_fx:

* a region becomes one shared_expert_region call (its own nodes in a GraphModule kept under a key) and its join a
  shared_expert_region_join; the main stream's readers of x read the op's x_pass; the outlined graph computes what
  the bracketed one did, and the counters show the region and its join ran;
* a region whose interior value is read outside it keeps its markers (Inductor then compiles it on the main stream).
"""
from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

import k3fuse  # noqa: F401  (declares torch.ops.k3fuse)
from k3fuse import runtime
from k3fuse.kernels.ops.shared_expert import outline_regions

ops = torch.ops.k3fuse
SITE = 3


def _bracketed(x, w, r, leak: bool):
    x_side = ops.shared_expert_fork(x, SITE)
    h = torch.relu(x_side @ w.t())
    y = h * 0.5
    ops.shared_expert_end(y, SITE)
    routed = r * 2 + x.sum(-1, keepdim=True)  # the main stream reads x too
    out = ops.shared_expert_join(y, routed, [x], SITE) + routed
    return (out, h) if leak else out


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(5, 8, generator=g), torch.randn(8, 8, generator=g), torch.randn(5, 8, generator=g)


def _targets(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_a_region_becomes_one_op_that_computes_what_the_bracket_did():
    x, w, r = _inputs()
    gm = make_fx(lambda x, w, r: _bracketed(x, w, r, leak=False), tracing_mode="fake")(x, w, r)
    want = _bracketed(x, w, r, leak=False)
    assert outline_regions(gm) == 1
    targets = _targets(gm)
    assert ops.shared_expert_region.default in targets and ops.shared_expert_region_join.default in targets
    assert not {ops.shared_expert_fork.default, ops.shared_expert_end.default, ops.shared_expert_join.default} \
        & set(targets)
    (region,) = [n for n in gm.graph.nodes if n.target is ops.shared_expert_region.default]
    x_node = region.args[0]
    # x itself is read only by the region and by the join's keep_alive; the main stream reads x_pass
    assert {u.target for u in x_node.users} == {ops.shared_expert_region.default,
                                               ops.shared_expert_region_join.default}
    runtime.reset_stats()
    with runtime.strict():
        got = gm(x, w, r)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert runtime.stats()["shared_expert_region"] == {"reference": 1}
    assert runtime.stats()["shared_expert_region_join"] == {"reference": 1}


def test_a_region_read_from_outside_keeps_its_markers():
    x, w, r = _inputs()
    gm = make_fx(lambda x, w, r: _bracketed(x, w, r, leak=True), tracing_mode="fake")(x, w, r)
    before = _targets(gm)
    assert outline_regions(gm) == 0
    assert _targets(gm) == before
