"""One rank of `k3fuse bench`: build the reference stack, compile every arm, time every token count.

Per arm: torch.compile (stock Inductor, or the k3fuse backend in strict mode with the arm's rules),
then for each token count a CUDA graph of `steps` decode steps (the KDA state threaded from step to
step, fresh random inputs per replay) timed over `replays` replays, one replay profiled (kernels
per step, device time per kernel, the timeline of one step), and the runtime counters read back, so
every figure says which implementation ran (and, for 4-bit experts, which CuTe launch: w4a16_launches).
Compile time is the first calls' wall time; the passes' share is the time the rewrite log recorded for
the rules. Before the arms, an eager probe runs each token count's decode steps on the same inputs and
counts the distinct experts every step touches (routing.py), which the weight-read floor uses.
"""
from __future__ import annotations

import gc
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from . import profile, routing, timing
from .arms import Arm, parse_arms


@dataclass(frozen=True)
class BenchConfig:
    """What `k3fuse bench` runs (see `k3fuse bench --help` for each field)."""

    preset: str = "k3"  # published widths, MXFP4 experts (`k3_moe_inter128`: the narrow bf16 variant)
    overrides: dict[str, Any] = field(default_factory=dict)
    layers: int = 1
    residual: str = "plain"
    tp: int = 1
    tokens: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    arms: tuple[str, ...] = ("stock", "k3fuse")
    rule_arm_tokens: tuple[int, ...] | None = None  # per-rule arms only at these counts (None: all)
    steps: int = 10
    replays: int = 20
    compiler: str = "inductor"
    device: str = "cuda"
    profile: bool = True
    compile_only: bool = False
    seed: int = 0
    rules: tuple[str, ...] | None = None  # the `k3fuse` arm's rules (--rules; None: the default rules)
    log: str | None = None                # append the k3fuse arms' rewrite log here (--log)
    routing: str = "uniform"  # or "zipf:<s>" (routing.py)

    def arm_list(self) -> list[Arm]:
        return parse_arms(self.arms, default_rules=self.rules)

    def model_config(self) -> Any:
        from k3fuse.model import get_config

        return get_config(self.preset, n_layers=self.layers, residual=self.residual, **self.overrides)

    def tokens_for(self, arm: Arm) -> tuple[int, ...]:
        if arm.name in ("stock", "k3fuse") or self.rule_arm_tokens is None:
            return self.tokens
        return tuple(t for t in self.tokens if t in self.rule_arm_tokens)


def _random_state(model: Any, T: int, gen: torch.Generator) -> Any:
    """A KDA state mid-sequence (small random values, never zeros: zeros hide unwritten outputs)."""
    from k3fuse.model import DecodeState

    state = model.init_state(T)

    def rnd(t: torch.Tensor, scale: float) -> torch.Tensor:
        return (torch.randn(t.shape, generator=gen, device=t.device) * scale).to(t.dtype)

    return DecodeState(recurrent=tuple(rnd(r, 0.1) for r in state.recurrent),
                       conv=tuple(rnd(c, 1.0) for c in state.conv))


def weight_bytes(model: Any) -> tuple[int, int]:
    """(routed experts' bytes, every other parameter's bytes) of this rank: the experts' packed weights
    and scales when quantized."""
    expert_bytes = dense_bytes = 0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if ".routed.w1" in name or ".routed.w2" in name or ".routed.w3" in name:
            expert_bytes += nbytes
        else:
            dense_bytes += nbytes
    return expert_bytes, dense_bytes


def weight_floor(model: Any, T: int, touched: float | None = None) -> dict[str, float]:
    """Per-rank bytes a decode step must read at T tokens: every parameter once, the routed experts
    (packed weights and scales when quantized) only for the experts T tokens touch: `touched`, the
    measured distinct experts per step, or the expectation under uniform routing. The KDA state, read
    and written once per step, is given apart (it grows with T: 400 MB at 64 tokens)."""
    cfg = model.config
    expert_bytes, dense_bytes = weight_bytes(model)
    uniform = routing.expected_uniform(cfg.n_experts, cfg.top_k, T)
    touched = uniform if touched is None else touched
    state = model.init_state(1) if model.device.type != "meta" else None
    state_bytes = 0 if state is None else T * sum(t.numel() * t.element_size()
                                                   for t in state.recurrent + state.conv)
    return {"dense_bytes": dense_bytes, "expert_bytes_touched": expert_bytes * touched / cfg.n_experts,
            "experts_touched": touched, "experts_touched_uniform": uniform,
            "state_bytes_read_write": 2 * state_bytes}


def _compile(model: Any, arm: Arm, cfg: BenchConfig, rank: int) -> tuple[Any, Any]:
    import k3fuse
    from k3fuse.log import RewriteLog

    torch._dynamo.reset()
    if arm.is_stock:
        backend = "inductor" if cfg.compiler == "inductor" else "eager"
        return torch.compile(model, backend=backend), None
    rlog = RewriteLog(cfg.log, rank=rank)
    kw = dict(strict=True, enabled_rules=arm.rules)
    ctx = (k3fuse.DecodeContext.from_process_group(**kw) if cfg.tp > 1 else k3fuse.DecodeContext(**kw))
    options = {"compiler": cfg.compiler, "context": ctx, "log": rlog}
    return torch.compile(model, backend="k3fuse", options=options), rlog


def _inputs(model: Any, T: int, cfg: BenchConfig, device: torch.device
            ) -> tuple[torch.Generator, list[torch.Tensor], Any]:
    """The decode steps' inputs and starting state at T tokens (seeded by T: every arm, and the
    expert probe, sees the same), and the generator that refills them between replays."""
    gen = torch.Generator(device).manual_seed(cfg.seed * 1009 + T)
    H, dtype = model.config.hidden, model.dtype
    xs = [torch.randn(T, H, generator=gen, device=device).to(dtype) for _ in range(cfg.steps)]
    return gen, xs, _random_state(model, T, gen)


def _time_tokens(compiled: Any, model: Any, T: int, cfg: BenchConfig, device: torch.device
                 ) -> tuple[dict[str, Any], torch.Tensor]:
    """Time T tokens; returns the row and the first call's output (every arm sees the same inputs
    at a given T, so the arms' outputs can be compared)."""
    gen, xs, state0 = _inputs(model, T, cfg, device)

    def steps() -> torch.Tensor:
        state, y = state0, xs[0]
        for x in xs:
            y, state = compiled(x, state)
        return y

    def refill() -> None:
        for x in xs:
            x.normal_(generator=gen)

    row: dict[str, Any] = {"tokens": T}
    t0 = time.perf_counter()
    with torch.no_grad():
        first = steps()  # compiles on the first token count (and once more when the shape turns dynamic)
        if device.type == "cuda":
            torch.cuda.synchronize()
        row["first_call_s"] = time.perf_counter() - t0
        first = first.float().cpu()
        if cfg.compile_only:
            return row, first
        if device.type == "cuda":
            graph = timing.capture(steps)
            per_step = timing.time_graph(graph, cfg.steps, cfg.replays, refill)
            if cfg.profile:
                row["profile"] = profile.profile_steps(graph.replay, cfg.steps)
            del graph
        else:
            per_step = timing.time_host(steps, cfg.steps, cfg.replays, refill)
    row["us_this_rank"] = timing.median(per_step)
    ordered = sorted(per_step)  # the spread of this rank's replays: a difference inside it is noise
    row["us_p10_p90"] = [ordered[len(ordered) // 10], ordered[(len(ordered) * 9) // 10]]
    row["us"] = timing.slowest_rank(row["us_this_rank"], device)
    return row, first


def w4a16_launches(model_cfg: Any, tp: int, tokens: tuple[int, ...]) -> dict[int, dict[str, Any]] | None:
    """Per token count, the CuTe W4A16 launch the routed-experts op takes for this model's 4-bit experts at
    TP `tp` (W4A16Launch.for_call: its mode, gate/up K split and down row tiles) and the tables' layout. None
    for bf16 experts."""
    if not model_cfg.quantized_experts:
        return None
    import dataclasses

    from k3fuse.kernels.lib.composite.routed_experts_w4a16 import W4A16Launch

    fmt, layout = model_cfg.expert_format, model_cfg.expert_layout
    shape = (model_cfg.n_experts, model_cfg.moe_inter // tp, model_cfg.latent, model_cfg.top_k)
    launches: dict[int, dict[str, Any]] = {}
    for T in tokens:
        try:
            launches[T] = {"layout": layout,
                           "config": dataclasses.asdict(W4A16Launch.for_call(fmt, T, *shape, layout=layout))}
        except ValueError as exc:  # widths off the CuTe kernel's steps: the op runs Triton there
            launches[T] = {"error": str(exc)}
    return launches


def bench_rank(rank: int, world_size: int, cfg: BenchConfig) -> dict[str, Any]:
    """Run every arm at every token count on this rank; returns this rank's report."""
    import k3fuse
    from k3fuse.model import K3DecodeStack

    device = torch.device(f"cuda:{rank}" if cfg.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = dist.group.WORLD if world_size > 1 else None
    model_cfg = cfg.model_config()
    model = K3DecodeStack(model_cfg, tp_size=world_size, rank=rank, group=group, seed=cfg.seed,
                          device=device, init_on_device=device.type == "cuda")
    routing.apply_routing(model, routing.parse_routing(cfg.routing), cfg.seed)
    experts: dict[int, dict[str, Any]] = {}
    for T in cfg.tokens:  # the same inputs the arms run: the distinct experts every step touches
        _, xs, state0 = _inputs(model, T, cfg, device)
        experts[T] = routing.distinct_experts(model, xs, state0)
        del xs, state0
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report: dict[str, Any] = {"rank": rank, "arms": {}, "model": asdict(model_cfg), "routing": cfg.routing,
                              "distinct_experts": experts,
                              "floor": {T: weight_floor(model, T, experts[T]["mean"]) for T in cfg.tokens}}
    if device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(device)
        report["copy_bandwidth_Bps"] = timing.copy_bandwidth(device)
        report["read_bandwidth_Bps"] = timing.read_bandwidth(device)
        report["multicast"] = "never used (k3fuse's fused collectives are unicast)"
        report["w4a16_launch"] = w4a16_launches(model_cfg, world_size, cfg.tokens)
    stock_out: dict[int, torch.Tensor] = {}  # the stock arm's output per T: every figure says how far
    for arm in cfg.arm_list():                # the arm's numbers are from stock's on the same inputs
        compiled, rlog = _compile(model, arm, cfg, rank)
        k3fuse.reset_stats()
        entry: dict[str, Any] = {"rows": []}
        try:
            for T in cfg.tokens_for(arm):
                t0 = time.perf_counter()
                row, out = _time_tokens(compiled, model, T, cfg, device)
                if rank == 0:  # a line per arm and token count: a long run is never silent
                    took = f"{time.perf_counter() - t0:.1f} s"
                    print(f"  {arm.name} T={T}: " + (f"{row['us']:.1f} µs/step ({took})" if row.get("us") else took),
                          flush=True)
                if arm.is_stock:
                    stock_out[T] = out
                elif T in stock_out:
                    row["rel_err_vs_stock"] = float((out - stock_out[T]).norm() / stock_out[T].norm())
                entry["rows"].append(row)
        except Exception as exc:  # one arm failing (strict mode!) must not hide the others
            entry["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:500]
        entry["compile_s"] = sum(r.get("first_call_s", 0.0) for r in entry["rows"])
        entry["stats"] = k3fuse.stats()
        if rlog is not None:
            summary = rlog.summary()
            entry["rewrites"] = {rule: {"applied": s["applied"], "rejected": s["rejected"], "why": s["why"]}
                                 for rule, s in summary.items()}
            entry["passes_ms"] = round(sum(rlog.rule_time_ms.values()), 1)
            entry["graphs"] = len({e.graph_id for e in rlog.events})
            entry["fallbacks"] = {op: {k: v for k, v in impls.items() if k.startswith("fallback")}
                                  for op, impls in entry["stats"].items()
                                  if any(k.startswith("fallback") for k in impls)}
        report["arms"][arm.name] = entry
        del compiled
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return report


__all__ = ["BenchConfig", "bench_rank", "weight_bytes", "weight_floor", "w4a16_launches"]
