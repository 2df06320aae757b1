"""`k3fuse bench` on the command line: parse, check before any work, run, print, write."""
from __future__ import annotations

import argparse
from typing import Any

from ...usage_error import UsageError

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
    from ..flags import add_moved_tokens_flag, add_rules_flag, batches, positive_int

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
    p.add_argument("--layers", type=positive_int, default=1)
    p.add_argument("--residual", choices=("plain", "attnres"), default="plain")
    p.add_argument("--tp", type=positive_int, default=None, help="tensor-parallel ranks (default: 1 on a GPU, 2 gloo ranks on CPU)")
    p.add_argument("--batch", type=batches, default=(1, 2, 4, 8, 16, 32, 64),
                   help="tokens decoded per step (one per sequence) to measure, e.g. 1,8,64")
    add_moved_tokens_flag(p, "--batch 1,8,64 (the token counts per step to measure)")
    p.add_argument("--arms", default="stock,k3fuse",
                   help="stock, k3fuse, only:<rule>, without:<rule>, with:<rule>, or rules (every "
                        "only/without/with arm)")
    add_rules_flag(p)
    p.add_argument("--rule-arm-batch", type=batches, default=None,
                   help="run the only:/without:/with: arms at these --batch counts only (they cost a compile each)")
    p.add_argument("--steps", type=positive_int, default=10, help="decode steps per CUDA graph")
    p.add_argument("--replays", type=positive_int, default=20, help="timed replays per token count")
    p.add_argument("--compiler", choices=("inductor", "eager"), default="inductor")
    p.add_argument("--no-profile", dest="profile", action="store_false")
    p.add_argument("--compile-only", action="store_true", help="only compile time (e.g. --layers 93)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log", default=None, help="append the k3fuse arms' rewrite log (JSONL) here")
    p.add_argument("--json", default=None, help="write the merged result here")
    p.add_argument("--plots", default=None, metavar="DIR",
                   help="write latency.png and timeline.png into DIR (created if missing)")
    p.set_defaults(func=_cmd_bench)


def config_from_args(args: argparse.Namespace) -> Any:
    """A checked BenchConfig; every mistake is one line (UsageError) before any work starts."""
    import torch

    from ...fileio import check_append_file, check_output_dir, check_output_file
    from ..flags import check_moved_tokens, rule_selection
    from .arms import parse_arms
    from .runner import BenchConfig

    check_moved_tokens(args, "bench")
    # the destinations first: a mistake found after the run loses the run
    if args.json is not None:
        check_output_file(args.json, option="--json")
    if args.plots is not None:
        check_output_dir(args.plots, option="--plots")
    if args.log is not None:
        check_append_file(args.log, option="--log")
    default_rules = rule_selection(args.rules) if args.rules is not None else None
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda but this torch sees no CUDA GPU", "use --device cpu")
    defaults = CUDA_DEFAULTS if device == "cuda" else CPU_DEFAULTS
    tp = args.tp or defaults["tp"]
    if device == "cuda" and tp > torch.cuda.device_count():
        raise UsageError(f"--tp {tp} needs {tp} GPUs, {torch.cuda.device_count()} visible", "lower --tp")
    overrides = args.overrides if args.overrides is not None else parse_overrides(defaults["set"])
    try:
        from .routing import parse_routing

        parse_routing(args.routing)
        parse_arms(args.arms.split(","), default_rules=default_rules)
        cfg = BenchConfig(preset=args.preset or defaults["preset"], overrides=overrides, layers=args.layers,
                          residual=args.residual, tp=tp, tokens=tuple(args.batch),
                          arms=tuple(args.arms.split(",")), rule_arm_tokens=args.rule_arm_batch,
                          steps=args.steps, replays=args.replays, compiler=args.compiler, device=device,
                          profile=args.profile, compile_only=args.compile_only, seed=args.seed,
                          rules=tuple(default_rules) if default_rules is not None else None, log=args.log,
                          routing=args.routing)
        cfg.model_config().validate_for_tp(tp)
    except ValueError as exc:
        raise UsageError(str(exc), "see k3fuse bench --help") from None
    return cfg


def _cmd_bench(args: argparse.Namespace) -> int:
    from . import run_bench
    from .report import plot, print_tables, write_json

    cfg = config_from_args(args)
    print(f"k3fuse bench: {len(cfg.arms)} arm spec(s) x {len(cfg.tokens)} token counts on {cfg.tp} "
          f"{cfg.device} rank(s); each arm compiles first (10-15 s per arm on a GPU)", flush=True)
    if cfg.device == "cpu":
        print("k3fuse bench: on CPU the fused ops run their plain-torch reference path, not the CUDA kernels: "
              "these timings check that the bench runs, they measure no speed-up", flush=True)
    result = run_bench(cfg)
    print_tables(result)
    if args.json:
        print(f"wrote {write_json(result, args.json)}")
    if args.plots:
        written, skipped = plot(result, args.plots)
        for path in written:
            print(f"wrote {path}")
        for name, why in skipped.items():
            print(f"skipped {name}: {why}")
    failed = [name for name, arm in result["arms"].items() if arm.get("error")]
    if failed:
        print(f"k3fuse bench: arm(s) {failed} failed (see the error column)")
        return 1
    return 0


__all__ = ["register_bench", "config_from_args"]
