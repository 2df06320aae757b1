"""`k3fuse demo`: the main job on a built-in default.

A small reference Kimi K3 stack runs on TP ranks (gloo on CPU, NCCL on GPUs), compiled with
`torch.compile(backend="k3fuse")`, next to the same model in eager mode. The demo decodes a few
steps with both, checks that outputs and the persistent KDA state agree, and prints what the
passes did (the rewrite log summary) and what ran at run time (implementation counters).
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class DemoConfig:
    preset: str = "small"
    layers: int = 2
    residual: str = "plain"
    tp: int = 2
    tokens: int = 4
    steps: int = 8
    compiler: str = "inductor"
    seed: int = 0
    strict: bool = True
    log: str | None = None
    device: str = "cpu"


@dataclass
class RankReport:
    rank: int
    compile_s: float
    graphs: int
    max_rel_err_out: float
    max_rel_err_state: float
    rewrite_summary: dict[str, dict[str, Any]]
    active_rules: list[str]
    runtime_stats: dict[str, dict[str, int]]


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.double(), b.double()
    return float((a64 - b64).norm() / b64.norm().clamp_min(1e-30))


def _copy_state(dst: Any, src: Any) -> None:
    for d, s in zip(dst.recurrent + dst.conv, src.recurrent + src.conv):
        d.copy_(s)


def _run_rank(rank: int, world_size: int, cfg: DemoConfig) -> dict[str, Any]:
    import torch.distributed as dist

    import k3fuse
    from k3fuse.log import RewriteLog
    from k3fuse.model import K3DecodeStack, get_config

    device = torch.device(cfg.device if cfg.device == "cpu" else f"cuda:{rank}")
    model_cfg = get_config(cfg.preset, n_layers=cfg.layers, residual=cfg.residual)
    group = dist.group.WORLD if world_size > 1 else None
    model = K3DecodeStack(model_cfg, tp_size=world_size, rank=rank, group=group, seed=cfg.seed, device=device)
    ctx = (k3fuse.DecodeContext.from_process_group(strict=cfg.strict) if world_size > 1
           else k3fuse.DecodeContext(strict=cfg.strict))
    rlog = RewriteLog(cfg.log, rank=rank)
    compiled = torch.compile(model, backend="k3fuse",
                             options={"compiler": cfg.compiler, "context": ctx, "log": rlog})

    gen = torch.Generator().manual_seed(cfg.seed + 1)
    # Persistent state buffers, as a serving engine keeps them: each step's new state is copied in,
    # so every step calls the compiled step with the same shapes and strides (no recompilation).
    state_ref = model.init_state(cfg.tokens)
    state_new = model.init_state(cfg.tokens)
    k3fuse.reset_stats()
    err_out = err_state = 0.0
    compile_s = 0.0
    with torch.no_grad():
        for step in range(cfg.steps):
            x = torch.randn(cfg.tokens, model_cfg.hidden, generator=gen).to(device=device, dtype=model_cfg.torch_dtype)
            y_ref, next_ref = model(x, state_ref)
            t0 = time.perf_counter()
            with k3fuse.strict(cfg.strict):
                y_new, next_new = compiled(x, state_new)
            if step == 0:
                compile_s = time.perf_counter() - t0
            _copy_state(state_ref, next_ref)
            _copy_state(state_new, next_new)
            err_out = max(err_out, _rel_err(y_new, y_ref))
            for a, b in zip(state_new.recurrent + state_new.conv, state_ref.recurrent + state_ref.conv):
                err_state = max(err_state, _rel_err(a, b))
    report = RankReport(rank=rank, compile_s=compile_s, graphs=len({e.graph_id for e in rlog.events}), max_rel_err_out=err_out, max_rel_err_state=err_state,
                        rewrite_summary=rlog.summary(), active_rules=rlog.active_rules(),
                        runtime_stats=k3fuse.stats())
    return asdict(report)


def run_demo(cfg: DemoConfig) -> list[dict[str, Any]]:
    """Run the demo on cfg.tp ranks and return one report per rank."""
    from k3fuse.dist import launch

    if cfg.tp == 1:
        return [_run_rank(0, 1, cfg)]
    backend = "nccl" if cfg.device == "cuda" else "gloo"
    return launch(_run_rank, cfg.tp, backend=backend, args=(cfg,), timeout_s=1800)


def print_demo(cfg: DemoConfig, reports: list[dict[str, Any]]) -> None:
    from rich.table import Table

    from .cli import print_rewrite_summary, wide_console

    console = wide_console()
    r0 = reports[0]
    console.print(f"[bold]k3fuse demo[/bold]: preset={cfg.preset} layers={cfg.layers} residual={cfg.residual} "
                  f"TP={cfg.tp} tokens={cfg.tokens} steps={cfg.steps} compiler={cfg.compiler} "
                  f"strict={cfg.strict} torch={torch.__version__}")
    print_rewrite_summary(r0["rewrite_summary"],
                          title=f"rewrite log (rank 0, {r0['graphs']} compiled graph(s)): what the passes did")
    stats = Table(title="runtime (rank 0): what each fused op ran")
    stats.add_column("op")
    stats.add_column("implementation")
    stats.add_column("calls", justify="right")
    for op, impls in sorted(r0["runtime_stats"].items()):
        for impl, n in sorted(impls.items()):
            stats.add_row(op, impl, str(n))
    console.print(stats)
    check = Table(title="k3fuse vs stock eager, every rank")
    for col in ("rank", "first call s (compile)", "max rel err output", "max rel err KDA state"):
        check.add_column(col)
    for r in reports:
        check.add_row(str(r["rank"]), f"{r['compile_s']:.1f}", f"{r['max_rel_err_out']:.2e}",
                      f"{r['max_rel_err_state']:.2e}")
    console.print(check)
    console.print("active rules: " + (", ".join(r0["active_rules"]) or "none"))
    console.print("stock path: K3FUSE_DISABLE=1   one rule off: K3FUSE_RULES=-<rule>   log: --log FILE, k3fuse log FILE")


def demo_passed(reports: list[dict[str, Any]], tol: float = 1e-4) -> bool:
    return all(r["max_rel_err_out"] <= tol and r["max_rel_err_state"] <= tol for r in reports)


def register_demo(sub: Any) -> None:
    p = sub.add_parser("demo", help="compile a small K3 stack with the k3fuse backend on TP ranks and check it")
    defaults = DemoConfig()
    p.add_argument("--preset", default=defaults.preset, help="model preset (tiny, small)")
    p.add_argument("--layers", type=int, default=defaults.layers)
    p.add_argument("--residual", choices=("plain", "attnres"), default=defaults.residual)
    p.add_argument("--tp", type=int, default=defaults.tp)
    p.add_argument("--tokens", type=int, default=defaults.tokens, help="sequences decoded per step")
    p.add_argument("--steps", type=int, default=defaults.steps)
    p.add_argument("--compiler", choices=("inductor", "eager"), default=defaults.compiler)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--no-strict", dest="strict", action="store_false", help="allow fused-op fallbacks")
    p.add_argument("--device", choices=("cpu", "cuda"), default=defaults.device)
    p.add_argument("--log", default=None, help="append the rewrite log (JSONL) here")
    p.add_argument("--json", default=None, help="write the per-rank reports here")
    p.set_defaults(func=_cmd_demo)


def _cmd_demo(args: Any) -> int:
    cfg = DemoConfig(preset=args.preset, layers=args.layers, residual=args.residual, tp=args.tp,
                     tokens=args.tokens, steps=args.steps, compiler=args.compiler, seed=args.seed,
                     strict=args.strict, log=args.log, device=args.device)
    reports = run_demo(cfg)
    print_demo(cfg, reports)
    if args.json:
        Path(args.json).write_text(json.dumps({"config": asdict(cfg), "ranks": reports}, indent=2))
    ok = demo_passed(reports)
    print("demo: PASS (k3fuse output and state match stock)" if ok else "demo: FAIL (mismatch, see table)")
    return 0 if ok else 1
