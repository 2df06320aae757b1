"""`k3fuse validate`: was the speedup measured on the path it claims, and is its error explained?

Runs N decode steps of the reference model (k3fuse.model) on TP ranks (gloo on CPU, NCCL on GPUs,
through k3fuse.dist.launch) three ways with the same weights and inputs:
  ref     a float64 copy of the model (the model's parameters upcast), eager; quantized routed experts
          (`expert_format` mxfp4 / int4, the k3 preset's mxfp4) keep their packed bytes and scales and
          are dequantized exactly into float64, so ref is float64 on the dequantized weights;
  stock   the model in its own dtype, `torch.compile` with Inductor (`--stock eager`: eager);
  k3fuse  the model through `torch.compile(backend="k3fuse")`, strict mode by default, so any
          fallback raises, and `k3fuse.stats()` says which implementation of each fused op ran.
Inputs are teacher-forced from the reference: step t+1's input is the embedding of the token
sampled from the reference output (argmax, or Gumbel-max at `--temperature` with noise shared by
all paths, so each path's own sampled token can be compared). Each path keeps its own persistent
KDA state, so state errors accumulate as they would in serving.

Reported per layer: KDA state error (recurrent, conv) against ref and against stock; the output
error of the stack truncated after that layer (same weights, `--no-layer-outputs` skips it);
agreement of the routed experts' top-k sets with ref; top-k flips, and whether each flip is near a
tie (the swapped experts' reference selection scores differ by at most `--tie-margin`). Per step:
the final output error and the sampled-token agreement. `--skew` biases the router towards
low-index experts (skewed routing); `--temperature` samples instead of argmax.

Verdict: an error of k3fuse against ref is *explained* when it is within `max(2 x stock's error,
floor)` (floor by dtype), or when it follows a top-k flip near a tie (at that or an earlier step:
the state carries it). A flip far from a tie, or an error beyond the bound without such a flip, is
*unexplained*, and the command exits 1. Bad input (no process group, TP that differs across
ranks, a dead peer) is a clear error (exit 2), never a hang.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

FLOORS = {torch.float32: 1e-4, torch.float64: 1e-8, torch.bfloat16: 2e-2, torch.float16: 5e-3}
TIE_MARGINS = {torch.float32: 1e-4, torch.float64: 1e-8, torch.bfloat16: 2e-2, torch.float16: 5e-3}
VOCAB = 128


from .validate_config import ValidateConfig  # noqa: E402  (torch-free: the CLI imports it for --help)


class ValidateError(RuntimeError):
    """Bad input to validate (process group, TP, configuration)."""


@dataclass
class LayerReport:
    layer: int
    state_err_k3fuse: float = 0.0       # max over steps and state tensors, vs ref
    state_err_stock: float = 0.0
    state_err_k3fuse_vs_stock: float = 0.0
    output_err_k3fuse: float | None = None   # final output of the stack truncated after this layer
    output_err_stock: float | None = None
    topk_agree_k3fuse: float = 1.0      # fraction of (step, token) with the same top-k set as ref
    topk_agree_stock: float = 1.0
    flips: int = 0
    flips_near_tie: int = 0
    min_flip_margin: float | None = None
    verdict: str = "ok"


@dataclass
class RankReport:
    rank: int
    config: dict
    model: dict = field(default_factory=dict)  # the K3Config that ran (expert_format, moe_inter, ...)
    output_err_k3fuse: list[float] = field(default_factory=list)
    output_err_stock: list[float] = field(default_factory=list)
    token_agree_k3fuse: float = 1.0
    token_agree_stock: float = 1.0
    layers: list[dict] = field(default_factory=list)
    steps: list[str] = field(default_factory=list)   # per step: ok | explained (...) | UNEXPLAINED (...)
    runtime_stats: dict = field(default_factory=dict)
    active_rules: list[str] = field(default_factory=list)
    fallbacks: dict = field(default_factory=dict)
    unexplained: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.double(), b.double()
    return float((a64 - b64).norm() / b64.norm().clamp_min(1e-30))


def _check_group(cfg: ValidateConfig):
    """The process group for cfg.tp; a clear error when it is missing or the ranks disagree."""
    import torch.distributed as dist

    from ..dist import ProcessGroupMissing, disagreements, require_group

    if cfg.tp == 1:
        return None
    try:
        group = require_group(None)
    except ProcessGroupMissing as exc:
        raise ValidateError(f"validate --tp {cfg.tp}: {exc}") from exc
    size = dist.get_world_size(group)
    # agree first (a collective every rank reaches), so every rank raises the same error
    try:
        diffs = disagreements(group, {k: v for k, v in asdict(cfg).items() if k != "inject"})
    except RuntimeError as exc:   # gloo/NCCL: connection reset, timeout
        raise ValidateError(f"validate: a peer rank did not take part in the configuration check "
                            f"(dead or hung?): {str(exc).splitlines()[0][:300]}") from exc
    if diffs:
        raise ValidateError("validate: ranks disagree on the configuration (" + "; ".join(diffs) + ")")
    if size != cfg.tp:
        raise ValidateError(f"validate --tp {cfg.tp} but the process group has {size} ranks")
    return group


def model_config(cfg: ValidateConfig, n_layers: int | None = None) -> Any:
    """The K3Config validate builds (preset, --set, layers, residual, dtype), checked for cfg.tp."""
    from ..model import get_config

    over = {**dict(cfg.overrides), "n_layers": n_layers or cfg.layers, "residual": cfg.residual}
    if cfg.dtype:
        over["dtype"] = cfg.dtype
    mcfg = get_config(cfg.preset, **over)
    mcfg.validate_for_tp(cfg.tp)
    return mcfg


def _build(cfg: ValidateConfig, n_layers: int, rank: int, group, device):
    from ..model import K3DecodeStack

    mcfg = model_config(cfg, n_layers)
    on_device = device.type == "cuda"  # K3 widths: seconds on the GPU instead of minutes on the host
    model = K3DecodeStack(mcfg, tp_size=cfg.tp, rank=rank, group=group, seed=cfg.seed, device=device,
                          init_on_device=on_device)
    if cfg.skew:
        with torch.no_grad():
            for layer in model.layers:
                b = layer.moe.routed.router.b_corr
                b.add_(cfg.skew * torch.linspace(1.0, -1.0, b.numel(), device=b.device, dtype=b.dtype))
    ref = K3DecodeStack(mcfg, tp_size=cfg.tp, rank=rank, group=group, seed=cfg.seed,
                        dtype=torch.float64, device=device, init_on_device=on_device)
    # load_state_dict casts into ref's float64 parameters; packed experts and their scales keep their
    # dtypes (the float64 model dequantizes them exactly)
    ref.load_state_dict(model.state_dict())
    return mcfg, model.eval(), ref.eval()


def _router_hooks(model, store: list, scores: bool) -> list:
    """Collect each layer's routed expert ids (and, for ref, the selection scores) per call."""
    handles = []
    for i, layer in enumerate(model.layers):
        router = layer.moe.routed.router

        def hook(mod, args, out, i=i):
            if scores:
                s = torch.sigmoid(mod.logits(args[0]).float()) + mod.b_corr
                store.append((i, out[1], s))
            else:
                store.append((i, out[1]))
        handles.append(router.register_forward_hook(hook))
    return handles


def _inject(scale: float) -> None:
    """Tests: a wrong fused all-reduce (reference output times `scale`) on CPU."""
    from ..kernels import dispatch

    for op in ("gemm_ar_residual", "gemm_ar_residual_rmsnorm"):
        ref = next(i for i in dispatch.implementations(op) if i.name == dispatch.REFERENCE)

        def run(*a, _ref=ref, **k):
            out = _ref.run(*a, **k)
            return tuple(o * scale for o in out) if isinstance(out, tuple) else out * scale
        dispatch.register_impl(op, dispatch.Impl("validate.injected", accepts=ref.accepts, run=run,
                                                 priority=1_000_000, device_types=("cpu",)))


def _sample(y: torch.Tensor, emb: torch.Tensor, temperature: float, noise: torch.Tensor) -> torch.Tensor:
    logits = y.double() @ emb.T / math.sqrt(emb.shape[1])
    if temperature > 0:
        logits = logits / temperature + noise
    return logits.argmax(-1)


def _run_paths(cfg, model, ref, device, xs, ctx):
    """Run the steps teacher-forced on the three paths; returns outputs, states, routing, log."""
    import k3fuse

    from ..log import RewriteLog

    stock = model if cfg.stock == "eager" else torch.compile(model, backend="inductor")
    rlog = RewriteLog(cfg.log, rank=ctx.rank)
    fused = torch.compile(model, backend="k3fuse",
                          options={"compiler": cfg.compiler, "context": ctx, "log": rlog})
    ref_log: list = []
    model_log: list = []   # stock and k3fuse share `model`: split its records after each call
    hooks = _router_hooks(ref, ref_log, scores=True) + _router_hooks(model, model_log, scores=False)
    routes: dict[str, list] = {"ref": ref_log, "stock": [], "k3fuse": []}
    out: dict[str, list] = {"ref": [], "stock": [], "k3fuse": []}
    states: dict[str, list] = {"ref": [], "stock": [], "k3fuse": []}
    cur = {"ref": ref.init_state(cfg.tokens), "stock": model.init_state(cfg.tokens),
           "k3fuse": model.init_state(cfg.tokens)}
    fns = {"ref": ref, "stock": stock, "k3fuse": fused}
    try:
        with torch.no_grad():
            for step, x in enumerate(xs):
                _progress(ctx.rank, f"{cfg.layers} layer(s), step {step + 1}/{len(xs)}: float64 copy, stock, "
                                    "k3fuse" + (" (the first step compiles)" if step == 0 else ""))
                for name in ("ref", "stock", "k3fuse"):
                    xin = x.to(torch.float64 if name == "ref" else model.dtype)
                    with k3fuse.strict(cfg.strict and name == "k3fuse"):
                        y, nxt = fns[name](xin, cur[name])
                    if name == "k3fuse":
                        k3fuse.check_collectives()   # a failed collective raises here, not as NaN
                    cur[name] = nxt
                    out[name].append(y)
                    states[name].append(nxt)
                    if name != "ref":
                        routes[name] += [(i, idx.clone()) for i, idx in model_log]
                        model_log.clear()
    finally:
        for h in hooks:
            h.remove()
    return out, states, routes, rlog


def _progress(rank: int, what: str) -> None:
    """One line per step on rank 0 (to stderr): a run of minutes is never silent."""
    if rank == 0:
        import sys

        print(f"validate: {what}", file=sys.stderr, flush=True)


def _score_gap(a: float, b: float) -> float:
    """How far apart two selection scores are: 0 for equal ones, equal infinities and two NaNs (an
    exact tie, which each top-k breaks its own way), inf for a NaN against a number."""
    if a == b or (math.isnan(a) and math.isnan(b)):
        return 0.0
    gap = abs(a - b)
    return gap if not math.isnan(gap) else math.inf


def _flip_analysis(rt_ref, rt_path, layers: int, steps: int, k: int, margin: float):
    """Per layer: (agreement, flips, near-tie flips, min margin, steps with a far flip, steps with a near flip)."""
    res = {}
    per_layer_ref = [[] for _ in range(layers)]
    per_layer_path = [[] for _ in range(layers)]
    for i, idx, s in rt_ref:
        per_layer_ref[i].append((idx, s))
    for i, idx in rt_path:
        per_layer_path[i].append(idx)
    for i in range(layers):
        same = total = flips = near = 0
        min_m = None
        far_steps, near_steps = set(), set()
        for step, ((ridx, s), pidx) in enumerate(zip(per_layer_ref[i], per_layer_path[i])):
            for t in range(ridx.shape[0]):
                a = set(ridx[t].tolist())
                b = set(pidx[t].tolist())
                total += 1
                if a == b:
                    same += 1
                    continue
                flips += 1
                only_ref, only_path = a - b, b - a
                m = max(_score_gap(float(s[t, e]), float(s[t, f])) for e in only_ref for f in only_path)
                min_m = m if min_m is None else min(min_m, m)
                if m <= margin:
                    near += 1
                    near_steps.add(step)
                else:
                    far_steps.add(step)
        res[i] = (same / total if total else 1.0, flips, near, min_m, far_steps, near_steps)
    return res


def validate_rank(rank: int, world_size: int, cfg: ValidateConfig) -> dict[str, Any]:
    """One rank's validation (called by `run_validate` on every rank; usable in-process)."""
    import torch.distributed as dist

    import k3fuse

    t0 = time.perf_counter()
    if cfg.tp < 1 or cfg.steps < 1 or cfg.layers < 1 or cfg.tokens < 1:
        raise ValidateError(f"validate: tp, steps, layers and tokens must be >= 1 ({cfg})")
    group = _check_group(cfg)
    if cfg.tp > 1:
        rank = dist.get_rank(group)
    device = torch.device("cpu") if cfg.device == "cpu" else torch.device("cuda", torch.cuda.current_device())
    if cfg.inject:
        _inject(1.0 + cfg.inject)
    mcfg, model, ref = _build(cfg, cfg.layers, rank, group, device)
    dt = model.dtype
    floor = FLOORS.get(dt, 1e-4)
    margin = cfg.tie_margin if cfg.tie_margin is not None else TIE_MARGINS.get(dt, 1e-4)
    ctx = (k3fuse.DecodeContext.from_process_group(strict=cfg.strict) if cfg.tp > 1
           else k3fuse.DecodeContext(strict=cfg.strict))

    # inputs: x_0 random, then the embedding of the reference's sampled token (teacher forcing)
    g = torch.Generator().manual_seed(cfg.seed + 12345)
    emb = torch.randn(VOCAB, mcfg.hidden, generator=g, dtype=torch.float64)
    noises = [-torch.log(-torch.log(torch.rand(cfg.tokens, VOCAB, generator=g, dtype=torch.float64)
                                    .clamp_min(1e-30))) for _ in range(cfg.steps)]
    x0 = torch.randn(cfg.tokens, mcfg.hidden, generator=g, dtype=torch.float64)
    xs = [x0.to(device)]
    ref_probe = []
    with torch.no_grad():
        st = ref.init_state(cfg.tokens)
        for step in range(cfg.steps - 1):
            y, st = ref(xs[-1], st)
            tok = _sample(y.cpu(), emb, cfg.temperature, noises[step])
            xs.append(emb[tok].to(device))
            ref_probe.append(tok)

    k3fuse.reset_stats()
    out, states, routes, rlog = _run_paths(cfg, model, ref, device, xs, ctx)
    rep = RankReport(rank=rank, config=asdict(cfg), model=asdict(mcfg))
    rep.runtime_stats = k3fuse.stats()
    rep.fallbacks = k3fuse.runtime.fallbacks() if hasattr(k3fuse, "runtime") else {}
    rep.active_rules = rlog.active_rules()
    rep.output_err_k3fuse = [_rel(a, b) for a, b in zip(out["k3fuse"], out["ref"])]
    rep.output_err_stock = [_rel(a, b) for a, b in zip(out["stock"], out["ref"])]
    toks = {n: [_sample(y.cpu(), emb, cfg.temperature, noises[s]) for s, y in enumerate(out[n])]
            for n in out}
    n_tok = cfg.steps * cfg.tokens
    rep.token_agree_k3fuse = sum(int((a == b).sum()) for a, b in zip(toks["k3fuse"], toks["ref"])) / n_tok
    rep.token_agree_stock = sum(int((a == b).sum()) for a, b in zip(toks["stock"], toks["ref"])) / n_tok

    flips_k3 = _flip_analysis(routes["ref"], routes["k3fuse"], cfg.layers, cfg.steps, mcfg.top_k, margin)
    flips_st = _flip_analysis(routes["ref"], routes["stock"], cfg.layers, cfg.steps, mcfg.top_k, margin)
    near_steps = set().union(*(f[5] for f in flips_k3.values())) if flips_k3 else set()
    far = {(i, s) for i, f in flips_k3.items() for s in f[4]}
    first_near = min(near_steps) if near_steps else None

    def judge(err_k3: float, err_st: float, step: int, what: str) -> str:
        bound = max(2.0 * err_st, floor)
        if err_k3 <= bound:
            return "ok"
        if any(s <= step for (_, s) in far):
            return f"UNEXPLAINED ({what}: err {err_k3:.3g} > {bound:.3g}; a top-k flip far from a tie)"
        if first_near is not None and first_near <= step:
            return f"explained ({what}: err {err_k3:.3g}; top-k flip near a tie at step {first_near})"
        return f"UNEXPLAINED ({what}: err {err_k3:.3g} > max(2 x stock {err_st:.3g}, floor {floor:g}), no routing flip)"

    for s in range(cfg.steps):
        v = judge(rep.output_err_k3fuse[s], rep.output_err_stock[s], s, f"step {s} output")
        rep.steps.append(v)
        if v.startswith("UNEXPLAINED"):
            rep.unexplained.append(v)

    layer_reports = []
    for i in range(cfg.layers):
        lr = LayerReport(layer=i)
        verdicts = []
        for s in range(cfg.steps):
            e3 = max(_rel(states["k3fuse"][s].recurrent[i], states["ref"][s].recurrent[i]),
                     _rel(states["k3fuse"][s].conv[i], states["ref"][s].conv[i]))
            es = max(_rel(states["stock"][s].recurrent[i], states["ref"][s].recurrent[i]),
                     _rel(states["stock"][s].conv[i], states["ref"][s].conv[i]))
            ek = max(_rel(states["k3fuse"][s].recurrent[i], states["stock"][s].recurrent[i]),
                     _rel(states["k3fuse"][s].conv[i], states["stock"][s].conv[i]))
            lr.state_err_k3fuse = max(lr.state_err_k3fuse, e3)
            lr.state_err_stock = max(lr.state_err_stock, es)
            lr.state_err_k3fuse_vs_stock = max(lr.state_err_k3fuse_vs_stock, ek)
            verdicts.append(judge(e3, es, s, f"layer {i} state step {s}"))
        agree, flips, near, min_m, far_steps, _ = flips_k3[i]
        lr.topk_agree_k3fuse, lr.flips, lr.flips_near_tie, lr.min_flip_margin = agree, flips, near, min_m
        lr.topk_agree_stock = flips_st[i][0]
        if far_steps:
            verdicts.append(f"UNEXPLAINED (layer {i}: {flips - near} top-k flip(s) farther than "
                            f"{margin:g} from a tie)")
        bad = [v for v in verdicts if v.startswith("UNEXPLAINED")]
        lr.verdict = bad[0] if bad else next((v for v in verdicts if v != "ok"), "ok")
        rep.unexplained += bad
        layer_reports.append(lr)

    if cfg.layer_outputs:
        for d in range(1, cfg.layers):
            sub = replace(cfg, layers=d)
            _, m_d, r_d = _build(sub, d, rank, group, device)
            o_d, _, _, _ = _run_paths(sub, m_d, r_d, device, xs, ctx)
            layer_reports[d - 1].output_err_k3fuse = max(_rel(a, b) for a, b in zip(o_d["k3fuse"], o_d["ref"]))
            layer_reports[d - 1].output_err_stock = max(_rel(a, b) for a, b in zip(o_d["stock"], o_d["ref"]))
        layer_reports[-1].output_err_k3fuse = max(rep.output_err_k3fuse)
        layer_reports[-1].output_err_stock = max(rep.output_err_stock)
    rep.layers = [asdict(lr) for lr in layer_reports]
    rep.seconds = time.perf_counter() - t0
    return asdict(rep)


def run_validate(cfg: ValidateConfig) -> list[dict[str, Any]]:
    """Validate on cfg.tp ranks (gloo on CPU, NCCL on GPUs); one report per rank."""
    from ..dist import launch

    try:
        model_config(cfg)  # a bad preset, --set or TP is one clear error here, not one per rank
    except ValueError as exc:
        raise ValidateError(f"validate: {exc}") from None
    if cfg.tp == 1:
        return [validate_rank(0, 1, cfg)]
    backend = "nccl" if cfg.device == "cuda" else "gloo"
    return launch(validate_rank, cfg.tp, backend=backend, args=(cfg,), timeout_s=cfg.timeout_s)


def passed(reports: list[dict[str, Any]]) -> bool:
    return not any(r["unexplained"] for r in reports)


def print_validate(cfg: ValidateConfig, reports: list[dict[str, Any]]) -> None:
    from rich.table import Table

    from .console import wide_console

    console = wide_console()
    r0 = reports[0]
    model_cfg = r0["model"] if "model" in r0 else {}
    console.print(f"[bold]k3fuse validate[/bold]: preset={cfg.preset} {dict(cfg.overrides)} "
                  f"experts={model_cfg.get('expert_format', '?')} moe_inter={model_cfg.get('moe_inter', '?')} "
                  f"layers={cfg.layers} "
                  f"residual={cfg.residual} TP={cfg.tp} tokens={cfg.tokens} steps={cfg.steps} "
                  f"device={cfg.device} stock={cfg.stock} compiler={cfg.compiler} skew={cfg.skew} "
                  f"temperature={cfg.temperature} strict={cfg.strict} torch={torch.__version__}")
    t = Table(title="per layer (rank 0; errors are relative norms, max over steps)")
    for col in ("layer", "state k3fuse/ref", "state stock/ref", "state k3fuse/stock", "output k3fuse/ref",
                "output stock/ref", "top-k agree k3fuse", "top-k agree stock", "flips (near tie)",
                "verdict"):
        t.add_column(col, overflow="fold")
    f = lambda v: "-" if v is None else f"{v:.2e}"   # noqa: E731
    for lr in r0["layers"]:
        t.add_row(str(lr["layer"]), f(lr["state_err_k3fuse"]), f(lr["state_err_stock"]),
                  f(lr["state_err_k3fuse_vs_stock"]), f(lr["output_err_k3fuse"]), f(lr["output_err_stock"]),
                  f"{lr['topk_agree_k3fuse']:.3f}", f"{lr['topk_agree_stock']:.3f}",
                  f"{lr['flips']} ({lr['flips_near_tie']})", lr["verdict"])
    console.print(t)
    s = Table(title="per step: final output vs the float64 copy")
    for col in ("step", "k3fuse", "stock", "verdict"):
        s.add_column(col, overflow="fold")
    for i, v in enumerate(r0["steps"]):
        s.add_row(str(i), f(r0["output_err_k3fuse"][i]), f(r0["output_err_stock"][i]), v)
    console.print(s)
    console.print(f"sampled-token agreement with ref: k3fuse {r0['token_agree_k3fuse']:.3f}, "
                  f"stock {r0['token_agree_stock']:.3f}")
    impl = Table(title="what ran (k3fuse.stats(), rank 0" + (", strict mode" if cfg.strict else "") + ")")
    for col in ("op", "implementation", "calls"):
        impl.add_column(col)
    for op, impls in sorted(r0["runtime_stats"].items()):
        for name, n in sorted(impls.items()):
            impl.add_row(op, name, str(n))
    console.print(impl)
    console.print("active rules: " + (", ".join(r0["active_rules"]) or "none"))
    for r in reports:
        for u in r["unexplained"]:
            console.print(f"[red]rank {r['rank']}: {u}[/red]")
