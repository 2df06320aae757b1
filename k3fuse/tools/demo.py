"""`k3fuse demo`: the main job on a built-in default.

A small reference Kimi K3 stack runs on TP ranks (gloo on CPU, NCCL on GPUs), compiled with
`torch.compile(backend="k3fuse")`, next to the same model in eager mode. The demo decodes a few
steps with both, checks that outputs and the persistent KDA state agree, and prints what the
passes did (the rewrite log summary) and what ran at run time (implementation counters).
"""
from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from ..usage_error import UsageError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DemoConfig:
    preset: str = "small"
    layers: int = 2
    residual: str = "plain"
    tp: int = 2
    batch: int = 4  # tokens per decode step (one per sequence); `tokens` is the guard's range elsewhere
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
    import torch  # noqa: F401  (the module imports torch lazily: `k3fuse --help` must stay fast)

    a64, b64 = a.double(), b.double()
    return float((a64 - b64).norm() / b64.norm().clamp_min(1e-30))


def _copy_state(dst: Any, src: Any) -> None:
    for d, s in zip(dst.recurrent + dst.conv, src.recurrent + src.conv):
        d.copy_(s)


def _run_rank(rank: int, world_size: int, cfg: DemoConfig) -> dict[str, Any]:
    import torch
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
    state_ref = model.init_state(cfg.batch)
    state_new = model.init_state(cfg.batch)
    k3fuse.reset_stats()
    err_out = err_state = 0.0
    compile_s = 0.0
    with torch.no_grad():
        for step in range(cfg.steps):
            x = torch.randn(cfg.batch, model_cfg.hidden, generator=gen).to(device=device, dtype=model_cfg.torch_dtype)
            y_ref, next_ref = model(x, state_ref)
            t0 = time.perf_counter()
            with k3fuse.strict(cfg.strict):
                y_new, next_new = compiled(x, state_new)
            if step == 0:
                compile_s = time.perf_counter() - t0
            if rank == 0:
                took = f" (first call, compiles: {compile_s:.1f} s)" if step == 0 else ""
                print(f"k3fuse demo: step {step + 1}/{cfg.steps} on {world_size} rank(s){took}", file=sys.stderr,
                      flush=True)
            _copy_state(state_ref, next_ref)
            _copy_state(state_new, next_new)
            err_out = max(err_out, _rel_err(y_new, y_ref))
            for a, b in zip(state_new.recurrent + state_new.conv, state_ref.recurrent + state_ref.conv):
                err_state = max(err_state, _rel_err(a, b))
    report = RankReport(rank=rank, compile_s=compile_s, graphs=len({e.graph_id for e in rlog.events}), max_rel_err_out=err_out, max_rel_err_state=err_state,
                        rewrite_summary=rlog.summary(), active_rules=rlog.active_rules(),
                        runtime_stats=k3fuse.stats())
    return asdict(report)


def check_config(cfg: DemoConfig) -> None:
    """Mistakes in the demo's settings, found before minutes of compiling (UsageError)."""
    from .flags import decode_tokens

    low, high = decode_tokens()
    if cfg.tp < 1:
        raise UsageError(f"--tp {cfg.tp}: the demo needs at least one rank", "pass --tp 1 or more")
    if not low <= cfg.batch <= high:
        raise UsageError(f"--batch {cfg.batch}: the decode rewrites cover {low}-{high} tokens per step, so nothing "
                         f"would be rewritten", f"pass --batch between {low} and {high}")
    if cfg.steps < 1:
        raise UsageError(f"--steps {cfg.steps}: nothing would be compiled or compared", "pass --steps 1 or more")
    if cfg.layers < 1:
        raise UsageError(f"--layers {cfg.layers}: the stack would be empty", "pass --layers 1 or more")
    from k3fuse.model import get_config

    try:
        get_config(cfg.preset, n_layers=cfg.layers, residual=cfg.residual).validate_for_tp(cfg.tp)
    except ValueError as exc:
        raise UsageError(str(exc), "pick a --tp that divides it") from None
    if cfg.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise UsageError(f"--device cuda but no CUDA GPU is visible (torch {torch.__version__}, {build})",
                             "run on a GPU machine or use --device cpu")
        if torch.cuda.device_count() < cfg.tp:
            raise UsageError(f"--device cuda --tp {cfg.tp} needs {cfg.tp} GPUs, {torch.cuda.device_count()} visible",
                             f"pass --tp {torch.cuda.device_count()} or fewer")


def run_demo(cfg: DemoConfig) -> list[dict[str, Any]]:
    """Run the demo on cfg.tp ranks and return one report per rank."""
    from k3fuse.dist import launch

    check_config(cfg)
    if cfg.tp == 1:
        return [_run_rank(0, 1, cfg)]
    backend = "nccl" if cfg.device == "cuda" else "gloo"
    return launch(_run_rank, cfg.tp, backend=backend, args=(cfg,), timeout_s=1800)


def print_demo(cfg: DemoConfig, reports: list[dict[str, Any]]) -> None:
    import torch
    from rich.table import Table

    from .console import print_rewrite_summary, wide_console

    console = wide_console()
    r0 = reports[0]
    console.print(f"[bold]k3fuse demo[/bold]: preset={cfg.preset} layers={cfg.layers} residual={cfg.residual} "
                  f"TP={cfg.tp} batch={cfg.batch} steps={cfg.steps} compiler={cfg.compiler} "
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


def demo_verdict(reports: list[dict[str, Any]], tol: float = 1e-4) -> str | None:
    """None when every rank matched stock eager and rewrote something, else what went wrong."""
    mismatch = [r["rank"] for r in reports if not (r["max_rel_err_out"] <= tol and r["max_rel_err_state"] <= tol)]
    if mismatch:
        return f"k3fuse output or state differs from stock eager on rank(s) {mismatch}, see the table"
    idle = [r["rank"] for r in reports if not r["active_rules"]]
    if idle:
        return (f"no rewrite fired on rank(s) {idle}: the comparison proves nothing; "
                f"see the rewrite log table for the guards that said no")
    return None


def demo_passed(reports: list[dict[str, Any]], tol: float = 1e-4) -> bool:
    """Outputs and state match stock eager on every rank, and every rank rewrote at least one site."""
    return demo_verdict(reports, tol) is None


def register_demo(sub: Any) -> None:
    from .flags import BATCH_HELP, add_moved_tokens_flag, add_rules_flag, batch, positive_int

    p = sub.add_parser("demo", help="compile a small K3 stack with the k3fuse backend on TP ranks and check it")
    defaults = DemoConfig()
    p.add_argument("--preset", default=defaults.preset, choices=("tiny", "small"), help="model preset")
    p.add_argument("--layers", type=positive_int, default=defaults.layers)
    p.add_argument("--residual", choices=("plain", "attnres"), default=defaults.residual)
    p.add_argument("--tp", type=positive_int, default=defaults.tp, help="tensor-parallel ranks")
    p.add_argument("--batch", type=batch, default=defaults.batch, help=BATCH_HELP)
    add_moved_tokens_flag(p, "--batch N (one count from 1 to 64)")
    p.add_argument("--steps", type=positive_int, default=defaults.steps, help="decode steps")
    p.add_argument("--compiler", choices=("inductor", "eager"), default=defaults.compiler)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--no-strict", dest="strict", action="store_false", help="allow fused-op fallbacks")
    p.add_argument("--device", choices=("cpu", "cuda"), default=defaults.device)
    add_rules_flag(p)
    p.add_argument("--log", default=None, help="append the rewrite log (JSONL) here")
    p.add_argument("--json", default=None, help="write the per-rank reports here")
    p.set_defaults(func=_cmd_demo)


def _cmd_demo(args: Any) -> int:
    import json

    from ..fileio import check_append_file, check_output_file, write_text_atomic
    from .flags import check_moved_tokens, use_rules

    check_moved_tokens(args, "demo")
    cfg = DemoConfig(preset=args.preset, layers=args.layers, residual=args.residual, tp=args.tp,
                     batch=args.batch, steps=args.steps, compiler=args.compiler, seed=args.seed,
                     strict=args.strict, log=args.log, device=args.device)
    # every output path and setting first: finding a bad one after the run loses the run
    if args.json:
        check_output_file(args.json, option="--json")
    if args.log:
        check_append_file(args.log, option="--log", not_same_as=[("--json file", args.json)])
    check_config(cfg)
    from .. import settings

    if settings.get("K3FUSE_DISABLE"):
        raise UsageError("K3FUSE_DISABLE is set: the kill switch turns every rewrite off, so the demo would "
                         "compare stock with stock and fail with no rewrite fired",
                         "unset K3FUSE_DISABLE to run the demo")
    use_rules(args.rules)
    from .console import wide_console

    console = wide_console(stderr=True)
    doing = (f"k3fuse demo: compiling a {cfg.preset} K3 stack on {cfg.tp} {cfg.device} rank(s) with "
             f"torch.compile(backend='k3fuse', compiler={cfg.compiler}) and decoding {cfg.steps} "
             f"steps next to stock eager (about a minute on CPU)...")
    console.print(doing)  # then a line per decode step from rank 0 (a spinner would garble with them)
    t0 = time.perf_counter()
    reports = run_demo(cfg)
    console.print(f"k3fuse demo: ran in {time.perf_counter() - t0:.0f} s")
    print_demo(cfg, reports)
    if args.json:
        write_text_atomic(args.json, json.dumps({"config": asdict(cfg), "ranks": reports}, indent=2))
    problem = demo_verdict(reports)
    print("demo: PASS (k3fuse rewrote the graph and its output and state match stock)" if problem is None
          else f"demo: FAIL ({problem})")
    return 0 if problem is None else 1
