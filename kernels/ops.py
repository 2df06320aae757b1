"""The fused ops torch.ops.k3fuse.*: schemas, fake impls and the eager entry into dispatch.

Schemas are the contract of docs/architecture.md "Custom ops". Each op has
- a fake impl (register_fake): output shapes/dtypes only, so FakeTensor tracing, AOT, Inductor and
  torch.export never run a kernel or a collective;
- one CompositeExplicitAutograd impl (every device: CPU and CUDA) that hands the arguments, minus
  `strict`, to `kernels.dispatch.dispatch`, which picks and counts the implementation.

Ops are inference-only (Autograd falls through: outputs never require grad). Registration happens once, on import of
k3fuse.kernels.

What an implementation registered with `dispatch.register_impl(op, Impl(...))` receives: the op's
arguments in schema order without `strict` (supports and run get the same), and what run returns:
  gemm_ar_residual          (x, weight, residual, addend, group_name, world_size, max_tokens=) -> out
  gemm_ar_residual_rmsnorm  (x, weight, residual, addend, norm_weight, eps, group_name, world_size,
                             max_tokens=) -> (out, normed)
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
The op itself returns the fork's x_pass and performs the join (streams.join), so neither is an impl.
Collective ops: every rank must pick the same implementation (supports must decide from shapes,
dtypes and world size only), or the ranks would run different collectives.
"""
from __future__ import annotations

import torch
import torch.fx

from k3fuse import runtime

from . import reference  # noqa: F401  (registers the reference impls and stock sequences)
from . import streams
from .dispatch import dispatch

NAMESPACE = "k3fuse"

SCHEMAS: dict[str, str] = {
    "gemm_ar_residual":
        "(Tensor x, Tensor weight, Tensor residual, Tensor? addend, str group_name, "
        "int world_size, int max_tokens=64, bool strict=False) -> Tensor",
    "gemm_ar_residual_rmsnorm":
        "(Tensor x, Tensor weight, Tensor residual, Tensor? addend, Tensor norm_weight, float eps, "
        "str group_name, int world_size, int max_tokens=64, bool strict=False) -> (Tensor, Tensor)",
    "moe_front_sharded":
        "(Tensor x, Tensor router_w, Tensor? down_w, str group_name, int world_size, "
        "int max_tokens=64, bool strict=False) -> (Tensor, Tensor)",
    "shared_expert_fork":
        "(Tensor x, Tensor[] proj, Tensor[] proj_bias, Tensor? w_down, Tensor? b_down, str act, int site, "
        "bool strict=False) -> Tensor",
    "shared_expert_join":
        "(Tensor x_pass, Tensor anchor, Tensor[] reads, int site, int out_features=-1) -> Tensor",
    "l2_prefetch":
        "(Tensor anchor, Tensor[] weights, int budget_bytes) -> ()",
    "decode_gemm":
        "(Tensor x, Tensor weight, Tensor? bias, ScalarType? out_dtype=None, bool strict=False) "
        "-> Tensor",
}

_lib = torch.library.Library(NAMESPACE, "DEF")
for _name, _schema in SCHEMAS.items():
    _lib.define(_name + _schema)


def _register(name: str, eager, fake) -> None:
    qualname = f"{NAMESPACE}::{name}"
    torch.library.impl(qualname, "CompositeExplicitAutograd", lib=_lib)(eager)
    torch.library.register_fake(qualname, lib=_lib)(fake)
    # Inference-only: declare the op non-differentiable (Autograd falls through), so weights that
    # happen to require grad neither trip autograd's "no autograd kernel" warning nor make
    # torch.compile trace a backward; outputs never require grad.
    _lib.impl(name, torch.library.fallthrough_kernel, "Autograd")


def _rows(x: torch.Tensor, features) -> tuple:
    return (*x.shape[:-1], features)


def _check_gemm(x: torch.Tensor, weight: torch.Tensor, op: str) -> None:
    torch._check(x.shape[-1] == weight.shape[-1],
                 lambda: f"k3fuse.{op}: x {tuple(x.shape)} and weight {tuple(weight.shape)} "
                         "disagree on the reduction dim")


# --- gemm_ar_residual ---------------------------------------------------------------------------
def _gemm_ar_residual(x, weight, residual, addend, group_name, world_size, max_tokens=64,
                      strict=False):
    return dispatch("gemm_ar_residual", x, weight, residual, addend, group_name, world_size,
                    max_tokens=max_tokens, strict=strict)


def _gemm_ar_residual_fake(x, weight, residual, addend, group_name, world_size, max_tokens=64,
                           strict=False):
    _check_gemm(x, weight, "gemm_ar_residual")
    return residual.new_empty(residual.shape)


# --- gemm_ar_residual_rmsnorm -------------------------------------------------------------------
def _gemm_ar_residual_rmsnorm(x, weight, residual, addend, norm_weight, eps, group_name,
                              world_size, max_tokens=64, strict=False):
    return dispatch("gemm_ar_residual_rmsnorm", x, weight, residual, addend, norm_weight, eps,
                    group_name, world_size, max_tokens=max_tokens, strict=strict)


def _gemm_ar_residual_rmsnorm_fake(x, weight, residual, addend, norm_weight, eps, group_name,
                                   world_size, max_tokens=64, strict=False):
    _check_gemm(x, weight, "gemm_ar_residual_rmsnorm")
    return residual.new_empty(residual.shape), residual.new_empty(residual.shape)


# --- moe_front_sharded --------------------------------------------------------------------------
def _moe_front_sharded(x, router_w, down_w, group_name, world_size, max_tokens=64, strict=False):
    """Takes the FULL replicated W_r [E, H] and W_down [L, H]; each rank computes its 1/world_size
    rows (rank from the group at run time), so one rewritten graph serves every rank."""
    return dispatch("moe_front_sharded", x, router_w, down_w, group_name, world_size,
                    max_tokens=max_tokens, strict=strict)


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


# --- shared_expert_fork / join ------------------------------------------------------------------
def _shared_expert_fork(x, proj, proj_bias, w_down, b_down, act, site, strict=False):
    """Launch the shared-expert branch for `site` (side stream on CUDA); return x_pass, a copy of x."""
    dispatch("shared_expert_fork", x, proj, proj_bias, w_down, b_down, act, site, strict=strict)
    with torch.no_grad():
        return x.clone()


def _shared_expert_fork_fake(x, proj, proj_bias, w_down, b_down, act, site, strict=False):
    torch._check(len(proj) >= 1, lambda: "k3fuse.shared_expert_fork: no projection")
    torch._check(not proj_bias or len(proj_bias) == len(proj),
                 lambda: f"k3fuse.shared_expert_fork: {len(proj_bias)} biases for {len(proj)} projections")
    for w in proj:
        _check_gemm(x, w, "shared_expert_fork")
    return torch.empty_like(x)


def _join_features(anchor: torch.Tensor, out_features: int):
    return anchor.shape[-1] if out_features < 0 else out_features


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


def _shared_expert_join_fake(x_pass, anchor, reads, site, out_features=-1):
    return x_pass.new_empty(_rows(x_pass, _join_features(anchor, out_features)))


# --- l2_prefetch --------------------------------------------------------------------------------
def _l2_prefetch(anchor, weights, budget_bytes):
    dispatch("l2_prefetch", anchor, weights, budget_bytes)


def _l2_prefetch_fake(anchor, weights, budget_bytes):
    return None


# --- decode_gemm --------------------------------------------------------------------------------
def _decode_gemm(x, weight, bias, out_dtype=None, strict=False):
    return dispatch("decode_gemm", x, weight, bias, out_dtype, strict=strict)


def _decode_gemm_fake(x, weight, bias, out_dtype=None, strict=False):
    _check_gemm(x, weight, "decode_gemm")
    return x.new_empty(_rows(x, weight.shape[0]), dtype=out_dtype or x.dtype)


_register("gemm_ar_residual", _gemm_ar_residual, _gemm_ar_residual_fake)
_register("gemm_ar_residual_rmsnorm", _gemm_ar_residual_rmsnorm, _gemm_ar_residual_rmsnorm_fake)
_register("moe_front_sharded", _moe_front_sharded, _moe_front_sharded_fake)
_register("shared_expert_fork", _shared_expert_fork, _shared_expert_fork_fake)
_register("shared_expert_join", _shared_expert_join, _shared_expert_join_fake)
_register("l2_prefetch", _l2_prefetch, _l2_prefetch_fake)
_register("decode_gemm", _decode_gemm, _decode_gemm_fake)


def _keep_l2_prefetch_alive() -> None:
    """l2_prefetch returns nothing, so every dead-code pass would drop it: mark it side-effectful.

    `torch.fx.node.has_side_effect` on the packet and the overload makes `Node.is_impure()` true,
    which fx `eliminate_dead_code`, AOTAutograd, Inductor's scheduler and torch.export all honour
    (verified on CPU with torch 2.13 in tests/test_ops.py: DCE, torch.compile(inductor) with the op
    between a functional all_reduce and its wait, export + save/load).

    Not chosen: `torch.library._register_effectful_op(..., EffectType.ORDERED)` (also keeps it, but
    threads an effect token through AOT and export: a `with_effects` wrapper node plus a token
    input/output that every rule, the verifier and post-grad insertion would have to handle), and a
    `mutates_args` dummy (a fake mutation makes functionalization copy the weights).
    """
    packet = getattr(torch.ops, NAMESPACE).l2_prefetch
    torch.fx.node.has_side_effect(packet)
    torch.fx.node.has_side_effect(packet.default)


_keep_l2_prefetch_alive()

OPS: tuple[str, ...] = tuple(SCHEMAS)


# --- kda_delta_rule -----------------------------------------------------------------------------
# One KDA delta-rule step (k3fuse/model/layers.py `delta_rule`), fp32 in and out:
#   S = recurrent * exp(g)[..., None];  e = beta[..., None] * (v - S^T k)
#   S_new = S + k e^T;                  o = S_new^T q
# recurrent [T, h, dk, dv], g/k/q [T, h, dk], beta [T, h], v [T, h, dv] -> (S_new, o [T, h, dv]).
# Implementations get (recurrent, g, beta, k, v, q) and return (S_new, o), both new tensors.
KDA_DELTA_RULE_SCHEMA = ("(Tensor recurrent, Tensor g, Tensor beta, Tensor k, Tensor v, Tensor q, "
                         "bool strict=False) -> (Tensor, Tensor)")
_lib.define("kda_delta_rule" + KDA_DELTA_RULE_SCHEMA)
SCHEMAS["kda_delta_rule"] = KDA_DELTA_RULE_SCHEMA


def _kda_delta_rule(recurrent, g, beta, k, v, q, strict=False):
    return dispatch("kda_delta_rule", recurrent, g, beta, k, v, q, strict=strict)


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


_register("kda_delta_rule", _kda_delta_rule, _kda_delta_rule_fake)
OPS = tuple(SCHEMAS)
