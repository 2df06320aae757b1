"""shared_expert_fork / _end / _join: the markers that put a region of graph nodes on the side stream.

shared_expert_stream brackets the shared-expert branch's own nodes (its projections, activation and
down projection, as the model wrote them, and what later rules made of them: decode_gemm) with
these markers; nothing of the computation moves into an op:

    x_side = shared_expert_fork(x, site)      before x's first reader; the region reads x_side
    ... the region's nodes ...                 (only x_side, each other and static weights)
    shared_expert_end(y, site)                 right after the region; y its output
    ... the main stream: router, routed experts ...
    out = shared_expert_join(y, anchor, keep_alive, site)   right before y's consumer

Executed node by node (an FX GraphModule: the eager compiler, a torch.export program, CUDA graphs
captured over either), CUDA: the fork makes the side stream current after an event on the main
stream (kernels/streams.py), so the region's kernels launch there; the end makes the main stream
current again; the join waits for the region's end. x_side is a copy of x made on the side stream,
the join's output a copy of y made on the main stream after the wait (an op's output may not alias
its input). `keep_alive` (x) keeps what the side stream reads alive until the join in any buffer
planner; `anchor` (the routed output) orders the join after the routed experts. On CPU, and on
the stock path, nothing switches. The verifier checks every bracket (k3fuse.verify).

Inductor launches all of a graph's kernels on the stream it found when the first one launched, so
a stream switched inside an Inductor graph would split a region between two streams. Inductor
therefore lowers the markers to nothing (`_lower_in_inductor`): the region is compiled and fused
with the graph on the main stream, correct and without overlap.
"""
from __future__ import annotations

import sys

import torch

from k3fuse import runtime
from k3fuse.graph_facts import OpTraits

from .. import dispatch, streams
from ..declare import OpDecl, declare

FORK = "shared_expert_fork"
END = "shared_expert_end"
JOIN = "shared_expert_join"
SIDE_STREAM = "torch.side_stream"
STOCK = "stock"


def side_stream_fork(x: torch.Tensor, site: int) -> torch.Tensor:
    """CUDA: the side stream waits for the main stream and becomes current; x copied there."""
    streams.fork(site, x, SIDE_STREAM)
    with torch.no_grad():
        return x.clone()


def _inline_fork(producer: str):
    def run(x: torch.Tensor, site: int) -> torch.Tensor:
        streams.fork_inline(site, x.device, producer)
        with torch.no_grad():
            return x.clone()

    return run


def side_stream_warmup(shapes: object) -> None:
    """Create the side stream outside any capture (the sites' events come with their first fork)."""
    if torch.cuda.is_available():
        streams.prepare()


def _always(spec: object) -> None:
    return None


def _end(y: torch.Tensor, site: int) -> None:
    streams.end(site, y.device)


def _join(y: torch.Tensor, anchor: torch.Tensor, keep_alive: list[torch.Tensor], site: int) -> torch.Tensor:
    """Wait for `site`'s region and return a copy of its output; counts under the fork's implementation."""
    producer = streams.join(site, y)
    runtime.record(JOIN, producer)
    with torch.no_grad():
        return y.clone()


_lowered = False


def _lower_in_inductor() -> None:
    """Make Inductor lower the markers to nothing, once Inductor is loaded (see the module doc).

    Called by the markers' fake impls, which run whenever a graph holding them is traced or
    rewritten, so a compile with Inductor finds the lowerings before it lowers (it imports its
    lowering module first); a process that never loads Inductor never imports it here."""
    global _lowered
    if _lowered or "torch._inductor.lowering" not in sys.modules:
        return
    from torch._inductor.lowering import register_lowering

    ops = torch.ops.k3fuse
    register_lowering(ops.shared_expert_fork.default, type_promotion_kind=None)(lambda x, site: x)
    register_lowering(ops.shared_expert_end.default, type_promotion_kind=None)(lambda y, site: None)
    register_lowering(ops.shared_expert_join.default, type_promotion_kind=None)(
        lambda y, anchor, keep_alive, site: y)
    _lowered = True


def _fork_fake(x: torch.Tensor, site: int) -> torch.Tensor:
    _lower_in_inductor()
    return torch.empty_like(x)


def _end_fake(y: torch.Tensor, site: int) -> None:
    _lower_in_inductor()
    return None


def _join_fake(y: torch.Tensor, anchor: torch.Tensor, keep_alive: list[torch.Tensor], site: int) -> torch.Tensor:
    _lower_in_inductor()
    return torch.empty_like(y)


DECLS = (
    OpDecl(FORK, "(Tensor x, int site) -> Tensor", _fork_fake, _inline_fork(STOCK), _inline_fork(dispatch.REFERENCE),
           traits=OpTraits(side_stream="fork")),
    # `y` (argument 0) only orders the end after the region: the end records an event, it reads nothing
    OpDecl(END, "(Tensor y, int site) -> ()", _end_fake, None, None,
           traits=OpTraits(side_stream="end", ordering_args=frozenset({0})), side_effect=True, eager=_end),
    # `anchor` (argument 1) orders the join after the routed experts; `keep_alive` (argument 2) is not read
    OpDecl(JOIN, "(Tensor y, Tensor anchor, Tensor[] keep_alive, int site) -> Tensor", _join_fake, None, None,
           traits=OpTraits(sync=True, ordering_args=frozenset({1, 2}), side_stream="join"), eager=_join),
)
for _decl in DECLS:
    declare(_decl)
dispatch.register_impl(FORK, dispatch.Impl(SIDE_STREAM, _always, side_stream_fork, priority=0,
                                           warmup=side_stream_warmup))
_lower_in_inductor()
