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
a stream switched inside an Inductor graph would split a region between two streams. The
torch.compile backend therefore outlines each region before Inductor lowers the graph
(`outline_regions`): fork, region and end become one opaque op, `shared_expert_region`, which runs
the region's own nodes (an FX GraphModule, kept in this process under a hash of its code) on the
side stream, and the join becomes `shared_expert_region_join`, the same wait. The op also returns
x_pass, a copy of x that the main stream's readers of x read instead, so that no reordering pass
(Inductor's `reorder_for_locality` moves a producer to its only consumer) sinks the region to its join. Its kernels run
node by node, unfused, but off the main stream. Where a graph reaches Inductor with its markers
(the post-grad pass the engines host, whose FX-graph cache would replay an outlined op in a process
that never outlined it), Inductor lowers them to nothing (`_lower_in_inductor`): the region is
compiled and fused with the graph on the main stream, correct and without overlap.
"""
from __future__ import annotations

import hashlib
import logging
import operator
import sys
from dataclasses import dataclass

import torch
import torch.fx as fx

from k3fuse import runtime
from k3fuse.graph_facts import OpTraits

from .. import dispatch, streams
from ..declare import OpDecl, declare

logger = logging.getLogger("k3fuse")

FORK = "shared_expert_fork"
END = "shared_expert_end"
JOIN = "shared_expert_join"
REGION = "shared_expert_region"
REGION_JOIN = "shared_expert_region_join"
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


def _joining(op: str):
    """The eager body of a join op `op` (the marker's, the outlined region's): wait for `site`'s region and
    return a copy of its output; counts under the implementation that ran the fork."""

    def join(y: torch.Tensor, anchor: torch.Tensor, keep_alive: list[torch.Tensor], site: int) -> torch.Tensor:
        producer = streams.join(site, y)
        runtime.record(op, producer)
        with torch.no_grad():
            return y.clone()

    return join


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


#: outlined regions of this process by key (a hash of the program's code and site); filled by `outline_regions`,
#: which the backend runs on every graph before Inductor compiles it, so a cached compile finds its program here
_programs: dict[str, fx.GraphModule] = {}


def _program(key: str) -> fx.GraphModule:
    program = _programs.get(key)
    if program is None:
        raise RuntimeError(f"k3fuse {REGION}: no region {key!r} was outlined in this process (the graph holding it "
                           "was compiled elsewhere); compile it here with torch.compile(backend='k3fuse')")
    return program


def _run_region(x: torch.Tensor, inputs: list[torch.Tensor], key: str) -> torch.Tensor:
    with torch.no_grad():
        return _program(key)(x.clone(), *inputs)


def side_stream_region(x: torch.Tensor, inputs: list[torch.Tensor], key: str,
                       site: int) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA: the region's nodes run on the side stream after the main stream's work so far; returns
    (its output, x_pass: a copy of x made on the main stream)."""
    with torch.no_grad():
        x_pass = x.clone()
    streams.fork(site, x, SIDE_STREAM)
    try:
        return _run_region(x, inputs, key), x_pass
    finally:
        streams.end(site, x.device)


def _inline_region(producer: str):
    def run(x: torch.Tensor, inputs: list[torch.Tensor], key: str, site: int) -> tuple[torch.Tensor, torch.Tensor]:
        streams.fork_inline(site, x.device, producer)
        with torch.no_grad():
            return _run_region(x, inputs, key), x.clone()

    return run


def _region_fake(x: torch.Tensor, inputs: list[torch.Tensor], key: str, site: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _program(key)(x, *inputs), torch.empty_like(x)   # the region's own ops' fake impls give its output


@dataclass(frozen=True)
class _Region:
    fork: fx.Node
    body: list[fx.Node]
    end: fx.Node
    join: fx.Node


def _regions(graph: fx.Graph) -> list[_Region]:
    """Every fork..end bracket whose join reads the end's value: the shape shared_expert_stream writes."""
    ops = torch.ops.k3fuse
    order = list(graph.nodes)
    out = []
    for i, fork in enumerate(order):
        if fork.target is not ops.shared_expert_fork.default:
            continue
        site = fork.args[1]
        j = next((j for j in range(i + 1, len(order)) if order[j].target is ops.shared_expert_end.default
                  and order[j].args[1] == site), None)
        if j is None:
            continue
        end = order[j]
        joins = [n for n in end.args[0].users if n.target is ops.shared_expert_join.default and n.args[3] == site]
        if len(joins) == 1:
            out.append(_Region(fork, order[i + 1:j], end, joins[0]))
    return out


def _outline(graph: fx.Graph, region: _Region) -> str | None:
    """Replace one region by a shared_expert_region call; the reason it cannot be, or None."""
    inside = set(region.body)
    y = region.end.args[0]
    if y not in inside:
        return "the region's output is not computed inside it"
    for n in region.body:
        if any(u not in inside and u not in (region.end, region.join) for u in n.users):
            return f"{n.name} is read outside the region"
    program_graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {region.fork: program_graph.placeholder("x")}
    external: list[fx.Node] = []
    for n in region.body:
        for a in n.all_input_nodes:
            if a in env or a in inside:
                continue
            if not isinstance(a.meta.get("val"), torch.Tensor):
                return f"the region reads {a.name}, which is not a tensor"
            env[a] = program_graph.placeholder(f"in{len(external)}")
            external.append(a)
        env[n] = program_graph.node_copy(n, lambda a: env[a])
    program_graph.output(env[y])
    program = fx.GraphModule(torch.nn.Module(), program_graph)
    site = region.fork.args[1]
    key = f"{site}:{hashlib.sha1(program.code.encode()).hexdigest()[:16]}"
    _programs.setdefault(key, program)
    ops = torch.ops.k3fuse
    x = region.fork.args[0]
    with graph.inserting_before(region.fork):
        call = graph.call_function(ops.shared_expert_region.default, (x, external, key, site))
        y_side = graph.call_function(operator.getitem, (call, 0))
        x_pass = graph.call_function(operator.getitem, (call, 1))
    y_side.meta["val"], x_pass.meta["val"] = y.meta.get("val"), x.meta.get("val")
    call.meta["val"] = (y_side.meta["val"], x_pass.meta["val"])
    # the main stream's readers of x read x_pass, so no scheduler sinks the region towards its join
    for user in [u for u in x.users if u not in (call, region.fork, region.join)]:
        user.replace_input_with(x, x_pass)
    with graph.inserting_before(region.join):
        join = graph.call_function(ops.shared_expert_region_join.default, (y_side, *region.join.args[1:]))
    join.meta["val"] = region.join.meta.get("val")
    region.join.replace_all_uses_with(join)
    for n in (region.join, region.end, *reversed(region.body), region.fork):
        graph.erase_node(n)
    return None


def outline_regions(gm: fx.GraphModule) -> int:
    """Before Inductor lowers `gm`: each bracketed region becomes one shared_expert_region call, run on
    the side stream, and its join a shared_expert_region_join (see the module doc). Returns how many;
    a region that cannot be outlined keeps its markers (compiled on the main stream) and is logged."""
    outlined = 0
    for region in _regions(gm.graph):
        why = _outline(gm.graph, region)
        if why is None:
            outlined += 1
        else:
            logger.info("k3fuse: shared-expert region %s stays on the main stream under Inductor: %s",
                        region.fork.args[1], why)
    if outlined:
        gm.graph.lint()
        gm.recompile()
        logger.info("k3fuse: %d shared-expert region(s) outlined onto the side stream for Inductor", outlined)
    return outlined


DECLS = (
    OpDecl(FORK, "(Tensor x, int site) -> Tensor", _fork_fake, _inline_fork(STOCK), _inline_fork(dispatch.REFERENCE),
           traits=OpTraits(side_stream="fork")),
    # `y` (argument 0) only orders the end after the region: the end records an event, it reads nothing
    OpDecl(END, "(Tensor y, int site) -> ()", _end_fake, None, None,
           traits=OpTraits(side_stream="end", ordering_args=frozenset({0})), side_effect=True, eager=_end),
    # `anchor` (argument 1) orders the join after the routed experts; `keep_alive` (argument 2) is not read
    OpDecl(JOIN, "(Tensor y, Tensor anchor, Tensor[] keep_alive, int site) -> Tensor", _join_fake, None, None,
           traits=OpTraits(sync=True, ordering_args=frozenset({1, 2}), side_stream="join"), eager=_joining(JOIN)),
    # the outlined forms, made only where Inductor compiles the graph (outline_regions)
    # returns (the region's output, x_pass): the main stream's readers of x read x_pass (see outline_regions)
    OpDecl(REGION, "(Tensor x, Tensor[] inputs, str key, int site) -> (Tensor, Tensor)", _region_fake,
           _inline_region(STOCK), _inline_region(dispatch.REFERENCE)),
    OpDecl(REGION_JOIN, "(Tensor y, Tensor anchor, Tensor[] keep_alive, int site) -> Tensor", _join_fake, None, None,
           traits=OpTraits(sync=True, ordering_args=frozenset({1, 2})), eager=_joining(REGION_JOIN)),
)
for _decl in DECLS:
    declare(_decl)
dispatch.register_impl(FORK, dispatch.Impl(SIDE_STREAM, _always, side_stream_fork, priority=0,
                                           warmup=side_stream_warmup))
dispatch.register_impl(REGION, dispatch.Impl(SIDE_STREAM, _always, side_stream_region, priority=0,
                                             warmup=side_stream_warmup))
_lower_in_inductor()
