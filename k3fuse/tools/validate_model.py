"""`k3fuse validate --model`: the whole model over many decode steps, stock and k3fuse against a float32 copy.

Three paths with the same weights decode the same sequences: `ref`, a float32 copy of the model (eager; packed
experts keep their bytes and dequantize exactly in fp32), `stock` (torch.compile, Inductor) and `k3fuse`
(torch.compile(backend="k3fuse"), strict mode: a fallback raises), both in the model dtype (bf16 by default).
Every path is fed the reference's greedy token at every step (teacher forcing), so the paths stay comparable
for the whole run and every step's comparison means something:

* the routed experts each path selects, per layer, step and sequence, against the reference's: a different
  top-k set is a routing flip, near a tie when the swapped experts' reference selection scores differ by at
  most `--tie-margin` (validate's flag; default by dtype, bf16: 2e-2); a flip far from a tie is a bug. A flip changes that layer's output
  by a whole expert's share, and the state carries it (the KDA state, the KV cache): random-weight routers sit
  near ties often, so in bf16 flips, not rounding, drive the divergence from the float32 copy. A sequence's
  first flip must be near a tie; its later flips follow from the state the first one changed;
* greedy tokens, step by step: a path disagrees where its argmax is not the reference's; a disagreement is
  explained when the float32 logit margin between the two tokens (reference logit of its token minus
  reference logit of the path's) is at most `--logit-tie` (a near tie of the logits), or when that sequence
  had a near-tie routing flip at this or an earlier step; unexplained otherwise. The first disagreement is
  reported with its step, tokens and margin;
* temperature sampling with a fixed seed (sampling.py: the same random number for every path): each path's
  sampled token against the reference's; a difference is explained when the number falls within the two
  distributions' total-variation distance of an edge of the reference token's CDF interval;
* the KDA recurrent and conv states and the KV cache against the reference every step (relative norm,
  worst layer): drift curves, plotted with `--plots DIR`;
* the rewrite log and the runtime counters: every rule expected to fire on this model at this TP fired, and
  no fused op fell back (strict mode raises on the first fallback).
Exit 1 on an unexplained disagreement, a rule that did not fire, or a fallback.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from .model_args import ModelArgs

#: default near-tie tolerance of a greedy flip, in fp32 logit units (the logits of these models have std ~1)
TIE_TOL = {"bfloat16": 0.1, "float16": 0.02, "float32": 1e-3}
#: default near-tie tolerance of a routing flip, in selection-score units (k3fuse validate's, by dtype)
ROUTE_TIE = {"bfloat16": 2e-2, "float16": 5e-3, "float32": 1e-4}
#: the rules expected on the whole model: every default rule that applies at TP 1, and the collective ones at TP >= 2
EXPECTED_TP1 = ("fused_routing", "routed_experts", "moe_combine", "shared_expert_stream", "kda_short_conv",
                "kda_delta_rule", "decode_gemm")
EXPECTED_TP2 = EXPECTED_TP1 + ("oproj_allreduce_residual", "moe_front_sharded")


@dataclass(frozen=True)
class ValidateModelConfig:
    model: ModelArgs = field(default_factory=ModelArgs)
    batch: int = 2
    steps: int = 1000
    dtype: str = "bfloat16"
    temperature: float = 0.8
    tie_tol: float | None = None  # greedy: the float32 logit margin of a near tie (--logit-tie)
    route_tie: float | None = None  # routing: the selection-score gap of a near tie (--tie-margin)
    context: int = 0
    strict: bool = True
    log: str | None = None
    progress_every: int = 100
    compiler: str = "inductor"  # k3fuse's inner compiler
    stock: str = "compile"  # the stock path: torch.compile (Inductor) or eager


def _rel(a: Any, b: Any) -> float:
    a64, b64 = a.double(), b.double()
    return float((a64 - b64).norm() / b64.norm().clamp_min(1e-30))


def _sample_check(logits_ref: Any, logits_path: Any, u: Any, cfg: Any) -> list[tuple[int, int, int, float, float]]:
    """Sampled-token differences between a path and the reference: (sequence, ref token, path token, distance of
    the random number to the reference interval's nearest edge, total-variation distance)."""
    import torch

    from ..model.sampling import sample

    t_ref, t_path = sample(logits_ref, u, cfg), sample(logits_path, u, cfg)
    out = []
    if torch.equal(t_ref, t_path):
        return out
    p_ref = torch.softmax(logits_ref.double() / cfg.temperature, -1)
    p_path = torch.softmax(logits_path.double() / cfg.temperature, -1)
    tv = (p_ref - p_path).abs().sum(-1) / 2
    cdf = torch.cumsum(p_ref, -1)
    for b in torch.nonzero(t_ref != t_path).flatten().tolist():
        tok = int(t_ref[b])
        lo, hi = (float(cdf[b, tok - 1]) if tok else 0.0), float(cdf[b, tok])
        edge = min(abs(float(u[b]) - lo), abs(hi - float(u[b])))
        out.append((b, tok, int(t_path[b]), edge, float(tv[b])))
    return out


def _routers(model: Any) -> list[Any]:
    return [layer.mlp.routed.router for layer in model.layers if hasattr(layer.mlp, "routed")]


def _record_routing(model: Any, store: list, scores: bool) -> list:
    """Forward hooks on every router: each call appends (layer, expert ids [, selection scores]) to `store`
    (compiled steps trace the hook; its append is replayed after the graph)."""
    handles = []
    for i, router in enumerate(_routers(model)):
        def hook(mod: Any, args: Any, out: Any, i: int = i) -> None:
            if scores:
                import torch

                store.append((i, out[1], torch.sigmoid(mod.logits(args[0])) + mod.b_corr))
            else:
                store.append((i, out[1]))
        handles.append(router.register_forward_hook(hook))
    return handles


def _routing_flips(ref: list, path: list, margin: float, step: int) -> list[dict[str, Any]]:
    """Per layer and sequence where the path's top-k set is not the reference's: the largest reference selection-
    score gap between a swapped pair (a near tie when <= margin)."""
    flips = []
    for (layer, idx_ref, score), (_, idx_path) in zip(ref, path):
        for b in range(idx_ref.shape[0]):
            a, c = set(idx_ref[b].tolist()), set(idx_path[b].tolist())
            if a == c:
                continue
            gap = max(abs(float(score[b, e]) - float(score[b, f])) for e in a - c for f in c - a)
            flips.append({"step": step, "layer": layer, "sequence": b, "gap": gap, "near_tie": gap <= margin})
    return flips


def validate_model_rank(rank: int, world: int, cfg: ValidateModelConfig) -> dict[str, Any]:
    import torch

    import k3fuse
    from k3fuse.log import RewriteLog

    from ..model import SamplingConfig
    from ..model.sampling import step_uniform
    from .model_run import build_model, compile_step, context_lengths, fill_context

    t0 = time.perf_counter()
    dtype = getattr(torch, cfg.dtype)
    model = build_model(cfg.model, rank, world, dtype=dtype)
    ref = build_model(cfg.model, rank, world, dtype=torch.float32)
    ref.load_state_dict(model.state_dict())  # the same weights upcast (packed experts: the same bytes)
    tie_tol = cfg.tie_tol if cfg.tie_tol is not None else TIE_TOL.get(cfg.dtype, 0.1)
    route_tie = cfg.route_tie if cfg.route_tie is not None else ROUTE_TIE.get(cfg.dtype, 2e-2)
    rlog = RewriteLog(cfg.log, rank=rank)
    steps = {"ref": compile_step(ref, "eager"), "stock": compile_step(model, "stock" if cfg.stock == "compile"
                                                                      else "eager"),
             "k3fuse": compile_step(model, "k3fuse", strict=cfg.strict, log=rlog, compiler=cfg.compiler)}
    capacity = cfg.context + cfg.steps
    lengths = context_lengths(cfg.batch, cfg.context)
    states = {}
    for name, m in (("ref", ref), ("stock", model), ("k3fuse", model)):
        states[name] = m.new_state(cfg.batch, max(1, capacity), block_size=cfg.model.block_size,
                                   kv_dtype=cfg.model.kv_dtype)
        fill_context(m, states[name], lengths, cfg.model.seed)
    for name in ("stock", "k3fuse"):  # the same starting state as the reference's, in the model's dtypes
        for dst, src in zip(states[name].kv + states[name].recurrent + states[name].conv,
                            states["ref"].kv + states["ref"].recurrent + states["ref"].conv):
            dst.copy_(src.to(dst.dtype))
    sampling = SamplingConfig(cfg.temperature, 1.0, cfg.model.seed) if cfg.temperature > 0 else None
    gen = torch.Generator().manual_seed(cfg.model.seed + 99)
    tokens = torch.randint(0, model.config.vocab_size, (cfg.batch,), generator=gen).to(model.device)
    curves: dict[str, list[float]] = {f"{p}_{what}": [] for p in ("stock", "k3fuse")
                                      for what in ("logits", "recurrent", "conv", "kv")}
    greedy: dict[str, list[dict[str, Any]]] = {"stock": [], "k3fuse": [], "k3fuse_vs_stock": []}
    sampled: dict[str, list[dict[str, Any]]] = {"stock": [], "k3fuse": []}
    flips: dict[str, list[dict[str, Any]]] = {"stock": [], "k3fuse": []}
    first_flip: dict[str, dict[int, int]] = {"stock": {}, "k3fuse": {}}  # sequence -> step of its first near tie
    ref_routes: list = []
    model_routes: list = []  # stock and k3fuse share the model: split after each call
    hooks = _record_routing(ref, ref_routes, scores=True) + _record_routing(model, model_routes, scores=False)
    k3fuse.reset_stats()
    with torch.no_grad():
        for s in range(cfg.steps):
            logits, routes = {}, {}
            for name, step in steps.items():
                with k3fuse.strict(cfg.strict and name == "k3fuse"):
                    logits[name] = step(tokens, states[name])[1].float()
                if name != "ref":
                    routes[name] = list(model_routes)
                    model_routes.clear()
            for path in ("stock", "k3fuse"):
                for f in _routing_flips(ref_routes, routes[path], route_tie, s):  # in layer order
                    # a sequence's first flip must be a near tie; later ones follow from the state it changed
                    f["carried"] = f["sequence"] in first_flip[path]
                    flips[path].append(f)
                    if f["near_tie"]:
                        first_flip[path].setdefault(f["sequence"], s)
            ref_routes.clear()
            if model.tp_size > 1 and not model.standin:
                k3fuse.check_collectives()  # a failed fused collective raises here, not as NaN
            want = logits["ref"].argmax(-1)
            for path, base in (("stock", "ref"), ("k3fuse", "ref"), ("k3fuse_vs_stock", "stock")):
                got_path = "k3fuse" if path == "k3fuse_vs_stock" else path
                got = logits[got_path].argmax(-1)
                base_tok = want if base == "ref" else logits["stock"].argmax(-1)
                for b in torch.nonzero(got != base_tok).flatten().tolist():
                    margin = float(logits["ref"][b, base_tok[b]] - logits["ref"][b, got[b]])
                    routed = first_flip.get(got_path, {}).get(b) if base == "ref" else None
                    why = ("logit near tie" if margin <= tie_tol else
                           f"routing near tie at step {routed}" if routed is not None else None)
                    greedy[path].append({"step": s, "sequence": b, "tokens": [int(base_tok[b]), int(got[b])],
                                         "margin": margin, "explained": why is not None, "why": why})
            for path in ("stock", "k3fuse"):
                st, sr = states[path], states["ref"]
                curves[f"{path}_logits"].append(_rel(logits[path], logits["ref"]))
                curves[f"{path}_recurrent"].append(max((_rel(a, b) for a, b in zip(st.recurrent, sr.recurrent)),
                                                       default=0.0))
                curves[f"{path}_conv"].append(max((_rel(a, b) for a, b in zip(st.conv, sr.conv)), default=0.0))
                curves[f"{path}_kv"].append(max((_rel(a.float() * c, b.float() * d) for a, c, b, d in
                                                 zip(st.kv, st.kv_scale, sr.kv, sr.kv_scale)), default=0.0))
                if sampling is not None:
                    u = step_uniform(sr.uniforms, sr.seq_lens)
                    for b, t_ref, t_path, edge, tv in _sample_check(logits["ref"], logits[path], u, sampling):
                        sampled[path].append({"step": s, "sequence": b, "tokens": [t_ref, t_path], "edge": edge,
                                              "tv": tv, "explained": edge <= tv})
            tokens = want
            if rank == 0 and (s + 1) % cfg.progress_every == 0:
                import sys

                print(f"validate --model: step {s + 1}/{cfg.steps}: greedy disagreements k3fuse "
                      f"{len(greedy['k3fuse'])}, stock {len(greedy['stock'])}; kv drift k3fuse "
                      f"{curves['k3fuse_kv'][-1]:.2e}", file=sys.stderr, flush=True)
    for h in hooks:
        h.remove()
    expected = EXPECTED_TP2 if model.tp_size > 1 and not model.standin else EXPECTED_TP1
    active = rlog.active_rules()
    report: dict[str, Any] = {
        "rank": rank, "model": asdict(model.config), "tp": model.tp_size, "standin": model.standin,
        "tie_tol": tie_tol, "route_tie": route_tie, "curves": curves, "greedy": greedy, "sampled": sampled,
        "routing_flips": flips,
        "stats": k3fuse.stats(), "fallbacks": k3fuse.runtime.fallbacks(), "active_rules": active,
        "missing_rules": [r for r in expected if r not in active],
        "applied": {r: s["applied"] for r, s in rlog.summary().items()},
        "seconds": time.perf_counter() - t0, "device": str(model.device),
        "gpu": torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else None,
    }
    report["verdict"] = verdict(report)
    return report


def verdict(report: dict[str, Any]) -> list[str]:
    """What fails the run (empty: it passed)."""
    problems = []
    for path in ("stock", "k3fuse"):  # k3fuse against stock is shown, not judged: each is judged by the copy
        far = [f for f in report["routing_flips"][path] if not f["near_tie"] and not f["carried"]]
        if far:
            f = far[0]
            problems.append(f"{path}: {len(far)} sequence(s) whose first routing flip is far from a tie (selection-"
                            f"score gap > {report['route_tie']:g}); first at step {f['step']}, layer {f['layer']}, "
                            f"sequence {f['sequence']} (gap {f['gap']:.3g})")
        bad = [d for d in report["greedy"][path] if not d["explained"]]
        if bad:
            d = bad[0]
            problems.append(f"{path}: {len(bad)} greedy disagreement(s) past the tie tolerance {report['tie_tol']:g} "
                            f"without an earlier routing near tie; first at step {d['step']} (tokens {d['tokens']}, "
                            f"float32 margin {d['margin']:.3g})")
    for path in ("stock", "k3fuse"):
        bad = [d for d in report["sampled"][path] if not d["explained"]]
        if bad:
            d = bad[0]
            problems.append(f"{path}: {len(bad)} sampled token(s) differ where the distributions agree (step "
                            f"{d['step']}, tokens {d['tokens']}, edge {d['edge']:.3g} > TV {d['tv']:.3g})")
    if report["missing_rules"]:
        problems.append(f"rule(s) that did not fire: {report['missing_rules']}")
    if report["fallbacks"]:
        problems.append(f"fallbacks: {report['fallbacks']}")
    return problems


def run_validate_model(cfg: ValidateModelConfig) -> list[dict[str, Any]]:
    from k3fuse.dist import launch

    if cfg.model.world == 1:
        return [validate_model_rank(0, 1, cfg)]
    backend = "nccl" if cfg.model.device == "cuda" else "gloo"
    return launch(validate_model_rank, cfg.model.world, backend=backend, args=(cfg,), timeout_s=24 * 3600)


def _at_steps(curve: list[float]) -> str:
    picks = [i for i in (0, 9, 99, 999, len(curve) - 1) if i < len(curve)]
    return " ".join(f"{curve[i]:.1e}@{i + 1}" for i in sorted(set(picks)))


def print_validate_model(cfg: ValidateModelConfig, reports: list[dict[str, Any]]) -> None:
    from rich.table import Table

    from .console import wide_console

    console = wide_console()
    r0 = reports[0]
    mc = r0["model"]
    who = f"rank {cfg.model.as_rank} of TP {cfg.model.of} alone" if cfg.model.standin else f"TP {r0['tp']}"
    console.print(f"[bold]k3fuse validate --model[/bold]: preset={cfg.model.preset} layers={mc['n_layers']} "
                  f"({', '.join(sorted({k for k in _kinds(mc)}))}) residual={mc['residual']} "
                  f"experts={mc['expert_format']} {who} device={r0['gpu'] or r0['device']} dtype={cfg.dtype} "
                  f"kv={cfg.model.kv_dtype} batch={cfg.batch} steps={cfg.steps} context={cfg.context} "
                  f"temperature={cfg.temperature} strict={cfg.strict} ({r0['seconds']:.0f} s)")
    t = Table(title=f"greedy tokens against the float32 copy (teacher-forced; near tie: margin <= {r0['tie_tol']:g})")
    for col in ("path", "agree", "disagreements (near tie)", "first disagreement"):
        t.add_column(col, overflow="fold")
    n = cfg.steps * cfg.batch
    for path in ("stock", "k3fuse", "k3fuse_vs_stock"):
        ds = r0["greedy"][path]
        first = (f"step {ds[0]['step']}, seq {ds[0]['sequence']}: {ds[0]['tokens'][0]} vs {ds[0]['tokens'][1]}, "
                 f"margin {ds[0]['margin']:.3g}" if ds else "-")
        t.add_row(path, f"{1 - len(ds) / n:.4f}", f"{len(ds)} ({sum(d['explained'] for d in ds)})", first)
    console.print(t)
    for path in ("stock", "k3fuse"):
        ds, fl = r0["greedy"][path], r0["routing_flips"][path]
        console.print(f"{path}: routing flips {len(fl)} ({sum(f['near_tie'] for f in fl)} near a tie of "
                      f"{r0['route_tie']:g}, {sum(f['carried'] for f in fl)} after the sequence's first); disagreements explained by a logit near tie "
                      f"{sum(d.get('why') == 'logit near tie' for d in ds)}, by an earlier routing near tie "
                      f"{sum(str(d.get('why', '')).startswith('routing') for d in ds)}")
    if cfg.temperature > 0:
        console.print(f"sampled tokens (temperature {cfg.temperature}, fixed seed): " + "; ".join(
            f"{p} differs at {len(r0['sampled'][p])} of {n} ({sum(d['explained'] for d in r0['sampled'][p])} "
            f"within the distributions' distance)" for p in ("stock", "k3fuse")))
    d = Table(title="drift against the float32 copy (relative norm, worst layer) at steps 1, 10, 100, 1000, last")
    for col in ("path", "logits", "KDA recurrent", "KDA conv", "KV cache"):
        d.add_column(col)
    for path in ("stock", "k3fuse"):
        c = r0["curves"]
        d.add_row(path, *(_at_steps(c[f"{path}_{w}"]) for w in ("logits", "recurrent", "conv", "kv")))
    console.print(d)
    console.print("rules applied (rewrite log, per compiled graph): " + ", ".join(
        f"{r} {n}" for r, n in r0["applied"].items() if n))
    console.print("fused-op calls (k3fuse.stats()): " + ", ".join(
        f"{op} {sum(v.values())}" for op, v in sorted(r0["stats"].items())))
    for r in reports:
        for problem in r["verdict"]:
            console.print(f"[red]rank {r['rank']}: {problem}[/red]")


# --- the command line (validate_cli.py hands `--model` runs here) -------------------------------------------
def add_model_mode_flags(p: Any) -> None:
    """The flags only `validate --model` reads (the others are validate's own)."""
    p.add_argument("--model", action="store_true",
                   help="the whole model (embedding, KDA/MLA/dense/MoE layers, head, sampling) over --steps "
                        "(default 1000) decode steps against a float32 copy; the model flags below apply")
    p.add_argument("--as-rank", type=int, default=None, metavar="R", help="--model: rank R of a TP --of model, "
                                                                          "alone (stand-in collectives)")
    p.add_argument("--of", type=int, default=None, metavar="N", help="--model: the TP size of --as-rank")
    p.add_argument("--kv-dtype", choices=("auto", "fp8"), default="auto", help="--model: the latent KV cache")
    p.add_argument("--block-size", type=int, default=64, help="--model: tokens per KV cache block")
    p.add_argument("--context", type=int, default=0, help="--model: random tokens already in each cache")
    p.add_argument("--checkpoint", default=None, metavar="DIR", help="--model: a K3 checkpoint directory (its "
                                                                     "config.json and weights replace --preset's)")
    p.add_argument("--plots", default=None, metavar="DIR", help="--model: write drift.png into DIR")
    p.add_argument("--logit-tie", type=float, default=None,
                   help="--model: the float32 logit margin under which a greedy token difference is a near tie "
                        "(default by dtype; bf16 0.1)")


def refuse_model_flags(args: Any) -> None:
    """A `--model` flag given without --model: one line (it would be ignored)."""
    from ..usage_error import UsageError

    for flag, given in (("--as-rank", args.as_rank is not None), ("--of", args.of is not None),
                        ("--checkpoint", args.checkpoint is not None), ("--plots", args.plots is not None),
                        ("--logit-tie", args.logit_tie is not None), ("--context", args.context != 0),
                        ("--kv-dtype", args.kv_dtype != "auto"), ("--block-size", args.block_size != 64)):
        if given:
            raise UsageError(f"{flag} is a flag of validate --model", "add --model (the whole model)")


def cmd_validate_model(args: Any) -> int:
    import json

    from ..fileio import check_append_file, check_output_dir, check_output_file, write_text_atomic
    from ..usage_error import UsageError
    from .flags import use_rules
    from .model_args import model_args

    if args.json:
        check_output_file(args.json, option="--json")
    if args.log:
        check_append_file(args.log, option="--log")
    if args.plots:
        check_output_dir(args.plots, option="--plots")
    if args.context < 0 or args.block_size < 1:
        raise UsageError(f"--context {args.context} / --block-size {args.block_size}", "pass --context >= 0, "
                                                                                       "--block-size >= 1")
    if args.residual is not None:
        args.overrides = {**args.overrides, "residual": args.residual}
    ma = model_args(args, default_tp=2)
    if ma.device == "cuda":
        import torch

        if torch.cuda.device_count() < ma.world:
            raise UsageError(f"--tp {ma.world} needs {ma.world} GPUs, {torch.cuda.device_count()} visible",
                             "lower --tp, or one rank with --as-rank R --of N")
    use_rules(args.rules)
    cfg = ValidateModelConfig(model=ma, batch=args.batch, steps=args.steps or 1000, dtype=args.dtype or "bfloat16",
                              temperature=args.temperature if args.temperature > 0 else 0.8,
                              tie_tol=args.logit_tie, route_tie=args.tie_margin, context=args.context,
                              strict=args.strict, log=args.log,
                              compiler=args.compiler, stock=args.stock)
    reports = run_validate_model(cfg)
    print_validate_model(cfg, reports)
    if args.plots:
        for path in plot_validate_model(reports, args.plots):
            print(f"wrote {path}")
    if args.json:
        write_text_atomic(args.json, json.dumps({"config": asdict(cfg), "ranks": reports}, indent=2, default=str))
    ok = not any(r["verdict"] for r in reports)
    print("validate --model: PASS (every disagreement with the float32 copy is a near tie, every expected rule "
          "fired, no fallback)" if ok else "validate --model: FAIL (see above)")
    return 0 if ok else 1


def _kinds(mc: dict[str, Any]) -> list[str]:
    from ..model import K3Config

    return [k.name for k in K3Config(**mc).layer_kinds()]


def plot_validate_model(reports: list[dict[str, Any]], directory: str) -> list[str]:
    """drift.png: each state's and the logits' relative error against the float32 copy, per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from pathlib import Path

    c = reports[0]["curves"]
    fig, axes = plt.subplots(1, 4, figsize=(18, 4), sharex=True)
    for ax, what in zip(axes, ("logits", "recurrent", "conv", "kv")):
        for path in ("stock", "k3fuse"):
            values = [max(v, 1e-12) for v in c[f"{path}_{what}"]]
            ax.plot(range(1, len(values) + 1), values, label=path, lw=1)
        ax.set_yscale("log")
        ax.set_title({"kv": "KV cache", "recurrent": "KDA recurrent", "conv": "KDA conv", "logits": "logits"}[what])
        ax.set_xlabel("decode step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("relative error vs float32 copy")
    axes[0].legend()
    Path(directory).mkdir(parents=True, exist_ok=True)
    path = Path(directory) / "drift.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [str(path)]


__all__ = ["ValidateModelConfig", "validate_model_rank", "run_validate_model", "print_validate_model",
           "plot_validate_model", "verdict", "TIE_TOL", "EXPECTED_TP1", "EXPECTED_TP2", "add_model_mode_flags",
           "cmd_validate_model", "refuse_model_flags"]
