"""The fused ops torch.ops.k3fuse.*, each declared once (`OpDecl`) and registered from that.

A declaration holds everything the rest of k3fuse knows about an op (docs/architecture.md "Custom
ops"): its schema; its fake impl (output shapes/dtypes only, so FakeTensor tracing, AOT, Inductor
and torch.export never run a kernel or a collective); its stock sequence (the unfused torch ops it
replaced: the kill switch and the call guard run it); its plain-torch reference (the CPU path and
the numerical oracle); whether it is a collective (no per-rank fallback); and its ordering traits
for the verifier (`k3fuse.ir.OpTraits`: sync point, anchor, ordering-only arguments). `declare`
turns that into the torch.library op, whose one CompositeExplicitAutograd impl (every device) hands
the arguments, minus `strict`, to `kernels.dispatch.dispatch`, which picks and counts the
implementation. Kernel backends (cute/, triton/) register further `Impl`s against the op's name.

Ops are inference-only (Autograd falls through: outputs never require grad). Registration happens
once, on import of k3fuse.kernels; `dispatch.register_impl` refuses an op that is not declared here.

What an implementation registered with `dispatch.register_impl(op, Impl(...))` receives: the op's
arguments in schema order without `strict` (supports and run get the same), and what run returns:
  gemm_ar_residual          (x, weight, residual, addend, group_name, world_size, max_tokens=) -> out
  gemm_ar_residual_rmsnorm  (x, weight, residual, addend, norm_weight, eps, group_name, world_size,
                             max_tokens=) -> (out, normed)
  allreduce_rmsnorm         (x, norm_weight, eps, group_name, world_size, max_tokens=)
                             -> (summed, normed), both [T, L] in x.dtype
  moe_front_sharded         (x, router_w, down_w, group_name, world_size, max_tokens=)  (full
                             replicated weights; an impl slices this rank's rows itself)
                             -> (logits fp32 [T, E], latent [T, L] x.dtype); down_w None is the
                             router-only form (no latent projection): latent is empty [T, 0]
  shared_expert_fork        (x, proj, proj_bias, w_down, b_down, act, site) -> None; it must post
                             its output with streams.launch(site, inputs, compute, producer=name)
                             (kernels/reference/shared_expert.py: what the branch is, `act` strings)
  l2_prefetch               (anchor, weights, budget_bytes) -> None (never read `anchor`: its
                             collective may still be in flight)
  decode_gemm               (x, weight, bias, out_dtype) -> y
  route_topk                (logits, b_corr, top_k, routed_scaling, eps) -> (weights fp32 [T, k],
                             idx int64 [T, k]); ties to the lowest expert index (reference/routing.py)
  kda_delta_rule            (recurrent, g, beta, k, v, q) -> (S_new, o), both new fp32 tensors
  routed_experts            (a, experts, w1, w3, w2, top_k, situ_beta, situ_linear_beta) -> z [T*k, L]
                             in pair order, a's dtype (k3fuse/spelling.py `routed_experts`)
  routed_experts_w4a16      (a, experts, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale,
                             top_k, situ_beta, situ_linear_beta, format, table) -> z [T*k, L] in pair
                             order, a's dtype (k3fuse/spelling.py `routed_experts_quantized`; `table`
                             MXFP4's nibble -> value table, None for int4)
The op itself returns the fork's x_pass and performs the join (streams.join), so neither is an impl.
Collective ops: every rank must pick the same implementation (supports must decide from shapes,
dtypes and world size only), or the ranks would run different collectives.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from k3fuse import runtime
from k3fuse.ir import OpTraits, declare_op_traits
from k3fuse.spelling import (routed_experts, routed_experts_gathered, routed_experts_quantized,
                             routed_experts_quantized_gathered)

from . import dispatch as _dispatch
from . import streams
from .reference import allreduce, kda_delta, linear, moe_front, prefetch, routing, shared_expert, stock

NAMESPACE = "k3fuse"
REFERENCE_PRIORITY = -100


@dataclass(frozen=True)
class OpDecl:
    """One fused op, declared once.

    reference: the "reference" Impl (any device, lowest priority; None: the op is not dispatched).
    eager: the op's own eager body when it is more than a dispatch (the fork returns x_pass, the
    join waits for the side stream); default: dispatch with the schema's arguments.
    side_effect: returns nothing yet must survive dead-code elimination (l2_prefetch).
    """

    name: str
    schema: str
    fake: Callable[..., Any]
    stock: Callable[..., Any] | None
    reference: Callable[..., Any] | None
    traits: OpTraits = OpTraits()
    collective: bool = False
    side_effect: bool = False
    eager: Callable[..., Any] | None = None

    @property
    def qualname(self) -> str:
        return f"{NAMESPACE}::{self.name}"


def _always(*args: object, **kwargs: object) -> None:
    return None


def _rows(x: torch.Tensor, features) -> tuple:
    return (*x.shape[:-1], features)


def _check_gemm(x: torch.Tensor, weight: torch.Tensor, op: str) -> None:
    torch._check(x.shape[-1] == weight.shape[-1],
                 lambda: f"k3fuse.{op}: x {tuple(x.shape)} and weight {tuple(weight.shape)} "
                         "disagree on the reduction dim")


# --- fake impls (shapes only) ------------------------------------------------------------------
def _gemm_ar_residual_fake(x, weight, residual, addend, group_name, world_size, max_tokens=64,
                           strict=False):
    _check_gemm(x, weight, "gemm_ar_residual")
    return residual.new_empty(residual.shape)


def _gemm_ar_residual_rmsnorm_fake(x, weight, residual, addend, norm_weight, eps, group_name,
                                   world_size, max_tokens=64, strict=False):
    _check_gemm(x, weight, "gemm_ar_residual_rmsnorm")
    return residual.new_empty(residual.shape), residual.new_empty(residual.shape)


def _allreduce_rmsnorm_fake(x, norm_weight, eps, group_name, world_size, max_tokens=64, strict=False):
    torch._check(x.dim() >= 1, lambda: "k3fuse.allreduce_rmsnorm: x must be [..., L], got a scalar")
    torch._check(norm_weight.dim() == 1 and norm_weight.shape[0] == x.shape[-1],
                 lambda: f"k3fuse.allreduce_rmsnorm: norm_weight is {tuple(norm_weight.shape)}, expected "
                         f"[L] = ({x.shape[-1]},) (x is {tuple(x.shape)})")
    torch._check(x.dtype.is_floating_point,
                 lambda: f"k3fuse.allreduce_rmsnorm: x must be floating point, got {x.dtype}")
    torch._check(world_size >= 1, lambda: f"k3fuse.allreduce_rmsnorm: world_size={world_size} must be >= 1")
    return x.new_empty(x.shape), x.new_empty(x.shape)


def _moe_front_sharded_fake(x, router_w, down_w, group_name, world_size, max_tokens=64,
                            strict=False):
    weights = (("router_w", router_w),) if down_w is None else (("router_w", router_w), ("down_w", down_w))
    for what, w in weights:
        _check_gemm(x, w, "moe_front_sharded")
        torch._check(w.shape[0] % world_size == 0,
                     lambda: f"k3fuse.moe_front_sharded: {what} rows {w.shape[0]} not divisible "
                             f"by world_size {world_size}")
    logits = x.new_empty(_rows(x, router_w.shape[0]), dtype=torch.float32)
    latent = x.new_empty(_rows(x, 0 if down_w is None else down_w.shape[0]))  # router-only: [T, 0]
    return logits, latent


def _shared_expert_fork_fake(x, proj, proj_bias, w_down, b_down, act, site, strict=False):
    torch._check(len(proj) >= 1, lambda: "k3fuse.shared_expert_fork: no projection")
    torch._check(not proj_bias or len(proj_bias) == len(proj),
                 lambda: f"k3fuse.shared_expert_fork: {len(proj_bias)} biases for {len(proj)} projections")
    for w in proj:
        _check_gemm(x, w, "shared_expert_fork")
    return torch.empty_like(x)


def _join_features(anchor: torch.Tensor, out_features: int):
    return anchor.shape[-1] if out_features < 0 else out_features


def _shared_expert_join_fake(x_pass, anchor, reads, site, out_features=-1):
    return x_pass.new_empty(_rows(x_pass, _join_features(anchor, out_features)))


def _l2_prefetch_fake(anchor, weights, budget_bytes):
    return None


def _decode_gemm_fake(x, weight, bias, out_dtype=None, strict=False):
    _check_gemm(x, weight, "decode_gemm")
    return x.new_empty(_rows(x, weight.shape[0]), dtype=out_dtype or x.dtype)


def _kda_delta_rule_fake(recurrent, g, beta, k, v, q, strict=False):
    torch._check(recurrent.dim() == 4, lambda: f"k3fuse.kda_delta_rule: recurrent must be [T, h, dk, dv], "
                                               f"got {tuple(recurrent.shape)}")
    T, h, dk, dv = recurrent.shape
    for what, t, shape in (("g", g, (T, h, dk)), ("beta", beta, (T, h)), ("k", k, (T, h, dk)),
                           ("v", v, (T, h, dv)), ("q", q, (T, h, dk))):
        torch._check(tuple(t.shape) == shape,
                     lambda what=what, t=t, shape=shape: f"k3fuse.kda_delta_rule: {what} is {tuple(t.shape)}, "
                                                         f"expected {shape}")
    return (recurrent.new_empty(recurrent.shape, dtype=torch.float32),
            recurrent.new_empty((T, h, dv), dtype=torch.float32))


def _route_topk_fake(logits, b_corr, top_k, routed_scaling, eps=1e-20, strict=False):
    torch._check(logits.dim() == 2, lambda: f"k3fuse.route_topk: logits must be [T, E], got {tuple(logits.shape)}")
    torch._check(logits.dtype == torch.float32,
                 lambda: f"k3fuse.route_topk: logits must be float32 (the fp32 router), got {logits.dtype}")
    E = logits.shape[1]
    torch._check(b_corr.dim() == 1 and b_corr.shape[0] == E,
                 lambda: f"k3fuse.route_topk: b_corr is {tuple(b_corr.shape)}, expected [E] = ({E},)")
    torch._check(b_corr.dtype == torch.float32,
                 lambda: f"k3fuse.route_topk: b_corr must be float32, got {b_corr.dtype}")
    torch._check(1 <= top_k, lambda: f"k3fuse.route_topk: top_k={top_k} must be at least 1")
    torch._check(top_k <= E, lambda: f"k3fuse.route_topk: top_k={top_k} exceeds the {E} experts")
    T = logits.shape[0]
    return (logits.new_empty((T, top_k), dtype=torch.float32),
            logits.new_empty((T, top_k), dtype=torch.int64))


def _routed_experts_fake(a, experts, w1, w3, w2, top_k, situ_beta, situ_linear_beta, strict=False):
    name = "k3fuse.routed_experts"
    torch._check(a.dim() == 2, lambda: f"{name}: a must be the latent [T, L], got {tuple(a.shape)}")
    torch._check(experts.dim() == 1 and experts.dtype == torch.int64,
                 lambda: f"{name}: experts must be int64 [T*top_k], got {experts.dtype} {tuple(experts.shape)}")
    torch._check(experts.shape[0] == a.shape[0] * top_k,
                 lambda: f"{name}: {experts.shape[0]} expert ids for {a.shape[0]} tokens x top_k={top_k}")
    torch._check(w1.dim() == 3 and w1.shape == w3.shape and w1.shape[2] == a.shape[1],
                 lambda: f"{name}: w1/w3 must be [E, I, L={a.shape[1]}], got {tuple(w1.shape)} / {tuple(w3.shape)}")
    torch._check(w2.dim() == 3 and w2.shape[0] == w1.shape[0] and w2.shape[1] == a.shape[1]
                 and w2.shape[2] == w1.shape[1],
                 lambda: f"{name}: w2 must be [E, L, I] = {(w1.shape[0], a.shape[1], w1.shape[1])}, "
                         f"got {tuple(w2.shape)}")
    torch._check(a.dtype == w1.dtype == w3.dtype == w2.dtype,
                 lambda: f"{name}: a and the expert weights must share a dtype: {a.dtype}, {w1.dtype}, "
                         f"{w3.dtype}, {w2.dtype}")
    return a.new_empty((experts.shape[0], a.shape[1]))


#: the quantized expert formats routed_experts_w4a16 takes (k3fuse/quant.py's layouts) and the
#: packed elements per stored item of each: uint8 bytes of two E2M1 nibbles, int32 words of eight
W4A16_FORMATS = {"mxfp4": 2, "int4": 8}


def _routed_experts_w4a16_fake(a, experts, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale, top_k,
                               situ_beta, situ_linear_beta, format, table=None, strict=False):
    name = "k3fuse.routed_experts_w4a16"
    torch._check(format in W4A16_FORMATS,
                 lambda: f"{name}: format {format!r} is not one of {sorted(W4A16_FORMATS)}")
    per = W4A16_FORMATS[format]
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
        torch._check(tuple(scale.shape) == (E, rows, cols // 32),
                     lambda what=what, scale=scale, rows=rows, cols=cols:
                     f"{name}: {what} must be [E, {rows}, {cols}/32] = {(E, rows, cols // 32)} (group size 32), "
                     f"got {tuple(scale.shape)}")
    return a.new_empty((experts.shape[0], L))


# --- eager bodies that are more than a dispatch -------------------------------------------------
def _shared_expert_fork(x, proj, proj_bias, w_down, b_down, act, site, strict=False):
    """Launch the shared-expert branch for `site` (side stream on CUDA); return x_pass, a copy of x."""
    _dispatch.dispatch("shared_expert_fork", x, proj, proj_bias, w_down, b_down, act, site, strict=strict)
    with torch.no_grad():
        return x.clone()


def _shared_expert_join(x_pass, anchor, reads, site, out_features=-1):
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
    runtime.record("shared_expert_join", producer)
    return output


SYNC = OpTraits(sync=True)

#: every fused op; the kernels' `Impl`s register against these names
DECLARATIONS: tuple[OpDecl, ...] = (
    OpDecl("gemm_ar_residual",
           "(Tensor x, Tensor weight, Tensor residual, Tensor? addend, str group_name, "
           "int world_size, int max_tokens=64, bool strict=False) -> Tensor",
           _gemm_ar_residual_fake, stock.gemm_ar_residual, allreduce.gemm_ar_residual,
           traits=SYNC, collective=True),
    OpDecl("gemm_ar_residual_rmsnorm",
           "(Tensor x, Tensor weight, Tensor residual, Tensor? addend, Tensor norm_weight, float eps, "
           "str group_name, int world_size, int max_tokens=64, bool strict=False) -> (Tensor, Tensor)",
           _gemm_ar_residual_rmsnorm_fake, stock.gemm_ar_residual_rmsnorm, allreduce.gemm_ar_residual_rmsnorm,
           traits=SYNC, collective=True),
    # the MoE tail: the latent partial [T, L] all-reduced and RMSNorm'd in one op; returns the sum too
    # (the graph may read it elsewhere): (summed, rms_norm(summed) * norm_weight), both in x.dtype
    OpDecl("allreduce_rmsnorm",
           "(Tensor x, Tensor norm_weight, float eps, str group_name, int world_size, int max_tokens=64, "
           "bool strict=False) -> (Tensor, Tensor)",
           _allreduce_rmsnorm_fake, stock.allreduce_rmsnorm, allreduce.allreduce_rmsnorm,
           traits=SYNC, collective=True),
    # takes the FULL replicated W_r [E, H] and W_down [L, H]; each rank computes its 1/world_size
    # rows (rank from the group at run time), so one rewritten graph serves every rank
    OpDecl("moe_front_sharded",
           "(Tensor x, Tensor router_w, Tensor? down_w, str group_name, int world_size, "
           "int max_tokens=64, bool strict=False) -> (Tensor, Tensor)",
           _moe_front_sharded_fake, stock.moe_front_sharded, moe_front.moe_front_sharded,
           traits=SYNC, collective=True),
    OpDecl("shared_expert_fork",
           "(Tensor x, Tensor[] proj, Tensor[] proj_bias, Tensor? w_down, Tensor? b_down, str act, int site, "
           "bool strict=False) -> Tensor",
           _shared_expert_fork_fake, stock.shared_expert_fork, shared_expert.make_fork_run(_dispatch.REFERENCE),
           eager=_shared_expert_fork),
    # `anchor` (argument 1, the routed output) only keeps the join after the routed experts
    OpDecl("shared_expert_join",
           "(Tensor x_pass, Tensor anchor, Tensor[] reads, int site, int out_features=-1) -> Tensor",
           _shared_expert_join_fake, None, None,
           traits=OpTraits(sync=True, ordering_args=frozenset({1})), eager=_shared_expert_join),
    # side effect only: never reads `anchor` (its collective may still be in flight)
    OpDecl("l2_prefetch", "(Tensor anchor, Tensor[] weights, int budget_bytes) -> ()",
           _l2_prefetch_fake, stock.l2_prefetch, prefetch.l2_prefetch,
           traits=OpTraits(anchor=True), side_effect=True),
    OpDecl("decode_gemm",
           "(Tensor x, Tensor weight, Tensor? bias, ScalarType? out_dtype=None, bool strict=False) -> Tensor",
           _decode_gemm_fake, stock.decode_gemm, linear.decode_gemm),
    # one KDA delta-rule step (k3fuse/model/layers.py `delta_rule`), fp32 in and out:
    #   S = recurrent * exp(g)[..., None];  e = beta[..., None] * (v - S^T k)
    #   S_new = S + k e^T;                  o = S_new^T q
    # recurrent [T, h, dk, dv], g/k/q [T, h, dk], beta [T, h], v [T, h, dv] -> (S_new, o [T, h, dv])
    OpDecl("kda_delta_rule",
           "(Tensor recurrent, Tensor g, Tensor beta, Tensor k, Tensor v, Tensor q, "
           "bool strict=False) -> (Tensor, Tensor)",
           _kda_delta_rule_fake, stock.kda_delta_rule, kda_delta.kda_delta_rule),
    # the model's `route` in one op: scores = sigmoid(logits); idx = top-k of scores + b_corr (ties to
    # the lowest expert index); weights = scores[idx] / (sum + eps) * routed_scaling, the sum taken in
    # selection order. logits fp32 [T, E], b_corr fp32 [E] -> (weights fp32 [T, k], idx int64 [T, k]).
    # Not a collective: every rank computes it from the same (all-gathered) logits, same bits.
    OpDecl("route_topk",
           "(Tensor logits, Tensor b_corr, int top_k, float routed_scaling, float eps=1e-20, "
           "bool strict=False) -> (Tensor, Tensor)",
           _route_topk_fake, stock.route_topk, routing.route_topk),
    # the model's routed experts (k3fuse/spelling.py `routed_experts`): for each (token, slot) pair p,
    #   z[p] = w2[e_p] @ situ_glu(w1[e_p] @ a[p // k], w3[e_p] @ a[p // k])
    # rounded to a's dtype after each projection, as the model's spelling. a [T, L], experts int64
    # [T*k], w1/w3 [E, I, L], w2 [E, L, I] -> z [T*k, L]. Stock: the model's spelling (grouped GEMMs
    # on CUDA); reference: the gathered bmm (any device).
    OpDecl("routed_experts",
           "(Tensor a, Tensor experts, Tensor w1, Tensor w3, Tensor w2, int top_k, float situ_beta, "
           "float situ_linear_beta, bool strict=False) -> Tensor",
           _routed_experts_fake, routed_experts, routed_experts_gathered),
    # routed_experts over the checkpoint's 4-bit experts (k3fuse/quant.py; format "mxfp4" or "int4",
    # group size 32; `table` the spelling's E2M1 value table for mxfp4, None for int4):
    # z[p] = w2[e_p] @ situ_glu(w1[e_p] @ a[p // k], w3[e_p] @ a[p // k]) on the dequantized
    # weights, rounded to a's dtype after each projection. Stock: the model's spelling (the step's
    # experts gathered, dequantized, grouped GEMMs on CUDA); reference: the same dequantization,
    # then the gathered bmm (any device).
    OpDecl("routed_experts_w4a16",
           "(Tensor a, Tensor experts, Tensor w1_packed, Tensor w1_scale, Tensor w3_packed, Tensor w3_scale, "
           "Tensor w2_packed, Tensor w2_scale, int top_k, float situ_beta, float situ_linear_beta, str format, "
           "Tensor? table=None, bool strict=False) -> Tensor",
           _routed_experts_w4a16_fake, routed_experts_quantized, routed_experts_quantized_gathered),
)

_lib = torch.library.Library(NAMESPACE, "DEF")


def _dispatching_eager(decl: OpDecl) -> Callable[..., Any]:
    """The default eager body: the schema's arguments in order (defaults filled in), handed to
    dispatch positionally, `strict` and `max_tokens` by keyword. The argument layout is worked out
    once here; a call only indexes."""
    arguments = torch._C.parse_schema(decl.qualname + decl.schema).arguments
    names = [a.name for a in arguments]
    index = {n: i for i, n in enumerate(names)}
    defaults = tuple(a.default_value if a.has_default_value() else None for a in arguments)
    keyword_positions = [(n, index[n]) for n in ("max_tokens", "strict") if n in index]
    positions = [i for i, n in enumerate(names) if n not in ("max_tokens", "strict")]

    def eager(*args: Any, **kwargs: Any) -> Any:
        full = [*args, *defaults[len(args):]]
        for name, value in kwargs.items():
            full[index[name]] = value
        return _dispatch.dispatch(decl.name, *[full[i] for i in positions],
                                  **{n: full[i] for n, i in keyword_positions})

    eager.__name__ = f"_{decl.name}"
    return eager


def declare(decl: OpDecl) -> None:
    """Define the op and register everything its declaration says (once, on import)."""
    _lib.define(decl.name + decl.schema)
    torch.library.impl(decl.qualname, "CompositeExplicitAutograd", lib=_lib)(decl.eager or _dispatching_eager(decl))
    torch.library.register_fake(decl.qualname, lib=_lib)(decl.fake)
    # Inference-only: declare the op non-differentiable (Autograd falls through), so weights that
    # happen to require grad neither trip autograd's "no autograd kernel" warning nor make
    # torch.compile trace a backward; outputs never require grad.
    _lib.impl(decl.name, torch.library.fallthrough_kernel, "Autograd")
    declare_op_traits(decl.qualname, decl.traits)
    _dispatch.declare(decl.name)
    if decl.collective:
        _dispatch.COLLECTIVE_OPS.add(decl.name)
    if decl.stock is not None:
        _dispatch.register_stock(decl.name, decl.stock)
    if decl.reference is not None:
        _dispatch.register_impl(decl.name, _dispatch.Impl(_dispatch.REFERENCE, _always, decl.reference,
                                                          REFERENCE_PRIORITY, _dispatch.ALL_DEVICES))
    if decl.side_effect:
        _keep_alive(decl.name)


def _keep_alive(name: str) -> None:
    """An op that returns nothing would be dropped by every dead-code pass: mark it side-effectful.

    `torch.fx.node.has_side_effect` on the packet and the overload makes `Node.is_impure()` true,
    which fx `eliminate_dead_code`, AOTAutograd, Inductor's scheduler and torch.export all honour
    (verified on CPU with torch 2.13 in tests/test_ops.py: DCE, torch.compile(inductor) with the op
    between a functional all_reduce and its wait, export + save/load).

    Not chosen: `torch.library._register_effectful_op(..., EffectType.ORDERED)` (also keeps it, but
    threads an effect token through AOT and export: a `with_effects` wrapper node plus a token
    input/output that every rule, the verifier and post-grad insertion would have to handle), and a
    `mutates_args` dummy (a fake mutation makes functionalization copy the weights).
    """
    packet = getattr(getattr(torch.ops, NAMESPACE), name)
    torch.fx.node.has_side_effect(packet)
    torch.fx.node.has_side_effect(packet.default)


for _decl in DECLARATIONS:
    declare(_decl)

SCHEMAS: dict[str, str] = {d.name: d.schema for d in DECLARATIONS}
OPS: tuple[str, ...] = tuple(SCHEMAS)
