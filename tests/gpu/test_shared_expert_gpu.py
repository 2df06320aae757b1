"""GPU: the shared-expert fork runs the model's bf16 sequence on the side stream (issue 8, item 2).

* K3 per-rank shapes at TP 2 (H = 7168, S/tp = 3072), bf16, every odd token count 1..63 plus 2, 8,
  64, with and without the down projection, against a float64 reference, NaN-poisoned memory (an
  unwritten output element fails), strict mode; the runtime counters show the bf16 side-stream
  implementation ran ("torch.side_stream"), never the float32 reference, and which GEMM kernels
  served the projections (`shared_expert_gemm`);
* HF activations (SiLU-gated, GELU-gated with biases, relu^2) against the stock bf16 sequence;
* a slowed side stream (torch.cuda._sleep queued on it before the work) still matches, also while the
  main stream reuses memory;
* CUDA-graph capture, replays with changing inputs (and with the slowed side stream);
* a compiled model (torch.compile backend "k3fuse", Inductor, buffers reused by Inductor): numbers
  match eager with the side stream slowed, and a torch.profiler trace shows the side-stream kernels
  overlapping the routed-expert kernels of the main stream.

Run: python -m pytest -q -m gpu tests/gpu/test_shared_expert_gpu.py   (one GPU)
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # collected on CPU CI only with -m gpu; skip cleanly there
    pytest.skip("needs CUDA", allow_module_level=True)

import k3fuse  # noqa: E402
import k3fuse.kernels  # noqa: F401,E402  (registers torch.ops.k3fuse.*)
from k3fuse import runtime  # noqa: E402
from k3fuse.kernels import dispatch, streams  # noqa: E402
from k3fuse.kernels.ops import shared_expert as cuda_shared_expert  # noqa: E402
from k3fuse.kernels.lib.reference import shared_expert  # noqa: E402
from k3fuse.tools.bench.profile import concurrency, kernel_events  # noqa: E402
from k3fuse.kernels.lib.reference.shared_expert import situ_act  # noqa: E402
from k3fuse.model.shapes import gemm_site  # noqa: E402
from k3fuse.spelling import K3_SITU_BETA, K3_SITU_LINEAR_BETA  # noqa: E402

DEV = "cuda"
BF16 = torch.bfloat16
_SHARED_GATE = gemm_site("shared_gate_tp2")  # one rank's gate (and up) rows at TP 2: [S/2, H]
H, S_TP2 = _SHARED_GATE.k, _SHARED_GATE.n
TOKENS = sorted(set(range(1, 64, 2)) | {2, 8, 64})
ops = torch.ops.k3fuse
SLEEP_CYCLES = 50_000_000  # ~25 ms at H200 clocks: far longer than the main-stream work between fork and join


@pytest.fixture(autouse=True)
def _fresh():
    dispatch.load_gpu_impls()
    streams.prepare()
    runtime.reset_stats()
    streams.clear()
    yield
    torch.cuda.synchronize()
    streams.clear()


def _w(*shape, seed, scale=None):
    g = torch.Generator(device=DEV).manual_seed(seed)
    t = torch.randn(*shape, device=DEV, generator=g)
    return (t * (scale if scale is not None else shape[-1] ** -0.5)).to(BF16)


_weights: dict = {}


def _k3_weights():
    """K3 shared expert, one rank at TP 2: gate/up [3072, 7168], down [7168, 3072]."""
    if not _weights:
        _weights.update(wg=_w(S_TP2, H, seed=1), wu=_w(S_TP2, H, seed=2), wd=_w(H, S_TP2, seed=3))
    return _weights["wg"], _weights["wu"], _weights["wd"]


def _situ64(g, u, beta=K3_SITU_BETA, linear_beta=K3_SITU_LINEAR_BETA):
    return beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))


def _ref64(x, proj, bias, wd, bd, act):
    d = [p.double() for p in proj]
    x64 = x.double().reshape(-1, x.shape[-1])
    ps = [x64 @ w.T + (bias[i].double() if bias else 0) for i, w in enumerate(d)]
    h = {"situ": lambda: _situ64(ps[0], ps[1]),
         "silu_glu": lambda: F.silu(ps[0]) * ps[1],
         "gelu_tanh_glu": lambda: F.gelu(ps[0], approximate="tanh") * ps[1],
         "relu2": lambda: torch.square(F.relu(ps[0]))}[act]()
    if wd is not None:
        h = h @ wd.double().T + (bd.double() if bd is not None else 0)
    return h


def _rel(y, ref):
    return ((y.double().reshape(ref.shape) - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _poison():
    """Fill freed memory of the main and the side stream's pools with NaN (best effort: the outputs
    are then carved from NaN blocks, so an element the kernels never write shows up)."""
    for stream in (torch.cuda.current_stream(), streams.side_stream()):
        with torch.cuda.stream(stream):
            blocks = [torch.full((n,), float("nan"), dtype=BF16, device=DEV)
                      for n in [1 << k for k in range(8, 20)] for _ in range(4)]
            blocks.append(torch.full((64 << 20,), float("nan"), dtype=BF16, device=DEV))
            del blocks
    torch.cuda.synchronize()


def _kernels_loaded() -> bool:
    names = {i.name for i in dispatch.implementations("decode_gemm")}
    return {"cute.gemv", "triton.splitk"} <= names and not dispatch.import_errors()


def _fork_join(x, proj, bias, wd, bd, act, site, out_features=None):
    xp = ops.shared_expert_fork(x, proj, bias, wd, bd, act, site)
    anchor = x if wd is not None else x[..., : (out_features or proj[0].shape[0])]
    reads = [x, *proj, *bias, *(t for t in (wd, bd) if t is not None)]
    return xp, ops.shared_expert_join(xp, anchor, reads, site, -1 if wd is not None else out_features)


# --- K3 shapes, every token count ------------------------------------------------------------------
@pytest.mark.parametrize("with_down", [True, False], ids=["mlp", "gate_up"])
def test_k3_shapes_every_token_count_against_float64(with_down):
    wg, wu, wd = _k3_weights()
    wd = wd if with_down else None
    for T in TOKENS:
        x = torch.randn(T, H, device=DEV).to(BF16)
        _poison()
        runtime.reset_stats()
        with runtime.strict():
            xp, y = _fork_join(x, [wg, wu], [], wd, None, situ_act(), 0, S_TP2)
        torch.cuda.synchronize()
        assert torch.equal(xp, x)
        assert y.shape == (T, H if with_down else S_TP2) and y.dtype == BF16
        assert not torch.isnan(y).any(), f"T={T}: NaN (unwritten output)"
        rel = _rel(y, _ref64(x, [wg, wu], [], wd, None, "situ"))
        assert rel < 1e-2, f"T={T}: rel err {rel:.2e}"
        stats = runtime.stats()
        assert stats["shared_expert_fork"] == {"torch.side_stream": 1}, stats
        assert stats["shared_expert_join"] == {"torch.side_stream": 1}, stats
        assert runtime.fallbacks() == {}
        gemms = stats[cuda_shared_expert.STATS_KEY]
        assert sum(gemms.values()) == (3 if with_down else 2), gemms
        assert "reference" not in gemms
        if _kernels_loaded():  # H200 with CuTe DSL and Triton: the decode-GEMM kernels, not cuBLAS
            assert set(gemms) <= {"cute.gemv", "triton.splitk"}, (T, gemms)


def test_side_stream_runs_bf16_and_never_upcasts_the_weights():
    """The issue-8 profile: no float32 copy of the weights per step (two copy kernels of 63 and 84 us)."""
    wg, wu, wd = _k3_weights()
    x = torch.randn(4, H, device=DEV).to(BF16)
    _fork_join(x, [wg, wu], [], wd, None, situ_act(), 0)  # warm (compiles the kernels)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            _fork_join(x, [wg, wu], [], wd, None, situ_act(), 0)
        torch.cuda.synchronize()
    big_copies = [e for e in prof.key_averages() if "copy" in e.key.lower() and "elementwise" in e.key.lower()
                  and e.device_time_total / max(e.count, 1) > 20]
    assert not big_copies, [(e.key, e.device_time_total) for e in big_copies]


@pytest.mark.parametrize("act", ["silu_glu", "gelu_tanh_glu", "relu2"])
def test_hf_activations_match_the_stock_bf16_sequence(act):
    gated = act != "relu2"
    proj = [_w(S_TP2, H, seed=11), _w(S_TP2, H, seed=12)][: 2 if gated else 1]
    bias = [_w(S_TP2, seed=13, scale=0.1), _w(S_TP2, seed=14, scale=0.1)][: len(proj)] if act == "gelu_tanh_glu" else []
    wd = _w(H, S_TP2, seed=15)
    bd = _w(H, seed=16, scale=0.1) if act == "gelu_tanh_glu" else None
    for T in (1, 2, 5, 17, 64):
        x = torch.randn(1, T, H, device=DEV).to(BF16)  # HF decode layout [batch, seq, hidden]
        _poison()
        with runtime.strict():
            _, y = _fork_join(x, proj, bias, wd, bd, act, 1)
        stock = shared_expert.branch(x, proj, bias, wd, bd, act)  # F.linear (cuBLAS) + the activation's ops
        torch.cuda.synchronize()
        assert y.shape == (1, T, H) and not torch.isnan(y).any()
        assert _rel(y, _ref64(x, proj, bias, wd, bd, act)) < 1e-2
        assert _rel(y, stock.double()) < 1e-2
    assert runtime.fallbacks() == {}


# --- a slow side stream -----------------------------------------------------------------------------
@pytest.fixture
def slow_side(monkeypatch):
    """torch.cuda._sleep queued on the side stream before the branch's kernels (inside streams.launch,
    where the current stream is the side stream)."""
    original = shared_expert.branch

    def slowed(*args, **kwargs):
        assert torch.cuda.current_stream() == streams.side_stream()
        torch.cuda._sleep(SLEEP_CYCLES)
        return original(*args, **kwargs)

    monkeypatch.setattr(shared_expert, "branch", slowed)
    yield


def test_slowed_side_stream_still_matches_while_main_reuses_memory(slow_side):
    wg, wu, wd = _k3_weights()
    w_routed = _w(H, H, seed=21)
    for T in (1, 7, 64):
        x = torch.randn(T, H, device=DEV).to(BF16)
        ref = _ref64(x, [wg, wu], [], wd, None, "situ")
        x_work = x.clone()
        with runtime.strict():
            xp = ops.shared_expert_fork(x_work, [wg, wu], [], wd, None, situ_act(), 2)
            reads = [x_work, wg, wu, wd]
            del x_work  # the caller's reference goes; the side stream is still asleep, x must survive
            junk = [torch.full((T, H), float("nan"), dtype=BF16, device=DEV) for _ in range(8)]
            routed = F.linear(xp, w_routed)
            y = ops.shared_expert_join(xp, routed, reads, 2)
        out = routed + y
        torch.cuda.synchronize()
        del junk
        assert not torch.isnan(out).any()
        assert _rel(y, ref) < 1e-2, T
    assert runtime.stats()["shared_expert_fork"] == {"torch.side_stream": 3}


# --- CUDA graphs --------------------------------------------------------------------------------------
@pytest.mark.parametrize("slow", [False, True], ids=["plain", "slowed_side"])
def test_cuda_graph_capture_and_replays_with_changing_inputs(slow, monkeypatch):
    if slow:
        original = shared_expert.branch

        def slowed(*args, **kwargs):
            torch.cuda._sleep(SLEEP_CYCLES // 10)
            return original(*args, **kwargs)

        monkeypatch.setattr(shared_expert, "branch", slowed)
    wg, wu, wd = _k3_weights()
    w_routed = _w(H, H, seed=31)
    T = 5
    x_static = torch.randn(T, H, device=DEV).to(BF16)

    def step(x):
        xp = ops.shared_expert_fork(x, [wg, wu], [], wd, None, situ_act(), 3)
        routed = F.linear(xp, w_routed)
        return routed + ops.shared_expert_join(xp, routed, [x, wg, wu, wd], 3)

    streams.prepare(sites=[3])
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        for _ in range(3):
            step(x_static)
    torch.cuda.current_stream().wait_stream(warm)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with runtime.strict(), torch.cuda.graph(graph):
        y_static = step(x_static)
    for i in range(20):
        x_new = torch.randn(T, H, device=DEV).to(BF16)
        x_static.copy_(x_new)
        graph.replay()
        torch.cuda.synchronize()
        ref = x_new.double() @ w_routed.double().T + _ref64(x_new, [wg, wu], [], wd, None, "situ")
        assert not torch.isnan(y_static).any(), i
        assert _rel(y_static, ref) < 1e-2, i
    assert runtime.fallbacks() == {}


# --- a compiled model: overlap in a profiler trace ------------------------------------------------------
class HFMoE(nn.Module):
    """DeepSeek-style MoE block at K3 width, bf16: sigmoid top-k router, routed SiLU experts (dense
    combine, main stream) plus a SiLU-gated shared expert [3072 x 7168] (the side stream)."""

    def __init__(self, n_experts=8, inter=1024):
        super().__init__()
        self.gate = nn.Linear(H, n_experts, bias=False)
        self.experts = nn.ModuleList(nn.ModuleDict({"gate_proj": nn.Linear(H, inter, bias=False),
                                                    "up_proj": nn.Linear(H, inter, bias=False),
                                                    "down_proj": nn.Linear(inter, H, bias=False)})
                                     for _ in range(n_experts))
        self.shared_gate_proj = nn.Linear(H, S_TP2, bias=False)
        self.shared_up_proj = nn.Linear(H, S_TP2, bias=False)
        self.shared_down_proj = nn.Linear(S_TP2, H, bias=False)
        for p in self.parameters():
            nn.init.normal_(p, std=p.shape[-1] ** -0.5)
        self.requires_grad_(False)

    def forward(self, x):
        residuals = x
        scores = F.linear(x.float(), self.gate.weight.float()).sigmoid()
        w, idx = torch.topk(scores, 2, dim=-1)
        combine = torch.zeros_like(scores).scatter(1, idx, w / w.sum(-1, keepdim=True)).to(x.dtype)
        routed = sum(e["down_proj"](F.silu(e["gate_proj"](x)) * e["up_proj"](x)) * combine[:, i:i + 1]
                     for i, e in enumerate(self.experts))
        shared = self.shared_down_proj(F.silu(self.shared_gate_proj(residuals)) * self.shared_up_proj(residuals))
        return routed + shared


def _compiled(model):
    torch._dynamo.reset()
    ctx = k3fuse.DecodeContext(device_capability=torch.cuda.get_device_capability(), dtype=BF16, strict=True)
    rlog = k3fuse.RewriteLog()
    fn = torch.compile(model, backend="k3fuse", fullgraph=True,
                       options={"compiler": "inductor", "context": ctx, "log": rlog})
    return fn, rlog


def test_compiled_model_matches_with_a_slow_side_stream(slow_side):
    model = HFMoE().to(DEV, BF16).eval()
    fn, rlog = _compiled(model)
    with torch.no_grad():
        for T in (1, 8, 33):
            x = torch.randn(T, H, device=DEV).to(BF16)
            runtime.reset_stats()
            with runtime.strict():
                y = fn(x)
            ref = model(x)
            torch.cuda.synchronize()
            assert not torch.isnan(y).any()
            assert _rel(y, ref.double()) < 2e-2, T
            assert runtime.stats()["shared_expert_fork"] == {"torch.side_stream": 1}
    graphs = {e.graph_id for e in rlog.events}  # 1 token compiles a static graph, 8 a dynamic one
    assert rlog.applied("shared_expert_stream") == len(graphs) >= 1


def test_compiled_model_profile_shows_side_stream_overlapping_routed_experts():
    model = HFMoE().to(DEV, BF16).eval()
    fn, rlog = _compiled(model)
    x = torch.randn(8, H, device=DEV).to(BF16)
    with torch.no_grad():
        for _ in range(3):
            fn(x)
        torch.cuda.synchronize()
        assert rlog.applied("shared_expert_stream") == 1  # compiled on the first call
        # replay a CUDA graph of 5 steps, as a server does: eager launches of a model this small
        # leave the main stream idle while the host catches up, which hides any overlap
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(x)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(5):
                fn(x)
        graph.replay()
        torch.cuda.synchronize()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                graph.replay()
                torch.cuda.synchronize()
    kernels = kernel_events(prof)
    conc = concurrency(kernels)
    per_step = conc["concurrent_us"] / 5
    # stock (no fork) runs nothing concurrently; the shared expert's three GEMMs [3072 x 7168] read
    # ~132 MB (~30 µs at H200 bandwidth) per step, and the fork should hide a good part of them
    assert per_step >= 5.0, (f"only {per_step:.1f} µs per step of kernel time ran concurrently "
                             f"(busy {conc['busy_us']:.1f}, wall {conc['wall_us']:.1f} µs over 5 steps)\n"
                             f"{_timeline_summary(kernels)}")


def _timeline_summary(kernels) -> str:
    """The first 40 kernels (offset from the first, duration, profiler stream id, name): what a
    failed concurrency assertion needs to be read."""
    t0 = kernels[0].start_us if kernels else 0.0
    return "\n".join(f"  +{k.start_us - t0:8.1f} {k.dur_us:7.1f} s{k.stream:<5} {k.name[:90]}" for k in kernels[:40])
