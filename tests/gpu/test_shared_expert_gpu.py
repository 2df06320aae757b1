"""GPU: the shared expert's bracketed region on the side stream (issue 49, item 4).

shared_expert_stream leaves the branch's own nodes in the graph between shared_expert_fork and
shared_expert_end (kernels/ops/shared_expert.py, kernels/streams.py). Run node by node (the k3fuse
backend's eager compiler, a torch.export program), the region's kernels go to the side stream:

* the region really runs on a second stream and the numbers match the model (strict mode, counters
  under "torch.side_stream");
* a race shows up as different bits: the side stream slowed (torch.cuda._sleep queued on it by the
  fork) with the main stream filling freed memory with NaN meanwhile, the program gives the same
  bits as unslowed;
* lifetimes across streams: x (allocated on the main stream, copied on the side one) survives its
  last main-stream reference while the side stream sleeps; the region's output (allocated on the
  side stream, copied by the join on the main one) survives while the main stream sleeps and the
  side stream allocates;
* CUDA-graph capture over the node-by-node program, replays with changing inputs (plain and with the
  slowed side stream captured), the same bits as uncaptured runs; a profile of the replay shows the
  side-stream kernels overlapping the routed experts;
* with the backend's Inductor, each region is outlined into one op (Inductor launches its own kernels on
  one stream): the region and its join run on the side stream, the numbers match, the replay overlaps.

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
from k3fuse.model.shapes import gemm_site  # noqa: E402
from k3fuse.tools.bench.profile import concurrency, kernel_events  # noqa: E402

DEV = "cuda"
BF16 = torch.bfloat16
_SHARED_GATE = gemm_site("shared_gate_tp2")  # one rank's gate (and up) rows at TP 2: [S/2, H]
H, S_TP2 = _SHARED_GATE.k, _SHARED_GATE.n
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


def _w(*shape, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(*shape, device=DEV, generator=g) * shape[-1] ** -0.5).to(BF16)


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


_model: dict = {}


def _hf_moe() -> HFMoE:
    if not _model:
        torch.manual_seed(0)
        _model["m"] = HFMoE().to(DEV, BF16).eval()
    return _model["m"]


def _compiled(compiler: str):
    """The model through the k3fuse backend: "eager" runs the rewritten graph node by node."""
    torch._dynamo.reset()
    ctx = k3fuse.DecodeContext(device_capability=torch.cuda.get_device_capability(), dtype=BF16, strict=True)
    rlog = k3fuse.RewriteLog()
    fn = torch.compile(_hf_moe(), backend="k3fuse", fullgraph=True,
                       options={"compiler": compiler, "context": ctx, "log": rlog})
    return fn, rlog


def _rel(y, ref) -> float:
    return ((y.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def _junk(n: int = 8, numel: int = 1 << 20) -> list[torch.Tensor]:
    """NaN-filled allocations on the current stream (they reuse whatever the allocator freed)."""
    return [torch.full((numel,), float("nan"), dtype=BF16, device=DEV) for _ in range(n)]


def _slow_side(monkeypatch) -> None:
    """From now on: torch.cuda._sleep queued on the side stream right after each fork (the region's
    kernels wait behind it); after each end, the main stream fills fresh allocations with NaN."""
    fork, end = streams.fork, streams.end

    def slowed_fork(site, x, producer):
        fork(site, x, producer)
        assert torch.cuda.current_stream() == streams.side_stream(x.device)
        torch.cuda._sleep(SLEEP_CYCLES)

    def poisoning_end(site, device):
        end(site, device)
        assert torch.cuda.current_stream() != streams.side_stream(device)
        _junk()

    monkeypatch.setattr(streams, "fork", slowed_fork)
    monkeypatch.setattr(streams, "end", poisoning_end)


# --- node by node: the region on the side stream ---------------------------------------------------------
def _steps_match_the_model(fn) -> list[dict]:
    """Strict steps at 1, 8 and 33 tokens against the model; the runtime counters of each step."""
    stats = []
    with torch.no_grad():
        for T in (1, 8, 33):
            x = torch.randn(T, H, device=DEV).to(BF16)
            runtime.reset_stats()
            with runtime.strict():
                y = fn(x)
            torch.cuda.synchronize()
            assert not torch.isnan(y).any(), T
            assert _rel(y, _hf_moe()(x)) < 2e-2, T
            stats.append(runtime.stats())
    return stats


def _assert_two_streams(fn) -> None:
    """One profiled step at 8 tokens launched kernels on at least two streams."""
    with torch.no_grad():
        x = torch.randn(8, H, device=DEV).to(BF16)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                fn(x)
                torch.cuda.synchronize()
    kernels = kernel_events(prof)
    assert len({k.stream for k in kernels}) >= 2, [(k.stream, k.name[:60]) for k in kernels]


def test_node_by_node_the_region_runs_on_the_side_stream():
    fn, rlog = _compiled("eager")
    for stats in _steps_match_the_model(fn):
        assert stats["shared_expert_fork"] == {"torch.side_stream": 1}
        assert stats["shared_expert_join"] == {"torch.side_stream": 1}
    assert rlog.applied("shared_expert_stream") >= 1
    _assert_two_streams(fn)


def test_a_slowed_side_stream_gives_the_same_bits(monkeypatch):
    """Same program, same kernels: only the timing differs, so any missing wait or early free would
    show up as different bits (or as the NaN the main stream wrote into freed memory)."""
    fn, _ = _compiled("eager")
    xs = [torch.randn(T, H, device=DEV).to(BF16) for T in (1, 7, 64)]
    with torch.no_grad():
        plain = [fn(x) for x in xs]
        torch.cuda.synchronize()
        _slow_side(monkeypatch)
        with runtime.strict():
            slowed = [fn(x) for x in xs]
        torch.cuda.synchronize()
    for T, y, ref in zip((1, 7, 64), slowed, plain):
        assert not torch.isnan(y).any(), T
        assert torch.equal(y, ref), T
    assert runtime.stats()["shared_expert_join"]["torch.side_stream"] >= len(xs)


# --- lifetimes across the two streams -------------------------------------------------------------------
def test_x_survives_its_last_main_reference_while_the_side_stream_sleeps(monkeypatch):
    """The fork copies x on the side stream, behind a sleep: x's memory must not go to the main
    stream's next allocations meanwhile (the fork records x on the side stream)."""
    fork = streams.fork

    def slowed_fork(site, x, producer):
        fork(site, x, producer)
        torch.cuda._sleep(SLEEP_CYCLES)

    monkeypatch.setattr(streams, "fork", slowed_fork)
    w = _w(S_TP2, H, seed=3)
    for T in (1, 33):
        x = torch.randn(T, H, device=DEV).to(BF16)
        expected = F.linear(x, w)
        x_work = x.clone()
        with runtime.strict():
            x_side = ops.shared_expert_fork(x_work, 5)
            y = F.linear(x_side, w)  # the region, on the side stream
            ops.shared_expert_end(y, 5)
            del x_work  # its last reference: the block goes back to the allocator
            junk = _junk(8, T * H)  # the main stream takes freed blocks of x's size and writes NaN
            out = ops.shared_expert_join(y, x_side, [], 5)
        torch.cuda.synchronize()
        del junk
        assert not torch.isnan(out).any(), T  # the NaN the main stream wrote did not reach the copy
        assert _rel(out, expected) < 1e-3, T


def test_the_region_output_survives_until_the_main_stream_copied_it(monkeypatch):
    """The region's output is allocated on the side stream and copied by the join on the main stream,
    behind a sleep here: dropped right after, its memory must not go to the side stream's next
    allocations before the copy ran (the join records it on the main stream)."""
    join = streams.join

    def slowed_join(site, y):
        producer = join(site, y)
        torch.cuda._sleep(SLEEP_CYCLES)  # on the main stream, before the join's copy
        return producer

    monkeypatch.setattr(streams, "join", slowed_join)
    w = _w(S_TP2, H, seed=4)
    x = torch.randn(9, H, device=DEV).to(BF16)
    expected = F.linear(x, w)
    with runtime.strict():
        x_side = ops.shared_expert_fork(x, 6)
        y = F.linear(x_side, w)
        ops.shared_expert_end(y, 6)
        out = ops.shared_expert_join(y, x, [x], 6)
        del y, x_side
        with torch.cuda.stream(streams.side_stream()):
            junk = _junk(8, 9 * S_TP2)  # the side stream reuses its freed blocks and writes NaN
    torch.cuda.synchronize()
    del junk
    assert not torch.isnan(out).any()  # the NaN the side stream wrote did not reach the join's copy
    assert _rel(out, expected) < 1e-3


# --- CUDA graphs ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("slow", [False, True], ids=["plain", "slowed_side"])
def test_cuda_graph_capture_and_replays_with_changing_inputs(slow, monkeypatch):
    fn, _ = _compiled("eager")
    T = 5
    x_static = torch.randn(T, H, device=DEV).to(BF16)
    with torch.no_grad():
        warm = torch.cuda.Stream()
        warm.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(warm):
            for _ in range(3):
                fn(x_static)
        torch.cuda.current_stream().wait_stream(warm)
        torch.cuda.synchronize()
        inputs = [torch.randn(T, H, device=DEV).to(BF16) for _ in range(10)]
        expected = [fn(x).clone() for x in inputs]  # uncaptured, node by node
        torch.cuda.synchronize()
        if slow:
            fork = streams.fork

            def slowed_fork(site, x, producer):
                fork(site, x, producer)
                torch.cuda._sleep(SLEEP_CYCLES // 10)

            monkeypatch.setattr(streams, "fork", slowed_fork)
        graph = torch.cuda.CUDAGraph()
        with runtime.strict(), torch.cuda.graph(graph):
            y_static = fn(x_static)
        for i, (x, ref) in enumerate(zip(inputs, expected)):
            x_static.copy_(x)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(y_static, ref), i
    assert runtime.fallbacks() == {}


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_replayed_graph_overlaps_the_side_stream_with_the_routed_experts(compiler):
    fn, rlog = _compiled(compiler)
    x = torch.randn(8, H, device=DEV).to(BF16)
    with torch.no_grad():
        for _ in range(3):
            fn(x)
        torch.cuda.synchronize()
        assert rlog.applied("shared_expert_stream") == 1
        # replay a CUDA graph of 5 steps, as a server does: node-by-node launches of a model this small
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
    # node by node without the fork nothing runs concurrently; the shared expert's three GEMMs
    # [3072 x 7168] read ~132 MB (~30 µs at H200 bandwidth) per step, and the side stream should hide
    # a good part of them behind the routed experts
    assert per_step >= 5.0, (f"only {per_step:.1f} µs per step of kernel time ran concurrently "
                             f"(busy {conc['busy_us']:.1f}, wall {conc['wall_us']:.1f} µs over 5 steps)\n"
                             f"{_timeline_summary(kernels)}")


def _timeline_summary(kernels) -> str:
    """The first 40 kernels (offset from the first, duration, profiler stream id, name): what a
    failed concurrency assertion needs to be read."""
    t0 = kernels[0].start_us if kernels else 0.0
    return "\n".join(f"  +{k.start_us - t0:8.1f} {k.dur_us:7.1f} s{k.stream:<5} {k.name[:90]}" for k in kernels[:40])


# --- Inductor: the region outlined into one op ------------------------------------------------------------
def test_inductor_runs_the_outlined_region_on_the_side_stream():
    fn, rlog = _compiled("inductor")
    for stats in _steps_match_the_model(fn):
        assert not {"shared_expert_fork", "shared_expert_join"} & set(stats), stats
        assert stats["shared_expert_region"] == {"torch.side_stream": 1}, stats
        assert stats["shared_expert_region_join"] == {"torch.side_stream": 1}, stats
    graphs = {e.graph_id for e in rlog.events}  # 1 token compiles a static graph, 8 a dynamic one
    assert rlog.applied("shared_expert_stream") == len(graphs) >= 1
    _assert_two_streams(fn)
