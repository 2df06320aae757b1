"""The KDA delta-rule step -> k3fuse.kda_delta_rule (one pass over the fp32 recurrent state).

Why: the step reads the fp32 state S [T, h, 128, 128] (403 MB at 64 tokens, TP1, K3) and
Inductor splits it at the first reduction (S^T k), so its two pointwise kernels read S twice
(~380 us at 64 tokens on H200). Value column j of the update needs only column j of S, so one
kernel that owns (token, head, block of value columns) reads S once and writes it once.

Spelling: `delta_rule` of k3fuse/spelling.py, imported and traced as is (the model calls the
same function, so the two cannot drift):
    S = recurrent * torch.exp(g).unsqueeze(-1)
    e = beta.unsqueeze(-1) * (vc - torch.einsum("thkv,thk->thv", S, kc))
    S = S + kc.unsqueeze(-1) * e.unsqueeze(-2)
    o = torch.einsum("thkv,thk->thv", S, qc)
einsum lowers to bmm with an operand order that depends on which of T and h are 1 (a size-1
batch dim is folded differently), so the one spelling is traced at four example shapes: the same
computation in the four ATen forms a decode graph can hold. HF transformers' Kimi Linear (and FLA's
naive recurrence) write both contractions as a broadcast multiply and a sum over the key dim,
`(S * k[..., None]).sum(-2)`: `delta_rule_hf` of k3fuse/spelling.py, variant "broadcast" (one trace:
no bmm, no shape-dependent form). HF's decay `g[..., None].exp()` (unsqueeze, then exp) is K3's
`exp(g).unsqueeze(-1)` to the matcher (k3fuse.vocabulary: unary ops commute with unsqueeze).
The decay's own form is outside the site (g is an operand): Kimi Linear's unbounded
`-exp(A_log) * softplus(z)` and K3's lower-bounded `lb * sigmoid(exp(A_log) * z)` feed the same step,
which the op computes for any g. Inductor's post-grad graph (the
`inductor_pass` door) holds yet other layouts of the same bmm operands (it cancels the einsum's
permute pairs and composes others), so sites the traced forms miss are found structurally
(variant "layout"): the same pointwise ops, and each contraction's bmm is accepted only when its
operands and result are, view for view, the einsum's (the chain of layout ops is replayed on fake
tensors of the site's shapes and its strides compared with the einsum's operand views).

Needs: every operand fp32, shapes [T, h, dk, dv] / [T, h, dk] / [T, h] / [T, h, dv] / [T, h, dk]
(no broadcasting), decode tokens; on a GPU, a kernel that covers (heads, dk, dv) at those tokens.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from k3fuse.kernels.ops.kda_delta import KDADeltaSpec
from k3fuse.rule_api import (DecodeContext, GuardFailure, Match, PatternSpec, Rule, compiled_patterns, failures,
                             find_matches, kernel_covers, node_order, shape_of, tensor_value, token_count)
from k3fuse.spelling import delta_rule, delta_rule_hf

from ._pattern_tools import randn

D = 8  # example head dim (the pattern is shape-agnostic except for which dims are 1)

#: (variant, T, h): einsum's four bmm forms; "tokens" is the general one (T >= 2, h >= 2, and a
#: dynamic token dim)
FORMS = (("tokens", 2, 2), ("one_token", 1, 2), ("one_head", 2, 1), ("one_token_one_head", 1, 1))


def _example(T: int, h: int) -> tuple[torch.Tensor, ...]:
    return (randn(T, h, D, D), randn(T, h, D), randn(T, h), randn(T, h, D), randn(T, h, D), randn(T, h, D))


def _shape_failure(match: Match) -> GuardFailure | None:
    """The operands have exactly the shapes the op takes (the pattern alone would admit broadcasts)."""
    shapes = {name: shape_of(match[name]) for name in ("recurrent", "g", "beta", "kc", "vc", "qc")}
    rec = shapes["recurrent"]
    if rec is not None and len(rec) == 4:
        T, h, dk, dv = rec
        want = {"g": (T, h, dk), "beta": (T, h), "kc": (T, h, dk), "vc": (T, h, dv), "qc": (T, h, dk)}
        if all(shapes[n] is not None and tuple(shapes[n]) == s for n, s in want.items()):
            return None
    return GuardFailure("site", "shape", "delta-rule operands are not [T, h, dk, dv] / [T, h, dk] / [T, h] / "
                                         "[T, h, dv] / [T, h, dk]",
                        {n: [str(d) for d in s] if s is not None else None for n, s in shapes.items()})


def _dtype_failure(match: Match) -> GuardFailure | None:
    dtypes = {}
    for name in ("recurrent", "g", "beta", "kc", "vc", "qc"):
        val = match.val(name)
        dtypes[name] = str(val.dtype) if isinstance(val, torch.Tensor) else None
    if all(d == "torch.float32" for d in dtypes.values()):
        return None
    return GuardFailure("site", "dtype", "the delta rule is fused for fp32 operands only", dtypes)


class KDADeltaRule(Rule):
    """S' = S*exp(g); e = beta*(v - S'^T k); S_new = S' + k e^T; o = S_new^T q -> k3fuse.kda_delta_rule."""

    name = "kda_delta_rule"
    emits = ("kda_delta_rule",)
    description = ("the KDA delta-rule step (decay, k-reduction, rank-1 update, q-reduction over the fp32 "
                   "state) -> k3fuse.kda_delta_rule (reads and writes the state once)")

    def patterns(self) -> list[PatternSpec]:
        return [*(PatternSpec(name, delta_rule, lambda T=T, h=h: _example(T, h)) for name, T, h in FORMS),
                PatternSpec("broadcast", delta_rule_hf, lambda: _example(2, 2))]

    def find(self, graph: fx.Graph, ctx: DecodeContext) -> list[Match]:
        """The traced forms first; then, structurally, the sites whose bmm operands another
        compiler pass laid out differently (Inductor's post-grad graph)."""
        traced = find_matches(graph, compiled_patterns(self))
        taken = {n for m in traced for n in m.nodes}
        layout = [m for a in graph.nodes if a.op == "call_function" and a.target is aten.add.Tensor
                  and a not in taken for m in [_layout_match(graph, a)] if m is not None]
        order = node_order(graph)
        return sorted(traced + layout, key=lambda m: order[m.outputs[0]])

    def check_site(self, match: Match, ctx: DecodeContext) -> list[GuardFailure]:
        found = failures(_shape_failure(match), _dtype_failure(match))
        if found:
            return found
        found = failures(token_count(match["recurrent"], ctx))
        if found:
            return found
        T, h, dk, dv = shape_of(match["recurrent"])
        spec = KDADeltaSpec(heads=h, dk=dk, dv=dv, dtype=torch.float32)
        return failures(kernel_covers(ctx, spec, T if isinstance(T, int) else None))

    def rewrite(self, match: Match, ctx: DecodeContext) -> list[fx.Node]:
        return match.replace_with(torch.ops.k3fuse.kda_delta_rule.default, recurrent=match["recurrent"],
                                  g=match["g"], beta=match["beta"], k=match["kc"], v=match["vc"], q=match["qc"],
                                  strict=ctx.strict)


# --- the structural form: same pointwise ops, bmm operands checked view for view ------------------
aten = torch.ops.aten
_RESHAPES = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default,
                       aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default})
_PERMUTES = frozenset({aten.permute.default, aten.transpose.int, aten.t.default})
_SAME = frozenset({aten.alias.default, aten.clone.default, aten.contiguous.default})  # values unchanged
_LAYOUT = _RESHAPES | _PERMUTES | _SAME


def _is_layout(n) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target in _LAYOUT


def _chain(n) -> tuple[fx.Node, list[fx.Node]]:
    """The first non-layout producer of `n` and the layout nodes from it to `n` (in order)."""
    chain = []
    while _is_layout(n):
        chain.append(n)
        n = n.args[0]
    return n, chain[::-1]


def _replay(base: torch.Tensor, chain: list[fx.Node]) -> torch.Tensor | None:
    """`base` (a fresh contiguous fake tensor standing for the chain's source) through the chain's
    layout ops as views; None when a step is not a view of the previous one."""
    t = base
    try:
        for n in chain:
            if n.target in _SAME:
                continue
            if n.target in _RESHAPES:
                t = t.view(tensor_value(n).shape)
            elif n.target is aten.t.default:
                t = t.t()
            elif n.target is aten.transpose.int:
                t = t.transpose(n.args[1], n.args[2])
            else:
                t = t.permute(list(n.args[1]))
    except Exception:
        return None
    return t


def _known(cond) -> bool:
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return bool(statically_known_true(cond))


def _same_view(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    """Same shape, and the same element of the source at every index (strides of size-1 dims are
    free), so the two views hold the same values."""
    if a is None or a.dim() != b.dim() or not _known(a.storage_offset() == b.storage_offset()):
        return False
    for sa, sb, ta, tb in zip(a.shape, b.shape, a.stride(), b.stride()):
        if not _known(sa == sb):
            return False
        if not _known(sa == 1) and not _known(ta == tb):
            return False
    return True


def _fresh(like: torch.Tensor, shape) -> torch.Tensor | None:
    """A contiguous fake tensor of `shape` in `like`'s fake mode."""
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode([like])
    if mode is None:
        return None
    with mode:
        return torch.empty(tuple(shape), dtype=like.dtype, device=like.device)


def _is_view_of(n, src: fx.Node, expected) -> list[fx.Node] | None:
    """The layout chain from `src` to `n` when it computes `expected(base)` of a contiguous base of
    src's shape; else None."""
    root, chain = _chain(n)
    val = tensor_value(src)
    if root is not src or val is None:
        return None
    base = _fresh(val, val.shape)
    if base is None:
        return None
    return chain if _same_view(_replay(base, chain), expected(base)) else None


def _contraction(bmm: fx.Node, S: fx.Node, vec: fx.Node, final: fx.Node) -> list[fx.Node] | None:
    """Nodes of einsum("thkv,thk->thv", S, vec) spelled as layout(bmm(layout(S), layout(vec))),
    ending at `final`, in either operand order; None if the bmm is not exactly that."""
    if not (isinstance(bmm, fx.Node) and bmm.target is aten.bmm.default):
        return None
    sv = tensor_value(S)
    if sv is None or sv.dim() != 4:
        return None
    T, h, dk, dv = sv.shape
    x, y = bmm.args
    forms = ((x, y, lambda b: b.permute(0, 1, 3, 2).reshape(T * h, dv, dk), lambda b: b.reshape(T * h, dk, 1)),
             (y, x, lambda b: b.reshape(T * h, dk, dv), lambda b: b.reshape(T * h, 1, dk)))
    for s_arg, v_arg, s_view, v_view in forms:
        s_chain = _is_view_of(s_arg, S, s_view)
        v_chain = s_chain is not None and _is_view_of(v_arg, vec, v_view)
        if s_chain is None or v_chain is None or v_chain is False:
            continue
        out_chain = _is_view_of(final, bmm, lambda b: b.reshape(T, h, dv))
        if out_chain is not None:
            return [*s_chain, *v_chain, bmm, *out_chain]
    return None


def _unsqueezed(n, dim: int) -> tuple[fx.Node, list[fx.Node]] | None:
    """(x, chain) when `n` is `x.unsqueeze(dim)` up to views."""
    root, _ = _chain(n)
    if tensor_value(root) is None:
        return None
    chain = _is_view_of(n, root, lambda b: b.unsqueeze(dim))
    return None if chain is None else (root, chain)


def _pairs(n: fx.Node):
    a, b = n.args[:2]
    return ((a, b), (b, a))


def _is(n, target) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target is target and not n.kwargs


def _layout_match(graph: fx.Graph, A: fx.Node) -> Match | None:
    """The delta rule ending at `A` = S' + k e^T, whatever the layout of its two bmm contractions."""
    try:
        return _layout_match_at(graph, A)
    except Exception:  # an unusual graph (unknown shapes, a guard the fake mode cannot decide): no site
        return None


def _layout_match_at(graph: fx.Graph, A: fx.Node) -> Match | None:
    for S1, U in _pairs(A):
        if not (_is(S1, aten.mul.Tensor) and _is(U, aten.mul.Tensor)):
            continue
        for rec, E in _pairs(S1):
            dec = _unsqueezed(E, -1)
            if dec is None or not _is(dec[0], aten.exp.default) or tensor_value(rec) is None or tensor_value(rec).dim() != 4:
                continue
            exp, e_chain = dec
            for KU, EU in _pairs(U):
                ku, eu = _unsqueezed(KU, -1), _unsqueezed(EU, -2)
                if ku is None or eu is None or not _is(eu[0], aten.mul.Tensor):
                    continue
                kc, e = ku[0], eu[0]
                for BU, D in _pairs(e):
                    bu = _unsqueezed(BU, -1)
                    if bu is None or not _is(D, aten.sub.Tensor):
                        continue
                    vc, R1 = D.args
                    first = _contraction(_chain(R1)[0], S1, kc, R1)
                    if first is None:
                        continue
                    second = _second_contraction(graph, A)
                    if second is None:
                        continue
                    qc, o, o_nodes = second
                    inputs = {"recurrent": rec, "g": exp.args[0], "beta": bu[0], "kc": kc, "vc": vc, "qc": qc}
                    nodes = {exp, *e_chain, S1, *first, D, *bu[1], e, *eu[1], *ku[1], U, A, *o_nodes}
                    return _checked_match(graph, inputs, [A, o], nodes)
    return None


def _second_contraction(graph: fx.Graph, A: fx.Node):
    """(qc, o, nodes) for o = einsum("thkv,thk->thv", A, qc): a bmm reading a view of A, its result
    followed forward through single-user layout ops to a [T, h, dv] value."""
    T, h, dk, dv = tensor_value(A).shape
    for bmm in graph.nodes:
        if not _is(bmm, aten.bmm.default):
            continue
        roots = [_chain(a)[0] for a in bmm.args]
        if A not in roots or roots.count(A) != 1:
            continue
        qc = roots[1 - roots.index(A)]
        final = bmm
        while True:
            v = tensor_value(final)
            if v is not None and v.dim() == 3 and all(_known(a == b) for a, b in zip(v.shape, (T, h, dv))):
                break
            users = list(final.users)
            if len(users) != 1 or not _is_layout(users[0]):
                final = None
                break
            final = users[0]
        if final is None:
            continue
        nodes = _contraction(bmm, A, qc, final)
        if nodes is not None:
            return qc, final, nodes
    return None


def _checked_match(graph: fx.Graph, inputs: dict, outputs: list[fx.Node], nodes: set) -> Match | None:
    """A Match when no computed interior value is read outside the site (layout nodes are exempt:
    Match.replace leaves them to their other users)."""
    order = node_order(graph)
    for n in nodes:
        if n in outputs or _is_layout(n):
            continue
        if any(u not in nodes for u in n.users):
            return None
    return Match(variant="layout", graph=graph, inputs=inputs, scalars={}, outputs=outputs,
                 nodes=sorted(nodes, key=order.__getitem__))


__all__ = ["KDADeltaRule"]
