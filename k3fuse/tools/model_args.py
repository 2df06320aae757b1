"""The whole-model flags `generate`, `validate --model` and `bench --model` share, and their checks (torch-free).

    --preset P --layers N --set f=v     the K3Config (N keeps K3's layer pattern: MLA every 4th and last)
    --tp N                              N ranks (gloo on CPU, NCCL on GPUs)
    --as-rank R --of N                  rank R's slice of a TP N model, alone on one device: collectives are
                                        local stand-ins of the same shapes, the figures one rank's compute
    --context C                         tokens already in each sequence's cache (random; lengths may differ)
    --kv-dtype auto|fp8 --block-size B  the paged latent cache
    --checkpoint DIR                    the weights of a K3 checkpoint in the shipped layout (k3fuse/model/
                                        checkpoint.py: its config.json replaces --preset; each rank reads its slice)

Every mistake is one line naming the problem and the fix (UsageError), before any model is built.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..usage_error import UsageError
from .flags import positive_int

#: the longest context the CLI builds a cache for (K3's max_position_embeddings)
MAX_CONTEXT = 1 << 20


@dataclass(frozen=True)
class ModelArgs:
    """Which model a verb builds and how each rank holds it."""

    preset: str = "small"
    layers: int | None = None          # None: the preset's
    overrides: tuple[tuple[str, Any], ...] = ()
    tp: int = 1
    as_rank: int | None = None         # with `of`: one rank of a TP `of` deployment, alone
    of: int | None = None
    device: str = "cpu"
    seed: int = 0
    kv_dtype: str = "auto"
    block_size: int = 64
    checkpoint: str | None = None
    notes: tuple[str, ...] = field(default=())  # what the checks changed (e.g. the experts' layout)

    @property
    def standin(self) -> bool:
        return self.as_rank is not None

    @property
    def world(self) -> int:
        """Processes to launch: one for a stand-in rank, else the TP size."""
        return 1 if self.standin else self.tp

    @property
    def model_tp(self) -> int:
        """The TP size the model's widths are divided by."""
        return self.of if self.standin else self.tp  # type: ignore[return-value]

    def config(self) -> Any:
        """The K3Config: the preset's, or the checkpoint's config.json (its first `layers` layers)."""
        import dataclasses

        from ..model import get_config

        over = dict(self.overrides)
        if self.layers is not None:
            over["n_layers"] = self.layers
        if self.checkpoint is None:
            return get_config(self.preset, **over)
        from ..model.checkpoint import read_config

        cfg = read_config(self.checkpoint, expert_layout=over.pop("expert_layout", "rows"))
        if "n_layers" in over:
            over["dense_layers"] = min(cfg.dense_layers, over["n_layers"])
        return dataclasses.replace(cfg, **over)


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


def add_model_flags(p: argparse.ArgumentParser, preset: str = "small", tp: int = 2) -> None:
    p.add_argument("--preset", default=preset, help=f"model preset (tiny, small, k3; default {preset})")
    p.add_argument("--layers", type=positive_int, default=None,
                   help="decoder layers, K3's pattern kept (MLA every 4th and the last; default: the preset's)")
    p.add_argument("--set", dest="overrides", type=parse_overrides, action=MergeOverrides, default={},
                   help="K3Config fields (repeatable), e.g. --set residual=plain --set expert_format=mxfp4")
    p.add_argument("--tp", type=positive_int, default=None, help=f"tensor-parallel ranks (default {tp}; 1 with "
                                                                  f"--as-rank)")
    p.add_argument("--as-rank", type=int, default=None, metavar="R",
                   help="build rank R's slice of a TP --of model and run it alone on one device (collectives "
                        "become local stand-ins: the figures are one rank's compute)")
    p.add_argument("--of", type=int, default=None, metavar="N", help="the TP size --as-rank is a rank of")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--seed", type=int, default=0, help="weights and inputs")
    p.add_argument("--kv-dtype", choices=("auto", "fp8"), default="auto",
                   help="latent KV cache: the trunk dtype (bf16 for K3) or FP8 e4m3 with a per-layer scale")
    p.add_argument("--block-size", type=positive_int, default=64, help="tokens per KV cache block")
    p.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="a K3 checkpoint directory (Hugging Face layout): its config.json and weights replace --preset's "
                        "(--layers N: its first N layers)")


def model_args(args: argparse.Namespace, default_tp: int) -> ModelArgs:
    """ModelArgs from the parsed flags, every mistake one line (UsageError)."""
    if (args.as_rank is None) != (args.of is None):
        raise UsageError("--as-rank and --of go together", "pass both, e.g. --as-rank 0 --of 16")
    if args.as_rank is not None:
        if args.of < 1:
            raise UsageError(f"--of {args.of}: a TP size is at least 1", "pass --of 16 (or 8, 32)")
        if not 0 <= args.as_rank < args.of:
            raise UsageError(f"--as-rank {args.as_rank} is outside --of {args.of}",
                             f"pass a rank in 0..{args.of - 1}")
        if args.tp not in (None, 1):
            raise UsageError(f"--tp {args.tp} with --as-rank: a stand-in rank runs alone",
                             "drop --tp (or run --tp N without --as-rank)")
    checkpoint = None
    if args.checkpoint is not None:
        from ..fileio import check_input_file

        checkpoint = str(check_input_file(str(Path(args.checkpoint) / "config.json"), "checkpoint config").parent)
    ma = ModelArgs(preset=args.preset, layers=args.layers, overrides=tuple(sorted(args.overrides.items())),
                   tp=1 if args.as_rank is not None else (args.tp or default_tp), as_rank=args.as_rank, of=args.of,
                   device=args.device, seed=args.seed, kv_dtype=args.kv_dtype, block_size=args.block_size,
                   checkpoint=checkpoint)
    return check_model_args(ma)


def check_model_args(ma: ModelArgs) -> ModelArgs:
    """The config and the TP division, checked (UsageError); a stand-in rank whose experts cannot be held in
    block order gets the checkpoint's row order instead (said in `notes`)."""
    import dataclasses

    try:
        cfg = ma.config()
    except UsageError:  # a checkpoint's config.json that is not K3's: its own one line
        raise
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc), "see --help for the presets and --set fields") from None
    tp = ma.model_tp
    try:
        cfg.validate_for_tp(tp)
    except ValueError as exc:
        flag = f"--of {tp}" if ma.standin else f"--tp {tp}"
        raise UsageError(f"{flag}: {exc}", "pick a TP size that divides every sharded width") from None
    try:
        cfg.check_expert_layout(tp)
    except ValueError:
        if "expert_layout" in dict(ma.overrides):
            raise UsageError(f"TP {tp} leaves moe_inter/tp={cfg.moe_inter // tp}, which expert_layout=blocks cannot "
                             "hold", "use --set expert_layout=rows") from None
        note = (f"experts held in the checkpoint's row order: moe_inter/tp = {cfg.moe_inter // tp} at TP {tp} is not "
                "whole 128-element steps (block order needs them)")
        ma = dataclasses.replace(ma, overrides=tuple(sorted({**dict(ma.overrides), "expert_layout": "rows"}.items())),
                                 notes=ma.notes + (note,))
    return ma


__all__ = ["ModelArgs", "add_model_flags", "model_args", "check_model_args", "MAX_CONTEXT", "parse_overrides",
           "MergeOverrides"]
