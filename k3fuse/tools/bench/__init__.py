"""`k3fuse bench`: the whole compiled K3 layer, stock `torch.compile` against k3fuse, same run.

What users feel is the layer, not one op: an op that wins alone can lose in the layer (a side path
running reference code, a shape no kernel serves, a fallback nobody counted). This benchmark runs
the reference stack at K3 widths under CUDA-graph replay and reports, per arm and token count, the
slower rank's µs per step, the ratio to stock, kernels per step, per-kernel device time, compile
time (and the passes' share), the rewrite counts and the runtime counters of strict mode.

    k3fuse bench                                  # K3 published widths, MXFP4 experts, 1 layer, TP 1 (CPU: a smoke run)
    k3fuse bench --routing zipf:1.1               # skewed expert choice (the distinct experts per step are reported)
    k3fuse bench --preset k3_moe_inter128 --tp 2  # the narrow bf16 experts (moe_inter=128) of earlier figures
    k3fuse bench --residual attnres --layers 2 --arms stock,k3fuse,rules --rule-arm-batch 1,8
    k3fuse bench --device cpu --preset small      # the same code on gloo ranks (CI smoke test)
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .arms import Arm, parse_arms

if TYPE_CHECKING:  # the runner imports torch: only when a benchmark runs (keeps `k3fuse --help` fast)
    from .runner import BenchConfig


def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    """Run `cfg` on cfg.tp ranks (NCCL on GPUs, gloo on CPU) and merge the ranks' reports."""
    from k3fuse.dist import launch

    from .report import merge
    from .runner import bench_rank

    if cfg.tp == 1:
        reports = [bench_rank(0, 1, cfg)]
    else:
        reports = launch(bench_rank, cfg.tp, backend="nccl" if cfg.device == "cuda" else "gloo",
                         args=(cfg,), timeout_s=3600)
    return merge(cfg, reports)


__all__ = ["run_bench", "Arm", "parse_arms"]
