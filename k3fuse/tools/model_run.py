"""Running the whole model for the CLI: one rank's model, its arms, a random context, CUDA graphs of decode
steps, and what a stand-in rank's missing collectives would add.

Shared by `k3fuse generate`, `k3fuse validate --model` and `k3fuse bench --model` (one definition of how each
builds and runs the model).
"""
from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..model import DecodeStep, K3Model, ModelState, SamplingConfig, check_room
from .bench.timing import record, warm_up
from .model_args import ModelArgs

#: the arms a model verb compares: stock torch.compile (Inductor), k3fuse (strict), eager (no compile)
ARMS = ("stock", "k3fuse", "eager")


def device_for(ma: ModelArgs, rank: int) -> torch.device:
    if ma.device == "cpu":
        return torch.device("cpu")
    index = rank if ma.world > 1 else torch.cuda.current_device()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def build_model(ma: ModelArgs, rank: int, world: int, sampling: SamplingConfig | None = None,
                dtype: torch.dtype | None = None) -> K3Model:
    """This process's model: rank `rank` of `world` ranks, or the stand-in rank ma.as_rank of ma.of."""
    device = device_for(ma, rank)
    tp, rank_, group = (ma.of, ma.as_rank, None) if ma.standin else (world, rank,
                                                                     dist.group.WORLD if world > 1 else None)
    if ma.checkpoint is not None:  # every rank reads its own slices of the files (k3fuse/model/checkpoint.py)
        from ..model.checkpoint import load_checkpoint

        cfg = ma.config()
        loaded = load_checkpoint(ma.checkpoint, rank=rank_, tp_size=tp, device=device,  # type: ignore[arg-type]
                                 layers=list(range(cfg.n_layers)), group=group, standin=ma.standin,
                                 expert_layout=cfg.expert_layout, dtype=dtype, sampling=sampling)
        return loaded.model.eval()
    return K3Model(ma.config(), tp_size=tp, rank=rank_, group=group, standin=ma.standin, seed=ma.seed,  # type: ignore[arg-type]
                   device=device, init_on_device=device.type == "cuda", sampling=sampling, dtype=dtype).eval()


def context_lengths(batch: int, context: int) -> list[int]:
    """Tokens already cached per sequence for --context C: C for the first, then shorter by eighths, down to a
    quarter (lengths differ within a batch, as in serving)."""
    if context == 0:
        return [0] * batch
    return [max(1, context - (b % 7) * (context // 8)) for b in range(batch)]


def fill_context(model: K3Model, state: ModelState, lengths: list[int], seed: int) -> None:
    """A mid-generation state: every cache block random (the positions past each length are never read), the
    sequences' lengths set, the KDA states small random values (never zeros: zeros hide unwritten outputs)."""
    gen = torch.Generator(model.device).manual_seed(seed * 7919 + 17)
    with torch.no_grad():
        for kv, scale in zip(state.kv, state.kv_scale):
            for chunk in kv.split(max(1, (64 << 20) // max(1, kv[0].numel())), 0):  # bounded fp32 temporaries
                chunk.copy_((torch.randn(chunk.shape, generator=gen, device=kv.device) / scale).to(kv.dtype))
        started = torch.tensor([n > 0 for n in lengths], device=model.device)  # a new sequence's KDA state is 0
        for t, scale in [(r, 0.05) for r in state.recurrent] + [(c, 1.0) for c in state.conv]:
            draw = torch.randn(t.shape, generator=gen, device=t.device) * scale
            t.copy_(draw * started.view(-1, *([1] * (t.dim() - 1))))
        state.seq_lens.copy_(torch.tensor(lengths, dtype=torch.int32))
    check_room(state, 1)   # the next step appends a token: a full cache would index past its blocks


def compile_step(model: K3Model, arm: str, *, strict: bool = True, log: Any = None, compiler: str = "inductor",
                 rules: frozenset[str] | None = None) -> DecodeStep:
    """The arm's decode step: stock torch.compile (Inductor), k3fuse (strict by default), or eager."""
    if arm == "eager":
        return DecodeStep(model)
    if arm == "stock":
        return DecodeStep(model, backend="inductor")
    import k3fuse

    kw: dict[str, Any] = {"strict": strict}
    if rules is not None:
        kw["enabled_rules"] = rules
    ctx = (k3fuse.DecodeContext.from_process_group(**kw) if model.tp_size > 1 and not model.standin
           else k3fuse.DecodeContext(**kw))
    return DecodeStep(model, backend="k3fuse", options={"compiler": compiler, "context": ctx, "log": log})


def snapshot(state: ModelState) -> list[torch.Tensor]:
    """Copies of what a step changes and later steps read back (KDA states, lengths); the cache's new slots are
    overwritten before they are read, so it needs none."""
    return [t.clone() for t in state.recurrent + state.conv + (state.seq_lens,)]


def restore(state: ModelState, saved: list[torch.Tensor]) -> None:
    for dst, src in zip(state.recurrent + state.conv + (state.seq_lens,), saved):
        dst.copy_(src)


class GraphedSteps:
    """`n` decode steps captured in one CUDA graph: each step reads the token buffer and writes its next token
    back into it (and into row i of `tokens_out`), so a replay generates n tokens per sequence in place.
    Warm-up (compiles, workspaces) runs on a side stream from a snapshot of the state, restored before capture."""

    def __init__(self, step: Callable[[torch.Tensor, ModelState], tuple[torch.Tensor, torch.Tensor]],
                 state: ModelState, tokens: torch.Tensor, n: int, warmup: int = 2):
        self.state, self.n = state, n
        self.tokens = tokens.clone()
        self.tokens_out = torch.empty(n, tokens.shape[0], dtype=torch.int64, device=tokens.device)
        self.logits: torch.Tensor | None = None

        def steps() -> None:
            for i in range(n):
                nxt, logits = step(self.tokens, state)
                self.tokens.copy_(nxt)
                self.tokens_out[i].copy_(nxt)
            self.logits = logits

        check_room(state, n)   # read once here: the captured steps never read a length back
        saved, first = snapshot(state), self.tokens.clone()
        warm_up(steps, warmup)
        restore(state, saved)
        self.tokens.copy_(first)
        self.graph = record(steps)

    def replay(self) -> torch.Tensor:
        """n more tokens per sequence: [n, B] (a view of the graph's buffer: copy it before the next replay)."""
        self.graph.replay()
        return self.tokens_out


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def now(device: torch.device) -> float:
    synchronize(device)
    return time.perf_counter()


# --- what a stand-in rank leaves out ---------------------------------------------------------------------
#: one all-reduce of a [T, 7168] bf16 decode activation over NVLink, measured on 2 x H200 at TP 2 (docs/perf.md
#: section 2, bench/results/h200_fused_ar_tp2.json): k3fuse's fused one-shot all-reduce over its GEMM alone
#: (k3fuse minus the cuBLAS GEMM), and torch.compile's NCCL all-reduce + add + norm over the GEMM alone, by tokens
FUSED_AR_US = {1: 6.8, 2: 4.6, 4: 5.0, 8: 5.3, 16: 7.5, 32: 13.3, 64: 17.0}
NCCL_AR_US = {1: 17.1, 2: 18.4, 4: 20.9, 8: 17.5, 16: 18.9, 32: 23.7, 64: 27.6}
PROJECTION_SOURCE = ("projected from all-reduces of [T, 7168] bf16 measured on 2 x H200 over NVLink at TP 2 "
                     "(docs/perf.md section 2); a TP 16 deployment spans two nodes, whose collectives were not measured")


def _at(table: dict[int, float], tokens: int) -> float:
    """The measured value at the largest measured token count <= tokens (the smallest above it past the end)."""
    keys = sorted(table)
    i = bisect.bisect_right(keys, tokens) - 1
    return table[keys[max(i, 0)]]


@dataclass(frozen=True)
class Collective:
    name: str
    per_step: int
    bytes_per_rank: int
    us_fused: float | None  # k3fuse's fused one-shot where a rule fuses it at TP >= 2, else None
    us_nccl: float


def missing_collectives(model: K3Model, tokens: int) -> list[Collective]:
    """The collectives one decode step of the real TP deployment runs and a stand-in rank leaves out, each with
    its projected cost (PROJECTION_SOURCE): per layer the attention's out-projection all-reduce and the dense
    MLP's / MoE's final reduction (both fused by oproj_allreduce_residual at TP >= 2), the MoE's latent
    all-reduce (NCCL: moe_tail_allreduce_norm is off by default); the embedding's all-reduce; the logits' gather."""
    cfg, tp = model.config, model.tp_size
    esize = torch.finfo(model.dtype).bits // 8
    n_moe = sum(1 for k in model.kinds if k.mlp == "moe")
    fused, nccl = _at(FUSED_AR_US, tokens), _at(NCCL_AR_US, tokens)
    return [
        Collective("attention out-projection all-reduce", len(model.kinds), tokens * cfg.hidden * esize, fused, nccl),
        Collective("MLP / MoE final all-reduce", len(model.kinds), tokens * cfg.hidden * esize, fused, nccl),
        Collective("MoE latent all-reduce", n_moe, tokens * cfg.latent * esize, None, nccl),
        Collective("embedding all-reduce", 1, tokens * cfg.hidden * esize, None, nccl),
        Collective("logits all-gather", 1, tokens * cfg.vocab_size // tp * esize, None, nccl),
    ] if tp > 1 else []


def projected_us(collectives: list[Collective], arm: str) -> float:
    """The collectives' projected µs per step for an arm (k3fuse: fused where a rule fuses)."""
    return sum(c.per_step * (c.us_fused if arm == "k3fuse" and c.us_fused is not None else c.us_nccl)
               for c in collectives)


__all__ = ["ARMS", "build_model", "context_lengths", "fill_context", "compile_step", "GraphedSteps", "snapshot",
           "restore", "missing_collectives", "projected_us", "PROJECTION_SOURCE", "Collective", "now", "synchronize",
           "device_for"]
