"""decode_gemm: y = x @ weight.T (+ bias) for the static-weight projections of a decode step.

Kernels: the CuTe GEMV (CUDA-core FMA, a pure weight stream) at 1-2 tokens, the Triton split-K
kernel (tensor cores) above: FMA becomes compute-bound by 8..64 tokens. The crossover is the
measured one (docs/perf.md); K3FUSE_GEMV_MAX_M overrides it for experiments.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from k3fuse import runtime

from ..declare import OpDecl, check_gemm, declare, rows
from ..dispatch import Impl, register_impl
from ..lib.reference import linear, stock
from ..spec import Spec, aligned, call_only

OP = "decode_gemm"
IO_DTYPES = (torch.bfloat16, torch.float16)
GEMV_MAX_M = 2
# measured exceptions to the crossover (docs/perf.md): the narrow router keeps the GEMV up to M=4
GEMV_MAX_M_BY_SHAPE = {(896, 7168): 4}
GEMV_MAX_ROWS = 8  # the GEMV kernel's token limit (one register row per token)


def gemv_max_m(N: int, K: int) -> int:
    """Largest token count the GEMV takes for weight [N, K] (the rest goes to split-K);
    K3FUSE_GEMV_MAX_M as the TP group agreed it (it decides the fused all-reduce's GEMM path)."""
    forced = runtime.path_setting("K3FUSE_GEMV_MAX_M")
    if forced is not None:
        return forced
    return GEMV_MAX_M_BY_SHAPE.get((N, K), GEMV_MAX_M)


@dataclass(frozen=True, kw_only=True)
class DecodeGemmSpec(Spec):
    """x [tokens, K] (leading dims flattened), weight [N, K]."""

    op: ClassVar[str] = OP
    N: int
    K: int
    dtype: torch.dtype
    out_dtype: torch.dtype
    bias: bool
    w_dtype: torch.dtype | None = call_only(None)  # None: the activation's dtype
    cuda: bool = call_only(True)
    fits: bool = call_only(True)  # x [.., K], weight [N, K] and bias [N] agree
    unit_stride: bool = call_only(True)  # x, weight (and bias) have a unit inner stride
    contiguous: bool = call_only(True)  # x, weight (and bias) contiguous and 16-byte aligned

    @classmethod
    def from_call(cls, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  out_dtype: torch.dtype | None = None, **_: Any) -> DecodeGemmSpec:
        x2 = x.reshape(-1, x.shape[-1])
        fits = (weight.dim() == 2 and x.shape[-1] == weight.shape[-1]
                and (bias is None or (bias.dim() == 1 and bias.shape[0] == weight.shape[0])))
        tensors = [t for t in (x2, weight, bias) if t is not None]
        return cls(tokens=x2.shape[0], N=int(weight.shape[0]), K=int(weight.shape[-1]), dtype=x.dtype,
                   out_dtype=out_dtype or x.dtype, bias=bias is not None, w_dtype=weight.dtype,
                   cuda=x.is_cuda, fits=fits, unit_stride=all(t.stride(-1) == 1 for t in tensors),
                   contiguous=all(aligned(t) for t in tensors))


def _call_facts(spec: DecodeGemmSpec) -> str | None:
    if not spec.cuda:
        return "not a CUDA tensor"
    if not spec.fits:
        return "x / weight / bias shapes do not fit"
    if spec.w_dtype not in (None, spec.dtype):
        return f"weight dtype {spec.w_dtype} differs from x {spec.dtype}"
    return None


def gemv_accepts(spec: DecodeGemmSpec, crossover: bool = True) -> str | None:
    """The GEMV's predicate; crossover=False asks only what the kernel can run (benches, GPU tests)."""
    from ..lib.cute import compat, gemv

    if not compat.available():
        return f"CuTe DSL unavailable ({compat.IMPORT_ERROR or 'disabled'})"
    M, N, K = spec.tokens, spec.N, spec.K
    if spec.dtype not in IO_DTYPES:
        return f"dtype {spec.dtype} (bf16/fp16 only)"
    if crossover and M > gemv_max_m(N, K):
        return f"M={M} > {gemv_max_m(N, K)}"
    if gemv.pick_config(M, N, K) is None:
        return f"no GEMV config for N={N} K={K}"
    if not 1 <= M <= GEMV_MAX_ROWS:
        return f"M={M} outside [1, {GEMV_MAX_ROWS}]"
    if spec.out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"out_dtype {spec.out_dtype}"
    if (why := _call_facts(spec)) is not None:
        return why
    if not spec.contiguous:
        return "x / weight / bias not contiguous and 16-byte aligned"
    return None


def gemv_run(x, weight, bias, out_dtype=None, **_):
    from ..lib.cute import gemv

    y = gemv.run(x.reshape(-1, x.shape[-1]), weight, bias, out_dtype or x.dtype)
    return y.view(*x.shape[:-1], weight.shape[0])


def gemv_warmup(shapes) -> None:
    """Compile the GEMV for every {"M","N","K","dtype","out_dtype"} it takes."""
    from ..lib.cute import compat, gemv

    for s in shapes:
        M, N, K = s["M"], s["N"], s["K"]
        dt = s.get("dtype", torch.bfloat16)
        spec = DecodeGemmSpec(tokens=M, N=N, K=K, dtype=dt, out_dtype=s.get("out_dtype") or dt,
                              bias=bool(s.get("bias", False)))
        if gemv_accepts(spec) is not None:  # the predicate decides, as at compile time and per call
            continue
        key, build = gemv.builder(M, K, *gemv.pick_config(M, N, K), dt, dt, spec.out_dtype, spec.bias)
        compat.compiled(key, build)


def splitk_accepts(spec: DecodeGemmSpec) -> str | None:
    from ..lib.triton import splitk_gemm

    if spec.dtype not in IO_DTYPES:
        return f"dtype {spec.dtype} (bf16/fp16 only)"
    if spec.out_dtype not in (spec.dtype, torch.float32):
        return f"out_dtype {spec.out_dtype}"
    if splitk_gemm.pick_config(spec.tokens, spec.N, spec.K) is None:
        return (f"M={spec.tokens} K={spec.K} (needs 1 <= M <= {splitk_gemm.MAX_M}, "
                f"K % {splitk_gemm.BLOCK_K} == 0)")
    if (why := _call_facts(spec)) is not None:
        return why
    if not spec.unit_stride:
        return "x / weight / bias need a unit inner stride"
    return None


def splitk_run(x, weight, bias, out_dtype=None, **_):
    from ..lib.triton import splitk_gemm

    y = splitk_gemm.run(x.reshape(-1, x.shape[-1]), weight, bias, out_dtype or x.dtype)
    return y.view(*x.shape[:-1], weight.shape[0])


def splitk_warmup(shapes) -> None:
    """Triton compiles on first launch: launch once per shape on scratch tensors."""
    from ..lib.triton import splitk_gemm

    for s in shapes:
        dt = s.get("dtype", torch.bfloat16)
        x = torch.zeros((s["M"], s["K"]), dtype=dt, device=s.get("device", "cuda"))
        w = torch.zeros((s["N"], s["K"]), dtype=dt, device=x.device)
        if splitk_accepts(DecodeGemmSpec.from_call(x, w, None, s.get("out_dtype"))) is None:
            splitk_gemm.run(x, w, None, s.get("out_dtype") or dt)


def _fake(x, weight, bias, out_dtype=None, strict=False):
    check_gemm(x, weight, OP)
    return x.new_empty(rows(x, weight.shape[0]), dtype=out_dtype or x.dtype)


DECL = OpDecl(OP, "(Tensor x, Tensor weight, Tensor? bias, ScalarType? out_dtype=None, bool strict=False) -> Tensor",
              _fake, stock.decode_gemm, linear.decode_gemm, spec=DecodeGemmSpec)
DECLS = (DECL,)
declare(DECL)
register_impl(OP, Impl("cute.gemv", gemv_accepts, gemv_run, priority=100, warmup=gemv_warmup,
                       needs=("cute.compat", "cute.gemv")))
register_impl(OP, Impl("triton.splitk", splitk_accepts, splitk_run, priority=50, warmup=splitk_warmup,
                       needs=("triton.splitk_gemm",)))
