"""GPU correctness of mla_decode: the Triton flash-decoding kernel against float64, at K3's shapes.

* batch 1 at 128K tokens, batch 8 mixed up to 32K, batch 64 mixed up to 4K (lengths 0 and 1
  included), heads 3 / 6 / 12, pages 16 and 64, bf16 and fp8 (e4m3 + scale) caches, into
  NaN-poisoned outputs over caches whose rows no sequence owns hold NaN, both kernel variants made
  for the cache (kernels/lib/triton/mla_decode.py CACHE_VARIANTS: the Gluon default, as itself on
  pages of 64 and as the Triton fallback on pages of 16, and the Triton fallback) and the trial
  variants (TRIAL_VARIANTS: the fp8 kernel that widens a tile ahead): within the
  roundings of p and of the output of the float64 attention; every split count from 1 to the chosen
  one's double, and every variant on either cache, gives that too; deterministic;
* a scaled 16-bit cache and lengths past the table's width (the whole table), every variant;
* the combine alone against a float64 merge (empty parts: NaN behind a -inf lse), one step and two,
  plain and behind PDL;
* the op through the dispatcher in strict mode: k3fuse.stats() shows the Triton kernel; the kill
  switch runs the plain spelling; a call no kernel takes (fp32 q) falls back to it, strict raises;
* one CUDA graph replayed 1000 times over changing lengths (and queries), the default variant through
  the op (its combine behind PDL), 200 times for the fallback and each trial: each replay against the plain
  spelling, every 100th against float64.

    python -m pytest -m gpu tests/gpu/test_mla_decode_gpu.py -q
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # collected on CPU CI only with -m gpu; skip cleanly there
    pytest.skip("needs CUDA", allow_module_level=True)

import k3fuse  # noqa: E402
from k3fuse import runtime  # noqa: E402
from k3fuse.kernels.lib.reference import mla_decode as reference  # noqa: E402
from k3fuse.kernels.lib.triton import mla_decode as kernel  # noqa: E402
from k3fuse.kernels.ops import mla_decode as mla_op  # noqa: E402

DEV = "cuda"
SCALE = 192 ** -0.5
FP8 = torch.float8_e4m3fn
OP = "mla_decode"


def make_case(lengths, heads, page, cache_dtype=torch.bfloat16, seed=0, width=None):
    """(q, kv_cache, block_table, seq_lens, kv_scale) on the GPU: pages drawn at random from a pool
    of exactly the pages in use (+1); unowned rows NaN, table entries past a sequence's pages a
    huge index (never followed)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    B = len(lengths)
    used = [-(-n // page) for n in lengths]
    width = width or max(1, max(used))
    blocks = sum(used) + 1
    q = (torch.randn(B, heads, 576, generator=g, device=DEV) * 2).bfloat16()
    cache = torch.randn(blocks, page, 576, generator=g, device=DEV)
    cache[..., :512] *= 1.5
    table = torch.full((B, width), 10 ** 9, dtype=torch.int32, device=DEV)
    order = torch.randperm(blocks, generator=g, device=DEV).int()
    owned = torch.zeros(blocks, page, dtype=torch.bool, device=DEV)
    at = 0
    for b, n in enumerate(lengths):
        table[b, :used[b]] = order[at:at + used[b]]
        at += used[b]
        tok = torch.arange(n, device=DEV)
        owned[table[b, tok // page].long(), tok % page] = True
    scale = None
    if cache_dtype == FP8:
        scale = torch.tensor([0.37], device=DEV)
        cache = (cache / scale).to(FP8)
        cache.view(torch.uint8)[~owned] = 0x7F  # e4m3fn NaN
    else:
        cache = cache.to(cache_dtype)
        cache[~owned] = float("nan")
    return q, cache, table, torch.tensor(lengths, dtype=torch.int32, device=DEV), scale


def f64_attention(q, cache, table, lens, kv_scale=None):
    """(out, sum_j p_j |c_kv_j|) in float64, one sequence at a time (its pages gathered)."""
    B, H, _ = q.shape
    page = cache.shape[1]
    out = torch.zeros(B, H, 512, dtype=torch.float64, device=DEV)
    mag = torch.zeros_like(out)
    for b, n in enumerate(lens.tolist()):
        n = min(n, table.shape[1] * page)  # past the table: all of it (the plain spelling's mask)
        if n == 0:
            continue
        tok = torch.arange(n, device=DEV)
        entries = cache[table[b, tok // page].long(), tok % page].double()
        if kv_scale is not None:
            entries = entries * kv_scale.double()
        p = torch.softmax((q[b].double() @ entries.T) * SCALE, dim=-1)
        out[b] = p @ entries[:, :512]
        mag[b] = p @ entries[:, :512].abs()
    return out, mag


def check(out, ref, mag, where):
    """Every element written; |out - ref| within one bf16 rounding of p (relative to sum_j p_j |c_kv_j|)
    and one of the output, each 2^-8 relative, plus fp32 score and sum roundings (a hair)."""
    assert not torch.isnan(out).any(), where
    excess = float(((out.double() - ref).abs() - 2 ** -8 * (ref.abs() + mag) * 1.05 - 1e-5).max())
    assert excess <= 0, (where, excess)


def variants_for(cache_dtype):
    """The variants a call on this cache can take (its Gluon default, its Triton fallback), and the trials."""
    return kernel.CACHE_VARIANTS[cache_dtype.itemsize] + kernel.TRIAL_VARIANTS[cache_dtype.itemsize]


def poisoned(q, cache, table, lens, kv_scale, **kw):
    out = torch.full((q.shape[0], q.shape[1], 512), float("nan"), dtype=q.dtype, device=DEV)
    assert kernel.run(q, cache, table, lens, SCALE, kv_scale, out=out, **kw) is out
    return out


CASES = [  # lengths, heads, page
    ([131072], 6, 64), ([131071], 3, 16), ([1, 32768, 5000, 0, 77, 8191, 8192, 20000], 12, 64),
    (None, 6, 16),  # batch 64, lengths 0 .. 4K
]


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("lengths,heads,page", CASES)
def test_against_float64_up_to_128k(lengths, heads, page, cache_dtype):
    if lengths is None:
        g = torch.Generator().manual_seed(1)
        lengths = [0, 1] + [int(x) for x in torch.randint(1, 4097, (62,), generator=g)]
    case = make_case(lengths, heads, page, cache_dtype, seed=len(lengths) + heads)
    spec = mla_op.MLADecodeSpec.from_call(*case[:4], SCALE, case[4])
    assert mla_op.accepts(spec) is None
    ref, mag = f64_attention(*case[:4], case[4])
    for variant in variants_for(cache_dtype):
        cfg = kernel.VARIANTS[variant]
        # a Gluon variant runs as itself on an H100 wherever a page holds whole tiles (else the Triton fallback)
        assert kernel.resolve(cfg, cache_dtype, case[0].device, page).gluon == (cfg.gluon and page % cfg.block_n == 0)
        out = poisoned(*case, config=cfg)
        check(out, ref, mag, (variant, len(lengths), max(lengths), heads, page, cache_dtype))
        assert torch.equal(out, poisoned(*case, config=cfg))  # deterministic: a fixed order, no atomics
        for b, n in enumerate(lengths):
            if n == 0:
                assert not out[b].any()


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
def test_every_split_count_and_every_variant(cache_dtype):
    for page in (16, 64):  # tiles across pages (a lookup a token), tiles in one page (a lookup a tile)
        case = make_case([3000, 1, 1500], 6, page, cache_dtype, seed=3)
        ref, mag = f64_attention(*case[:4], case[4])
        chosen = kernel.splits_for(3, 6, case[2].shape[1] * page, kernel.sm_count(torch.device(DEV)), cache_dtype)
        for splits in sorted({1, 2, 3, 7, chosen, 2 * chosen}):
            check(poisoned(*case, splits=splits), ref, mag, ("splits", splits, page))
    # every variant on either cache (the model's S, and 5) over pages of 64, where each runs as itself
    case = make_case([3000, 1, 1500], 6, 64, cache_dtype, seed=4)
    ref, mag = f64_attention(*case[:4], case[4])
    for name, cfg in kernel.VARIANTS.items():
        assert kernel.resolve(cfg, cache_dtype, case[0].device, 64) is cfg
        check(poisoned(*case, config=cfg), ref, mag, name)
        check(poisoned(*case, config=cfg, splits=5), ref, mag, (name, 5))


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
def test_scaled_cache_and_lengths_past_the_table(cache_dtype):
    """The model's spelling multiplies every cache by its scale (a 16-bit one too) and attends over the whole
    table when a length runs past it: every variant does the same, the Gluon ones on pages of 64."""
    case = make_case([4096, 4096, 640, 0], 6, 64, cache_dtype, seed=11)
    q, cache, table, lens, kv_scale = case
    kv_scale = torch.tensor([0.37], device=DEV) if kv_scale is None else kv_scale
    lens = lens.clone()
    lens[0] += 5000  # a full row of the table, and a length past it
    ref, mag = f64_attention(q, cache, table, lens, kv_scale)
    assert mla_op.accepts(mla_op.MLADecodeSpec.from_call(q, cache, table, lens, SCALE, kv_scale)) is None
    for variant in variants_for(cache_dtype):
        for splits in (None, 3):
            out = poisoned(q, cache, table, lens, kv_scale, config=kernel.VARIANTS[variant], splits=splits)
            check(out, ref, mag, (variant, splits))


@pytest.mark.parametrize("S", [150, 300])
def test_combine_alone_against_a_float64_merge(S):
    g = torch.Generator(device=DEV).manual_seed(9)
    B, H = 7, 12
    pout = torch.randn(B, H, S, 512, generator=g, device=DEV)
    plse = torch.randn(B, H, S, generator=g, device=DEV) * 4
    empty = torch.rand(B, H, S, generator=g, device=DEV) < 0.3
    plse[empty], pout[empty] = float("-inf"), float("nan")
    plse[2, 3], pout[2, 3] = float("-inf"), float("nan")
    ref, lse64 = reference.merge(pout.double(), plse.double())
    out = torch.full((B, H, 512), float("nan"), device=DEV)
    lse_out = torch.full((B, H), float("nan"), device=DEV)
    assert mla_op.mla_combine(pout, plse, out=out, lse_out=lse_out) is out
    assert not torch.isnan(out).any() and not out[2, 3].any() and lse_out[2, 3] == float("-inf")
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse_out.double(), lse64, rtol=1e-6, atol=1e-5)
    for pdl in (False, True):  # launched plainly and behind PDL (no primary before it here: it waits on none)
        out.fill_(float("nan"))
        kernel.combine(pout, plse, out=out, pdl=pdl)
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_op_strict_counts_the_kernel_disable_and_fallback_run_the_plain_spelling():
    q, cache, table, lens, _ = make_case([900, 4000, 3], 6, 64, seed=4)
    k3fuse.reset_stats()
    with k3fuse.strict():
        out = torch.ops.k3fuse.mla_decode(q, cache, table, lens, SCALE)
    assert k3fuse.stats() == {OP: {"triton.mla_decode": 1}}
    ref, mag = f64_attention(q, cache, table, lens)
    check(out, ref, mag, "op")
    runtime.reset_stats()
    with k3fuse.disable():
        stock = torch.ops.k3fuse.mla_decode(q, cache, table, lens, SCALE)
    assert runtime.stats() == {OP: {"fallback:disabled": 1}}
    assert torch.equal(stock, reference.plain_spelling(q, cache, table, lens, SCALE))
    runtime.reset_stats()
    qf = q.float()
    out = torch.ops.k3fuse.mla_decode(qf, cache.float(), table, lens, SCALE)  # no kernel takes fp32
    (reason,) = runtime.fallbacks()[OP]
    assert "q dtype torch.float32" in reason
    torch.testing.assert_close(out, reference.plain_spelling(qf, cache.float(), table, lens, SCALE))
    with k3fuse.strict(), pytest.raises(runtime.K3FuseFallbackError):
        torch.ops.k3fuse.mla_decode(qf, cache.float(), table, lens, SCALE)


def _graph_cases():
    return [(cache_dtype, variant) for cache_dtype in (torch.bfloat16, FP8) for variant in variants_for(cache_dtype)]


@pytest.mark.parametrize("cache_dtype,variant", _graph_cases())
def test_cuda_graph_1000_replays_over_changing_lengths(cache_dtype, variant):
    B, heads, page, capacity = 8, 6, 64, 8192
    width = capacity // page
    q, cache, table, lens, kv_scale = make_case([capacity] * B, heads, page, cache_dtype, seed=5, width=width)
    default = variant == kernel.CACHE_VARIANTS[cache_dtype.itemsize][0]
    mla_op.warmup([{"B": B, "heads": heads, "block_size": page, "max_context": capacity, "cache_dtype": cache_dtype}])
    static_q, static_lens = q.clone(), lens.clone()
    cfg = kernel.VARIANTS[variant]
    assert kernel.resolve(cfg, cache_dtype, q.device, page) is cfg  # pages of 64: every variant runs as itself
    splits = kernel.splits_for(B, heads, capacity, kernel.sm_count(torch.device(DEV)), cache_dtype, variant)
    static_out = torch.empty(B, heads, 512, dtype=q.dtype, device=DEV)
    kernel.run(static_q, cache, table, static_lens, SCALE, kv_scale, out=static_out, config=cfg, splits=splits)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        if default:  # the op, through the dispatcher
            static_out = torch.ops.k3fuse.mla_decode(static_q, cache, table, static_lens, SCALE, kv_scale)
        else:
            kernel.run(static_q, cache, table, static_lens, SCALE, kv_scale, out=static_out, config=cfg, splits=splits)
    g = torch.Generator(device=DEV).manual_seed(6)
    k3fuse.reset_stats()
    for step in range(1000 if default else 200):
        static_lens.copy_(torch.randint(0, capacity + 1, (B,), generator=g, device=DEV, dtype=torch.int32))
        if step % 7 == 0:
            static_lens[step % B] = 1 if step % 2 else 0
        static_q.copy_((torch.randn(B, heads, 576, generator=g, device=DEV) * 2).bfloat16())
        static_out.fill_(float("nan"))
        graph.replay()
        expect = reference.plain_spelling(static_q, cache, table, static_lens, SCALE, kv_scale)
        assert not torch.isnan(static_out).any(), step
        torch.testing.assert_close(static_out.float(), expect.float(), rtol=2 ** -6, atol=2e-2, msg=lambda m: f"{step}: {m}")
        if step % 100 == 0:
            ref, mag = f64_attention(static_q, cache, table, static_lens, kv_scale)
            check(static_out, ref, mag, ("replay", step))
    assert k3fuse.stats() == {}  # replays run no dispatch: the graph holds the kernels
