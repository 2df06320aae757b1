"""The matcher finds one traced pattern in every spelling a model produces (one test per spelling)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import LinearResidualRule, RMSNormRule
from torch.fx.experimental.proxy_tensor import make_fx

from k3fuse.matcher import compile_pattern, compiled_patterns, decomposition_table, find_matches
from k3fuse.rule import PatternSpec

aten = torch.ops.aten


def trace(fn, *args):
    """ATen graph of fn as the doors see it (fake tensors, Inductor decomposition table)."""
    return make_fx(fn, decomposition_table=decomposition_table(), tracing_mode="fake")(*args).graph


def matches(graph, rule=None):
    return find_matches(graph, compiled_patterns(rule or LINEAR_RULE))


LINEAR_RULE = LinearResidualRule()
X2, W, R2 = torch.randn(4, 8), torch.randn(16, 8), torch.randn(4, 16)
X3, R3 = torch.randn(2, 3, 8), torch.randn(2, 3, 16)


def _one(graph, variant="plain"):
    found = matches(graph)
    assert len(found) == 1, [m.variant for m in found]
    m = found[0]
    assert m.refused is None and m.variant == variant
    return m


def test_pattern_is_traced_to_aten_not_hand_built():
    cp = compile_pattern(LINEAR_RULE.patterns()[0])
    targets = [n.target for n in cp.graph.nodes if n.op == "call_function"]
    assert targets == [aten.permute.default, aten.mm.default, aten.add.Tensor]
    assert sorted(cp.placeholder_names.values()) == ["residual", "w", "x"]


def test_spelling_f_linear_2d():
    m = _one(trace(lambda x, w, r: r + F.linear(x, w), X2, W, R2))
    assert [m.inputs[k].name for k in ("x", "w", "residual")] == ["x_1", "w_1", "r_1"]
    assert [n.target for n in m.nodes] == [aten.permute.default, aten.mm.default, aten.add.Tensor]


def test_spelling_mm_and_t():
    g = trace(lambda x, w, r: r + torch.mm(x, w.t()), X2, W, R2)
    assert _one(g).inputs["w"].name == "w_1"


def test_spelling_transpose_method():
    g = trace(lambda x, w, r: r + x @ w.transpose(0, 1), X2, W, R2)
    assert _one(g).inputs["x"].name == "x_1"


def test_spelling_matmul_3d_with_reshapes():
    g = trace(lambda x, w, r: r + torch.matmul(x, w.T), X3, W, R3)
    m = _one(g)
    assert m.inputs["x"].target is aten.view.default  # the 2-D view the mm consumed
    assert aten.view.default in [n.target for n in m.nodes]  # the reshape back is inside the match
    assert m.outputs[0].meta["val"].shape == (2, 3, 16)


def test_spelling_f_linear_3d():
    assert _one(trace(lambda x, w, r: r + F.linear(x, w), X3, W, R3)).variant == "plain"


def test_spelling_operand_order_swapped():
    m = _one(trace(lambda x, w, r: F.linear(x, w) + r, X2, W, R2))
    assert m.inputs["residual"].name == "r_1"


def test_spelling_bias_addmm():
    g = trace(lambda x, w, b, r: r + F.linear(x, w, b), X2, W, torch.randn(16), R2)
    assert any(n.target is aten.addmm.default for n in g.nodes)
    from k3fuse.vocabulary import split_addmm
    split_addmm(g)
    assert _one(g, "bias").inputs["b"].name == "b_1"


def test_spelling_bias_mm_plus_add():
    g = trace(lambda x, w, b, r: (x @ w.t() + b) + r, X2, W, torch.randn(16), R2)
    assert _one(g, "bias").inputs["b"].name == "b_1"


def test_spelling_bias_3d():
    g = trace(lambda x, w, b, r: r + F.linear(x, w, b), X3, W, torch.randn(16), R3)
    from k3fuse.vocabulary import split_addmm
    split_addmm(g)
    assert _one(g, "bias").variant == "bias"


def test_biased_linear_prefers_the_bias_variant():
    g = trace(lambda x, w, b, r: r + F.linear(x, w, b), X2, W, torch.randn(16), R2)
    from k3fuse.vocabulary import split_addmm
    split_addmm(g)
    assert [m.variant for m in matches(g)] == ["bias"]


def test_spelling_clone_and_view_in_between():
    def fn(x, w, r):
        y = F.linear(x, w).clone().view(4, 16)
        return r + y.reshape(4, 16)
    m = _one(trace(fn, X2, W, R2))
    assert aten.clone.default in [n.target for n in m.nodes]


def test_spelling_casts_to_copy_vs_float():
    rule = RMSNormRule()
    x, w = torch.randn(4, 16, dtype=torch.bfloat16), torch.randn(16, dtype=torch.bfloat16)

    def via_to(x, w):
        xf = x.to(torch.float32)
        var = xf.pow(2).mean(dim=-1, keepdim=True)
        return (xf * torch.rsqrt(var + 1e-5) * w.to(torch.float32)).to(dtype=torch.bfloat16)

    def via_type(x, w):
        xf = x.type(torch.float32)
        return (torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * xf * w.float()).bfloat16()

    for fn in (via_to, via_type):
        found = matches(trace(fn, x, w), rule)
        assert len(found) == 1 and found[0].refused is None, fn.__name__
        assert found[0].scalars == {"eps": pytest.approx(1e-5)}


def test_scalar_tensor_matches_inductors_folded_full():
    """Inductor's joint-graph constant folding turns a masked_fill's scalar_tensor(-inf) into full([], -inf):
    one 0-d fill either way; another value is another computation."""
    spec = PatternSpec("mask", lambda x, m: torch.softmax(x.masked_fill(m, float("-inf")), -1),
                       lambda: (torch.randn(4, 8), torch.ones(4, 8, dtype=torch.bool)))
    pattern = compile_pattern(spec)
    x, m = torch.randn(4, 8), torch.rand(4, 8) > 0.5

    def folded(fill):
        return lambda x, m: torch.softmax(torch.where(m, torch.full([], fill), x), -1)

    assert len(find_matches(trace(folded(float("-inf")), x, m), [pattern])) == 1
    assert find_matches(trace(folded(0.0), x, m), [pattern]) == []


def test_literal_wildcard_captures_model_eps():
    def two_eps(x, w):  # the wildcard captures whatever eps the model uses
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()).to(torch.bfloat16)
    g = trace(two_eps, torch.randn(4, 16, dtype=torch.bfloat16), torch.randn(16, dtype=torch.bfloat16))
    assert matches(g, RMSNormRule())[0].scalars["eps"] == pytest.approx(1e-6)


def test_different_computation_does_not_match():
    g = trace(lambda x, w, r: r - F.linear(x, w), X2, W, R2)
    assert matches(g) == []


def test_interior_used_outside_is_refused():
    def fn(x, w, r):
        y = F.linear(x, w)
        return r + y, y.sum()
    found = matches(trace(fn, X2, W, R2))
    assert len(found) == 1
    refused = found[0].refused
    assert refused is not None and refused.guard == "interior_used_outside"
    assert refused.values["node"] == "mm" and refused.values["user"] == "sum_1"


def test_shared_weight_transpose_is_not_an_escape():
    def fn(x, w, r):  # one transpose of w feeding two linears
        wt = w.t()
        return r + x @ wt, (r + x @ wt) * 2
    g = trace(fn, X2, W, R2)
    found = matches(g)
    assert len(found) == 2 and all(m.refused is None for m in found)


def test_placeholder_used_twice_binds_one_value():
    spec = PatternSpec("sq", lambda a: a * a, lambda: (torch.randn(4),))
    cp = compile_pattern(spec)
    g_same = trace(lambda x: torch.tanh(x * x), torch.randn(4))
    g_diff = trace(lambda x, y: torch.tanh(x * y), torch.randn(4), torch.randn(4))
    assert len(find_matches(g_same, [cp])) == 1
    assert find_matches(g_diff, [cp]) == []


def test_multi_output_pattern():
    def pat(x, w, r):
        h = r + F.linear(x, w)
        return h, torch.tanh(h)
    cp = compile_pattern(PatternSpec("two", pat, lambda: (X2, W, R2)))
    g = trace(lambda x, w, r: (lambda h: (h * 3, torch.tanh(h)))(F.linear(x, w) + r), X2, W, R2)
    (m,) = find_matches(g, [cp])
    assert [o.target for o in m.outputs] == [aten.add.Tensor, aten.tanh.default]


def test_unused_literal_argument_is_a_clear_error():
    spec = PatternSpec("bad", lambda x, eps: x * 2, lambda: (torch.randn(4), 1e-6))
    with pytest.raises(ValueError, match="literal argument 'eps'"):
        compile_pattern(spec)


def test_same_structure_variants_prefer_the_graph_dtype():
    def lin(x, w):
        return F.linear(x, w)

    specs = [PatternSpec(f"lin[{d}]", lin, lambda d=d: (torch.randn(4, 8, dtype=d), torch.randn(16, 8, dtype=d)))
             for d in (torch.float32, torch.bfloat16)]
    patterns = [compile_pattern(s) for s in specs]
    for dtype in (torch.float32, torch.bfloat16):
        g = trace(lambda x, w: torch.tanh(F.linear(x, w)), torch.randn(4, 8, dtype=dtype),
                  torch.randn(16, 8, dtype=dtype))
        (m,) = find_matches(g, patterns)
        assert m.variant == f"lin[{dtype}]"


def test_a_pattern_compiled_inside_a_compile_keeps_out_of_its_shape_env():
    """The Inductor post-grad door compiles patterns while Dynamo's TracingContext and FakeTensorMode
    are active. Tracing a pattern there must not join that fake mode: its symbols and guards would
    land in the graph's ShapeEnv, where Dynamo later fails building guards ("symbol_to_source")."""
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from k3fuse import spelling

    def example():
        meta = {"device": "meta", "dtype": torch.bfloat16}
        return (torch.empty(8, 32, **meta), torch.empty(16, device="meta", dtype=torch.int64),
                torch.empty(4, 16, 32, **meta), torch.empty(4, 16, 32, **meta), torch.empty(4, 32, 16, **meta),
                2.0, 3.0)

    def grouped(a, experts, w1, w3, w2, beta, linear_beta):  # argsort, searchsorted, _grouped_mm, index_copy
        return spelling.routed_experts_grouped(a, experts, w1, w3, w2, 2, beta, linear_beta)

    outer = ShapeEnv()
    with tracing(TracingContext(FakeTensorMode(shape_env=outer))):
        compiled = compile_pattern(PatternSpec("grouped", grouped, example))
    assert torch.ops.aten._grouped_mm.default in {n.target for n in compiled.graph.nodes}
    assert not outer.guards and not outer.var_to_val  # nothing leaked into the ambient shape env
