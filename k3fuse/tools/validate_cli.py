"""`k3fuse validate` on the command line (the work is in k3fuse.tools.validate, imported when it runs)."""
from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from ..usage_error import UsageError
from .bench.cli import MergeOverrides, parse_overrides
from .flags import (BATCH_HELP, add_moved_tokens_flag, add_rules_flag, batch, check_moved_tokens, finite_float,
                    non_negative_float, positive_float, positive_int, use_rules)
from .validate_config import ValidateConfig
from .validate_model import add_model_mode_flags, cmd_validate_model, refuse_model_flags


def register_validate(sub: Any) -> None:
    d = ValidateConfig()
    p = sub.add_parser("validate", help="decode N steps through stock and k3fuse and explain every difference "
                                        "against a float64 copy of the model")
    p.add_argument("--preset", default=d.preset, help="model preset (tiny, small, k3)")
    p.add_argument("--set", dest="overrides", type=parse_overrides, action=MergeOverrides, default={},
                   help="K3Config fields (repeatable), e.g. expert_format=mxfp4 (MXFP4 routed experts; the k3 "
                        "preset's), or --set moe_inter=128 --set expert_format=bf16 (narrow bf16 experts)")
    p.add_argument("--layers", type=positive_int, default=None, help=f"default {d.layers} (--model: the preset's)")
    p.add_argument("--residual", choices=("plain", "attnres"), default=None, help=f"default {d.residual} (--model: "
                                                                                   "the preset's)")
    p.add_argument("--tp", type=positive_int, default=None, help=f"tensor-parallel ranks (default {d.tp})")
    p.add_argument("--batch", type=batch, default=d.tokens, help=BATCH_HELP)
    add_moved_tokens_flag(p, "--batch N (sequences decoded per step, 1 to 64)")
    p.add_argument("--steps", type=positive_int, default=None, help=f"decode steps (default {d.steps}; --model: 1000)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="model dtype (default: the preset's)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=d.device)
    p.add_argument("--compiler", choices=("inductor", "eager"), default=d.compiler, help="k3fuse's inner compiler")
    p.add_argument("--stock", choices=("compile", "eager"), default=d.stock,
                   help="stock path: torch.compile (Inductor) or eager")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--skew", type=finite_float, default=d.skew,
                   help="router bias skew towards low-index experts (a finite number)")
    p.add_argument("--temperature", type=non_negative_float, default=d.temperature,
                   help="sampling temperature (0: argmax)")
    p.add_argument("--tie-margin", type=non_negative_float, default=None,
                   help="selection-score gap under which a top-k flip counts as a near tie (default by dtype)")
    p.add_argument("--no-strict", dest="strict", action="store_false", help="allow fused-op fallbacks")
    p.add_argument("--no-layer-outputs", dest="layer_outputs", action="store_false",
                   help="skip the per-layer output errors (truncated stacks, one compile per depth)")
    p.add_argument("--timeout", type=positive_float, default=d.timeout_s, help="seconds before every rank is killed")
    add_rules_flag(p)
    p.add_argument("--log", default=None, help="append the k3fuse path's rewrite log (JSONL) here")
    p.add_argument("--json", default=None, help="write the per-rank reports here")
    add_model_mode_flags(p)
    p.set_defaults(func=_cmd_validate)


def check_config(cfg: ValidateConfig) -> None:
    """What the ranks would find only after building models: the preset, --set, --tp, the GPUs."""
    from k3fuse.model import get_config

    over = dict(cfg.overrides)
    if cfg.dtype:
        over["dtype"] = cfg.dtype
    try:
        get_config(cfg.preset, n_layers=cfg.layers, residual=cfg.residual, **over).validate_for_tp(cfg.tp)
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc), "see k3fuse validate --help") from None
    if cfg.device == "cuda":
        import torch

        if torch.cuda.device_count() < cfg.tp:
            raise UsageError(f"--device cuda --tp {cfg.tp} needs {cfg.tp} GPUs, {torch.cuda.device_count()} visible",
                             "lower --tp or use --device cpu")


def _cmd_validate(args: Any) -> int:
    from ..fileio import check_append_file, check_output_file, write_text_atomic

    check_moved_tokens(args, "validate")
    if args.model:
        return cmd_validate_model(args)
    refuse_model_flags(args)
    d = ValidateConfig()
    args.layers, args.residual = args.layers or d.layers, args.residual or d.residual
    args.tp, args.steps = args.tp or d.tp, args.steps or d.steps
    if args.json:
        check_output_file(args.json, option="--json")
    if args.log:
        check_append_file(args.log, option="--log", not_same_as=[("--json file", args.json)])
    cfg = ValidateConfig(preset=args.preset, layers=args.layers, residual=args.residual, tp=args.tp,
                         tokens=args.batch, steps=args.steps, dtype=args.dtype, device=args.device,
                         compiler=args.compiler, stock=args.stock, seed=args.seed, skew=args.skew,
                         temperature=args.temperature, tie_margin=args.tie_margin, strict=args.strict,
                         layer_outputs=args.layer_outputs, timeout_s=args.timeout,
                         overrides=tuple(sorted(args.overrides.items())), log=args.log)
    check_config(cfg)
    use_rules(args.rules)

    from .validate import ValidateError, passed, print_validate, run_validate

    try:
        reports = run_validate(cfg)
    except ValidateError as exc:
        raise UsageError(str(exc).splitlines()[0]) from exc
    print_validate(cfg, reports)
    if args.json:
        write_text_atomic(args.json, json.dumps({"config": asdict(cfg), "ranks": reports}, indent=2, default=str))
    ok = passed(reports)
    print("validate: PASS (every difference from the float64 copy is within stock's or explained by a "
          "near-tie routing flip)" if ok else "validate: FAIL (unexplained error, see above)")
    return 0 if ok else 1


__all__ = ["register_validate", "check_config"]
