"""shared_expert_fork / shared_expert_join: the shared-expert branch on a side stream.

The fork launches the branch (p_i = x @ proj[i].T (+ bias), h = act(p_0..p_n-1), y = h @ w_down.T
(+ b_down) when w_down is given) on the side stream and returns x_pass, a copy of x that the
main-stream consumers of x use, so every scheduler keeps the fork before them; the join waits
(event) for the side output. `act` strings: lib/reference/shared_expert.py.

CUDA ("torch.side_stream", a real implementation: the op exists for the overlap): the model's own
sequence in the model dtype (`shared_expert.branch`, never a float32 upcast) inside
`streams.launch`, so every kernel goes on the side stream:
  * each projection through the decode-GEMM kernels (kernels/ops/decode_gemm.py, in their priority
    order, whichever accepts the shape), cuBLAS (`F.linear`) where none does; which one ran is
    counted under `shared_expert_gemm` (`cute.gemv`, `triton.splitk`, `cublas`);
  * the activation: K3's SiTU-GLU as one Triton kernel (lib/triton/glu_act.py, counted under
    `shared_expert_act`), any other activation with the stock pointwise ops.
"""
from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from k3fuse import runtime
from k3fuse.graph_facts import OpTraits

from .. import dispatch, streams
from ..declare import OpDecl, check_gemm, declare, rows
from ..lib.reference import shared_expert, stock
from .decode_gemm import OP as GEMM_OP
from .decode_gemm import DecodeGemmSpec

FORK = "shared_expert_fork"
JOIN = "shared_expert_join"
STATS_KEY = "shared_expert_gemm"
ACT_STATS_KEY = "shared_expert_act"  # which activation ran: the fused kernel or the op-by-op program
CUBLAS = "cublas"
SIDE_STREAM = "torch.side_stream"


def _broken() -> dict[str, str]:
    entry = dispatch._ops.get(GEMM_OP)
    return entry.broken if entry is not None else {}


def linear(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x2 [M, K] @ weight.T (+ bias) in x2's dtype: the first decode-GEMM kernel that accepts it, else cuBLAS."""
    broken = _broken()
    spec = None
    for impl in dispatch.cuda_kernels(GEMM_OP):
        if impl.name in broken:
            continue
        try:
            spec = spec or DecodeGemmSpec.from_call(x2, weight, bias, None)
            reason = impl.accepts(spec)
        except Exception:
            continue
        if reason is not None:
            continue
        try:
            y = impl.run(x2, weight, bias, None)
        except Exception as exc:
            if runtime.is_strict():
                raise runtime.K3FuseFallbackError(
                    f"k3fuse op shared_expert_fork fell back in strict mode: decode-GEMM kernel "
                    f"{impl.name} failed: {type(exc).__name__}: {exc}") from exc
            broken[impl.name] = f"failed: {type(exc).__name__}: {exc}"[:200]
            warnings.warn(f"k3fuse: shared_expert_fork projection kernel {impl.name} failed ({exc}); "
                          "disabled for this process, cuBLAS runs it", RuntimeWarning, stacklevel=2)
            break
        runtime.record(STATS_KEY, impl.name)
        return y
    runtime.record(STATS_KEY, CUBLAS)
    return F.linear(x2, weight, bias)


def _situ_kernel_fits(g: torch.Tensor, u: torch.Tensor) -> bool:
    from ..lib.triton import glu_act

    return (g.is_cuda and g.shape == u.shape and g.dtype == u.dtype and g.dtype in glu_act.DTYPES
            and g.is_contiguous() and u.is_contiguous())


@functools.lru_cache(maxsize=64)
def _fused_activation(act: str) -> shared_expert.Activation | None:
    """One Triton kernel for K3's SiTU-GLU (the eager program is a dozen launches), else None."""
    try:
        from ..lib.triton import HAVE_TRITON, glu_act
    except Exception:
        return None
    if not HAVE_TRITON:
        return None
    params = glu_act.situ_params(act)
    if params is None:
        return None

    def fused(p: Sequence[torch.Tensor]) -> torch.Tensor:
        if _situ_kernel_fits(p[0], p[1]):
            runtime.record(ACT_STATS_KEY, "triton.situ_glu")
            return glu_act.situ_glu(p[0], p[1], *params)
        runtime.record(ACT_STATS_KEY, "torch.ops")
        return shared_expert.activation(act)[1](p)

    return fused


def side_stream_run(x: torch.Tensor, proj: Sequence[torch.Tensor], proj_bias: Sequence[torch.Tensor],
                    w_down: torch.Tensor | None, b_down: torch.Tensor | None, act: str, site: int,
                    producer: str = SIDE_STREAM) -> None:
    shared_expert.check_branch(x, proj, proj_bias, act)
    act_fn = _fused_activation(act)
    streams.launch(site, shared_expert.reads(x, proj, proj_bias, w_down, b_down),
                   lambda: shared_expert.branch(x, proj, proj_bias, w_down, b_down, act, linear, act_fn),
                   producer)


def side_stream_warmup(shapes: Sequence[Any]) -> None:
    """Create the side stream (outside any capture) and let the GEMM kernels compile for `shapes`
    (decode_gemm's format: [{"M", "N", "K", "dtype"}], may be empty)."""
    if not torch.cuda.is_available():
        return
    streams.prepare()
    if shapes:
        dispatch.warmup(GEMM_OP, shapes)


def _always(spec: object) -> None:
    return None


def _fork(x, proj, proj_bias, w_down, b_down, act, site, strict=False):
    """Launch the shared-expert branch for `site` (side stream on CUDA); return x_pass, a copy of x."""
    dispatch.dispatch(FORK, x, proj, proj_bias, w_down, b_down, act, site, strict=strict)
    with torch.no_grad():
        return x.clone()


def _join_features(anchor: torch.Tensor, out_features: int):
    return anchor.shape[-1] if out_features < 0 else out_features


def _join(x_pass, anchor, reads, site, out_features=-1):
    """Wait (event) for `site`'s side output and return it; counts under the fork's producer.

    `reads` (x and the weights the fork read) are not used here: taking them keeps them alive, in
    every scheduler and buffer planner, until the side stream is done with them."""
    output, producer = streams.join(site, x_pass.device)
    expected = _join_features(anchor, out_features)
    if output.shape[-1] != expected or output.dtype != x_pass.dtype:
        raise RuntimeError(
            f"k3fuse.shared_expert_join(site={site}): side output is {tuple(output.shape)} "
            f"{output.dtype}, the graph expects last dim {expected} and {x_pass.dtype} "
            "(pass out_features when the fork has no w_down)")
    runtime.record(JOIN, producer)
    return output


def _fork_fake(x, proj, proj_bias, w_down, b_down, act, site, strict=False):
    torch._check(len(proj) >= 1, lambda: "k3fuse.shared_expert_fork: no projection")
    torch._check(not proj_bias or len(proj_bias) == len(proj),
                 lambda: f"k3fuse.shared_expert_fork: {len(proj_bias)} biases for {len(proj)} projections")
    for w in proj:
        check_gemm(x, w, FORK)
    return torch.empty_like(x)


def _join_fake(x_pass, anchor, reads, site, out_features=-1):
    return x_pass.new_empty(rows(x_pass, _join_features(anchor, out_features)))


DECLS = (
    OpDecl(FORK, "(Tensor x, Tensor[] proj, Tensor[] proj_bias, Tensor? w_down, Tensor? b_down, str act, int site, "
                 "bool strict=False) -> Tensor",
           _fork_fake, stock.shared_expert_fork, shared_expert.make_fork_run(dispatch.REFERENCE), eager=_fork),
    # `anchor` (argument 1, the routed output) only keeps the join after the routed experts
    OpDecl(JOIN, "(Tensor x_pass, Tensor anchor, Tensor[] reads, int site, int out_features=-1) -> Tensor",
           _join_fake, None, None, traits=OpTraits(sync=True, ordering_args=frozenset({1})), eager=_join),
)
for _decl in DECLS:
    declare(_decl)
dispatch.register_impl(FORK, dispatch.Impl(SIDE_STREAM, _always, side_stream_run, priority=0,
                                           warmup=side_stream_warmup))
