"""Per-rank bytes-and-latency model of the MoE front (router + latent down-projection) at TP W.

Why: issue 9 item 1 asks for `moe_front_sharded` at TP 4/8/16, and at most 2 GPUs are lent (at
times one). One GPU measures one rank's compute at TP N (`bench/bench_moe_front.py --world 1
--as-tp N`: the op on 1/N of the rows, gathering its own slot only); the NVLink exchange needs
the peers. This model fits the compute from those one-GPU slices, adds an exchange term whose
parameters are assumed or borrowed (each parameter says which), and projects per-rank µs for
three paths:

  stock replicated     torch.compile of F.linear(x.float(), W_r.float()) and F.linear(x, W_down)
                       on every rank: measured, the same at every W (every rank does all of it)
  k3fuse replicated    k3fuse.decode_gemm on both, on every rank: measured, the same at every W
  k3fuse sharded       one push GEMM over (E + L) / W rows + the NVLink exchange + the gather

Sharded at TP W and T tokens, per rank:
  compute  = push_fixed[T] + push_gemm_bytes(W, T) / push_bw[T]      (fitted on one-GPU slices)
           + gather_fixed[T] + gather_bytes(W, T) / copy_bw          (measured: slice - push only)
  exchange = nvlink_latency + (1 - push_overlap) * (W - 1) * push_bytes_per_peer(W, T) / nvlink_bw
At W = 1 the rule does not fire (patterns/moe_front_sharded.py: tp_at_least(ctx, 2)), so the
"sharded" path there is the k3fuse replicated one.

Torch-free (only json): `--project` runs anywhere, and the tests need no GPU.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

#: the token counts and TP degrees the projection table shows (issue 9 item 1)
TABLE_TP = (2, 4, 8, 16)
TABLE_TOKENS = (1, 8, 64)

# Assumed exchange parameters: nothing here measured them (no 2-GPU run of this op yet).
NVLINK_GBPS = 450.0
NVLINK_LATENCY_US = 1.0
PUSH_OVERLAP = 0.0
SOURCE_NVLINK_GBPS = ("assumed: H200 datasheet (NVLink 4, 18 links, 900 GB/s both ways = 450 GB/s out of "
                      "each GPU); not measured here")
SOURCE_NVLINK_LATENCY = ("assumed: not measured here (a store to a peer's HBM until the peer's poll sees it); "
                         "the fused all-reduce's 7.5-11 us over its GEMM (docs/perf/2026-11-30-decode-gemm-fused-ar.md "
                         "section 2) bundle it with a second kernel, the launch boundary and rank skew")
SOURCE_PUSH_OVERLAP = ("assumed: the pushes leave from the epilogue of each split-K tile's last CTA, after its "
                       "weight stream, so no NVLink transfer hides behind the weights")


@dataclass(frozen=True)
class FrontShape:
    """The front as one rank holds it at TP 1: W_r [E, H] and W_down [L, H] in bf16, fp32 logits,
    a bf16 latent, fp32 words in the exchange. Defaults are K3's (k3fuse.model.shapes:
    gemm_site("router"), gemm_site("w_down")); the benchmark JSONs carry their own E, L, H."""

    E: int = 896
    L: int = 3584
    H: int = 7168
    weight_bytes_per: int = 2
    act_bytes_per: int = 2
    logit_bytes_per: int = 4
    word_bytes: int = 4

    def rows(self, W: int) -> int:
        """Rows of [W_r ; W_down] one rank reads at TP W (E / W router + L / W latent)."""
        if W < 1 or self.E % W or self.L % W:
            raise ValueError(f"E {self.E} / L {self.L} not divisible by TP {W}")
        return self.E // W + self.L // W

    def weight_bytes(self, W: int) -> int:
        """(E + L) * H * 2 / W: the weight bytes one rank streams per step."""
        return self.rows(W) * self.H * self.weight_bytes_per

    def activation_bytes(self, T: int) -> int:
        return T * self.H * self.act_bytes_per

    def push_bytes_per_peer(self, W: int, T: int) -> int:
        """T * (E + L) / W fp32 words: what one rank writes into each peer's buffer."""
        return T * self.rows(W) * self.word_bytes

    def pushed_bytes(self, W: int, T: int) -> int:
        """All a rank sends over NVLink per step: to each of its W - 1 peers."""
        return (W - 1) * self.push_bytes_per_peer(W, T)

    def push_gemm_bytes(self, W: int, T: int) -> int:
        """HBM bytes of the push GEMM: its weight rows, the activations, its own fp32 slot."""
        return self.weight_bytes(W) + self.activation_bytes(T) + self.push_bytes_per_peer(W, T)

    def gather_bytes(self, W: int, T: int, slots: int) -> int:
        """HBM bytes of the gather: it reads `slots` fp32 slots of T x (E + L) / W words and writes
        their router columns as fp32 logits, their latent columns as bf16 (slots = W in the real
        op, 1 in a one-GPU slice, which gathers only its own slot)."""
        per_slot = T * (self.rows(W) * self.word_bytes
                        + self.E // W * self.logit_bytes_per + self.L // W * self.act_bytes_per)
        return slots * per_slot

    def replicated_bytes(self, T: int) -> int:
        """k3fuse replicated: both weights, x once per GEMM, fp32 logits, bf16 latent."""
        return (self.weight_bytes(1) + 2 * self.activation_bytes(T)
                + T * (self.E * self.logit_bytes_per + self.L * self.act_bytes_per))

    def stock_bytes(self, T: int) -> int:
        """Stock adds the fp32 copy of W_r (written, then read by the fp32 GEMM) and of x."""
        fp32_copy = self.E * self.H * 4 * 2 + T * self.H * 4 * 2
        return self.replicated_bytes(T) + fp32_copy


@dataclass(frozen=True)
class LineFit:
    """µs = fixed_us + bytes / bandwidth, from `n_points` (bytes, µs) points; `method` says how."""

    fixed_us: float
    GBps: float
    n_points: int
    method: str

    def us(self, nbytes: float) -> float:
        return self.fixed_us + nbytes / (self.GBps * 1e3)


def fit_line(points: Sequence[tuple[float, float]], prior_GBps: float | None = None) -> LineFit:
    """Least squares of µs = fixed + bytes / bw over (bytes, µs) points.

    Two or more distinct byte counts fit both parameters. One byte count (today: as-tp 2 only)
    cannot separate them, so the bandwidth is taken as `prior_GBps` (the copy bandwidth measured in
    the same run) and the fixed cost is the mean residual: every µs the kernel spends above
    streaming at copy speed is counted as per-call cost (launch, ramp, split-K reduction, tail),
    which does not shrink with the rows. Evidence for that shape of curve: the decode GEMM at
    oproj_tp8 and oproj_tp16 (docs/perf/2026-11-30-decode-gemm-fused-ar.md section 1) differ by 2.8 µs
    for 11 MB, i.e. a marginal 4.0 TB/s, about the copy bandwidth, on top of a ~2 µs fixed cost.
    A non-positive fitted slope (noise) falls back to the one-point rule and says so.
    """
    if not points:
        raise ValueError("no (bytes, us) points to fit")
    n = len(points)
    note = ""
    if len({b for b, _ in points}) >= 2:
        mb = sum(b for b, _ in points) / n
        mt = sum(t for _, t in points) / n
        sxx = sum((b - mb) ** 2 for b, _ in points)
        slope = sum((b - mb) * (t - mt) for b, t in points) / sxx   # µs per byte
        if slope > 0:
            return LineFit(mt - slope * mb, 1.0 / (slope * 1e3), n, f"least squares over {n} points")
        note = f"; the least-squares slope was {slope:.3g} us/B (not positive)"
    if prior_GBps is None or prior_GBps <= 0:
        raise ValueError("one byte count cannot fit a bandwidth: pass prior_GBps")
    fixed = sum(t - b / (prior_GBps * 1e3) for b, t in points) / n
    return LineFit(fixed, prior_GBps, n, f"one byte count ({n} point(s)): bandwidth assumed = copy bandwidth, "
                                         f"fixed cost = residual{note}")


@dataclass(frozen=True)
class SlicePoint:
    """One one-GPU timing of one rank's TP-`as_tp` slice at T tokens (µs)."""

    as_tp: int
    T: int
    slice_us: float
    push_only_us: float
    source: str


@dataclass(frozen=True)
class Runs:
    """What the benchmark JSONs hold, merged: one-GPU slices, replicated arms, world-2 runs."""

    shape: FrontShape
    copy_GBps: float
    stock_us: Mapping[int, float]
    replicated_us: Mapping[int, float]
    slices: tuple[SlicePoint, ...]
    #: world-1 "sharded": the op over all rows on one GPU (what TP 1 would compute; never in the fit)
    world1_op_us: Mapping[int, float]
    #: world-2 "sharded": the op over NVLink at TP 2, the slower rank
    tp2_us: Mapping[int, float]
    one_gpu_sources: tuple[str, ...]
    tp2_sources: tuple[str, ...]


def _mean_by_T(pairs: Iterable[tuple[int, float]]) -> dict[int, float]:
    acc: dict[int, list[float]] = {}
    for T, v in pairs:
        acc.setdefault(T, []).append(v)
    return {T: sum(v) / len(v) for T, v in sorted(acc.items())}


def _row_slices(row: Mapping[str, Any]) -> dict[int, Mapping[str, Any]]:
    """A row's slice timings by as-tp: the new "slices" dict, else the legacy top-level keys, whose
    as-tp the floors give (floor_replicated / floor_slice = (E + L) / ((E + L) / N) = N exactly)."""
    if "slices" in row:
        return {int(n): s for n, s in row["slices"].items() if "skipped" not in s}
    if "slice" not in row:
        return {}
    n = round(row["floor_replicated"] / row["floor_slice"])
    if abs(row["floor_replicated"] / row["floor_slice"] - n) > 1e-6 * n:
        raise ValueError(f"slice floors do not give an integer as-tp: {row['floor_replicated']} / {row['floor_slice']}")
    return {n: row}


def load_runs(paths: Sequence[str]) -> Runs:
    """Read bench_moe_front JSONs: world-1 files give slices and the replicated arms (mean per T
    over files), world-2 files the TP 2 measurement of the sharded op."""
    shape: FrontShape | None = None
    copies, stock, rep, op1, tp2, slices = [], [], [], [], [], []
    one_gpu, two_gpu = [], []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        name = os.path.basename(path)
        s = FrontShape(E=data["E"], L=data["L"], H=data["H"])
        if shape is not None and s != shape:
            raise ValueError(f"{name}: shape {s} differs from {shape}")
        shape = s
        world = data["conditions"]["world"]
        rows = data["rows"]
        if world == 2:
            two_gpu.append(name)
            tp2 += [(r["M"], r["sharded"]) for r in rows if "sharded" in r]
            continue
        if world != 1:
            raise ValueError(f"{name}: world {world}; the model reads world 1 (slices) and world 2 (TP 2) runs")
        one_gpu.append(name)
        copies.append(data["conditions"]["copy_GBps"])
        for r in rows:
            T = r["M"]
            stock.append((T, r["stock"]))
            rep.append((T, r["gemv"]))
            op1.append((T, r["sharded"]))
            for n, sl in _row_slices(r).items():
                if sl.get("slice_push_only") is not None:   # None: that side arm failed on the GPU
                    slices.append(SlicePoint(n, T, sl["slice"], sl["slice_push_only"], name))
    if shape is None or not one_gpu:
        raise ValueError("no world-1 benchmark JSON (bench_moe_front.py --world 1 --as-tp N) among the inputs")
    if not slices:
        raise ValueError("the world-1 JSONs hold no slice timings (run with --as-tp N)")
    return Runs(shape, sum(copies) / len(copies), _mean_by_T(stock), _mean_by_T(rep), tuple(slices),
                _mean_by_T(op1), _mean_by_T(tp2), tuple(one_gpu), tuple(two_gpu))


@dataclass(frozen=True)
class FrontParams:
    """Every parameter of the model, with `provenance[name]` saying where its value comes from."""

    shape: FrontShape
    copy_GBps: float
    push: Mapping[int, LineFit]          # per token count: the push GEMM's fixed cost and bandwidth
    gather_fixed_us: Mapping[int, float]  # per token count: the gather's visible cost less its bytes
    stock_us: Mapping[int, float]
    replicated_us: Mapping[int, float]
    nvlink_GBps: float = NVLINK_GBPS
    nvlink_latency_us: float = NVLINK_LATENCY_US
    push_overlap: float = PUSH_OVERLAP
    #: per token count: the fused out-projection all-reduce's cost over its GEMM at TP 2 (section 2 of
    #: docs/perf/2026-11-30-decode-gemm-fused-ar.md), used only as the pessimistic bracket of the exchange
    bracket_us: Mapping[int, float] = field(default_factory=dict)
    provenance: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        missing = [f.name for f in fields(self) if f.name not in ("shape", "provenance")
                   and f.name not in self.provenance]
        if missing:
            raise ValueError(f"parameters without provenance: {missing}")


def fit_params(runs: Runs, *, nvlink_GBps: float = NVLINK_GBPS, nvlink_latency_us: float = NVLINK_LATENCY_US,
               push_overlap: float = PUSH_OVERLAP, bracket_us: Mapping[int, float] | None = None,
               bracket_source: str = "") -> FrontParams:
    """Fit the compute per token count from the slices; take the rest as measured or assumed."""
    sh = runs.shape
    push: dict[int, LineFit] = {}
    gather: dict[int, float] = {}
    for T in sorted({p.T for p in runs.slices}):
        pts = [p for p in runs.slices if p.T == T]
        push[T] = fit_line([(sh.push_gemm_bytes(p.as_tp, T), p.push_only_us) for p in pts], runs.copy_GBps)
        gather[T] = sum(p.slice_us - p.push_only_us - sh.gather_bytes(p.as_tp, T, 1) / (runs.copy_GBps * 1e3)
                        for p in pts) / len(pts)
    files = ", ".join(runs.one_gpu_sources)
    tps = sorted({p.as_tp for p in runs.slices})
    prov = {
        "copy_GBps": f"measured: conditions.copy_GBps of {files} (device copy in the same process)",
        "push": (f"fitted per token count on (push_gemm_bytes, slice_push_only) at as-tp {tps} from {files} "
                 f"(see each fit's method)"),
        "gather_fixed_us": (f"measured: slice - slice_push_only (the gather's visible cost after the push GEMM, "
                            f"PDL on) less its bytes at copy bandwidth, as-tp {tps}, {files}; assumed independent "
                            f"of W (one program per (token, source rank), all in parallel)"),
        "stock_us": f"measured: 'stock' of {files} (one GPU; the same work on every rank at any TP)",
        "replicated_us": f"measured: 'gemv' of {files} (k3fuse decode_gemm on both; the same at any TP)",
        "nvlink_GBps": SOURCE_NVLINK_GBPS if nvlink_GBps == NVLINK_GBPS else "given on the command line",
        "nvlink_latency_us": SOURCE_NVLINK_LATENCY if nvlink_latency_us == NVLINK_LATENCY_US
        else "given on the command line",
        "push_overlap": SOURCE_PUSH_OVERLAP if push_overlap == PUSH_OVERLAP else "given on the command line",
        "bracket_us": bracket_source or "not given (no pessimistic bracket)",
    }
    return FrontParams(sh, runs.copy_GBps, push, gather, dict(runs.stock_us), dict(runs.replicated_us),
                       nvlink_GBps, nvlink_latency_us, push_overlap, dict(bracket_us or {}), prov)


def _at(table: Mapping[int, Any], T: int, what: str) -> Any:
    if T not in table:
        raise KeyError(f"{what}: no measurement at {T} tokens (measured: {sorted(table)})")
    return table[T]


def compute_us(p: FrontParams, W: int, T: int, slots: int | None = None) -> float:
    """One rank's push GEMM + gather at TP W (`slots` = slots gathered: W, or 1 for a one-GPU slice)."""
    sh = p.shape
    slots = W if slots is None else slots
    gemm = _at(p.push, T, "push GEMM fit").us(sh.push_gemm_bytes(W, T))
    return gemm + _at(p.gather_fixed_us, T, "gather") + sh.gather_bytes(W, T, slots) / (p.copy_GBps * 1e3)


def exchange_us(p: FrontParams, W: int, T: int) -> float:
    """NVLink one-way latency + this rank's pushes to its W - 1 peers at NVLink bandwidth (0 at W = 1)."""
    if W == 1:
        return 0.0
    return p.nvlink_latency_us + (1 - p.push_overlap) * p.shape.pushed_bytes(W, T) / (p.nvlink_GBps * 1e3)


@dataclass(frozen=True)
class Projection:
    """One (TP, tokens) cell: per-rank µs of the three paths and the terms behind them."""

    W: int
    T: int
    weight_bytes: int
    push_bytes_per_peer: int
    stock_us: float
    replicated_us: float
    compute_us: float
    exchange_us: float
    sharded_us: float
    saving_us: float                 # k3fuse replicated - sharded (> 0: sharding wins)
    bracket_sharded_us: float | None  # compute + the fused AR's TP 2 overhead instead of the exchange
    bracket_saving_us: float | None


def project(p: FrontParams, W: int, T: int) -> Projection:
    """Per-rank µs at TP W and T tokens. At W = 1 the rule does not fire: sharded = replicated."""
    sh = p.shape
    rep = _at(p.replicated_us, T, "k3fuse replicated")
    stock = _at(p.stock_us, T, "stock")
    if W == 1:
        return Projection(1, T, sh.weight_bytes(1), 0, stock, rep, rep, 0.0, rep, 0.0, rep, 0.0)
    comp = compute_us(p, W, T)
    exch = exchange_us(p, W, T)
    br = comp + p.bracket_us[T] if T in p.bracket_us else None
    return Projection(W, T, sh.weight_bytes(W), sh.push_bytes_per_peer(W, T), stock, rep, comp, exch, comp + exch,
                      rep - comp - exch, br, None if br is None else rep - br)


@dataclass(frozen=True)
class Check:
    """A measured µs against the model's prediction of the same thing."""

    what: str
    W: int
    T: int
    measured_us: float
    predicted_us: float
    note: str

    @property
    def error(self) -> float:
        """(predicted - measured) / measured."""
        return (self.predicted_us - self.measured_us) / self.measured_us


def compute_checks(p: FrontParams, runs: Runs) -> list[Check]:
    """Measured one-GPU compute against predicted: each slice (mean over runs) and the world-1 op
    over all rows (TP 1's compute: never in the fit, and run with the heuristic push config)."""
    out = []
    by: dict[tuple[int, int], list[float]] = {}
    for s in runs.slices:
        by.setdefault((s.as_tp, s.T), []).append(s.slice_us)
    for (n, T), us in sorted(by.items()):
        fit = p.push[T]
        note = ("in the fit: the only byte count at this T, so exact by construction"
                if fit.method.startswith("one byte count") else f"in the fit ({fit.n_points} points)")
        out.append(Check("slice", n, T, sum(us) / len(us), compute_us(p, n, T, slots=1), note))
    for T, us in sorted(runs.world1_op_us.items()):
        if T in p.push:
            out.append(Check("world-1 op", 1, T, us, compute_us(p, 1, T, slots=1),
                             "out of the fit: the op over all rows, heuristic push config "
                             "(TUNED has no entry for all 4480 rows)"))
    return out


def tp2_checks(p: FrontParams, runs: Runs) -> list[Check]:
    """The world-2 measurement of the sharded op against the projection at TP 2 (empty: none yet)."""
    return [Check("world-2 op", 2, T, us, project(p, 2, T).sharded_us,
                  f"measured exchange = measured - predicted compute = {us - compute_us(p, 2, T):.2f} us")
            for T, us in sorted(runs.tp2_us.items()) if T in p.push]


def splitk_checks(p: FrontParams, decode_gemm: Mapping[str, Any]) -> list[Check]:
    """The fitted push-GEMM line against the same Triton split-K kernel, without push and on one
    weight, at other row counts with K = H (bench_decode_gemm: the router's 896 rows, W_down's 3584;
    another run): the only data on how this kernel family scales with the rows."""
    out = []
    for r in decode_gemm["rows"]:
        if r.get("K") != p.shape.H or r["M"] not in p.push or r.get("triton.splitk") is None:
            continue
        ob = 4 if r["out_dtype"] == "float32" else 2
        nbytes = r["N"] * r["K"] * p.shape.weight_bytes_per + p.shape.activation_bytes(r["M"]) + r["M"] * r["N"] * ob
        out.append(Check(f"triton.splitk {r['shape']}", r["N"], r["M"], r["triton.splitk"], p.push[r["M"]].us(nbytes),
                         f"no push, one weight, {r.get('splitk_cfg', {}).get('SPLIT_K', '?')}-way split; against "
                         f"the push-GEMM line alone (no gather)"))
    return out


def bracket_from_json(fused_ar: Mapping[str, Any], decode_gemm: Mapping[str, Any]) -> dict[int, float]:
    """The overhead of the fused out-projection all-reduce at TP 2 over its GEMM alone (section 2 of
    docs/perf/2026-11-30-decode-gemm-fused-ar.md), per token count: 'k3fuse' of bench_fused_ar minus
    'k3fuse' of oproj_tp2 in bench_decode_gemm (two runs; the only NVLink numbers measured so far)."""
    gemm = {r["M"]: r["k3fuse"] for r in decode_gemm["rows"] if r.get("shape") == "oproj_tp2"}
    return {r["M"]: r["k3fuse"] - gemm[r["M"]] for r in fused_ar["rows"] if r["M"] in gemm}


def _f(x: float | None, nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _kernel(coverage: Mapping[int, str | None] | None, W: int) -> str:
    """"covers", "declines (below)" (the reason follows the table) or "unknown" (no coverage given)."""
    if coverage is None or W not in coverage:
        return "unknown"
    return "declines (below)" if coverage[W] else "covers"


def projection_table(p: FrontParams, tps: Sequence[int] = TABLE_TP, tokens: Sequence[int] = TABLE_TOKENS,
                     coverage: Mapping[int, str | None] | None = None) -> list[str]:
    """The projection as markdown rows (µs per rank)."""
    lines = ["| TP | tokens | weight MB / rank | pushed KB / peer | stock replicated | k3fuse replicated "
             "| sharded: compute | + exchange | = sharded | saving vs k3fuse replicated "
             "| sharded, exchange = fused-AR TP 2 overhead | its saving | kernel |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for W in tps:
        for T in tokens:
            r = project(p, W, T)
            lines.append(f"| {W} | {T} | {r.weight_bytes / 1e6:.1f} | {r.push_bytes_per_peer / 1e3:.1f} "
                         f"| {_f(r.stock_us)} | {_f(r.replicated_us)} | {_f(r.compute_us)} | {_f(r.exchange_us)} "
                         f"| **{_f(r.sharded_us)}** | {r.saving_us:+.1f} | {_f(r.bracket_sharded_us)} "
                         f"| {'-' if r.bracket_saving_us is None else f'{r.bracket_saving_us:+.1f}'} "
                         f"| {_kernel(coverage, W)} |")
    return lines


def check_table(checks: Sequence[Check], col: str = "TP") -> list[str]:
    """Checks as markdown rows; `col` names the W column (TP, or rows for the split-K checks)."""
    lines = [f"| measured | {col} | tokens | measured µs | predicted µs | error | note |", "|---|---|---|---|---|---|---|"]
    for c in checks:
        lines.append(f"| {c.what} | {c.W} | {c.T} | {c.measured_us:.2f} | {c.predicted_us:.2f} "
                     f"| {100 * c.error:+.1f}% | {c.note} |")
    return lines


def report(p: FrontParams, runs: Runs, coverage: Mapping[int, str | None] | None = None,
           tps: Sequence[int] = TABLE_TP, tokens: Sequence[int] = TABLE_TOKENS,
           decode_gemm: Mapping[str, Any] | None = None) -> tuple[list[str], dict[str, Any]]:
    """The printed text (markdown) and the JSON of a projection."""
    sh = p.shape
    tokens = [T for T in tokens if T in p.push]
    out = [f"MoE front per rank: E {sh.E}, L {sh.L}, H {sh.H}, bf16 weights; µs per decode step.",
           f"Inputs: one GPU {', '.join(runs.one_gpu_sources)}; two GPUs "
           f"{', '.join(runs.tp2_sources) or 'none'}.", "", "Parameters:"]
    for name in ("copy_GBps", "nvlink_GBps", "nvlink_latency_us", "push_overlap"):
        out.append(f"- {name} = {getattr(p, name):g}: {p.provenance[name]}")
    for name in ("push", "gather_fixed_us", "stock_us", "replicated_us", "bracket_us"):
        out.append(f"- {name}: {p.provenance[name]}")
    out += ["", "Push GEMM fit per token count (µs = fixed + bytes / bandwidth) and the gather:"]
    for T, fit in p.push.items():
        out.append(f"- T={T}: fixed {fit.fixed_us:.2f} us, {fit.GBps:.0f} GB/s ({fit.method}); "
                   f"gather fixed {p.gather_fixed_us[T]:.2f} us")
    out += ["", "Projection (µs per rank; saving > 0: sharded wins):", ""]
    out += projection_table(p, tps, tokens, coverage)
    for W in tps:
        if coverage and coverage.get(W):
            out.append(f"\nKernel at TP {W}: declines today ({coverage[W]}); the row is the model only.")
        if W > 8:
            out.append(f"\nTP {W} on H200: an HGX H200 NVLink domain has 8 GPUs, so TP {W} spans two nodes; the "
                       f"exchange terms assume all {W} ranks in one NVLink domain.")
    checks = compute_checks(p, runs)
    out += ["", "One-GPU compute, measured against predicted (no NVLink in either):", ""] + check_table(checks)
    sk = splitk_checks(p, decode_gemm) if decode_gemm is not None else []
    if sk:
        out += ["", "The push-GEMM line against the plain Triton split-K GEMM at other row counts "
                    "(one H200, bench_decode_gemm, another run):", ""] + check_table(sk, "rows")
    tp2 = tp2_checks(p, runs)
    if tp2:
        out += ["", "TP 2 on two GPUs, measured against the projection (the exchange term's only check):", ""]
        out += check_table(tp2)
    else:
        out += ["", "No TP 2 measurement: none of the inputs is a two-GPU run (--world 2), so the exchange term "
                    "(NVLink latency and bandwidth, both assumed) is not checked against anything yet."]
    js = {"inputs": {"one_gpu": list(runs.one_gpu_sources), "two_gpu": list(runs.tp2_sources)},
          "shape": asdict(sh),
          "params": {"copy_GBps": p.copy_GBps, "nvlink_GBps": p.nvlink_GBps,
                     "nvlink_latency_us": p.nvlink_latency_us, "push_overlap": p.push_overlap,
                     "push": {str(T): asdict(f) for T, f in p.push.items()},
                     "gather_fixed_us": {str(T): v for T, v in p.gather_fixed_us.items()},
                     "stock_us": {str(T): v for T, v in p.stock_us.items()},
                     "replicated_us": {str(T): v for T, v in p.replicated_us.items()},
                     "bracket_us": {str(T): v for T, v in p.bracket_us.items()},
                     "provenance": dict(p.provenance)},
          "projection": [dict(asdict(project(p, W, T)), kernel=_kernel(coverage, W),
                              kernel_declines=(coverage or {}).get(W)) for W in tps for T in tokens],
          "compute_checks": [dict(asdict(c), error=c.error) for c in checks],
          "splitk_checks": [dict(asdict(c), error=c.error) for c in sk],
          "tp2_checks": [dict(asdict(c), error=c.error) for c in tp2],
          "tp2_measurement": bool(tp2)}
    return out, js


__all__ = ["FrontShape", "LineFit", "fit_line", "SlicePoint", "Runs", "load_runs", "FrontParams", "fit_params",
           "compute_us", "exchange_us", "Projection", "project", "Check", "compute_checks", "tp2_checks",
           "splitk_checks", "bracket_from_json", "projection_table", "check_table", "report", "TABLE_TP", "TABLE_TOKENS"]
