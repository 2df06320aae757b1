"""Fast, one-process checks of the third-party spellings (issue 13): in-place copies followed to the
copied value, router recognition and latent choice in moe_front_sharded, near-miss reasons.
The multi-rank, three-door proof is tests/test_thirdparty_models.py."""
from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from thirdparty_models import DecodeModel, SingleReductionMoE
from torch.fx.experimental.proxy_tensor import make_fx

import k3fuse
from k3fuse import vocabulary
from k3fuse.matcher import compiled_patterns, decomposition_table, find_matches
from k3fuse.patterns import MoEFrontSharded, OProjAllReduceResidual
from k3fuse.pipeline import run_pipeline

aten = torch.ops.aten


def _trace(fn, *args, functional: bool = True):
    gm = make_fx(fn, decomposition_table=decomposition_table(), tracing_mode="fake",
                 pre_dispatch=False)(*args) if functional else make_fx(fn, tracing_mode="fake")(*args)
    return gm.graph


def _inplace_reduce(x, w, r):
    y = F.linear(x, w)
    y = aten.copy.default(y, funcol.all_reduce(y, "sum", "tp"))  # what dist.all_reduce(y) functionalises to
    return r + y


def _node(graph, target):
    return next(n for n in graph.nodes if n.target is target)


def test_functional_copy_stands_for_the_copied_value_and_oproj_matches_it():
    g = _trace(_inplace_reduce, torch.randn(4, 8), torch.randn(16, 8), torch.randn(4, 16))
    copy = _node(g, aten.copy.default)
    assert vocabulary.copied_value(copy) is copy.args[1]  # the reduced value, never the destination
    assert vocabulary.value_root(copy).target is torch.ops._c10d_functional.wait_tensor.default
    (m,) = find_matches(g, compiled_patterns(OProjAllReduceResidual()))
    assert m.variant == "attnres" and m.refused is None and copy in m.nodes


def test_copy_is_not_followed_when_the_destination_is_read_after_it_or_it_casts():
    def later_read(x, w, r):
        y = F.linear(x, w)
        z = aten.copy.default(y, funcol.all_reduce(y, "sum", "tp"))
        return r + z, y * 2  # the old y is still read after the copy

    def inplace(x, w):
        y = F.linear(x, w)
        return aten.copy_.default(y, funcol.all_reduce(y, "sum", "tp")) + 1

    def casting(x, w, d):
        return aten.copy.default(d, F.linear(x, w)) + 1

    g = _trace(later_read, torch.randn(4, 8), torch.randn(16, 8), torch.randn(4, 16))
    assert vocabulary.copied_value(_node(g, aten.copy.default)) is None
    g = _trace(inplace, torch.randn(4, 8), torch.randn(16, 8), functional=False)
    copy_ = _node(g, aten.copy_.default)
    assert vocabulary.copied_value(copy_) is copy_.args[1]  # copy_ in a graph that is not functionalised
    with g.inserting_after(copy_):  # a later reader of the destination sees the copied value through
        g.call_function(aten.mul.Tensor, (copy_.args[0], 2))  # the mutation: the copy must stay
    assert vocabulary.copied_value(copy_) is None
    g = _trace(casting, torch.randn(4, 8), torch.randn(16, 8), torch.randn(4, 16, dtype=torch.float64))
    assert vocabulary.copied_value(_node(g, aten.copy.default)) is None


def _exported(model, *args):
    return torch.export.export(model, args).run_decompositions(decomposition_table()).graph


def test_router_spellings_and_latent_choice():
    x = torch.randn(3, DecodeModel.HIDDEN)
    rule, ctx = MoEFrontSharded(), k3fuse.DecodeContext()
    for kind, variant in (("deepseek", "router"), ("softmax", "router"), ("nemotron", "router+latent")):
        matches = rule.find(_exported(DecodeModel(kind, n_layers=2), x), ctx)
        assert [m.variant for m in matches] == [variant, variant], kind
        assert all(m.refused is None for m in matches)
        if kind == "nemotron":  # the latent is fc1_latent_proj, not the shared expert's up projection
            assert all("fc1_latent_proj" in m["down_w"].name for m in matches)


def test_near_miss_reasons_name_the_candidate_and_the_divergence():
    x, r = torch.randn(3, 32), torch.randn(3, 32)
    ctx = k3fuse.DecodeContext()
    g = _trace(lambda x, w, r: r + funcol.all_reduce(F.linear(x, w) * 2, "sum", "tp"),
               torch.randn(4, 8), torch.randn(16, 8), torch.randn(4, 16))
    reason, values = OProjAllReduceResidual().explain_miss(g, ctx)
    assert reason.endswith("the _c10d_functional.all_reduce input is aten.mul (mul), not aten.mm"), reason
    assert values["candidate"] == "all_reduce" and values["diverged_at"] == "mul"
    g = _exported(SingleReductionMoE(), x, r)  # TP 1: no all_reduce at all
    assert OProjAllReduceResidual().explain_miss(g, ctx) == ("no _c10d_functional.all_reduce in the graph", {})
    g = _exported(DecodeModel("softmax", n_layers=1, temperature=2.0), x)
    assert MoEFrontSharded().find(g, ctx) == []
    reason, values = MoEFrontSharded().explain_miss(g, ctx)
    assert reason == "router: the score function softmax (div_1) reads aten.div (div), not a router linear"
    g = _trace(lambda x, w: torch.topk(torch.tanh(F.linear(x, w)), 2), torch.randn(4, 8), torch.randn(6, 8))
    reason, values = MoEFrontSharded().explain_miss(g, ctx)
    assert reason.startswith("router: top-k topk reached through aten.tanh (tanh), not a score function"), reason


def test_not_matched_event_carries_reason_and_values(tmp_path):
    g = _trace(lambda x, w, r: r + funcol.all_reduce(F.linear(x, w) * 2, "sum", "tp"),
               torch.randn(4, 8), torch.randn(16, 8), torch.randn(4, 16))
    ctx = k3fuse.DecodeContext(tp_size=2, group_name="tp", enabled_rules=frozenset({"oproj_allreduce_residual"}))
    path = tmp_path / "rw.jsonl"
    run_pipeline(g, ctx, log=str(path))
    events = [e for e in k3fuse.RewriteLog.from_jsonl(path).events if e.decision == "not_matched"]
    (e,) = [e for e in events if e.rule == "oproj_allreduce_residual"]
    assert "not aten.mm" in e.reason and e.values["diverged_at"] == "mul"


def test_moe_front_sharded_router_only_form():
    """down_w None (no latent projection): fp32 logits, an empty [T, 0] latent; reference == stock."""
    import k3fuse.kernels  # noqa: F401
    from k3fuse import runtime

    x, w = torch.randn(3, 32), torch.randn(8, 32)
    logits, latent = torch.ops.k3fuse.moe_front_sharded(x, w, None, "", 1)
    torch.testing.assert_close(logits, F.linear(x.float(), w.float()))
    assert latent.shape == (3, 0) and logits.dtype == torch.float32
    with runtime.disable():
        stock = torch.ops.k3fuse.moe_front_sharded(x, w, None, "", 1)
    assert torch.equal(stock[0], logits) and stock[1].shape == (3, 0)
