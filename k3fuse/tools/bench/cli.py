"""`k3fuse bench` on the command line: parse, check before any work, run, print, write."""
from __future__ import annotations

import argparse
from typing import Any

from ...usage_error import UsageError
from ..flags import positive_int
from ..model_args import MergeOverrides, parse_overrides  # noqa: F401  (validate_cli imports them from here)

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


def register_bench(sub: Any) -> None:
    from ..flags import add_moved_tokens_flag, add_rules_flag, batches

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
    p.add_argument("--layers", type=positive_int, default=None, help="default 1 (--model: the preset's)")
    p.add_argument("--residual", choices=("plain", "attnres"), default=None, help="default plain (--model: the "
                                                                                   "preset's)")
    p.add_argument("--tp", type=positive_int, default=None, help="tensor-parallel ranks (default: 1 on a GPU, 2 gloo ranks on CPU)")
    p.add_argument("--batch", type=batches, default=(1, 2, 4, 8, 16, 32, 64),
                   help="tokens decoded per step (one per sequence) to measure, e.g. 1,8,64")
    add_moved_tokens_flag(p, "--batch 1,8,64 (the token counts per step to measure)")
    p.add_argument("--arms", default=None,
                   help="stock, k3fuse, only:<rule>, without:<rule>, with:<rule>, or rules (every "
                        "only/without/with arm); --model: stock, k3fuse, peer (default all three)")
    add_rules_flag(p)
    p.add_argument("--rule-arm-batch", type=batches, default=None,
                   help="run the only:/without:/with: arms at these --batch counts only (they cost a compile each)")
    p.add_argument("--steps", type=positive_int, default=None, help="decode steps per CUDA graph (default 10; "
                                                                     "--model: 4)")
    p.add_argument("--replays", type=positive_int, default=None, help="timed replays per token count (default 20; "
                                                                       "--model: 10)")
    p.add_argument("--compiler", choices=("inductor", "eager"), default="inductor")
    p.add_argument("--no-profile", dest="profile", action="store_false")
    p.add_argument("--compile-only", action="store_true", help="only compile time (e.g. --layers 93)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log", default=None, help="append the k3fuse arms' rewrite log (JSONL) here")
    p.add_argument("--json", default=None, help="write the merged result here")
    p.add_argument("--plots", default=None, metavar="DIR",
                   help="write latency.png and timeline.png into DIR (created if missing)")
    add_model_bench_flags(p)
    p.set_defaults(func=_cmd_bench)


def add_model_bench_flags(p: Any) -> None:
    """`--model` and the flags only it reads (the whole model's step, k3fuse/tools/bench/model.py)."""
    p.add_argument("--model", action="store_true",
                   help="one decode step of the whole model (embedding, every layer type, head, sampling): stock vs "
                        "k3fuse vs the engine-like peer, batches x --context, floor, shares")
    p.add_argument("--context", type=_ints, default=(4096, 32768, 131072),
                   help="--model: tokens already cached per sequence, e.g. 4096,32768,131072")
    p.add_argument("--as-rank", type=int, default=None, metavar="R",
                   help="--model: rank R's slice of a TP --of model, alone on one device (stand-in collectives)")
    p.add_argument("--of", type=int, default=None, metavar="N", help="--model: the TP size of --as-rank")
    p.add_argument("--kv-dtype", choices=("auto", "fp8"), default="auto", help="--model: the latent KV cache")
    p.add_argument("--block-size", type=positive_int, default=64, help="--model: tokens per KV cache block")
    p.add_argument("--checkpoint", default=None, metavar="DIR", help="--model: a K3 checkpoint directory (its "
                                                                     "config.json and weights replace --preset's)")
    p.add_argument("--no-shares", dest="shares", action="store_false",
                   help="--model: skip the per-region graphs (the KDA / MLA / head shares)")


def _check_destinations(args: argparse.Namespace) -> None:
    """--json and --log, checked before any work: a mistake found after the run loses the run."""
    from ...fileio import check_append_file, check_output_file

    if args.json is not None:
        check_output_file(args.json, option="--json")
    if args.log is not None:
        check_append_file(args.log, option="--log")


def model_config_from_args(args: argparse.Namespace) -> Any:
    """`bench --model`'s ModelBenchConfig; every mistake one line before any work."""
    from ..flags import check_moved_tokens, use_rules
    from ..model_args import MAX_CONTEXT, model_args
    from .model import ARMS, ModelBenchConfig

    check_moved_tokens(args, "bench")
    _check_destinations(args)
    if args.plots is not None:
        raise UsageError("--plots is the layer bench's (bench --model prints its table and writes --json)",
                         "drop --plots")
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.preset = args.preset or ("k3" if args.device == "cuda" else "small")
    args.overrides = {**(args.overrides or {}), **({"residual": args.residual} if args.residual else {})}
    ma = model_args(args, default_tp=1)
    if ma.world > 1:
        raise UsageError(f"bench --model --tp {ma.tp}: the model bench runs one process",
                         f"run one rank of the deployment: --as-rank 0 --of {ma.tp}")
    arms = tuple(a.strip() for a in (args.arms or ",".join(ARMS)).split(",") if a.strip())
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        raise UsageError(f"--arms {args.arms!r}: unknown arm(s) {unknown} for --model", f"use {', '.join(ARMS)}")
    if "peer" in arms and arms[-1] != "peer":
        raise UsageError("--arms: the peer takes the model's expert tables over, so it runs last",
                         "put peer at the end")
    bad = [c for c in args.context if not 0 <= c <= MAX_CONTEXT]
    if bad:
        raise UsageError(f"--context {bad[0]} is outside 0..{MAX_CONTEXT} (K3's positions)", "pass e.g. 4096,32768")
    if ma.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda but this torch sees no CUDA GPU", "use --device cpu")
    use_rules(args.rules)
    return ModelBenchConfig(model=ma, batches=tuple(args.batch), contexts=tuple(args.context), arms=arms,
                            steps=args.steps or 4, replays=args.replays or 10, profile=args.profile,
                            shares=args.shares, json=args.json, log=args.log)


def config_from_args(args: argparse.Namespace) -> Any:
    """A checked BenchConfig; every mistake is one line (UsageError) before any work starts."""
    import torch

    from ...fileio import check_output_dir
    from ..flags import check_moved_tokens, rule_selection
    from .arms import parse_arms
    from .runner import BenchConfig

    check_moved_tokens(args, "bench")
    _check_destinations(args)
    if args.plots is not None:
        check_output_dir(args.plots, option="--plots")
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
        parse_arms((args.arms or "stock,k3fuse").split(","), default_rules=default_rules)
        cfg = BenchConfig(preset=args.preset or defaults["preset"], overrides=overrides, layers=args.layers or 1,
                          residual=args.residual or "plain", tp=tp, tokens=tuple(args.batch),
                          arms=tuple((args.arms or "stock,k3fuse").split(",")), rule_arm_tokens=args.rule_arm_batch,
                          steps=args.steps or 10, replays=args.replays or 20, compiler=args.compiler, device=device,
                          profile=args.profile, compile_only=args.compile_only, seed=args.seed,
                          rules=tuple(default_rules) if default_rules is not None else None, log=args.log,
                          routing=args.routing)
        cfg.model_config().validate_for_tp(tp)
    except ValueError as exc:
        raise UsageError(str(exc), "see k3fuse bench --help") from None
    return cfg


def _cmd_model_bench(args: argparse.Namespace) -> int:
    from .model import bench_model, print_model_bench, write_result

    cfg = model_config_from_args(args)
    print(f"k3fuse bench --model: {cfg.model.preset}, arms {', '.join(cfg.arms)}, batches {cfg.batches}, contexts "
          f"{cfg.contexts}; each arm compiles first", flush=True)
    result = bench_model(cfg, emit=lambda line: print(f"  {line}", flush=True))
    print_model_bench(result)
    if cfg.json:
        write_result(result, cfg.json)
        print(f"wrote {cfg.json}")
    failed = [a for a, e in result["arms"].items() if e.get("error")] + \
        [f"{r['arm']} B={r['batch']}" for r in result["rows"] if r.get("error")]
    return 1 if failed else 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from . import run_bench
    from .report import plot, print_tables, write_json

    if args.model:
        return _cmd_model_bench(args)
    for flag, given in (("--as-rank", args.as_rank is not None), ("--of", args.of is not None),
                        ("--checkpoint", args.checkpoint is not None)):
        if given:
            raise UsageError(f"{flag} is a flag of the whole-model bench", "add --model")
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
