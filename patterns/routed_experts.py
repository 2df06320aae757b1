"""The routed experts: gate/up projections, SiTU-GLU, down projection per (token, slot) pair ->
k3fuse.routed_experts, or over 4-bit experts -> k3fuse.routed_experts_w4a16.

Why: at decode the routed experts are the MoE's largest weight read, and the model's spellings
either sort the pairs and launch three grouped GEMMs plus the sort, searchsorted, gathers and the
scatter back (CUDA), or copy one expert weight per pair (CPU). k3fuse.routed_experts is one op
whose kernel reads each selected expert's weights once per step, so the whole block is one
dispatch (and one place to put a better kernel).

Spelling: `routed_experts_grouped` and `routed_experts_gathered` of k3fuse/spelling.py, imported and
traced as is (the model calls `routed_experts`, which picks one of them, so they cannot drift):
    grouped:  argsort(experts) -> index_select -> searchsorted(arange(1, E+1)) -> index_select(a, order // k)
              -> _grouped_mm(w1), _grouped_mm(w3) -> situ_glu -> _grouped_mm(w2) -> index_copy back
    gathered: a expanded to [T, k, L] -> bmm(w1[experts]), bmm(w3[experts]) -> situ_glu -> bmm(w2[experts])
top_k, beta and linear_beta are literal wildcards. The example tensors are meta tensors with T*k
expert ids, where k is the int wildcard's sentinel (traced into the expand's shape and the
floor division): no real allocation. The trace bakes sizes into arguments (the expand's [T, k, L],
the scatter buffer's [T*k, L], arange's end E), so those are free sizes (`PatternSpec.free_sizes`),
captured and checked against the operands' shapes; the factory ops' meta device matches any
device. `torch._grouped_mm` has a fake impl for bf16 only (this torch), so the grouped spelling is
traced in bf16, the one dtype `use_grouped_mm` picks it for that the op runs in; the gathered one
in fp32 and bf16 (its situ_glu casts differ).
Runs after fused_routing (the expert ids are route_topk's, reshaped); shared_expert_stream, after
it, anchors its join on the routed output further down (the weighted sum, all-reduce and W_up), which
is still computed from the MoE input through the op, so it finds its join as before.

Needs: a [T, L] (any trunk dtype), experts int64 [T*top_k], w1/w3 [E, I, L] and w2 [E, L, I] static
in a's dtype, decode tokens; on a GPU, a kernel that covers (E, I, L, top_k, dtype) at those tokens.

HF transformers' experts (`batched_mm_experts_forward`, Kimi Linear / DeepSeek-V3 / Kimi K2.5) are
`routed_experts_batched_hf` (variant "batched"): the tokens copied with `repeat_interleave`, a packed
gate_up_proj [E, 2I, L] with one bmm and a `chunk` into gate and up, `squeeze` after each bmm
(torch.export's core decomposition writes `squeeze.dims`, the vocabulary reads it as `squeeze.dim`);
I (the split size) is a free size. The op takes w1 = gate_up[:, :I] and w3 = gate_up[:, I:] (slices of
the static table, views); the CUDA kernels read contiguous w1/w3, so on a GPU context the packed form
is refused (`kernel_layout`) until a kernel takes the expert stride. The same form is traced with the
activations HF's models use, SiLU-GLU (Kimi Linear, DeepSeek-V3, K2.5) and ungated relu^2 (Nemotron-H,
`has_gate=False`), so that their sites are refused with the activation named (`activation`): the op
computes SiTU-GLU.

Quantized experts (K3's MXFP4, K2.x's int4; k3fuse/quant.py): `routed_experts_quantized_grouped` and
`_gathered` (the step's distinct experts gathered into min(T*k, E) slots, dequantized, then the
spellings above) -> k3fuse.routed_experts_w4a16, whose kernel reads the packed weights and scales
and dequantizes in registers. One pattern per format (the dequantization differs), form and layout
(a model holding its tables in block order un-blocks the selected experts with one
k3fuse.from_block_order node before it dequantizes them; the op is told the layout); the variant and the
log name the format and the layout. top_k is read off the shapes there (a free size, not an int
wildcard: see QUANT_TOP_K), and the trace bakes in the slot count min(T*k, E) besides the sizes
above (free sizes, checked against the operands, whose shapes the guards check for groups of 32).
E, I and L must be static; the token count may be symbolic (a recompile for a second batch size).
Needs: packed weights and scales static in the format's layout and dtypes (mxfp4 uint8 / uint8, int4
int32 / bf16, the pattern's), MXFP4's E2M1 table a static buffer (the kernel checks its values once);
blocks: I and L whole steps of quant.BLOCK_STEP.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from k3fuse.kernels.ops.routed_experts import RoutedExpertsSpec
from k3fuse.kernels.ops.routed_experts_w4a16 import RoutedExpertsW4A16Spec
from k3fuse.rule_api import (DecodeContext, GuardFailure, Match, PatternSpec, Rule, Variant, compiled_patterns,
                             failures, int_sentinel, kernel_covers, near_miss, shape_of, site_tokens, static_weight,
                             token_count)
from k3fuse.spelling import (routed_experts_batched_hf, routed_experts_batched_ungated_hf, routed_experts_gathered,
                             routed_experts_grouped, routed_experts_quantized_gathered,
                             routed_experts_quantized_grouped, situ_glu)

from k3fuse import quant, spelling

from ._pattern_tools import dtype_of, numeric_literals

aten = torch.ops.aten

#: example sizes: distinctive, so no other literal of the traced pattern equals them (they become free
#: sizes); L and I multiples of 8 (torch._grouped_mm's 16-byte row alignment in bf16)
T, L, E, I = 1031, 1048, 1021, 1040
TOP_K, BETA, LINEAR_BETA = 16, 4.0, 25.0
GATHERED, GROUPED, BATCHED = "gathered", "grouped", "batched"
#: the quantized patterns' example widths: whole groups of GROUP_SIZE, distinct from every other size
QL, QI = 47 * quant.GROUP_SIZE, 41 * quant.GROUP_SIZE
QUANT_FORMATS = ("mxfp4", "int4")


@dataclass(frozen=True)
class Form:
    """A variant's spelling (grouped GEMMs or gathered bmm) and, for 4-bit experts, their checkpoint
    format and the layout the model holds the packed tables in (None: BF16 experts)."""

    spelling: str  # GROUPED | GATHERED | BATCHED (HF's packed gate/up)
    format: str | None = None  # a quant format ("mxfp4", "int4"), None for BF16
    layout: str = "rows"
    activation: str = "situ"  # what the experts compute between the projections: ACTIVATIONS


def _top_k_sentinel() -> int:
    """The value the matcher traces top_k (parameter 5) as: the example's T*k expert ids use it."""
    return int_sentinel(5)


def _example(dtype: torch.dtype) -> tuple:
    meta = {"device": "meta", "dtype": dtype}
    pairs = T * _top_k_sentinel()
    return (torch.empty(T, L, **meta), torch.empty(pairs, device="meta", dtype=torch.int64),
            torch.empty(E, I, L, **meta), torch.empty(E, I, L, **meta), torch.empty(E, L, I, **meta),
            TOP_K, BETA, LINEAR_BETA)


def _spec(form: str, fn: Any, dtype: torch.dtype, free_sizes: tuple[tuple[str, int], ...]) -> PatternSpec:
    key = Variant(form, dtype, Form(form))
    return PatternSpec(str(key), fn, lambda: _example(dtype), key, free_sizes)


# --- HF's batched_mm experts: one traced function per activation -----------------------------------
#: the activations HF's experts compute, by name: what the log says of a refused site
ACTIVATIONS = {"situ": "SiTU-GLU", "silu": "SiLU-GLU, silu(g) * u", "relu2": "ungated relu^2, relu(u)^2"}


def _batched_situ(a, experts, gate_up, w2, top_k, beta, linear_beta):
    return routed_experts_batched_hf(a, experts, gate_up, w2, top_k, lambda g, u: situ_glu(g, u, beta, linear_beta))


def _batched_silu(a, experts, gate_up, w2, top_k):
    return routed_experts_batched_hf(a, experts, gate_up, w2, top_k, lambda g, u: F.silu(g) * u)


def _batched_relu2(a, experts, w_up, w2, top_k):
    return routed_experts_batched_ungated_hf(a, experts, w_up, w2, top_k, lambda h: torch.square(F.relu(h)))


_BATCHED = {"situ": _batched_situ, "silu": _batched_silu, "relu2": _batched_relu2}


def _batched_example(activation: str, dtype: torch.dtype) -> tuple:
    """Meta tensors (top_k, parameter 4, is the int wildcard: T*k expert ids); the gated forms' packed
    table [E, 2I, L], the ungated one's [E, I, L]."""
    meta = {"device": "meta", "dtype": dtype}
    pairs = T * int_sentinel(4)
    up_rows = I if activation == "relu2" else 2 * I
    out = (torch.empty(T, L, **meta), torch.empty(pairs, device="meta", dtype=torch.int64),
           torch.empty(E, up_rows, L, **meta), torch.empty(E, L, I, **meta), TOP_K)
    return (*out, BETA, LINEAR_BETA) if activation == "situ" else out


def _batched_spec(activation: str, dtype: torch.dtype) -> PatternSpec:
    form = BATCHED if activation == "situ" else f"{BATCHED}_{activation}"
    key = Variant(form, dtype, Form(BATCHED, activation=activation))
    sizes = (("tokens", T), ("latent", L)) + ((("inter", I),) if activation != "relu2" else ())
    return PatternSpec(str(key), _BATCHED[activation], lambda: _batched_example(activation, dtype), key, sizes)


def _activation_failure(match: Match, form: Form) -> GuardFailure | None:
    """A form traced with another activation than K3's: what the op computes is not what the site does."""
    if form.activation == "situ":
        return None
    return GuardFailure("site", "activation", f"the experts compute {ACTIVATIONS[form.activation]}; "
                        "k3fuse.routed_experts computes K3's SiTU-GLU, another function of the same projections",
                        {"activation": form.activation, "spelling": form.spelling})


def _batched_failure(match: Match, ctx: DecodeContext) -> GuardFailure | None:
    """The packed form: gate_up [E, 2I, L] with the captured split size I, w2 [E, L, I], a [T, L], experts
    int64 [T*k] in a's dtype; on a GPU context the op's kernels need w1/w3 apart (contiguous)."""
    a, experts, gate_up, w2 = (shape_of(match[n]) for n in ("a", "experts", "gate_up", "w2"))
    top_k, inter = match.scalars.get("top_k"), match.scalars.get("inter")
    values: dict[str, Any] = {n: [str(d) for d in s] if s is not None else None
                              for n, s in (("a", a), ("experts", experts), ("gate_up", gate_up), ("w2", w2))}
    values.update(top_k=top_k, inter=inter)
    dtypes = {n: dtype_of(match[n]) for n in ("a", "gate_up", "w2")}
    if len(set(dtypes.values())) != 1 or dtype_of(match["experts"]) != torch.int64:
        return GuardFailure("site", "dtype", "a and the expert tables do not share a dtype, or the expert ids are "
                            "not int64", {**values, **{f"{n}_dtype": str(d) for n, d in dtypes.items()}})
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
        return GuardFailure("site", "top_k", "top_k is not a positive int literal", values)
    if (a is None or len(a) != 2 or experts is None or len(experts) != 1 or gate_up is None or len(gate_up) != 3
            or w2 is None or len(w2) != 3 or not isinstance(inter, int)
            or [str(d) for d in gate_up] != [str(w2[0]), str(2 * inter), str(a[1])]
            or [str(d) for d in w2[1:]] != [str(a[1]), str(inter)] or str(experts[0]) != str(a[0] * top_k)):
        return GuardFailure("site", "shape", "operands are not a [T, L], experts [T*top_k], gate_up [E, 2I, L] split "
                            "at I and w2 [E, L, I]", values)
    for name, want in {"tokens": a[0], "latent": a[1]}.items():
        if name in match.scalars and str(match.scalars[name]) != str(want):
            return GuardFailure("site", "shape", f"the traced size {name} is not the operands'",
                                {**values, name: match.scalars[name], "expected": str(want)})
    if ctx.device_capability is not None:
        return GuardFailure("site", "kernel_layout", "packed gate_up_proj: the CUDA kernels read w1/w3 [E, I, L] "
                            "contiguous, and the halves of the packed [E, 2I, L] table are strided views",
                            values)
    return numeric_literals(match.scalars, ("beta", "linear_beta"), values)


# --- quantized experts: one traced function per format and form (the format is not a wildcard: it
# picks the dequantization). top_k is no int wildcard here but a free size (read off the shapes):
# torch's meta cumsum (expert_slots) builds a pairs x pairs mask, which an int wildcard's ~1e9
# sentinel in the pair count would overflow ----------------------------------------------------------
def _top_k_of(a: torch.Tensor, experts: torch.Tensor) -> int:
    return experts.shape[0] // a.shape[0]


def _quantized_spelling(fmt: str, form: str, layout: str):
    """The traced function of one quantized pattern: the model's spelling with the format, form and layout
    fixed (the format picks the dequantization, the layout whether the selected experts are un-blocked);
    MXFP4's E2M1 table is a wildcard input, int4 has none."""
    spelled = routed_experts_quantized_grouped if form == GROUPED else routed_experts_quantized_gathered
    if fmt == "mxfp4":
        def spelling(a, experts, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale, beta, linear_beta,
                     table):
            return spelled(a, experts, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale,
                           _top_k_of(a, experts), beta, linear_beta, fmt, table, layout)
    else:
        def spelling(a, experts, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale, beta, linear_beta):
            return spelled(a, experts, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale,
                           _top_k_of(a, experts), beta, linear_beta, fmt, None, layout)
    spelling.__name__ = f"{fmt}_{form}_{layout}"
    return spelling


#: the quantized examples' top_k (a free size: a value no other literal of the trace has)
QUANT_TOP_K = 37
#: the sizes each quantized form's trace bakes in besides top_k (the dequantization's own reshapes
#: are folded away): the slot count min(T*k, E), L and the pair count; the gathered form's expand
#: its token count too
QUANT_FREE_SIZES = {GROUPED: ("slots", "latent", "pairs"), GATHERED: ("slots", "latent", "pairs", "tokens")}


def _quantized_example(fmt: str, dtype: torch.dtype) -> tuple:
    """Meta tensors in `fmt`'s checkpoint layout (int4 scales in bf16 whatever the trunk, as K2.x
    checkpoints and the model store them)."""
    meta = {"device": "meta"}
    w13, w2 = quant.packed_shape(fmt, QI, QL), quant.packed_shape(fmt, QL, QI)
    s13, s2 = quant.scale_shape(fmt, QI, QL), quant.scale_shape(fmt, QL, QI)
    packed, scale = quant.packed_dtype(fmt), quant.scale_dtype(fmt)
    weights = []
    for shape, sshape in ((w13, s13), (w13, s13), (w2, s2)):
        weights += [torch.empty(E, *shape, dtype=packed, **meta), torch.empty(E, *sshape, dtype=scale, **meta)]
    table = (torch.empty(16, dtype=torch.float32, **meta),) if fmt == "mxfp4" else ()
    return (torch.empty(T, QL, dtype=dtype, **meta), torch.empty(T * QUANT_TOP_K, dtype=torch.int64, **meta),
            *weights, BETA, LINEAR_BETA, *table)


def _quantized_spec(fmt: str, form: str, layout: str, dtype: torch.dtype) -> PatternSpec:
    # the variant's name: "<form>_<format>", and "_blocks" after it for block-ordered tables
    key = Variant(f"{form}_{fmt}" + ("" if layout == "rows" else f"_{layout}"), dtype, Form(form, fmt, layout))
    pairs = T * QUANT_TOP_K
    size_of = {"slots": min(pairs, E), "latent": QL, "pairs": pairs, "tokens": T}
    sizes = (("top_k", QUANT_TOP_K), *((n, size_of[n]) for n in QUANT_FREE_SIZES[form]))
    return PatternSpec(str(key), _quantized_spelling(fmt, form, layout), lambda: _quantized_example(fmt, dtype), key,
                       sizes)


def _quantized_failure(match: Match, fmt: str, layout: str) -> GuardFailure | None:
    """a [T, L]; experts int64 [T*k]; the packed weights and scales in `fmt`'s layout for E experts of
    I x L / L x I with groups of 32, in its dtypes; the captured sizes equal those (slots min(T*k, E));
    block-ordered tables (`layout` blocks) of whole steps."""
    names = ("a", "experts", "w1_packed", "w1_scale", "w3_packed", "w3_scale", "w2_packed", "w2_scale")
    shapes = {n: shape_of(match[n]) for n in names}
    top_k = match.scalars.get("top_k")
    values: dict[str, Any] = {n: [str(d) for d in s] if s is not None else None for n, s in shapes.items()}
    values.update(top_k=top_k, format=fmt, layout=layout)
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
        return GuardFailure("site", "top_k", "top_k is not a positive int literal", values)
    a, experts, w1 = shapes["a"], shapes["experts"], shapes["w1_packed"]
    if a is None or len(a) != 2 or experts is None or len(experts) != 1 or w1 is None or len(w1) != 3:
        return GuardFailure("site", "shape", "operands are not a [T, L], experts [T*k] and stacked [E, ...] "
                            "packed weights", values)
    n_experts, inter, latent = w1[0], w1[1], a[1]
    if not all(isinstance(d, int) for d in (n_experts, inter, latent)):
        return GuardFailure("site", "shape", "E, I and L must be static (only the token count may be symbolic)",
                            values)
    if inter % quant.GROUP_SIZE or latent % quant.GROUP_SIZE:
        return GuardFailure("site", "group_size", f"I and L must be whole groups of {quant.GROUP_SIZE}",
                            {**values, "I": inter, "L": latent})
    if layout == "blocks" and (inter % quant.BLOCK_STEP or latent % quant.BLOCK_STEP):
        return GuardFailure("site", "layout", f"block-ordered tables need I and L in whole steps of "
                            f"{quant.BLOCK_STEP}", {**values, "I": inter, "L": latent})
    if str(experts[0]) != str(a[0] * top_k):
        return GuardFailure("site", "shape", "expected experts [T*top_k] for a [T, L]", values)
    want = {"w1_packed": (n_experts, *quant.packed_shape(fmt, inter, latent)),
            "w1_scale": (n_experts, *quant.scale_shape(fmt, inter, latent)),
            "w2_packed": (n_experts, *quant.packed_shape(fmt, latent, inter)),
            "w2_scale": (n_experts, *quant.scale_shape(fmt, latent, inter))}
    want["w3_packed"], want["w3_scale"] = want["w1_packed"], want["w1_scale"]
    wrong = {n: tuple(shapes[n] or ()) for n in want if tuple(shapes[n] or ()) != want[n]}
    if wrong:
        return GuardFailure("site", "shape", f"operand shapes are not {fmt}'s layout with groups of "
                            f"{quant.GROUP_SIZE}", {**values, "expected": {n: want[n] for n in wrong}})
    packed = quant.packed_dtype(fmt)
    dtypes = {n: dtype_of(match[n]) for n in names}
    scale_ok = (lambda d: d == torch.uint8) if fmt == "mxfp4" else (lambda d: d is not None and d.is_floating_point)
    if (dtypes["experts"] != torch.int64 or any(dtypes[n] != packed for n in ("w1_packed", "w3_packed", "w2_packed"))
            or not all(scale_ok(dtypes[n]) for n in ("w1_scale", "w3_scale", "w2_scale"))):
        return GuardFailure("site", "dtype", f"the packed weights or scales are not {fmt}'s dtypes, or the expert "
                            "ids are not int64", {**values, **{f"{n}_dtype": str(d) for n, d in dtypes.items()}})
    pairs = a[0] * top_k
    slots = spelling.slot_count(pairs, n_experts)
    captured = {"tokens": a[0], "latent": latent, "pairs": pairs, "slots": slots}
    for name, want_size in captured.items():
        if name in match.scalars and str(match.scalars[name]) != str(want_size):
            return GuardFailure("site", "shape", f"the traced size {name} is not the operands'",
                                {**values, name: match.scalars[name], "expected": str(want_size)})
    return numeric_literals(match.scalars, ("beta", "linear_beta"), values)


def _operand_failure(match: Match) -> GuardFailure | None:
    """a [T, L]; experts int64 [T*k]; w1/w3 [E, I, L], w2 [E, L, I] in a's dtype; the free sizes
    the match captured equal those shapes; numeric beta and linear_beta."""
    a, experts = shape_of(match["a"]), shape_of(match["experts"])
    w1, w3, w2 = (shape_of(match[n]) for n in ("w1", "w3", "w2"))
    top_k = match.scalars.get("top_k")
    values: dict[str, Any] = {n: [str(d) for d in s] if s is not None else None
                              for n, s in (("a", a), ("experts", experts), ("w1", w1), ("w3", w3), ("w2", w2))}
    values["top_k"] = top_k
    dtypes = {n: dtype_of(match[n]) for n in ("a", "w1", "w3", "w2")}
    if len(set(dtypes.values())) != 1 or dtype_of(match["experts"]) != torch.int64:
        return GuardFailure("site", "dtype", "a and the expert weights do not share a dtype, or the expert ids "
                            "are not int64", {**values, **{f"{n}_dtype": str(d) for n, d in dtypes.items()},
                                             "experts_dtype": str(dtype_of(match["experts"]))})
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
        return GuardFailure("site", "top_k", "top_k is not a positive int literal", values)
    if (a is None or len(a) != 2 or experts is None or len(experts) != 1 or w1 is None or len(w1) != 3
            or w3 is None or tuple(w3) != tuple(w1) or w2 is None or len(w2) != 3):
        return GuardFailure("site", "shape", "operands are not a [T, L], experts [T*k], w1/w3 [E, I, L], "
                            "w2 [E, L, I]", values)
    if not (str(experts[0]) == str(a[0] * top_k) and str(w1[2]) == str(a[1])
            and [str(d) for d in w2] == [str(w1[0]), str(a[1]), str(w1[1])]):
        return GuardFailure("site", "shape", "operand shapes disagree: expected experts [T*top_k], w1/w3 "
                            "[E, I, L], w2 [E, L, I] for a [T, L]", values)
    captured = {"tokens": a[0], "latent": a[1], "pairs": experts[0], "n_experts": w1[0]}
    for name, want in captured.items():
        if name in match.scalars and str(match.scalars[name]) != str(want):
            return GuardFailure("site", "shape", f"the traced size {name} is not the operands'",
                                {**values, name: match.scalars[name], "expected": str(want)})
    return numeric_literals(match.scalars, ("beta", "linear_beta"), values)


class RoutedExperts(Rule):
    """sort/grouped GEMMs or gather/bmm over the (token, slot) pairs  ->  k3fuse.routed_experts; the same
    after dequantizing 4-bit experts  ->  k3fuse.routed_experts_w4a16."""

    name = "routed_experts"
    emits = ("routed_experts", "routed_experts_w4a16")
    description = ("the routed experts (W1/W3 projections, SiTU-GLU, W2 per (token, slot) pair; grouped GEMMs or "
                   "gathered bmm; BF16 or dequantized MXFP4/int4) -> k3fuse.routed_experts / "
                   "routed_experts_w4a16 (one op: each selected expert's weights read once, 4-bit ones "
                   "dequantized in registers)")
    site_op = aten._grouped_mm.default

    def patterns(self) -> list[PatternSpec]:
        gathered_sizes = (("tokens", T), ("latent", L))
        # quantized first: their dequantized slots feed the BF16 spellings, which must not claim them
        forms = ((GROUPED, (torch.bfloat16,)), (GATHERED, (torch.float32, torch.bfloat16)))
        quantized = [_quantized_spec(fmt, form, layout, dtype) for fmt in QUANT_FORMATS
                     for layout in quant.EXPERT_LAYOUTS for form, dtypes in forms for dtype in dtypes]
        batched = [_batched_spec(activation, dtype) for activation in ACTIVATIONS
                   for dtype in (torch.float32, torch.bfloat16)]
        return quantized + [_spec(GROUPED, routed_experts_grouped, torch.bfloat16,
                      (("pairs", T * _top_k_sentinel()), ("latent", L), ("n_experts", E))),
                _spec(GATHERED, routed_experts_gathered, torch.float32, gathered_sizes),
                _spec(GATHERED, routed_experts_gathered, torch.bfloat16, gathered_sizes)] + batched

    def explain_miss(self, graph: fx.Graph, ctx: DecodeContext) -> tuple[str, dict[str, Any]] | None:
        """The matcher's near-miss search from the spelling whose GEMM the graph has: _grouped_mm
        for the grouped spelling, bmm for the gathered one."""
        present = {n.target for n in graph.nodes if n.op == "call_function"}
        compiled = compiled_patterns(self)
        for site_op, forms in ((aten._grouped_mm.default, (GROUPED,)), (aten.bmm.default, (GATHERED, BATCHED))):
            if site_op in present:
                return near_miss(graph, [c for c in compiled if c.spec.key.params.spelling in forms],
                                 site_op=site_op)
        return "no aten._grouped_mm or aten.bmm in the graph (no routed experts)", {}

    def check_site(self, match: Match, ctx: DecodeContext) -> list[GuardFailure]:
        form = match.params(Form)
        found = failures(_activation_failure(match, form))
        if found:
            return found
        if form.format is not None:
            return self._check_quantized(match, ctx, form.format, form.layout)
        tables = ("gate_up", "w2") if form.spelling == BATCHED else ("w1", "w3", "w2")
        operands = _batched_failure(match, ctx) if form.spelling == BATCHED else _operand_failure(match)
        found = failures(operands, *(static_weight(match[n], n) for n in tables))
        if found:
            return found
        found = failures(token_count(match["a"], ctx))
        if found:
            return found
        E, I, L = _table_sizes(match, form)  # noqa: E741
        spec = RoutedExpertsSpec(E=E, I=I, L=L, top_k=match["top_k"], dtype=dtype_of(match["a"]))
        return failures(kernel_covers(ctx, spec, site_tokens(match["a"])))

    def _check_quantized(self, match: Match, ctx: DecodeContext, fmt: str, layout: str) -> list[GuardFailure]:
        weights = ("w1_packed", "w1_scale", "w3_packed", "w3_scale", "w2_packed", "w2_scale")
        found = failures(_quantized_failure(match, fmt, layout), *(static_weight(match[n], n) for n in weights),
                         static_weight(match["table"], "table") if fmt == "mxfp4" else None)
        if found:
            return found
        found = failures(token_count(match["a"], ctx))
        if found:
            return found
        w1, a = shape_of(match["w1_packed"]), shape_of(match["a"])
        spec = RoutedExpertsW4A16Spec(E=w1[0], I=w1[1], L=a[1], top_k=match["top_k"], dtype=dtype_of(match["a"]),
                                      format=fmt, scale_dtype=dtype_of(match["w1_scale"]), layout=layout)
        return failures(kernel_covers(ctx, spec, site_tokens(match["a"])))

    def rewrite(self, match: Match, ctx: DecodeContext) -> list[fx.Node]:
        form = match.params(Form)
        common = dict(a=match["a"], experts=match["experts"], top_k=match["top_k"], situ_beta=float(match["beta"]),
                      situ_linear_beta=float(match["linear_beta"]), strict=ctx.strict)
        if form.format is not None:
            weights = {n: match[n] for n in ("w1_packed", "w1_scale", "w3_packed", "w3_scale", "w2_packed",
                                             "w2_scale")}
            new = match.replace_with(torch.ops.k3fuse.routed_experts_w4a16.default, **common, **weights,
                                     format=form.format, layout=form.layout,
                                     table=match["table"] if form.format == "mxfp4" else None)
            w1 = shape_of(match["w1_packed"])
            match.note(format=form.format, layout=form.layout, top_k=match["top_k"], E=w1[0], I=w1[1],
                       group_size=quant.GROUP_SIZE)
            return new
        if form.spelling == BATCHED:  # the packed table's halves, views of the static weight
            inter = match["inter"]
            tables = {"w1": match.insert(aten.slice.Tensor, (match["gate_up"], 1, 0, inter)),
                      "w3": match.insert(aten.slice.Tensor, (match["gate_up"], 1, inter, 2 * inter)),
                      "w2": match["w2"]}
        else:
            tables = {n: match[n] for n in ("w1", "w3", "w2")}
        new = match.replace_with(torch.ops.k3fuse.routed_experts.default, **common, **tables)
        E, I, _ = _table_sizes(match, form)  # noqa: E741
        match.note(top_k=match["top_k"], E=E, I=I, **({"packed_gate_up": True} if form.spelling == BATCHED else {}))
        return new


def _table_sizes(match: Match, form: Form) -> tuple[int, int, int]:
    """(E, I, L) of a BF16 site: w1's shape, or the packed table's with its split size."""
    if form.spelling == BATCHED:
        E, _, L = shape_of(match["gate_up"])
        return E, match["inter"], L
    return tuple(shape_of(match["w1"]))


__all__ = ["RoutedExperts"]
