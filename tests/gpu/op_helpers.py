"""What the GPU tests of the single-GPU ops share: strict runs counted and compared, CUDA-graph replay on
changing inputs."""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

from k3fuse import runtime


def graph_replays(op: Callable[..., Sequence[torch.Tensor]], operands: Callable[[int], Sequence[torch.Tensor]],
                  replays: int = 20) -> Iterator[tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]]:
    """`op` on `operands(3)` captured in one CUDA graph in strict mode (called once before capture, so it
    compiles for these strides), then replayed `replays` times, `operands(100 + i)` copied into the captured
    inputs before replay i; yields (those fresh operands, the graph's outputs) after each replay."""
    static = operands(3)
    with runtime.strict():
        op(*static)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = op(*static)
    for step in range(replays):
        fresh = operands(100 + step)
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        yield fresh, outs


def strict_deterministic_run(op: Callable[..., Sequence[torch.Tensor]], args: Sequence[torch.Tensor],
                             counts: dict[str, dict[str, int]]) -> Sequence[torch.Tensor]:
    """`op(*args)` twice in strict mode; checks that the runtime counted `counts` (op -> impl -> calls) and that
    both runs gave the same bits (a fixed reduction order); returns the first run's outputs."""
    runtime.reset_stats()
    with runtime.strict():
        first = op(*args)
        again = op(*args)
    assert runtime.stats() == counts
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    return first
