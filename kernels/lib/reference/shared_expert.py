"""The shared-expert branch as the fork computes it: projections, activation, optional down projection.

A branch is `[y =] down( act(p_0, ..., p_{n-1}) )` with `p_i = x @ proj_i.T (+ proj_bias_i)` and the
down projection optional (without it the output is the activation, [T, S/tp]: the down projection
was fused into the MoE final reduction, gemm_ar_residual). Every implementation runs the model's own
sequence, op for op: the projections through a `linear(x2d, weight, bias)` it chooses (F.linear on
CPU and in the stock path; on CUDA the decode-GEMM kernels, cuBLAS where none supports the shape,
see kernels/ops/shared_expert.py), the activation with the stock pointwise ops in the model dtype,
so the rounding points are the model's (kernels/lib/reference/stock.py), never a float32 upcast.

`act` names the activation, one of
  * a named activation, spelled as the model code spells it (each input in the model dtype):
      "silu_glu"        silu(p0) * p1                        (DeepSeek-V3 / Kimi shared experts)
      "gelu_glu"        gelu(p0) * p1
      "gelu_tanh_glu"   gelu(p0, approximate="tanh") * p1
      "relu2"           square(relu(p0))                     (Nemotron-H, ungated)
      "situ_glu:B:L"    K3's SiTU-GLU, beta B, linear_beta L: fp32 inside, cast back once
                        (`situ_act(beta, linear_beta)`)
  * a program: JSON `{"n": n_inputs, "steps": [[op, args, kwargs], ...], "out": ref}` of ATen/prims
    pointwise ops (what shared_expert_stream copies out of the graph it rewrites, so any
    activation the model wrote runs as written). An argument is a literal, a list, `{"$": i}` (value
    i: the inputs p_0.. first, then each step's result) or `{"dtype": "bfloat16"}`.
"""
from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from k3fuse.spelling import K3_SITU_BETA, K3_SITU_LINEAR_BETA, situ, situ_glu  # noqa: F401 (situ: re-exported)

from ... import streams

Linear = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
Activation = Callable[[Sequence[torch.Tensor]], torch.Tensor]


def situ_act(beta: float = K3_SITU_BETA, linear_beta: float = K3_SITU_LINEAR_BETA) -> str:
    return f"situ_glu:{float(beta)!r}:{float(linear_beta)!r}"


_NAMED: dict[str, tuple[int, Activation]] = {
    "silu_glu": (2, lambda p: F.silu(p[0]) * p[1]),
    "gelu_glu": (2, lambda p: F.gelu(p[0]) * p[1]),
    "gelu_tanh_glu": (2, lambda p: F.gelu(p[0], approximate="tanh") * p[1]),
    "relu2": (1, lambda p: torch.square(F.relu(p[0]))),
}

#: ops a program may run besides those tagged pointwise: the cast spellings
_CASTS = frozenset({"aten::_to_copy.default", "aten::to.dtype", "prims::convert_element_type.default"})


def _resolve(qualname: str) -> Any:
    ns, rest = qualname.split("::", 1)
    name, overload = rest.split(".", 1) if "." in rest else (rest, "default")
    if ns not in ("aten", "prims"):
        raise ValueError(f"shared-expert program: op {qualname} is not an ATen/prims op")
    op = getattr(getattr(getattr(torch.ops, ns), name), overload)
    if qualname not in _CASTS and torch.Tag.pointwise not in op.tags:
        raise ValueError(f"shared-expert program: op {qualname} is not pointwise")
    return op


def _decode(arg: Any) -> Any:
    if isinstance(arg, list):
        return [_decode(a) for a in arg]
    if isinstance(arg, dict):
        if "dtype" in arg:
            return getattr(torch, arg["dtype"])
        if "$" in arg:
            return _Ref(int(arg["$"]))
        raise ValueError(f"shared-expert program: unknown argument {arg!r}")
    return arg


class _Ref(int):
    pass


def _subst(arg: Any, values: list[torch.Tensor]) -> Any:
    if isinstance(arg, _Ref):
        return values[arg]
    if isinstance(arg, list):
        return [_subst(a, values) for a in arg]
    return arg


def _program(spec: dict[str, Any]) -> tuple[int, Activation]:
    n = int(spec["n"])
    steps = [(_resolve(op), [_decode(a) for a in args], {k: _decode(v) for k, v in kwargs.items()})
             for op, args, kwargs in spec["steps"]]
    out = _decode(spec["out"])
    if not isinstance(out, _Ref) or not 0 <= out < n + len(steps):
        raise ValueError(f"shared-expert program: bad output {spec['out']!r}")

    def run(inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        values = list(inputs)
        for op, args, kwargs in steps:
            values.append(op(*_subst(args, values), **{k: _subst(v, values) for k, v in kwargs.items()}))
        return values[out]

    return n, run


@functools.lru_cache(maxsize=512)
def activation(act: str) -> tuple[int, Activation]:
    """(number of projections it takes, the function) for an `act` string (see the module doc)."""
    if act.startswith("{"):
        return _program(json.loads(act))
    name, *params = act.split(":")
    if name == "situ_glu":
        beta, linear_beta = (float(p) for p in params) if params else (K3_SITU_BETA, K3_SITU_LINEAR_BETA)
        return 2, lambda p: situ_glu(p[0], p[1], beta, linear_beta)
    if name in _NAMED and not params:
        return _NAMED[name]
    raise ValueError(f"unknown shared-expert activation {act!r}: named ones are "
                     f"{sorted([*_NAMED, 'situ_glu:B:L'])}, or a JSON program")


def check_branch(x: torch.Tensor, proj: Sequence[torch.Tensor], proj_bias: Sequence[torch.Tensor],
                 act: str) -> None:
    n, _ = activation(act)
    if len(proj) != n:
        raise ValueError(f"shared-expert activation {act[:60]!r} takes {n} projections, got {len(proj)}")
    if proj_bias and len(proj_bias) != len(proj):
        raise ValueError(f"shared-expert proj_bias: {len(proj_bias)} biases for {len(proj)} projections "
                         "(give one per projection, or none)")


def torch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def branch(x: torch.Tensor, proj: Sequence[torch.Tensor], proj_bias: Sequence[torch.Tensor],
           w_down: torch.Tensor | None, b_down: torch.Tensor | None, act: str,
           linear: Linear = torch_linear, act_fn: Activation | None = None) -> torch.Tensor:
    """The shared-expert branch on x [..., H] -> [..., H] (with w_down) or [..., S] (activation).

    `act_fn` replaces `act`'s op-by-op evaluation with a kernel computing the same function (CUDA)."""
    check_branch(x, proj, proj_bias, act)
    x2 = x.reshape(-1, x.shape[-1])
    biases: Sequence[torch.Tensor | None] = proj_bias or [None] * len(proj)
    h = (act_fn or activation(act)[1])([linear(x2, w, b) for w, b in zip(proj, biases)])
    if w_down is not None:
        h = linear(h, w_down, b_down)
    return h.reshape(*x.shape[:-1], h.shape[-1])


def reads(x: torch.Tensor, proj: Sequence[torch.Tensor], proj_bias: Sequence[torch.Tensor],
          w_down: torch.Tensor | None, b_down: torch.Tensor | None) -> list[torch.Tensor]:
    """Every tensor the branch reads (what the fork records on the side stream)."""
    return [t for t in (x, *proj, *proj_bias, w_down, b_down) if t is not None]


def make_fork_run(producer: str, linear: Linear = torch_linear) -> Callable[..., None]:
    """A fork `run` that computes the branch via `streams.launch` (side stream on CUDA)."""

    def run(x: torch.Tensor, proj: Sequence[torch.Tensor], proj_bias: Sequence[torch.Tensor],
            w_down: torch.Tensor | None, b_down: torch.Tensor | None, act: str, site: int) -> None:
        check_branch(x, proj, proj_bias, act)
        streams.launch(site, reads(x, proj, proj_bias, w_down, b_down),
                       lambda: branch(x, proj, proj_bias, w_down, b_down, act, linear), producer)

    return run
