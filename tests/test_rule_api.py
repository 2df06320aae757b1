"""Rule authors' one import surface (`k3fuse.rule_api`), the common rewrite (`Match.replace_with`) and
typed variant parameters (issue 49, item 3).

* every rule under patterns/ reaches the framework only through k3fuse.rule_api (besides the K3
  math, the ops' Specs and the pattern helpers), and no rule reads a variant's name to decide
  anything: it reads `match.params(...)`;
* `replace_with` builds the op's arguments by schema name (defaults filling gaps, unknown names
  refused), rewires single- and multi-output sites and returns the new nodes;
* `Match.params` hands back the variant's typed parameters and refuses another type.
"""
from __future__ import annotations

import ast
import operator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.fx as fx

from k3fuse import rule_api
from k3fuse.rewrite_site import schema_args

ROOT = Path(__file__).resolve().parents[1]
RULE_FILES = sorted((ROOT / "patterns").glob("*.py"))
#: what a rule may import from k3fuse besides the rule API
RULE_SIDE = ("k3fuse.rule_api", "k3fuse.spelling", "k3fuse.quant", "k3fuse.kernels.ops.")


def _imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "k3fuse":
            out.update(f"k3fuse.{a.name}" for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m == "k3fuse" or m.startswith("k3fuse.")}


@pytest.mark.parametrize("path", RULE_FILES, ids=lambda p: p.name)
def test_rules_reach_the_framework_only_through_the_rule_api(path):
    bad = sorted(m for m in _imports(path) if not m.startswith(RULE_SIDE))
    assert bad == [], f"{path.name} imports {bad}; import them from k3fuse.rule_api"


@pytest.mark.parametrize("path", RULE_FILES, ids=lambda p: p.name)
def test_no_rule_decides_on_a_variants_name(path):
    """`key.form` and `match.variant` are names for the log: reading them (comparing, splitting) to
    decide a rewrite is what `Variant.params` replaces."""
    read = [f"line {n.lineno}: {ast.unparse(n)}" for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Attribute) and (n.attr == "form" or (n.attr == "variant" and isinstance(n.ctx, ast.Load)))]
    assert read == [], f"{path.name} reads a variant's name: {read}"


def test_the_rule_api_names_only_what_it_defines():
    assert sorted(rule_api.__all__) == sorted(set(rule_api.__all__))
    assert all(hasattr(rule_api, name) for name in rule_api.__all__)


# --- replace_with and schema_args --------------------------------------------------------------------
ops = torch.ops.k3fuse


def test_schema_args_orders_by_name_and_fills_defaults():
    import k3fuse.kernels  # noqa: F401  (declares torch.ops.k3fuse.*)

    op = ops.route_topk.default  # (logits, b_corr, top_k, routed_scaling, eps=1e-20, strict=False)
    assert schema_args(op, {"top_k": 2, "logits": "L", "b_corr": "B", "routed_scaling": 1.5}) == ("L", "B", 2, 1.5)
    assert schema_args(op, {"logits": "L", "b_corr": "B", "top_k": 2, "routed_scaling": 1.5, "strict": True}) == (
        "L", "B", 2, 1.5, 1e-20, True)
    with pytest.raises(TypeError, match="no argument"):
        schema_args(op, {"logits": "L", "typo": 1})
    with pytest.raises(TypeError, match="missing"):
        schema_args(op, {"logits": "L", "top_k": 2})


def _graph_with(fn, *examples):
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn, tracing_mode="fake")(*examples)


def _site(gm: fx.GraphModule, outputs: list[fx.Node], inputs: dict[str, fx.Node]) -> rule_api.Match:
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    return rule_api.Match(variant="v", graph=gm.graph, inputs=inputs, scalars={}, outputs=outputs, nodes=nodes)


def test_replace_with_a_single_output():
    import k3fuse.kernels  # noqa: F401

    gm = _graph_with(lambda x, w: torch.nn.functional.linear(x, w).relu(), torch.randn(3, 4), torch.randn(5, 4))
    x, w = [n for n in gm.graph.nodes if n.op == "placeholder"]
    mm = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default)
    site = _site(gm, [mm], {"x": x, "weight": w})
    site.nodes = [n for n in gm.graph.nodes if n.target in (torch.ops.aten.t.default, torch.ops.aten.mm.default)]
    new = site.replace_with(ops.decode_gemm.default, x=x, weight=w, bias=None, strict=True)
    (gemm,) = new
    assert gemm.target is ops.decode_gemm.default and gemm.args == (x, w, None, None, True)
    assert gemm.meta["val"].shape == (3, 5)
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [ops.decode_gemm.default,
                                                                             torch.ops.aten.relu.default]
    gm.recompile()
    a, b = torch.randn(3, 4), torch.randn(5, 4)
    torch.testing.assert_close(gm(a, b), torch.nn.functional.linear(a, b).relu())


def test_replace_with_several_outputs_gives_one_item_each():
    import k3fuse.kernels  # noqa: F401

    def route(logits, b):
        scores = logits.sigmoid()
        _, idx = torch.topk(scores + b, 2)
        w = scores.gather(-1, idx)
        return (w / (w.sum(-1, keepdim=True) + 1e-20)) * 2.5, idx

    gm = _graph_with(route, torch.randn(3, 8), torch.randn(8))
    logits, b = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out = next(n for n in gm.graph.nodes if n.op == "output")
    weights, idx = out.args[0]
    site = _site(gm, [weights, idx], {"logits": logits, "b_corr": b})
    fused, w_item, i_item = site.replace_with(ops.route_topk.default, logits=logits, b_corr=b, top_k=2,
                                             routed_scaling=2.5, eps=1e-20)
    assert (w_item.target, w_item.args) == (operator.getitem, (fused, 0))
    assert (i_item.target, i_item.args) == (operator.getitem, (fused, 1))
    assert out.args[0] == (w_item, i_item)
    assert [n for n in gm.graph.nodes if n.op == "call_function"] == [fused, w_item, i_item]


# --- typed variant parameters -------------------------------------------------------------------------
@dataclass(frozen=True)
class _Form:
    norm: bool


def test_match_params_are_the_variants_typed_parameters():
    key = rule_api.Variant("plain+norm", torch.bfloat16, _Form(norm=True))
    assert str(key) == "plain+norm[bfloat16]"  # the log's name is unchanged by the parameters
    m = rule_api.Match(variant=str(key), graph=fx.Graph(), inputs={}, scalars={}, outputs=[], nodes=[], key=key)
    assert m.params(_Form) == _Form(norm=True)
    with pytest.raises(TypeError, match="carries _Form, not int"):
        m.params(int)
    plain = rule_api.Match(variant="x", graph=fx.Graph(), inputs={}, scalars={}, outputs=[], nodes=[])
    with pytest.raises(TypeError, match="carries NoneType"):
        plain.params(_Form)


def test_every_k3_variant_carries_the_parameters_its_rewrite_reads():
    from k3fuse.patterns import DecodeGemm, OProjAllReduceResidual, RoutedExperts
    from k3fuse.patterns.decode_gemm import Form as LinearForm
    from k3fuse.patterns.oproj_allreduce_residual import Form as OProjForm
    from k3fuse.patterns.routed_experts import Form as ExpertsForm

    for rule, kind in ((OProjAllReduceResidual(), OProjForm), (DecodeGemm(), LinearForm),
                       (RoutedExperts(), ExpertsForm)):
        for spec in rule.patterns():
            assert isinstance(spec.key.params, kind), (rule.name, spec.name)
    forms = {s.name: s.key.params for s in RoutedExperts().patterns()}
    assert forms["grouped_mxfp4_blocks[bfloat16]"] == ExpertsForm("grouped", "mxfp4", "blocks")
    assert forms["gathered_int4[bfloat16]"] == ExpertsForm("gathered", "int4", "rows")
    assert forms["gathered"] == ExpertsForm("gathered")
    oproj = {s.name: s.key.params for s in OProjAllReduceResidual().patterns()}
    assert oproj["moe+norm[bfloat16]"] == OProjForm(addend=True, norm=True) and not oproj["attnres"].norm
