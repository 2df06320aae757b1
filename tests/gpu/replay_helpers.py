"""CUDA-graph replay on changing inputs, as the GPU tests of the single-GPU ops check it."""
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
