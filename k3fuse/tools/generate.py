"""`k3fuse generate`: token ids in, tokens out, through the whole K3 model, stock torch.compile against k3fuse.

    k3fuse generate                                  # the small preset on 2 gloo ranks (CPU), 16 tokens
    k3fuse generate --prompt-ids 1,2,3 --steps 32    # one prompt (every sequence of the batch gets it)
    k3fuse generate --prompt-file ids.txt            # one prompt per line, ids separated by spaces or commas
    k3fuse generate --device cuda --preset k3 --as-rank 0 --of 16 --batch 8 --context 4096   # one rank of TP 16

Per arm (stock, k3fuse; `--arms` adds eager): the prompt by stepping (prefill), then `--steps` decode steps
(CUDA graphs of `--graph-steps` steps on a GPU), µs per step, tokens per second per sequence and for the
batch, and whether the arms' tokens agree (the first step where they do not). `--context C` starts every
sequence with C random tokens already in its cache (lengths differ within the batch). A stand-in rank
(`--as-rank R --of N`) says its figures are one rank's compute and lists what the missing collectives would
add (projected from measured NVLink figures).
"""
from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ..usage_error import UsageError
from .model_args import MAX_CONTEXT, ModelArgs, add_model_flags, model_args


@dataclass(frozen=True)
class GenerateConfig:
    model: ModelArgs = field(default_factory=ModelArgs)
    prompts: tuple[tuple[int, ...], ...] = ()  # one per sequence, equal lengths; () = a random prompt of 4 ids
    batch: int = 4
    steps: int = 16
    context: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    arms: tuple[str, ...] = ("stock", "k3fuse")
    graph_steps: int = 8
    strict: bool = True
    log: str | None = None


def _prompt_matrix(cfg: GenerateConfig, vocab: int) -> Any:
    import torch

    if not cfg.prompts:
        return torch.randint(0, vocab, (cfg.batch, 4), generator=torch.Generator().manual_seed(cfg.model.seed + 1))
    rows = list(cfg.prompts) * (cfg.batch // len(cfg.prompts)) if len(cfg.prompts) < cfg.batch else list(cfg.prompts)
    return torch.tensor(rows, dtype=torch.int64)


def generate_rank(rank: int, world: int, cfg: GenerateConfig) -> dict[str, Any]:
    """One rank: every arm's tokens and timings (rank 0's figures are reported; the ranks agree on tokens)."""
    import torch

    import k3fuse
    from k3fuse.log import RewriteLog
    from k3fuse.model import SamplingConfig, check_room, prefill

    from .model_run import (GraphedSteps, build_model, compile_step, context_lengths, fill_context,
                            missing_collectives, now, projected_us)

    sampling = SamplingConfig(cfg.temperature, cfg.top_p, cfg.model.seed)
    model = build_model(cfg.model, rank, world, sampling)
    device = model.device
    prompts = _prompt_matrix(cfg, model.config.vocab_size).to(device)
    lengths = context_lengths(cfg.batch, cfg.context)
    graph_steps = min(cfg.graph_steps, cfg.steps)
    # the graph's warm-up steps and a last partial replay write past --steps: room for them
    capacity = cfg.context + prompts.shape[1] + cfg.steps + (2 * graph_steps if device.type == "cuda" else 0)
    report: dict[str, Any] = {"rank": rank, "arms": {}, "lengths": lengths}
    for arm in cfg.arms:
        torch._dynamo.reset()
        rlog = RewriteLog(cfg.log, rank=rank) if arm == "k3fuse" else None
        step = compile_step(model, arm, strict=cfg.strict, log=rlog)
        state = model.new_state(cfg.batch, capacity, block_size=cfg.model.block_size, kv_dtype=cfg.model.kv_dtype)
        fill_context(model, state, lengths, cfg.model.seed)
        check_room(state, prompts.shape[1] + cfg.steps)
        k3fuse.reset_stats()
        entry: dict[str, Any] = {}
        try:
            with torch.no_grad(), k3fuse.strict(cfg.strict and arm == "k3fuse"):
                t0 = now(device)
                tokens, _ = prefill(step, state, prompts)
                entry["prefill_s"] = now(device) - t0  # includes the compiles
                out = [tokens.clone()]
                if device.type == "cuda":
                    graphed = GraphedSteps(step, state, tokens, graph_steps)
                    t0, done = now(device), 1
                    while done < cfg.steps:
                        rows = graphed.replay().clone()
                        take = min(graph_steps, cfg.steps - done)
                        out += list(rows[:take])
                        done += graph_steps
                    seconds = now(device) - t0
                    decoded = cfg.steps - 1
                    us = seconds * 1e6 / max(1, -(-decoded // graph_steps) * graph_steps)
                else:
                    t0 = now(device)
                    for _ in range(cfg.steps - 1):
                        tokens, _ = step(tokens, state)
                        out.append(tokens.clone())
                    us = (now(device) - t0) * 1e6 / max(1, cfg.steps - 1)
        except Exception as exc:  # one arm failing (strict mode!) must not hide the others
            entry["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:500]
            report["arms"][arm] = entry
            continue
        entry.update(tokens=torch.stack(out).T.cpu().tolist(), us_per_step=us,
                     tokens_per_s_per_seq=1e6 / us, tokens_per_s=cfg.batch * 1e6 / us, stats=k3fuse.stats(),
                     fallbacks=k3fuse.runtime.fallbacks())
        if rlog is not None:
            entry["active_rules"] = rlog.active_rules()
            entry["graphs"] = len({e.graph_id for e in rlog.events})
        report["arms"][arm] = entry
        del step, state
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if model.standin:
        missing = missing_collectives(model, cfg.batch)
        report["missing_collectives"] = [asdict(c) for c in missing]
        report["projected_us"] = {arm: projected_us(missing, arm) for arm in cfg.arms}
    report["model"] = {"config": asdict(model.config), "tp": model.tp_size, "rank": model.rank,
                       "standin": model.standin, "device": str(device),
                       "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
    return report


def run_generate(cfg: GenerateConfig) -> list[dict[str, Any]]:
    from k3fuse.dist import launch

    if cfg.model.world == 1:
        return [generate_rank(0, 1, cfg)]
    backend = "nccl" if cfg.model.device == "cuda" else "gloo"
    return launch(generate_rank, cfg.model.world, backend=backend, args=(cfg,), timeout_s=3600)


def agreement(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Whether every arm produced the first arm's tokens (and every rank its rank 0's); the first step and
    sequence where one did not."""
    arms = {name: a for name, a in reports[0]["arms"].items() if "tokens" in a}
    if not arms:
        return {"agree": False, "first": None, "why": "no arm ran"}
    base_name, base = next(iter(arms.items()))
    for r in reports[1:]:
        for name, a in r["arms"].items():
            if a.get("tokens") != arms.get(name, {}).get("tokens"):
                return {"agree": False, "first": None, "why": f"rank {r['rank']}'s {name} tokens differ from rank 0's"}
    for name, a in arms.items():
        for seq, (x, y) in enumerate(zip(base["tokens"], a["tokens"])):
            for step, (tx, ty) in enumerate(zip(x, y)):
                if tx != ty:
                    return {"agree": False, "first": {"arm": name, "versus": base_name, "step": step, "sequence": seq,
                                                      "tokens": [tx, ty]}}
    return {"agree": True, "first": None}


def print_generate(cfg: GenerateConfig, reports: list[dict[str, Any]]) -> None:
    from rich.table import Table

    from .console import wide_console

    console = wide_console()
    r0 = reports[0]
    mc = r0["model"]["config"]
    who = (f"rank {cfg.model.as_rank} of TP {cfg.model.of} alone (stand-in collectives)" if cfg.model.standin
           else f"TP {cfg.model.tp}")
    console.print(f"[bold]k3fuse generate[/bold]: preset={cfg.model.preset} layers={mc['n_layers']} "
                  f"residual={mc['residual']} experts={mc['expert_format']}/{mc['expert_layout']} {who} "
                  f"device={r0['model']['gpu'] or r0['model']['device']} batch={cfg.batch} steps={cfg.steps} "
                  f"context={cfg.context} temperature={cfg.temperature} top_p={cfg.top_p} kv={cfg.model.kv_dtype}")
    for note in cfg.model.notes:
        console.print(f"note: {note}")
    t = Table(title="decode (rank 0)" + ("; one rank's compute, collectives not included" if cfg.model.standin else ""))
    for col in ("arm", "prefill s (compiles)", "µs / step", "tok/s per sequence", "tok/s batch", "graphs",
                "fallbacks", "error"):
        t.add_column(col, overflow="fold")
    for name, a in r0["arms"].items():
        if "error" in a:
            t.add_row(name, "-", "-", "-", "-", "-", "-", a["error"])
            continue
        t.add_row(name, f"{a['prefill_s']:.1f}", f"{a['us_per_step']:.0f}", f"{a['tokens_per_s_per_seq']:.1f}",
                  f"{a['tokens_per_s']:.1f}", str(a.get("graphs", "-")), str(a.get("fallbacks") or "none"), "")
    console.print(t)
    if cfg.model.standin and r0.get("missing_collectives"):
        m = Table(title="what the missing collectives would add, per step (PROJECTED, not measured)")
        for col in ("collective", "per step", "bytes / rank", "µs each k3fuse", "µs each stock"):
            m.add_column(col)
        for c in r0["missing_collectives"]:
            m.add_row(c["name"], str(c["per_step"]), str(c["bytes_per_rank"]),
                      "-" if c["us_fused"] is None else f"{c['us_fused']:.1f}", f"{c['us_nccl']:.1f}")
        console.print(m)
        from .model_run import PROJECTION_SOURCE

        for name, a in r0["arms"].items():
            if "us_per_step" in a:
                total = a["us_per_step"] + r0["projected_us"][name]
                console.print(f"{name}: {a['us_per_step']:.0f} µs measured + {r0['projected_us'][name]:.0f} µs "
                              f"projected = {total:.0f} µs/step, {cfg.batch * 1e6 / total:.1f} tok/s (projected)")
        console.print(PROJECTION_SOURCE)
    for name, a in r0["arms"].items():
        if "tokens" in a:
            shown = ", ".join(" ".join(map(str, seq[:12])) + (" ..." if len(seq) > 12 else "")
                              for seq in a["tokens"][:2])
            console.print(f"{name} tokens (first sequences): {shown}")
    agree = agreement(reports)
    if agree["agree"]:
        console.print("tokens: every arm and every rank agree")
    elif agree["first"]:
        f = agree["first"]
        console.print(f"tokens: {f['arm']} differs from {f['versus']} first at step {f['step']}, sequence "
                      f"{f['sequence']}: {f['tokens'][1]} vs {f['tokens'][0]}")
    else:
        console.print(f"tokens: {agree['why']}")


def register_generate(sub: Any) -> None:
    from .flags import BATCH_HELP, add_rules_flag, batch, non_negative_float, non_negative_int, positive_int

    p = sub.add_parser("generate", help="token ids in, tokens out through the whole K3 model: stock vs k3fuse")
    add_model_flags(p, preset="small", tp=2)
    p.add_argument("--prompt-ids", default=None, help="one prompt: comma-separated token ids")
    p.add_argument("--prompt-file", default=None, help="prompts, one a line (ids separated by spaces or commas)")
    p.add_argument("--batch", type=batch, default=None, help=BATCH_HELP + " (default: the prompts, or 4)")
    p.add_argument("--steps", type=positive_int, default=16, help="tokens to generate per sequence")
    p.add_argument("--context", type=non_negative_int, default=0,
                   help="tokens already in each sequence's cache (random; lengths differ within the batch)")
    p.add_argument("--temperature", type=non_negative_float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, (0, 1]")
    p.add_argument("--arms", default="stock,k3fuse", help="stock, k3fuse, eager (comma-separated)")
    p.add_argument("--graph-steps", type=positive_int, default=8, help="decode steps per CUDA graph (GPU)")
    p.add_argument("--no-strict", dest="strict", action="store_false", help="allow k3fuse fallbacks")
    p.add_argument("--write-checkpoint", default=None, metavar="DIR",
                   help="write a random checkpoint of --preset (--layers, --set) in K3's shipped layout into DIR (new "
                        "or empty), then stop")
    add_rules_flag(p)
    p.add_argument("--log", default=None, help="append the k3fuse arm's rewrite log (JSONL) here")
    p.add_argument("--json", default=None, help="write the per-rank reports here")
    p.set_defaults(func=_cmd_generate)


def _read_prompts(args: Any) -> tuple[tuple[int, ...], ...]:
    from ..fileio import check_input_file

    if args.prompt_ids is not None and args.prompt_file is not None:
        raise UsageError("--prompt-ids and --prompt-file both given", "pass one of them")
    lines: list[str] = []
    if args.prompt_ids is not None:
        lines = [args.prompt_ids]
    elif args.prompt_file is not None:
        path = check_input_file(args.prompt_file, "prompt file")
        lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
        if not lines:
            raise UsageError(f"{path} holds no prompt", "write one prompt a line: token ids separated by spaces")
    prompts = []
    for n, line in enumerate(lines, 1):
        try:
            ids = tuple(int(t) for t in line.replace(",", " ").split())
        except ValueError:
            raise UsageError(f"prompt {n} is not token ids: {line.strip()[:60]!r}",
                             "write integers separated by spaces or commas") from None
        if not ids:
            raise UsageError(f"prompt {n} is empty", "give at least one token id")
        prompts.append(ids)
    if prompts and len({len(p) for p in prompts}) > 1:
        raise UsageError(f"the prompts have different lengths {sorted({len(p) for p in prompts})}",
                         "give prompts of one length (prefill steps every sequence together)")
    return tuple(prompts)


def config_from_args(args: Any) -> GenerateConfig:
    from .flags import decode_tokens, use_rules

    ma = model_args(args, default_tp=2)
    prompts = _read_prompts(args)
    batch = args.batch or max(1, len(prompts)) if prompts else (args.batch or 4)
    low, high = decode_tokens()
    if prompts and len(prompts) > high:
        raise UsageError(f"{len(prompts)} prompts: a decode step takes {low}-{high} sequences", "split the file")
    if prompts and batch % len(prompts):
        raise UsageError(f"--batch {batch} is not a multiple of the {len(prompts)} prompts",
                         f"pass --batch {len(prompts)} (or a multiple)")
    vocab = ma.config().vocab_size
    bad = [t for p in prompts for t in p if not 0 <= t < vocab]
    if bad:
        raise UsageError(f"token id {bad[0]} is outside the vocabulary of {vocab}", f"use ids in 0..{vocab - 1}")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p {args.top_p} is outside (0, 1]", "pass e.g. --top-p 0.9")
    if args.context + (len(prompts[0]) if prompts else 4) + args.steps > MAX_CONTEXT:
        raise UsageError(f"--context {args.context} plus the prompt and --steps {args.steps} is longer than "
                         f"K3's {MAX_CONTEXT} positions", "lower --context or --steps")
    arms = tuple(a.strip() for a in args.arms.split(",") if a.strip())
    unknown = [a for a in arms if a not in ("stock", "k3fuse", "eager")]
    if unknown or not arms:
        raise UsageError(f"--arms {args.arms!r}: unknown arm(s) {unknown}", "use stock, k3fuse, eager")
    if ma.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda but this torch sees no CUDA GPU", "use --device cpu")
        if torch.cuda.device_count() < ma.world:
            raise UsageError(f"--tp {ma.world} needs {ma.world} GPUs, {torch.cuda.device_count()} visible",
                             "lower --tp, or run one rank with --as-rank R --of N")
    use_rules(args.rules)
    return GenerateConfig(model=ma, prompts=prompts, batch=batch, steps=args.steps, context=args.context,
                          temperature=args.temperature, top_p=args.top_p, arms=arms, graph_steps=args.graph_steps,
                          strict=args.strict, log=args.log)


def _write_checkpoint(args: Any) -> int:
    """`--write-checkpoint DIR`: random weights of the chosen config in the shipped layout, nothing else."""
    from ..model.checkpoint import write_checkpoint

    if args.checkpoint is not None:
        raise UsageError("--write-checkpoint with --checkpoint", "write a new checkpoint from --preset, or read one")
    ma = model_args(args, default_tp=1)
    t0 = time.perf_counter()
    files = write_checkpoint(args.write_checkpoint, ma.config(), seed=ma.seed,
                             device="cuda" if ma.device == "cuda" else "cpu")
    print(f"k3fuse generate: wrote {ma.config().name} ({ma.config().n_layers} layers) to {args.write_checkpoint}: "
          f"{len(files)} shard(s), config.json, model.safetensors.index.json ({time.perf_counter() - t0:.0f} s)")
    return 0


def _cmd_generate(args: Any) -> int:
    import json

    from ..fileio import check_append_file, check_output_file, write_text_atomic

    if args.write_checkpoint is not None:
        return _write_checkpoint(args)
    if args.json:
        check_output_file(args.json, option="--json")
    if args.log:
        check_append_file(args.log, option="--log")
    cfg = config_from_args(args)
    print(f"k3fuse generate: {cfg.model.preset} on {cfg.model.world} {cfg.model.device} rank(s), arms "
          f"{', '.join(cfg.arms)}; each arm compiles first", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    reports = run_generate(cfg)
    print(f"k3fuse generate: ran in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    print_generate(cfg, reports)
    if args.json:
        write_text_atomic(args.json, json.dumps({"config": asdict(cfg), "ranks": reports,
                                                 "agreement": agreement(reports)}, indent=2, default=str))
    failed = [name for name, a in reports[0]["arms"].items() if "error" in a]
    return 1 if failed else 0


__all__ = ["GenerateConfig", "generate_rank", "run_generate", "register_generate", "agreement", "config_from_args"]
