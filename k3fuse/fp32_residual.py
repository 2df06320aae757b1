"""The fp32-residual norm (SGLang's native RMSNorm) translated to the spelling the rules trace, and back.

SGLang's RMSNorm adds `x.float() + residual.float()` in fp32, keeps the sum in the trunk dtype as
the next residual and normalises the fp32 sum. The rules trace the add in the trunk dtype and the
norm of that sum (k3fuse.spelling.rms_norm). The translation adds in the trunk dtype, normalises
the rounded sum and makes the weight's promotion to fp32 an explicit cast (what the fused kernel
computes: it differs from the fp32-sum norm by one rounding of the sum); `restore_fp32_residual_norms`
puts back every translation no rule consumed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .graph_facts import NodeRecipe, fill_fake_values, is_erased, node_value
from .vocabulary import cast_dtype

aten = torch.ops.aten
prims = torch.ops.prims

_FP32_RESIDUAL_ENGINES: set[str] = set()
_TRUNK_16 = (torch.bfloat16, torch.float16)


def register_fp32_residual_norm(engine: str) -> None:
    """An engine writes its residual add + RMSNorm in the fp32-residual form (called by its module)."""
    _FP32_RESIDUAL_ENGINES.add(engine)


#: an operand's cast to fp32: the node while the graph still has it, else what rebuilds it on the operand
Upcast = fx.Node | NodeRecipe


@dataclass
class Fp32ResidualTranslation:
    """One fp32-residual add rewritten in the trunk dtype, with what putting it back needs."""

    total: fx.Node  # add(a, b) in the trunk dtype (stands for the residual the engine kept)
    total_f32: fx.Node  # convert(total, f32) (stands for the fp32 sum)
    fp32_sum: NodeRecipe  # the engine's add of the two upcasts
    kept: NodeRecipe  # the engine's cast of the fp32 sum back to the trunk dtype
    residual_readers: list[fx.Node]
    sum_readers: list[fx.Node]  # the fp32 sum's readers, and the weight multiply
    upcasts: list[Upcast] = field(default_factory=list)
    weight_f32: fx.Node | None = None  # convert(w, f32) in the weight multiply, if there was one

    def new_nodes(self) -> list[fx.Node]:
        return [self.total, self.total_f32] + ([self.weight_f32] if self.weight_f32 is not None else [])


def _cast_of(node: object, dtype: torch.dtype) -> fx.Node | None:
    """The input of `node` when it is a pure cast to `dtype`."""
    return node.args[0] if isinstance(node, fx.Node) and cast_dtype(node) == dtype else None


def _weight_multiply(total_f32: fx.Node) -> tuple[fx.Node, int] | None:
    """(mul, position of the weight) for `(sum * rsqrt(mean(sum^2) + eps)) * w` with w in a 16-bit
    dtype, the promotion the engine leaves implicit."""
    for normed in total_f32.users:
        if normed.target is not aten.mul.Tensor or len(normed.users) != 1:
            continue
        (mul,) = normed.users
        if mul.target is not aten.mul.Tensor or len(mul.args) != 2:
            continue
        position = 1 if mul.args[0] is normed else 0
        weight = mul.args[position]
        if isinstance(node_value(weight), torch.Tensor) and node_value(weight).dtype in _TRUNK_16:
            return mul, position
    return None


def _fp32_residual_add(node: fx.Node) -> tuple[fx.Node, fx.Node, list[fx.Node]] | None:
    """(a, b, the casts of the sum back to their dtype) when `node` is `add(a.float(), b.float())`
    of two 16-bit values of one dtype whose sum is also kept in that dtype."""
    if node.op != "call_function" or node.target is not aten.add.Tensor or len(node.args) != 2 or node.kwargs:
        return None
    a, b = (_cast_of(up, torch.float32) for up in node.args)
    if a is None or b is None or node_value(a) is None or node_value(b) is None:
        return None
    dtype = node_value(a).dtype
    if dtype not in _TRUNK_16 or node_value(b).dtype != dtype:
        return None
    kept = [u for u in node.users if cast_dtype(u) == dtype]
    return (a, b, kept) if kept else None


def _translate(graph: fx.Graph, node: fx.Node, a: fx.Node, b: fx.Node, kept: list[fx.Node]) -> Fp32ResidualTranslation:
    up_a, up_b = node.args
    with graph.inserting_before(node):
        total = graph.call_function(aten.add.Tensor, (a, b))
        total_f32 = graph.call_function(prims.convert_element_type.default, (total, torch.float32))
    fill_fake_values([total, total_f32])
    record = Fp32ResidualTranslation(
        total=total, total_f32=total_f32, fp32_sum=NodeRecipe.of(node), kept=NodeRecipe.of(kept[0]),
        residual_readers=[r for k in kept for r in k.users], sum_readers=[u for u in node.users if u not in kept])
    for k in kept:
        k.replace_all_uses_with(total)
        graph.erase_node(k)
    node.replace_all_uses_with(total_f32)
    graph.erase_node(node)
    for up in (up_a, up_b):  # a dead cast would read the all-reduce: the rule could not take it
        if up.users:
            record.upcasts.append(up)
        else:
            record.upcasts.append(NodeRecipe.of(up))
            graph.erase_node(up)
    found = _weight_multiply(total_f32)
    if found is not None:
        mul, position = found
        with graph.inserting_before(mul):
            record.weight_f32 = graph.call_function(prims.convert_element_type.default,
                                                    (mul.args[position], torch.float32))
        fill_fake_values([record.weight_f32])
        mul.replace_input_with(mul.args[position], record.weight_f32)
        record.sum_readers.append(mul)  # reads the weight's cast
    return record


def translate_fp32_residual_norms(graph: fx.Graph, engines: set[str]) -> list[Fp32ResidualTranslation]:
    """Rewrite each `add(a.float(), b.float())` whose sum is also cast back to a and b's 16-bit
    dtype (the kept residual) to the trunk-dtype spelling the rules trace (see above), in graphs
    of an engine (`engines`: those whose ops the graph holds) that writes its norm that way."""
    if not _FP32_RESIDUAL_ENGINES & engines:
        return []
    out = []
    for node in list(graph.nodes):
        found = _fp32_residual_add(node)
        if found is not None:
            out.append(_translate(graph, node, *found))
    return out


def _restore(graph: fx.Graph, t: Fp32ResidualTranslation, rebuilt: set[fx.Node]) -> None:
    with graph.inserting_before(t.total):
        ups = []
        for operand, up in zip(t.total.args, t.upcasts):
            if isinstance(up, NodeRecipe):
                up = up.rebuild(graph, (operand, *up.args[1:]))
                rebuilt.add(up)
            ups.append(up)
        total = t.fp32_sum.rebuild(graph, tuple(ups))
        kept = t.kept.rebuild(graph, (total, *t.kept.args[1:]))
    if t.weight_f32 is not None:
        t.weight_f32.replace_all_uses_with(t.weight_f32.args[0])
        graph.erase_node(t.weight_f32)
    t.total_f32.replace_all_uses_with(total)
    t.total.replace_all_uses_with(kept)
    graph.erase_node(t.total_f32)
    graph.erase_node(t.total)


def restore_fp32_residual_norms(graph: fx.Graph, translations: list[Fp32ResidualTranslation]) -> set[fx.Node]:
    """Put back each fp32-residual add no rule consumed; returns the nodes put back (readers of the
    engine ops' stand-ins, for `restore_engine_ops`)."""
    rebuilt: set[fx.Node] = set()
    for t in reversed(translations):
        new = t.new_nodes()
        allowed = set(new) | set(t.residual_readers) | set(t.sum_readers)
        if any(is_erased(n) for n in new) or any(u not in allowed for n in new for u in n.users):
            continue
        _restore(graph, t, rebuilt)
    return rebuilt


__all__ = ["register_fp32_residual_norm", "translate_fp32_residual_norms", "restore_fp32_residual_norms",
           "Fp32ResidualTranslation"]
