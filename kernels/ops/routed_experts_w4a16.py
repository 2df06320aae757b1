"""routed_experts_w4a16: the routed experts over 4-bit experts in the checkpoint's layouts, one op.

`routed_experts` (kernels/ops/routed_experts.py) on the dequantized weights of k3fuse/quant.py's
formats: `format` "mxfp4" (w uint8 [E, out, in/2] E2M1 nibbles, scales uint8 E8M0 [E, out, in/32];
`table` the spelling's 16 E2M1 values, or None) or "int4" (w int32 [E, out, in/8] of q + 8
nibbles, scales a float dtype [E, out, in/32]; no table), held in `layout` "rows" (as the checkpoint
stores them) or "blocks" (k3fuse.quant.block_order's, where the CuTe kernel's copy of a step is contiguous;
both kernels read either layout in place). z[p] = w2[e_p] @ situ_glu(w1[e_p] @ a[p // k], w3[e_p] @ a[p // k]), rounded to a's dtype
after each projection. Stock: the model's
`routed_experts_quantized` (the step's experts gathered, dequantized, grouped GEMMs on CUDA);
reference: the same dequantization, then the gathered bmm (any device); CUDA, both reading the packed
words and scales once and dequantizing in registers: lib/composite/routed_experts_w4a16.py (bf16 activations
with MXFP4, or int4 with bf16 scales: the CuTe expert GEMMs on mma.sync between the Triton grouping and
SiTU-GLU, tried first) and lib/triton/routed_experts_w4a16.py (both formats, bf16 and fp16). This module holds
the op's Spec, its kernels' predicates and their registration.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from k3fuse import settings
from k3fuse.quant import BLOCK_STEP, EXPERT_LAYOUTS
from k3fuse.spelling import routed_experts_quantized, routed_experts_quantized_gathered

from ..declare import OpDecl, declare
from ..dispatch import Impl, register_impl
from ..spec import Spec, call_only, operands_misfit

OP = "routed_experts_w4a16"
#: the formats and the packed elements per stored item: uint8 bytes of two E2M1 nibbles, int32 words of eight
FORMATS = {"mxfp4": 2, "int4": 8}
GROUP = 32  # elements per scale, both formats


@dataclass(frozen=True, kw_only=True)
class RoutedExpertsW4A16Spec(Spec):
    """a [tokens, L]; E experts of I x L (w1, w3) and L x I (w2) in `format`; experts [tokens * top_k]."""

    op: ClassVar[str] = OP
    E: int
    I: int  # noqa: E741 (the model's name for the expert intermediate size)
    L: int
    top_k: int
    dtype: torch.dtype
    format: str
    scale_dtype: torch.dtype  # MXFP4's E8M0 bytes (uint8), int4's float dtype
    layout: str = "rows"  # the tables' layout (k3fuse.quant.EXPERT_LAYOUTS)
    fits: str | None = call_only(None)  # why a call's operands are not the kernel's (devices, layouts, table)
    unaligned: str | None = call_only(None)  # tables off what CuTe's copies need (scale_alignment)

    @classmethod
    def from_call(cls, a, experts, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale, top_k, situ_beta,
                  situ_linear_beta, format, table=None, layout="rows", **_: Any) -> RoutedExpertsW4A16Spec:
        fits = _operands_misfit(a, experts, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale, top_k,
                                situ_beta, situ_linear_beta, format, table, layout)
        if fits is not None:
            return cls(tokens=0, E=0, I=0, L=0, top_k=int(top_k), dtype=torch.float32, format=str(format),
                       scale_dtype=torch.uint8, layout=str(layout), fits=fits)
        return cls(tokens=int(a.shape[0]), E=int(w1_packed.shape[0]), I=int(w1_packed.shape[1]), L=int(a.shape[1]),
                   top_k=int(top_k), dtype=a.dtype, format=str(format), scale_dtype=w1_scale.dtype, layout=layout,
                   unaligned=_unaligned(scale_alignment(w1_scale.dtype), w1_packed=w1_packed, w3_packed=w3_packed,
                                        w2_packed=w2_packed, w1_scale=w1_scale, w3_scale=w3_scale,
                                        w2_scale=w2_scale))


def scale_alignment(scale_dtype: torch.dtype) -> int:
    """The bytes a scale table's start must be aligned to for the CuTe kernel's copies: a row's scales of
    a step (its groups) in one copy."""
    from ..lib.cute.routed_experts_w4a16 import GROUPS_PER_STEP

    return GROUPS_PER_STEP * scale_dtype.itemsize


def _unaligned(scale_align: int, **tensors) -> str | None:
    """The packed weights whose storage is not 16-byte aligned and the scales not `scale_align`-byte aligned
    (a view into a larger tensor can be either), named; None for fake tensors (tracing) and aligned ones."""
    from torch._subclasses.fake_tensor import FakeTensor

    bad = [n for n, t in tensors.items()
           if not isinstance(t, FakeTensor) and t.data_ptr() % (16 if n.endswith("packed") else scale_align)]
    return f"{', '.join(bad)} not 16-byte (weights) / {scale_align}-byte (scales) aligned" if bad else None


def _operands_misfit(a, experts, w1, s1, w3, s3, w2, s2, top_k, situ_beta, situ_linear_beta, fmt,
                     table, layout) -> str | None:
    """Why a call's operands are not what the kernel reads (devices, layouts, dtypes, the table)."""
    tensors = dict(a=a, experts=experts, w1=w1, s1=s1, w3=w3, s3=s3, w2=w2, s2=s2)
    misfit = operands_misfit(tensors)
    if misfit is not None:  # (the library module is loaded for CUDA calls only)
        return misfit
    if fmt not in FORMATS:
        return f"format {fmt!r} (mxfp4/int4 only)"
    if layout not in EXPERT_LAYOUTS:
        return f"layout {layout!r} (one of {EXPERT_LAYOUTS})"
    if a.dim() != 2 or w1.dim() != 3:
        return f"a {tuple(a.shape)} / w1 {tuple(w1.shape)} are not [T, L] / [E, I, L/{FORMATS[fmt]}]"
    from ..lib.triton import routed_experts_w4a16 as kernel

    E, I, L = w1.shape[0], w1.shape[1], a.shape[1]
    want = kernel.packed_shapes(fmt, E, I, L)
    got = {n: tuple(tensors[n].shape) for n in want}
    if got != want:
        return f"{fmt} shapes {got} are not {want} (group size {GROUP})"
    packed = torch.uint8 if fmt == "mxfp4" else torch.int32
    for name in ("w1", "w3", "w2"):
        if tensors[name].dtype != packed:
            return f"{name} is {tensors[name].dtype}, {fmt} packs {packed}"
    for name in ("s1", "s3", "s2"):
        dt = tensors[name].dtype
        if (fmt == "mxfp4" and dt != torch.uint8) or (fmt == "int4" and dt not in kernel.INT4_SCALE_DTYPES):
            return f"{name} is {dt}, {fmt} scales are {'uint8' if fmt == 'mxfp4' else 'bf16/fp16/fp32'}"
    if experts.dtype != torch.int64 or experts.dim() != 1 or experts.shape[0] != a.shape[0] * top_k:
        return f"experts {experts.dtype} {tuple(experts.shape)} is not int64 [T*top_k]"
    if table is not None:
        if fmt != "mxfp4":
            return f"a value table with format {fmt!r} (only mxfp4 has one)"
        if not isinstance(table, torch.Tensor) or table.device != a.device:
            return "the E2M1 table is not a tensor on a's device"
        if not kernel.table_decodes(table):
            return "the table is not the E2M1 values the kernel decodes"
    return None


def accepts(spec: RoutedExpertsW4A16Spec) -> str | None:
    """Why the Triton kernels (whose grouping every CUDA path runs) do not cover a call, in either layout."""
    from ..lib.triton import routed_experts_w4a16 as kernel

    if (missing := kernel.missing_features()) is not None:
        return missing
    if spec.fits is not None:
        return spec.fits
    T, fmt = spec.tokens, spec.format
    if fmt not in FORMATS:
        return f"format {fmt!r} (mxfp4/int4 only)"
    if spec.dtype not in kernel.DTYPES:
        return f"dtype {spec.dtype} (bf16/fp16 only)"
    if not 1 <= T <= kernel.MAX_TOKENS:
        return f"T={T} (needs 1 <= T <= {kernel.MAX_TOKENS})"
    if not 1 <= spec.E <= kernel.MAX_EXPERTS:
        return f"E={spec.E} (needs 1 <= E <= {kernel.MAX_EXPERTS})"
    if not 1 <= T * spec.top_k <= kernel.MAX_PAIRS:
        return f"T*top_k={T * spec.top_k} (needs <= {kernel.MAX_PAIRS})"
    if spec.I % GROUP or spec.L % GROUP or spec.I < GROUP or spec.L < GROUP:
        return f"I={spec.I}, L={spec.L} (both need whole groups of {GROUP})"
    if spec.layout == "blocks" and (spec.I % BLOCK_STEP or spec.L % BLOCK_STEP):
        return f"layout 'blocks' at I={spec.I}, L={spec.L} (block order needs whole steps of {BLOCK_STEP})"
    return None


def run(a, experts, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale, top_k, situ_beta,
        situ_linear_beta, format, table=None, layout="rows", **_):
    from ..lib.triton import routed_experts_w4a16 as kernel

    return kernel.run(a, experts, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale, top_k, situ_beta,
                      situ_linear_beta, format, table, layout)


def _warmup_args(s: dict) -> tuple:
    """The op's arguments for a warmup shape {"M", "E", "I", "L", "top_k", "format", and optionally "dtype",
    "scale_dtype" (int4's; default the dtype), "layout", "device"}: zero activations and a table of a few experts
    (E is no compile-time constant; only its divisibility by 16 is; zero tables are the same in either layout)."""
    from ..lib.triton import routed_experts_w4a16 as kernel

    dev, dtype, fmt = s.get("device", "cuda"), s.get("dtype", torch.bfloat16), s["format"]
    T, E, I, L, k = s["M"], s["E"], s["I"], s["L"], s["top_k"]
    few = 16 if E % 16 == 0 else E
    packed = torch.uint8 if fmt == "mxfp4" else torch.int32
    scale = torch.uint8 if fmt == "mxfp4" else s.get("scale_dtype", dtype)
    t = {n: torch.zeros(sh, dtype=packed if n.startswith("w") else scale, device=dev)
         for n, sh in kernel.packed_shapes(fmt, few, I, L).items()}
    experts = torch.arange(T * k, device=dev, dtype=torch.int64) % few
    return (torch.zeros((T, L), dtype=dtype, device=dev), experts, t["w1"], t["s1"], t["w3"], t["s3"], t["w2"],
            t["s2"], k, 1.0, 1.0, fmt, None, s.get("layout", "rows"))


def warmup(shapes) -> None:
    """Compile ahead of capture: one launch per shape (_warmup_args)."""
    from ..lib.triton import routed_experts_w4a16 as kernel

    for s in shapes:
        args = _warmup_args(s)
        if accepts(RoutedExpertsW4A16Spec.from_call(*args)) is None:
            kernel.run(*args)


def _fake(a, experts, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale, top_k, situ_beta,
          situ_linear_beta, format, table=None, layout="rows", strict=False):
    name = "k3fuse.routed_experts_w4a16"
    torch._check(format in FORMATS, lambda: f"{name}: format {format!r} is not one of {sorted(FORMATS)}")
    torch._check(layout in EXPERT_LAYOUTS, lambda: f"{name}: layout {layout!r} is not one of {EXPERT_LAYOUTS}")
    per = FORMATS[format]
    torch._check(a.dim() == 2, lambda: f"{name}: a must be the latent [T, L], got {tuple(a.shape)}")
    torch._check(experts.dim() == 1 and experts.dtype == torch.int64,
                 lambda: f"{name}: experts must be int64 [T*top_k], got {experts.dtype} {tuple(experts.shape)}")
    torch._check(experts.shape[0] == a.shape[0] * top_k,
                 lambda: f"{name}: {experts.shape[0]} expert ids for {a.shape[0]} tokens x top_k={top_k}")
    L = a.shape[1]
    torch._check(w1_packed.dim() == 3 and w1_packed.shape == w3_packed.shape and w1_packed.shape[2] * per == L,
                 lambda: f"{name}: {format} w1/w3 must be [E, I, L/{per}] with L={L}, got "
                         f"{tuple(w1_packed.shape)} / {tuple(w3_packed.shape)}")
    E, I = w1_packed.shape[0], w1_packed.shape[1]
    torch._check(tuple(w2_packed.shape) == (E, L, I // per) and I % per == 0,
                 lambda: f"{name}: {format} w2 must be [E, L, I/{per}] = {(E, L, I // per)}, got "
                         f"{tuple(w2_packed.shape)}")
    torch._check(table is None or (format == "mxfp4" and tuple(table.shape) == (16,)),
                 lambda: f"{name}: the table is MXFP4's 16 E2M1 values (int4 has none), got "
                         f"{tuple(table.shape)} for {format}")
    for what, scale, rows, cols in (("w1_scale", w1_scale, I, L), ("w3_scale", w3_scale, I, L),
                                    ("w2_scale", w2_scale, L, I)):
        torch._check(tuple(scale.shape) == (E, rows, cols // GROUP),
                     lambda what=what, scale=scale, rows=rows, cols=cols:
                     f"{name}: {what} must be [E, {rows}, {cols}/32] = {(E, rows, cols // GROUP)} (group size "
                     f"{GROUP}), got {tuple(scale.shape)}")
    return a.new_empty((experts.shape[0], L))


def cute_accepts(spec: RoutedExpertsW4A16Spec) -> str | None:
    """The CuTe expert GEMMs: bf16 activations with MXFP4, or int4 with bf16 scales (unless
    K3FUSE_W4A16_CUTE_INT4=0), at widths of whole 128-element steps (a thread quad's step along K); the
    grouping and the activation are the Triton kernels', so their coverage first."""
    from ..lib.cute import compat
    from ..lib.cute.routed_experts_w4a16 import STEP

    if (why := accepts(spec)) is not None:
        return why
    if not compat.available():
        return f"CuTe DSL unavailable ({compat.IMPORT_ERROR or 'disabled'})"
    if spec.unaligned is not None:
        return spec.unaligned
    if spec.dtype != torch.bfloat16 or spec.format == "int4" and spec.scale_dtype != torch.bfloat16:
        return (f"{spec.format} ({spec.scale_dtype} scales) with {spec.dtype} activations (the CuTe kernel runs "
                f"bf16 activations with mxfp4, or int4 with bf16 scales)")
    if spec.format == "int4" and not settings.get("K3FUSE_W4A16_CUTE_INT4"):
        return "int4 on the CuTe kernel is turned off (K3FUSE_W4A16_CUTE_INT4=0)"
    if spec.I % STEP or spec.L % STEP:
        return f"I={spec.I}, L={spec.L} (the CuTe kernel needs multiples of {STEP})"
    return None


def cute_run(*args, **kwargs) -> torch.Tensor:
    """The CuTe path's launches (lib/composite/routed_experts_w4a16.py: run), loaded with the first CUDA call."""
    from ..lib.composite import routed_experts_w4a16 as composite

    return composite.run(*args, **kwargs)


def cute_warmup(shapes) -> None:
    """Compile the CuTe launches of each shape (_warmup_args) it takes, on a few experts' zero table with
    the whole table's launch (E sizes only the grouped grid)."""
    from ..lib.composite.routed_experts_w4a16 import W4A16Launch

    for s in shapes:
        args = _warmup_args(s)
        if cute_accepts(RoutedExpertsW4A16Spec.from_call(*args)) is None:
            cute_run(*args, launch=W4A16Launch.for_call(s["format"], s["M"], s["E"], s["I"], s["L"], s["top_k"],
                                                        s.get("layout", "rows")))


DECL = OpDecl(OP, "(Tensor a, Tensor experts, Tensor w1_packed, Tensor w1_scale, Tensor w3_packed, Tensor w3_scale, "
                  "Tensor w2_packed, Tensor w2_scale, int top_k, float situ_beta, float situ_linear_beta, str format, "
                  "Tensor? table=None, str layout=\"rows\", bool strict=False) -> Tensor",
              _fake, routed_experts_quantized, routed_experts_quantized_gathered, spec=RoutedExpertsW4A16Spec)
DECLS = (DECL,)
declare(DECL)
register_impl(OP, Impl("cute.routed_experts_w4a16", cute_accepts, cute_run, priority=60, warmup=cute_warmup,
                       needs=("cute.compat", "cute.routed_experts_w4a16", "triton.routed_experts_w4a16",
                              "composite.routed_experts_w4a16")))
register_impl(OP, Impl("triton.routed_experts_w4a16", accepts, run, priority=50, warmup=warmup,
                       needs=("triton.routed_experts_w4a16",)))
