"""The shared-expert MLP on a side stream, overlapping the routed experts.

Why: the shared experts (gate/up GEMV, SiTU-GLU, down GEMV) do not depend on the router, so on
the GPU they can run on a side stream while the main stream does the router, the latent
projection and the routed experts; their result is only needed at the final sum.

Rewrite (per MoE block), x = the MoE input:
  x_pass = k3fuse.shared_expert_fork(x, W_gate, W_up, W_down | None, site)   before x's first reader
  every other reader of x (router / latent / routed path) reads x_pass, so no scheduler can sink
  the fork below the routed experts;
  y_sh = k3fuse.shared_expert_join(x_pass, anchor=y_routed, site)           right before the consumer
  of the shared output: the all_reduce (unfused), the `y_routed + y_sh` add (TP=1), or the fused
  k3fuse.gemm_ar_residual[_rmsnorm] that took the down projection (then the side region is
  gate/up/SiTU only, W_down = None). The anchor keeps the join after the routed experts.
Collectives never move to the side stream: the region ends before the all-reduce.
Needs from the weights: W_gate, W_up (and W_down) static.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import Tensor

from k3fuse.context import DecodeContext
from k3fuse.guards import GuardFailure, decode_token_range, failures, static_weight, token_count
from k3fuse.matcher import CompiledPattern, compile_pattern, find_matches
from k3fuse.normalize import is_metadata_check
from k3fuse.rule import Match, PatternSpec, Rule, fake_call
from k3fuse.verify import op_qualname

from ._spelling import base_variant, erase_dead, linear, per_dtype, randn, situ_glu, trunk_dtype

T, H, S = 4, 16, 8  # example shapes: tokens, hidden, local shared intermediate
BETA, LINEAR_BETA = 4.0, 25.0
_FUSED_REDUCTION = {"k3fuse::gemm_ar_residual", "k3fuse::gemm_ar_residual_rmsnorm"}


def _gate_up(x: Tensor, w_gate: Tensor, w_up: Tensor, beta: float, linear_beta: float) -> Tensor:
    return situ_glu(linear(x, w_gate), linear(x, w_up), beta, linear_beta)


def _mlp(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, beta: float, linear_beta: float) -> Tensor:
    return linear(_gate_up(x, w_gate, w_up, beta, linear_beta), w_down)


def _specs() -> list[PatternSpec]:
    return [
        *per_dtype("mlp", _mlp, lambda d: (randn(T, H, dtype=d), randn(S, H, dtype=d), randn(S, H, dtype=d),
                                           randn(H, S, dtype=d), BETA, LINEAR_BETA)),
        *per_dtype("gate_up", _gate_up, lambda d: (randn(T, H, dtype=d), randn(S, H, dtype=d),
                                                   randn(S, H, dtype=d), BETA, LINEAR_BETA)),
    ]


@functools.cache
def _gate_up_patterns() -> tuple[CompiledPattern, ...]:
    return tuple(compile_pattern(s) for s in _specs() if base_variant(s.name) == "gate_up")


def shared_mlp_linears(graph: fx.Graph) -> set[fx.Node]:
    """Outputs of the gate/up linears of every SiTU-GLU MLP in `graph` (for rules that must tell
    the shared expert's projections from other linears of the same input)."""
    out: set[fx.Node] = set()
    for m in find_matches(graph, _gate_up_patterns(), overlap=True):
        out |= {n for n in m.nodes if n.target is torch.ops.aten.mm.default}
    return out


def _real_users(node: fx.Node) -> list[fx.Node]:
    return [u for u in node.users if not is_metadata_check(u)]


@dataclass
class _Site:
    consumer: fx.Node  # the node the join goes right before
    anchor: fx.Node  # the routed output


class SharedExpertStream(Rule):
    """Shared-expert MLP -> side stream (fork at its input, join before the sum with y_routed)."""

    name = "shared_expert_stream"
    emits = ("shared_expert_fork",)  # the join is an event wait, not a dispatched kernel
    description = ("shared-expert SiTU-GLU MLP -> k3fuse.shared_expert_fork/join: runs on a side stream "
                   "while the router and routed experts run; collectives stay on the main stream")

    def __init__(self) -> None:
        self._sites: dict[int, _Site] = {}

    def patterns(self) -> list[PatternSpec]:
        return _specs()

    def find(self, graph: fx.Graph, ctx: DecodeContext) -> list[Match]:
        self._sites = {}
        found = []
        for m in super().find(graph, ctx):
            if m.refused is None:
                site, why = self._locate(m)
                if site is None:
                    m.refused = why
                else:
                    self._sites[id(m)] = site
            found.append(m)
        return found

    @staticmethod
    def _locate(m: Match) -> tuple[_Site | None, GuardFailure | None]:
        """Where the shared output is consumed: it must only feed the sum with the routed output."""
        out = m.outputs[0]
        users = _real_users(out)
        order = {n: i for i, n in enumerate(m.graph.nodes)}

        def refuse(message: str) -> tuple[None, GuardFailure]:
            return None, GuardFailure("site", "shared_output_use", message,
                                      {"output": out.name, "users": [u.name for u in users]})

        if len(users) != 1:
            return refuse("the shared-expert output has other consumers than the sum with the routed output")
        user = users[0]
        if base_variant(m.variant) == "gate_up":
            if op_qualname(user) not in _FUSED_REDUCTION or user.args[0] is not out or user.args[3] is None:
                return refuse("SiTU output without its down projection must feed the fused MoE reduction")
            consumer, anchor = user, user.args[3]
        else:
            consumer, total = user, user
            if user.target is torch.ops._c10d_functional.all_reduce.default:
                waits = _real_users(user)
                if len(waits) != 1 or len(_real_users(waits[0])) != 1:
                    return refuse("the reduced shared output has other consumers")
                total = _real_users(waits[0])[0]
                value = waits[0]
            else:
                value = out
            if total.target is not torch.ops.aten.add.Tensor or len(total.args) != 2:
                return refuse("the shared output does not feed an add with the routed output")
            anchor = total.args[1] if total.args[0] is value else total.args[0]
        if not isinstance(anchor, fx.Node) or order[anchor] > order[consumer]:
            return refuse("the routed output is computed after the shared output's consumer")
        return _Site(consumer, anchor), None

    def check_contract(self, ctx: DecodeContext) -> list[GuardFailure]:
        return failures(decode_token_range(ctx))

    def check_site(self, match: Match, ctx: DecodeContext) -> list[GuardFailure]:
        weights = [static_weight(match[w], w) for w in ("w_gate", "w_up", "w_down") if w in match.inputs]
        return failures(*weights, token_count(match["x"], ctx), trunk_dtype(match["x"], "x", ctx.dtype))

    def rewrite(self, match: Match, ctx: DecodeContext) -> list[fx.Node]:
        site_info = self._sites[id(match)]
        graph, x = match.graph, match["x"]
        ops = torch.ops.k3fuse
        site = sum(1 for n in graph.nodes if op_qualname(n) == "k3fuse::shared_expert_fork")
        region = set(match.nodes)
        order = {n: i for i, n in enumerate(graph.nodes)}
        first_reader = min((u for u in x.users if not is_metadata_check(u)), key=order.__getitem__)
        w_down = match.inputs.get("w_down")
        fork_args = (x, match["w_gate"], match["w_up"], w_down, site, ctx.strict, float(match["beta"]),
                     float(match["linear_beta"]))
        with graph.inserting_before(first_reader):
            fork = graph.call_function(ops.shared_expert_fork.default, fork_args)
        fork.meta["val"] = fake_call(ops.shared_expert_fork.default, fork_args, {})
        for user in list(x.users):  # the main stream reads x through the fork
            if user is not fork and user not in region and not is_metadata_check(user):
                user.replace_input_with(x, fork)
        out = match.outputs[0]
        join_args = (fork, site_info.anchor, site, int(out.meta["val"].shape[-1]))
        with graph.inserting_before(site_info.consumer):
            join = graph.call_function(ops.shared_expert_join.default, join_args)
        join.meta["val"] = fake_call(ops.shared_expert_join.default, join_args, {})
        for n in (fork, join):
            if "stack_trace" in out.meta:
                n.meta["stack_trace"] = out.meta["stack_trace"]
        out.replace_all_uses_with(join, delete_user_cb=lambda u: u is not join and not is_metadata_check(u))
        erase_dead(graph, match.nodes)
        match.note(site=site, side_region="gate/up/SiTU" if w_down is None else "gate/up/SiTU/down",
                   join_before=site_info.consumer.name, anchor=site_info.anchor.name)
        return [fork, join]


__all__ = ["SharedExpertStream", "shared_mlp_linears"]
