"""`k3fuse bench` on the command line: parse, check before any work, run, print, write."""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from ...usage import UsageError

#: on GPUs: K3 at published widths with MXFP4 experts, one GPU (`--preset k3_moe_inter128`, or
#: `--set moe_inter=128 --set expert_format=bf16`, is the narrow bf16 variant earlier figures used)
CUDA_DEFAULTS = {"preset": "k3", "set": "", "tp": 1}
CPU_DEFAULTS = {"preset": "small", "set": "", "tp": 2}


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def parse_overrides(text: str) -> dict[str, Any]:
    """'moe_inter=128,latent=3584' -> {"moe_inter": 128, "latent": 3584} (numbers as int/float)."""
    out: dict[str, Any] = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"--set takes key=value pairs, got {item!r}")
        for cast in (int, float):
            try:
                out[key] = cast(value)
                break
            except ValueError:
                continue
        else:
            out[key] = value
    return out


class MergeOverrides(argparse.Action):
    """`--set` may repeat: `--set moe_inter=128 --set expert_format=bf16` sets both."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, {**(getattr(namespace, self.dest, None) or {}), **values})


def register_bench(sub: Any) -> None:
    p = sub.add_parser("bench", help="the compiled K3 layer: stock torch.compile vs k3fuse, same run",
                       description="Layer benchmark: CUDA-graph replays of multi-step graphs, the slower "
                                   "rank, strict mode, kernels per step, compile time, JSON and plots. "
                                   "Defaults: K3 at published widths with MXFP4 experts at TP 1 on a GPU; "
                                   "the small preset on gloo ranks on CPU (a smoke run).")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when a GPU is visible")
    p.add_argument("--preset", default=None, help="model preset (k3, k3_moe_inter128, small, tiny)")
    p.add_argument("--set", dest="overrides", type=parse_overrides, action=MergeOverrides, default=None,
                   help="K3Config fields (repeatable), e.g. --set moe_inter=128 --set expert_format=bf16")
    p.add_argument("--routing", default="uniform",
                   help="expert choice: uniform (the router as drawn) or zipf:<s>, a Zipf-shaped router "
                        "bias (e.g. zipf:1.1)")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--residual", choices=("plain", "attnres"), default="plain")
    p.add_argument("--tp", type=int, default=None, help="TP ranks (1 or 2 here; default 2)")
    p.add_argument("--tokens", type=_ints, default=(1, 2, 4, 8, 16, 32, 64), help="token counts, e.g. 1,8,64")
    p.add_argument("--arms", default="stock,k3fuse",
                   help="stock, k3fuse, only:<rule>, without:<rule>, or rules (every only/without arm)")
    p.add_argument("--rule-arm-tokens", type=_ints, default=None,
                   help="run the only:/without: arms at these token counts only (they cost a compile each)")
    p.add_argument("--steps", type=int, default=10, help="decode steps per CUDA graph")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--compiler", choices=("inductor", "eager"), default="inductor")
    p.add_argument("--no-profile", dest="profile", action="store_false")
    p.add_argument("--compile-only", action="store_true", help="only compile time (e.g. --layers 93)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the merged result here")
    p.add_argument("--plots", default=None, help="write <prefix>latency.png and <prefix>timeline.png")
    p.set_defaults(func=_cmd_bench)


def _check_output(path: str | None, what: str) -> None:
    if path is None:
        return
    parent = Path(path).parent
    if not parent.is_dir():
        raise UsageError(f"{what} directory {str(parent)!r} does not exist", "create it first")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"{what} directory {str(parent)!r} is not writable", "pick a writable directory")


def config_from_args(args: argparse.Namespace) -> Any:
    """A checked BenchConfig; every mistake is one line (UsageError) before any work starts."""
    import torch

    from .arms import parse_arms
    from .runner import BenchConfig

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda but this torch sees no CUDA GPU", "use --device cpu")
    defaults = CUDA_DEFAULTS if device == "cuda" else CPU_DEFAULTS
    tp = args.tp or defaults["tp"]
    if tp < 1 or (device == "cuda" and tp > torch.cuda.device_count()):
        raise UsageError(f"--tp {tp} needs {tp} GPUs, {torch.cuda.device_count()} visible", "lower --tp")
    if any(not 1 <= t <= 64 for t in args.tokens):
        raise UsageError(f"--tokens {args.tokens} outside decode (1..64)", "pass counts from 1 to 64")
    overrides = args.overrides if args.overrides is not None else parse_overrides(defaults["set"])
    try:
        from .routing import parse_routing

        parse_routing(args.routing)
        parse_arms(args.arms.split(","))
        cfg = BenchConfig(preset=args.preset or defaults["preset"], overrides=overrides, layers=args.layers,
                          residual=args.residual, tp=tp, tokens=tuple(args.tokens),
                          arms=tuple(args.arms.split(",")), rule_arm_tokens=args.rule_arm_tokens,
                          steps=args.steps, replays=args.replays, compiler=args.compiler, device=device,
                          profile=args.profile, compile_only=args.compile_only, seed=args.seed,
                          routing=args.routing)
        cfg.model_config().validate_for_tp(tp)
    except ValueError as exc:
        raise UsageError(str(exc), "see k3fuse bench --help") from None
    _check_output(args.json, "--json")
    _check_output(args.plots, "--plots")
    return cfg


def _cmd_bench(args: argparse.Namespace) -> int:
    from . import run_bench
    from .report import plot, print_tables, write_json

    cfg = config_from_args(args)
    print(f"k3fuse bench: {len(cfg.arms)} arm spec(s) x {len(cfg.tokens)} token counts on {cfg.tp} "
          f"{cfg.device} rank(s); each arm compiles first (10-15 s per arm on a GPU)", flush=True)
    result = run_bench(cfg)
    print_tables(result)
    if args.json:
        print(f"wrote {write_json(result, args.json)}")
    if args.plots and not cfg.compile_only:
        for path in plot(result, args.plots):
            print(f"wrote {path}")
    failed = [name for name, arm in result["arms"].items() if arm.get("error")]
    if failed:
        print(f"k3fuse bench: arm(s) {failed} failed (see the error column)")
        return 1
    return 0


__all__ = ["register_bench", "config_from_args"]
