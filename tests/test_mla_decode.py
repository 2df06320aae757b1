"""mla_decode on CPU: the op, its reference, plain spelling and merge, the split count, the byte count,
and the Triton kernels through Triton's interpreter.

* the reference and the plain spelling (the op's stock sequence) against a float64 loop over tokens
  (bf16 and fp8 caches, pages of 16 and 64, heads 3 / 6 / 12, lengths 0, 1, odd and past a page),
  with NaN in every cache row and block-table entry a sequence does not own; the merge of split
  partials against the unsplit float64 attention, empty parts (NaN behind a -inf lse) skipped;
* the op in strict mode counts the reference on CPU, the kill switch runs the plain spelling; the fake
  impl names bad shapes; the Spec names each misfit of a call and `accepts` each limit;
* the variants a call takes (Gluon where it runs, one Triton variant per cache where it does not);
  split_count, for every variant on the cache it is made for: fills the GPU at batch 1, takes fewer
  splits as the batch grows, never more splits than tiles; each variant's program_rate is the fit of
  the committed H100 split sweep (the arithmetic is the test's); decode_bytes' arithmetic;
* the Triton kernels run on CPU through TRITON_INTERPRET=1 in a subprocess: batch 1 to 64, contexts
  1 to 4099 tokens (several splits and pages each), mixed lengths (0 included) in one batch, pages
  of 16 and 64, heads 3 / 6 / 12 / 20, bf16 and fp8 caches, every Triton variant (kernels/lib/triton/
  mla_decode.py VARIANTS), one split and many, fp16 dots with q far outside fp16's range, a scaled
  16-bit cache, lengths past the table's width (the whole table, as the plain spelling reads it), into
  NaN-poisoned outputs and partials over caches whose unowned rows hold NaN; the combine alone (one
  step, two) against a float64 merge; within the bf16 roundings of p and of the output of the
  float64 result; a Gluon variant resolves to the cache's Triton variant under the interpreter (it
  cannot run Gluon: the GPU tests run it);
* every variant's split kernel (the Gluon ones too) compiles for sm_90 as its config claims: cp.async
  buffers or 16-byte register prefetch, wgmma or mma.sync in bf16 or fp16, one table lookup a tile,
  the PDL signal, registers and shared memory for its programs an SM, no spills but a few words;
  the combine waits on its PDL primary.
"""
from __future__ import annotations

import math
import os
import re
import subprocess
import textwrap

import pytest
import torch

import k3fuse
from k3fuse import runtime
from k3fuse.kernels.lib.triton import HAVE_TRITON
from k3fuse.kernels.lib.reference import mla_decode as reference
from k3fuse.kernels.ops import mla_decode as op
from triton_interpreter import run_in_interpreter

OP = "mla_decode"
SCALE = 192 ** -0.5
FP8 = torch.float8_e4m3fn


def make_case(lengths, heads, page, cache_dtype=torch.bfloat16, seed=0, spare_blocks=3):
    """(q, kv_cache, block_table, seq_lens, kv_scale): each sequence's pages drawn at random from a
    shared pool; cache rows no sequence owns and table entries past a sequence's pages are NaN / an
    index outside the cache, so that reading either shows up."""
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    width = max(1, max(-(-n // page) for n in lengths))
    blocks = B * width + spare_blocks
    q = (torch.randn(B, heads, 576, generator=g) * 2).bfloat16()
    cache = torch.randn(blocks, page, 576, generator=g)
    cache[..., :512] *= 1.5
    table = torch.randperm(blocks, generator=g)[:B * width].view(B, width).int()
    owned = torch.zeros(blocks, page, dtype=torch.bool)
    for b, n in enumerate(lengths):
        used = -(-n // page)
        table[b, used:] = 10 ** 9
        for j in range(n):
            owned[table[b, j // page], j % page] = True
    scale = None
    if cache_dtype == FP8:
        scale = torch.tensor([0.37])
        cache = (cache / scale).to(FP8)
        cache.view(torch.uint8)[~owned] = 0x7F  # e4m3fn NaN
    else:
        cache = cache.to(cache_dtype)
        cache[~owned] = float("nan")
    return q, cache, table, torch.tensor(lengths, dtype=torch.int32), scale


def f64_attention(q, cache, table, lens, scale, kv_scale=None):
    """(out, lse, weighted |c_kv|): a float64 loop over each sequence's tokens, page by page."""
    B, H, _ = q.shape
    page = cache.shape[1]
    out = torch.zeros(B, H, 512, dtype=torch.float64)
    lse = torch.full((B, H), float("-inf"), dtype=torch.float64)
    mag = torch.zeros(B, H, 512, dtype=torch.float64)
    for b in range(B):
        n = min(int(lens[b]), table.shape[1] * page)  # past the table: all of it (the plain spelling's mask)
        if n == 0:
            continue
        entries = torch.stack([cache[int(table[b, j // page]), j % page].double() for j in range(n)])
        if kv_scale is not None:
            entries = entries * float(kv_scale)
        s = (q[b].double() @ entries.T) * scale
        m = s.max(-1, keepdim=True).values
        e = torch.exp(s - m)
        p = e / e.sum(-1, keepdim=True)
        out[b] = p @ entries[:, :512]
        lse[b] = (m + torch.log(e.sum(-1, keepdim=True))).squeeze(-1)
        mag[b] = p @ entries[:, :512].abs()
    return out, lse, mag


def within(out, ref, mag, ulp):
    """|out - ref| <= ulp * (|ref| + sum_j p_j |c_kv_j|) (+ a hair): one rounding of p before the
    value dot and one of the output, each at most `ulp` relative."""
    return float(((out.double() - ref).abs() - ulp * (ref.abs() + mag) * 1.05 - 1e-6).max())


CASES = [  # lengths, heads, page, cache dtype
    ([1], 6, 64, torch.bfloat16), ([130], 3, 16, torch.bfloat16), ([0, 1, 17, 64, 65], 12, 16, torch.bfloat16),
    ([200, 3], 6, 64, FP8), ([1, 129, 50], 3, 16, FP8),
]


# --- reference, plain spelling, merge --------------------------------------------------------------------
@pytest.mark.parametrize("lengths,heads,page,cache_dtype", CASES)
def test_reference_and_plain_spelling_match_a_float64_loop(lengths, heads, page, cache_dtype):
    q, cache, table, lens, kv_scale = make_case(lengths, heads, page, cache_dtype, seed=sum(lengths) + heads)
    ref64, _, mag = f64_attention(q, cache, table, lens, SCALE, kv_scale)
    f64 = reference.mla_decode(q, cache, table, lens, SCALE, kv_scale, compute_dtype=torch.float64,
                               out_dtype=torch.float64)
    torch.testing.assert_close(f64, ref64, rtol=1e-12, atol=1e-12)
    for out in (reference.mla_decode(q, cache, table, lens, SCALE, kv_scale),
                reference.plain_spelling(q, cache, table, lens, SCALE, kv_scale)):
        assert out.dtype == torch.bfloat16 and out.shape == (len(lengths), heads, 512)
        assert not torch.isnan(out).any()
        assert within(out, ref64, mag, 2 ** -8) <= 0  # the fp32 result's one rounding to bf16
    assert not out[[i for i, n in enumerate(lengths) if n == 0]].any()  # length 0: zeros


def _split_partials(q, cache, table, lens, kv_scale, cuts):
    """Each sequence's tokens cut at `cuts` into parts; per part its float64 (normalised out, lse)."""
    B, H, _ = q.shape
    parts = len(cuts) + 1
    pout = torch.full((B, H, parts, 512), float("nan"), dtype=torch.float64)
    plse = torch.full((B, H, parts), float("-inf"), dtype=torch.float64)
    page = cache.shape[1]
    for b in range(B):
        bounds = [0, *[min(c, int(lens[b])) for c in cuts], int(lens[b])]
        for s in range(parts):
            lo, hi = bounds[s], bounds[s + 1]
            if hi <= lo:
                continue
            entries = torch.stack([cache[int(table[b, j // page]), j % page].double() for j in range(lo, hi)])
            if kv_scale is not None:
                entries = entries * float(kv_scale)
            sc = (q[b].double() @ entries.T) * SCALE
            plse[b, :, s] = torch.logsumexp(sc, -1)
            pout[b, :, s] = torch.softmax(sc, -1) @ entries[:, :512]
    return pout, plse


def test_merge_of_split_partials_is_the_unsplit_attention():
    q, cache, table, lens, _ = make_case([1, 40, 100, 0], 6, 16, seed=3)
    pout, plse = _split_partials(q, cache, table, lens, None, cuts=[7, 7, 60])  # an empty middle part
    out, lse = reference.merge(pout, plse)
    ref64, lse64, _ = f64_attention(q, cache, table, lens, SCALE)
    torch.testing.assert_close(out, ref64, rtol=1e-12, atol=1e-12)  # NaN behind -inf parts never read
    torch.testing.assert_close(lse, lse64, rtol=1e-12, atol=1e-12)
    assert not out[3].any() and torch.isinf(lse[3]).all()  # no part has entries: zeros, -inf
    # the op module's entry (DCP's) on CPU: the same merge, in the dtype asked for, lse chained out
    lse_out = torch.empty(4, 6)
    merged = op.mla_combine(pout.float(), plse.float(), out_dtype=torch.bfloat16, lse_out=lse_out)
    assert merged.dtype == torch.bfloat16 and within(merged, ref64, ref64.abs(), 2 ** -8) <= 0
    torch.testing.assert_close(lse_out.double(), lse64, rtol=1e-5, atol=1e-5)


# --- the op ---------------------------------------------------------------------------------------------
def test_op_strict_on_cpu_counts_the_reference_and_disable_runs_the_plain_spelling():
    q, cache, table, lens, kv_scale = make_case([5, 70], 6, 16, FP8, seed=1)
    runtime.reset_stats()
    with runtime.strict():
        out = torch.ops.k3fuse.mla_decode(q, cache, table, lens, SCALE, kv_scale)
    assert runtime.stats() == {OP: {"reference": 1}}
    assert torch.equal(out, reference.mla_decode(q, cache, table, lens, SCALE, kv_scale))
    runtime.reset_stats()
    with k3fuse.disable():
        stock = torch.ops.k3fuse.mla_decode(q, cache, table, lens, SCALE, kv_scale)
    assert runtime.stats() == {OP: {"fallback:disabled": 1}}
    assert torch.equal(stock, reference.plain_spelling(q, cache, table, lens, SCALE, kv_scale))


def test_fake_impl_shapes_and_messages():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, cache = torch.empty(4, 6, 576, dtype=torch.bfloat16), torch.empty(10, 64, 576, dtype=torch.bfloat16)
        table, lens = torch.empty(4, 3, dtype=torch.int32), torch.empty(4, dtype=torch.int32)
        out = torch.ops.k3fuse.mla_decode(q, cache, table, lens, SCALE)
        assert out.shape == (4, 6, 512) and out.dtype == torch.bfloat16
        bad = ((torch.empty(4, 6, 512, dtype=torch.bfloat16), cache, table, lens, None, r"q must be \[B, heads, 576\]"),
               (q, torch.empty(10, 64, 512), table, lens, None, "kv_cache must be"),
               (q, cache, torch.empty(3, 3, dtype=torch.int32), lens, None, r"block_table must be \[B=4"),
               (q, cache, table.long(), lens, None, "must be int32"),
               (q, cache.to(FP8), table, lens, None, "an fp8 kv_cache needs kv_scale"))
        for q_, c_, t_, l_, s_, message in bad:
            with pytest.raises(Exception, match=message):
                torch.ops.k3fuse.mla_decode(q_, c_, t_, l_, SCALE, s_)


def test_spec_from_call_names_each_misfit_and_accepts_each_limit():
    """from_call on fake CUDA tensors (no GPU needed): K3's calls are accepted; each misfit comes
    back named, and accepts names the dtype and head limits."""
    pytest.importorskip("triton")
    from torch._subclasses.fake_tensor import FakeTensorMode

    Spec, accepts = op.MLADecodeSpec, op.accepts
    with FakeTensorMode():
        dev = "cuda"
        q = torch.empty(8, 6, 576, device=dev, dtype=torch.bfloat16)
        cache = torch.empty(100, 64, 576, device=dev, dtype=torch.bfloat16)
        table = torch.empty(8, 2048, device=dev, dtype=torch.int32)
        lens = torch.empty(8, device=dev, dtype=torch.int32)
        scale = torch.empty(1, device=dev)
        good = Spec.from_call(q, cache, table, lens, SCALE)
        assert (good.tokens, good.heads, good.block_size, good.cache_dtype, good.dtype, good.max_context,
                good.fits) == (8, 6, 64, torch.bfloat16, torch.bfloat16, 2048 * 64, None)
        assert accepts(good) is None
        assert accepts(Spec.from_call(q, cache.to(FP8), table, lens, SCALE, scale)) is None
        assert accepts(Spec.from_call(q, cache.to(FP8), table, lens, SCALE)) == (
            "an fp8 cache needs its kv_scale")
        assert accepts(Spec.from_call(q, cache, table, lens, SCALE, scale)) is None  # a 16-bit cache may have one
        assert accepts(Spec.from_call(q, cache.to(FP8), table, lens, SCALE, scale.double())) == (
            "kv_scale must be one float32 element, got torch.float64 (1,)")
        assert accepts(Spec.from_call(q, cache, table.long(), lens, SCALE)) == (
            "block_table torch.int64 / seq_lens torch.int32 (int32 only)")
        short = torch.empty(4, 2048, device=dev, dtype=torch.int32)
        assert accepts(Spec.from_call(q, cache, short, lens, SCALE)).startswith("block_table (4, 2048)")
        q512 = torch.empty(8, 6, 512, device=dev, dtype=torch.bfloat16)
        assert accepts(Spec.from_call(q512, cache, table, lens, SCALE)).startswith("q (8, 6, 512)")
        column_major = torch.empty_strided((8, 2048), (1, 8), device=dev, dtype=torch.int32)
        assert accepts(Spec.from_call(q, cache, column_major, lens, SCALE)) == (
            "q, kv_cache, block_table and seq_lens need a unit inner stride")
        padded = torch.empty_strided((100, 64, 576), (64 * 580, 580, 1), device=dev, dtype=torch.bfloat16)  # 1160 B
        assert accepts(Spec.from_call(q, padded, table, lens, SCALE)).startswith("kv_cache rows must be 16-byte aligned")
        assert accepts(Spec.from_call(q.float(), cache.float(), table, lens, SCALE)) == (
            "q dtype torch.float32 (bf16/fp16 only)")
        assert accepts(Spec.from_call(q.half(), cache, table, lens, SCALE)) == (
            "cache dtype torch.bfloat16 with q torch.float16 (the query's dtype or fp8 e4m3 only)")
    assert accepts(Spec.from_call(torch.empty(8, 6, 576), torch.empty(4, 64, 576), torch.empty(8, 2, dtype=torch.int32),
                                  torch.empty(8, dtype=torch.int32), SCALE)) == (
        "q, kv_cache, block_table, seq_lens are not CUDA tensors on one device")
    assert accepts(Spec(tokens=1, heads=129, block_size=64, cache_dtype=torch.bfloat16, max_context=64)) == (
        "heads=129 (needs 1 <= heads <= 128)")


def test_kernel_covers_k3_heads_pages_and_caches():
    pytest.importorskip("triton")
    from k3fuse.kernels import dispatch

    for heads in (96, 48, 12, 6, 3):
        for page in (1, 16, 64):
            for cache_dtype in (torch.bfloat16, FP8):
                spec = op.MLADecodeSpec(heads=heads, block_size=page, cache_dtype=cache_dtype, max_context=1 << 17)
                assert dispatch.coverage(spec, range(1, 65)) == {}, (heads, page, cache_dtype)


# --- split count, bytes -----------------------------------------------------------------------------------
def test_split_count_fills_the_gpu_and_spends_no_split_it_does_not_need():
    pytest.importorskip("triton")
    from k3fuse.kernels.lib.triton import mla_decode as K

    sms = 132
    for cache_dtype in (torch.bfloat16, FP8):
        for name in K.CACHE_VARIANTS[cache_dtype.itemsize]:
            cfg = K.VARIANTS[name]
            kw = dict(config=cfg, entry_bytes=576 * cache_dtype.itemsize)
            slots = sms * cfg.programs_per_sm
            for heads in (3, 6, 12):
                for B in (1, 2, 3, 8, 17, 64):
                    for ctx in (1, 31, 32, 33, 500, 1024, 4096, 8192, 32768, 131072):
                        s = K.split_count(B, heads, ctx, sms, **kw)
                        where = (name, cache_dtype, heads, B, ctx, s)
                        assert 1 <= s <= min(K.MAX_SPLITS, -(-ctx // cfg.block_n)), where
                        if ctx >= 32768:  # enough programs stream to fill the GPU (its modelled bandwidth), at B1 too
                            programs = B * K.head_blocks(heads) * s
                            assert (min(programs, slots) >= 0.9 * slots
                                    or min(programs, slots) * cfg.program_rate >= 0.95 * K.MODEL_BANDWIDTH), where
                        if ctx >= 32768 and s > 1:  # the partials (written, read) stay a small part of the cache
                            share = (B * heads * s * 512 * 4 * 2) / (B * ctx * 576 * cache_dtype.itemsize)
                            assert share <= 0.4, (where, share)
                        if B == 64 and ctx <= 32768:  # 64 sequences fill the GPU with a few splits each
                            assert s <= 4, where
            assert K.split_count(1, 6, cfg.block_n, sms, **kw) == 1  # one tile: nothing to split
    assert K.splits_for(8, 6, 32768, sms, torch.bfloat16) == K.split_count(
        8, 6, 32768, sms, K.config_for(torch.bfloat16), entry_bytes=1152)
    with pytest.raises(ValueError, match="must be positive"):
        K.split_count(0, 6, 1024, sms, K.config_for(torch.bfloat16))
    with pytest.raises(ValueError, match="unknown variant 'nope'"):
        K.config_for(torch.bfloat16, "nope")


def test_each_cache_takes_its_gluon_variant_and_one_triton_variant_where_gluon_cannot_run():
    pytest.importorskip("triton")
    from k3fuse.kernels.lib.triton import mla_decode as K

    for cache_dtype, default, fallback in ((torch.bfloat16, "gluon64", "page32"), (FP8, "gluon64_fp8", "fp16pf")):
        assert K.config_for(cache_dtype) is K.VARIANTS[default] and K.VARIANTS[default].gluon
        assert K.fallback_for(cache_dtype) is K.VARIANTS[fallback] and not K.VARIANTS[fallback].gluon
        assert K.CACHE_VARIANTS[cache_dtype.itemsize] == (default, fallback)
        for where in (torch.device("cpu"), torch.device("meta")):  # no sm_90 GPU here, nor the interpreter's Gluon
            assert K.resolve(K.config_for(cache_dtype), cache_dtype, where, 64) is K.fallback_for(cache_dtype)
        fallback = K.fallback_for(cache_dtype)
        assert K.resolve(fallback, cache_dtype, torch.device("cpu"), 16) is fallback
    # every variant is a cache's default or its fallback, or a trial not yet measured: what lost was deleted
    made = [v for names in (*K.CACHE_VARIANTS.values(), *K.TRIAL_VARIANTS.values()) for v in names]
    assert sorted(K.VARIANTS) == sorted(made)


SWEEP_JSON = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "results",
                          "h100_mla_decode_h6_variants_splits.json")


def _sweep_points(rows, variant):
    """The sweep's points where `variant` ran at several split counts: (batch, heads, context, {S: seconds})."""
    points = []
    for r in rows:
        arms = {r["splits"][a]: r[a] * 1e-6 for a in r["splits"]
                if a.split("@")[0] == variant and isinstance(r.get(a), float)}
        if len(arms) > 1:
            points.append((r["batch"], r["heads"], r["context"], arms))
    return points


def _interpolated(arms: dict, S: int) -> float:
    """The time at S split counts: measured, or linear in log S between the arms around it (the nearest
    arm's outside them)."""
    ks = sorted(arms)
    if S <= ks[0] or S >= ks[-1]:
        return arms[ks[0] if S <= ks[0] else ks[-1]]
    lo = max(k for k in ks if k <= S)
    hi = min(k for k in ks if k >= S)
    if lo == hi:
        return arms[lo]
    w = math.log(S / lo) / math.log(hi / lo)
    return arms[lo] * (1 - w) + arms[hi] * w


def test_split_model_rates_are_the_sweeps_fit():
    """Each variant's program_rate is the fit of the committed H100 sweep (B1 and B8, 1K-128K, heads 6, each
    variant at its S and at S/2 and 2S): over rates of 8-40 GB/s in steps of 0.5, those whose split_count
    choices lose the least time to the best arm, summed over the points (a choice between two swept counts
    costs the time interpolated between them); of those, the rate whose split_cost differences fit the
    arms' best (least squares relative to each point's mean, the point's fixed cost free)."""
    pytest.importorskip("triton")
    import dataclasses
    import json

    from k3fuse.kernels.lib.triton import mla_decode as K

    with open(SWEEP_JSON) as f:
        doc = json.load(f)
    sms, rows = doc["sms"], doc["rows"]
    fitted = {}
    for name in (v for pair in K.CACHE_VARIANTS.values() for v in pair):  # the measured ones
        cfg = K.VARIANTS[name]
        entry = 576 * next(size for size, names in K.CACHE_VARIANTS.items() if name in names)
        points = _sweep_points(rows, name)
        assert len(points) == 10, name  # B1 and B8 at five contexts
        scores = []
        for rate in [8e9 + 0.5e9 * i for i in range(65)]:
            trial = dataclasses.replace(cfg, program_rate=rate)
            loss = squares = 0.0
            for B, H, ctx, arms in points:
                chosen = K.split_count(B, H, ctx, sms, trial, entry_bytes=entry)
                loss += _interpolated(arms, chosen) / min(arms.values()) - 1
                resid = [t - K.split_cost(B, H, ctx, sms, trial, entry, S)[1] for S, t in arms.items()]
                mean_t, mean_r = sum(arms.values()) / len(arms), sum(resid) / len(resid)
                squares += sum(((r - mean_r) / mean_t) ** 2 for r in resid)
            scores.append((round(loss, 6), squares, rate))
        loss, _, fitted[name] = min(scores)
        assert cfg.program_rate == fitted[name], (name, cfg.program_rate, fitted[name], loss)
    # the fit: the Triton bf16 kernel (two programs an SM) below the rest; each one-program-an-SM variant near
    # the bandwidth share of a full GPU (3.0 TB/s / 132), since the sweep's best keeps every SM busy
    assert fitted == {"page32": 14.5e9, "fp16pf": 23e9, "gluon64": 26e9, "gluon64_fp8": 23e9}


def test_decode_bytes_counts_the_cache_entries_q_and_out():
    b = op.decode_bytes(total_tokens=64 * 32768, batch=64, heads=6, cache_dtype=torch.bfloat16)
    assert b.cache == 576 * 2 * 64 * 32768 and b.q == 64 * 6 * 576 * 2 and b.out == 64 * 6 * 512 * 2
    assert b.total == b.cache + b.q + b.out
    assert op.decode_bytes(1000, 1, 3, FP8).cache == 576 * 1000
    # K3's 24 MLA layers at 64 x 32K in bf16: the issue's 58 GB a step a rank
    assert abs(24 * b.cache / 1e9 - 58) < 1


# --- the Triton kernels through Triton's interpreter ------------------------------------------------------
INTERPRETER_SCRIPT = textwrap.dedent("""
    import json, os
    assert os.environ["TRITON_INTERPRET"] == "1"
    import torch
    # Triton 3.6's interpreter turns a loop bound (a one-element array) into an int with int(array),
    # which NumPy >= 2.4 refuses for arrays of one dimension: read its one element instead
    import triton.runtime.interpreter as interp
    _patch = interp._patch_lang_tensor
    def _patch_lang_tensor(tensor, scope):
        _patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
    interp._patch_lang_tensor = _patch_lang_tensor

    import test_mla_decode as T
    from k3fuse.kernels.lib.triton import mla_decode as K
    assert K.HAVE_TRITON and K.INTERPRET
    K.sm_count = lambda device: 132  # an H100's, for split_count
    FP8 = torch.float8_e4m3fn

    def case(name, lengths, heads, page, cache_dtype, config=None, splits=None, seed=0, q_scale=None,
             kv_scale_16=None, past_table=0):
        q, cache, table, lens, kv_scale = T.make_case(lengths, heads, page, cache_dtype, seed=seed)
        if q_scale is not None:
            q = (q.float() * q_scale).bfloat16()
        if kv_scale_16 is not None:  # a 16-bit cache with a scale, as the model's spelling multiplies
            kv_scale = torch.tensor([kv_scale_16])
        lens = lens + past_table * (lens > 0).int()  # lengths past the table's width: the whole table
        B = len(lengths)
        cfg = K.resolve(config or K.config_for(cache_dtype), cache_dtype, q.device, page)
        S = splits or K.split_count(B, heads, table.shape[1] * page, 132, cfg, entry_bytes=576 * cache.element_size())
        out = torch.full((B, heads, 512), float("nan"), dtype=torch.bfloat16)
        partials = (torch.full((B, heads, S, 512), float("nan")), torch.full((B, heads, S), float("nan")))
        K.run(q, cache, table, lens, T.SCALE, kv_scale, out=out, config=config, splits=S, partials=partials)
        ref, lse, mag = T.f64_attention(q, cache, table, lens, T.SCALE, kv_scale)
        return {"case": name, "B": B, "heads": heads, "page": page, "cache": str(cache_dtype), "splits": S,
                "page_tiles": K.page_tiles(cfg, page),
                "max_len": max(lengths), "past_table": bool((lens > table.shape[1] * page).any()),
                "written": not bool(torch.isnan(out).any()),
                "excess": T.within(out, ref, mag, 2 ** -7),  # the interpreter's casts truncate: 2^-7
                "zeros_for_empty": bool(all(not out[b].any() for b, n in enumerate(lengths) if n == 0))}

    prefetch = K.LaunchConfig(block_n=32, num_warps=4, num_stages=1, prefetch=True)
    pipelined = K.LaunchConfig(block_n=64, num_warps=8, num_stages=3)
    gen = torch.Generator().manual_seed(5)
    mixed64 = [int(x) for x in torch.randint(0, 300, (64,), generator=gen)]
    results = [
        case("long_b1", [4099], 6, 64, torch.bfloat16),
        case("long_b1_fp8", [3001], 3, 16, FP8),
        case("mixed_b3", [1, 2500, 0], 3, 16, torch.bfloat16),
        case("mixed_b8_fp8", [1, 33, 64, 65, 700, 1023, 5, 129], 12, 64, FP8),
        case("b64", mixed64, 6, 16, torch.bfloat16),
        case("b64_one_split", mixed64, 6, 16, torch.bfloat16, splits=1),
        case("b64_fp8", mixed64, 12, 64, FP8),
        case("two_head_blocks", [77, 300], 20, 16, torch.bfloat16),
        case("one_token", [1, 1, 1], 6, 64, torch.bfloat16, splits=7),
        case("prefetch_bf16", [1000, 31], 12, 16, torch.bfloat16, config=prefetch),
        case("pipelined_fp8", [1000, 31], 6, 64, FP8, config=pipelined),
        case("many_splits", [333], 6, 16, torch.bfloat16, splits=50),
        # fp16 dots take q through a power of two: |q| far past fp16's range, and far below its normal range
        case("fp16_dots_large_q", [300, 7], 6, 64, FP8, config=K.VARIANTS["fp16pf"], q_scale=3e5),
        case("fp16_dots_tiny_q", [300, 7], 6, 16, FP8, config=K.VARIANTS["fp16pf"], q_scale=1e-7),
        case("bf16_scaled", [300, 7, 0], 6, 64, torch.bfloat16, kv_scale_16=0.37, splits=3),
        # lengths past the table: each sequence's pages fill its row of the table (whole pages, all owned)
        case("past_table_bf16", [208, 208, 0], 6, 16, torch.bfloat16, past_table=100),
        case("past_table_fp8", [128, 128], 3, 64, FP8, past_table=1000, splits=3),
    ]
    # every Triton variant: both caches, tiles in one page (64) and across pages (16), one split and three
    # (the interpreter runs no Gluon: a Gluon variant resolves to the cache's default here, and is the GPU tests')
    for name, cfg in K.VARIANTS.items():
        if cfg.gluon:
            assert K.resolve(cfg, torch.bfloat16, torch.device("cpu"), 64) == K.fallback_for(torch.bfloat16)
            continue
        for cache_dtype, page, lengths, heads, S in ((torch.bfloat16, 64, [200, 1, 0, 130], 6, 3),
                                                      (FP8, 64, [150, 64, 3], 12, 1),
                                                      (torch.bfloat16, 16, [100, 33], 3, 1), (FP8, 16, [77, 5], 6, 3)):
            results.append(case(f"variant_{name}_{cache_dtype}_{page}_S{S}", lengths, heads, page, cache_dtype,
                                config=cfg, splits=S, seed=len(lengths) + S))

    # the combine alone: random partials, some parts empty (NaN behind -inf), one row with none; S of 37
    # (one step) and 300 (two steps of 256, the second part-empty)
    for label, S in (("combine", 37), ("combine_s300", 300)):
        g = torch.Generator().manual_seed(9)
        B, H = 5, 6
        pout = torch.randn(B, H, S, 512, generator=g)
        plse = torch.randn(B, H, S, generator=g) * 4
        empty = torch.rand(B, H, S, generator=g) < 0.3
        plse[empty] = float("-inf"); pout[empty] = float("nan")
        plse[2, 3] = float("-inf"); pout[2, 3] = float("nan")
        live = plse > float("-inf")
        lse64 = torch.logsumexp(plse.double(), -1)
        w = torch.where(live, torch.exp(plse.double() - lse64.nan_to_num(0.0, neginf=0.0)[..., None]), 0.0)
        ref = (torch.where(live[..., None], pout.double(), 0.0) * w[..., None]).sum(-2)
        out = torch.full((B, H, 512), float("nan"))
        lse_out = torch.full((B, H), float("nan"))
        K.combine(pout, plse, out=out, lse_out=lse_out)
        out16 = K.combine(pout, plse, out_dtype=torch.bfloat16)
        results.append({"case": label, "blocks": K.combine_blocks(S, 512),
                        "written": not bool(torch.isnan(out).any()),
                        "err": float((out.double() - ref).abs().max()), "row_empty_zero": not bool(out[2, 3].any()),
                        "lse_err": float((lse_out.double() - lse64).nan_to_num(0.0).abs().max()),
                        "lse_empty": bool(lse_out[2, 3] == float("-inf")),
                        "bf16_excess": T.within(out16, ref, ref.abs(), 2 ** -7)})
    print("RESULT " + json.dumps(results))
""")


@pytest.fixture(scope="module")
def interpreter_results() -> list[dict]:
    here = os.path.dirname(__file__)
    script = f"import sys; sys.path.insert(0, {here!r})\n" + INTERPRETER_SCRIPT
    return {r["case"]: r for r in run_in_interpreter(script, timeout=900)}


def test_interpreter_split_kernel_matches_float64(interpreter_results):
    from k3fuse.kernels.lib.triton import mla_decode as K

    cases = [r for name, r in interpreter_results.items() if not name.startswith("combine")]
    assert len(cases) == 17 + 4 * sum(not cfg.gluon for cfg in K.VARIANTS.values())
    for r in cases:
        assert r["written"], r  # every element of the NaN-poisoned output written
        assert r["excess"] <= 0, r  # within the roundings of p and of the output (NaN partials, NaN rows unread)
        assert r["zeros_for_empty"], r
    # what the cases cover: several splits over long contexts, one split, batch 64, both caches and loop forms
    assert interpreter_results["long_b1"]["splits"] > 100 and interpreter_results["b64_one_split"]["splits"] == 1
    assert {r["page"] for r in cases} == {16, 64} and {r["heads"] for r in cases} >= {3, 6, 12, 20}
    assert {r["cache"] for r in cases} == {"torch.bfloat16", "torch.float8_e4m3fn"}
    assert {r["page_tiles"] for r in cases} == {True, False}  # one lookup a tile, and a lookup a token
    assert interpreter_results["past_table_fp8"]["past_table"] and interpreter_results["past_table_bf16"]["past_table"]


@pytest.mark.parametrize("case,blocks", [("combine", [64, 128]), ("combine_s300", [256, 32])])
def test_interpreter_combine_matches_a_float64_merge(interpreter_results, case, blocks):
    r = interpreter_results[case]
    assert r["blocks"] == blocks, r  # (BLOCK_S, BLOCK_D): every split in a step (two at S=300)
    assert r["written"] and r["row_empty_zero"] and r["lse_empty"], r
    assert r["err"] < 1e-5 and r["lse_err"] < 1e-5 and r["bf16_excess"] <= 0, r


# --- what the compiler makes of it on an H100 (no GPU needed) ----------------------------------------------
def _ptxas_report(ptx: str) -> dict:
    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("triton ships no ptxas here")
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"mla_decode_{os.getpid()}.ptx")
    with open(path, "w") as f:
        f.write(ptx)
    try:
        err = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.devnull], capture_output=True,
                             text=True, timeout=300).stderr
    finally:
        os.remove(path)
    return {"registers": int(re.search(r"Used (\d+) registers", err).group(1)),
            "spill": int(re.search(r"(\d+) bytes spill stores", err).group(1)),
            "wgmma_serialized": "wgmma.mma_async instructions are serialized" in err}


def _compile_split(variant: str, cache: str, single: bool, scaled: bool | None = None):
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    from k3fuse.kernels.lib.triton import mla_decode as K

    cfg = K.VARIANTS[variant]
    fp8 = cache == "fp8e4nv"
    names = K._mla_split_kernel.arg_names
    constexprs = dict(PAGE=64, BLOCK_H=16, BLOCK_N=cfg.block_n, LATENT=512, ROPE=64, IS_FP8=fp8,
                      HAS_SCALE=fp8 if scaled is None else scaled, SINGLE=single, PREFETCH=cfg.prefetch, PAGE_TILES=K.page_tiles(cfg, 64), FP16_DOTS=cfg.fp16_dots and fp8,
                      PDL=cfg.pdl and not single)  # as run() launches it
    part = "*bf16" if single else "*fp32"
    types = {"q_ptr": "*bf16", "kv_ptr": f"*{cache}", "bt_ptr": "*i32", "lens_ptr": "*i32",
             "kv_scale_ptr": "*fp32" if constexprs["HAS_SCALE"] else "*i32", "out_ptr": "*bf16", "pout_ptr": part,
             "plse_ptr": part, "qk_scale": "fp32"}
    sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    # what a launch specialises: 16-byte aligned pointers, the 16-divisible strides
    divisible = [n for n in names if n.endswith("_ptr")] + ["q_sb", "q_sh", "kv_sblk", "kv_stok", "o_sb", "o_sh",
                                                            "po_sb", "po_sh", "po_ss"]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    src = triton.compiler.ASTSource(fn=K._mla_split_kernel, signature=sig, attrs=attrs, constexprs=constexprs)
    return cfg, triton.compile(src, target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})


def _compile_gluon(variant: str, cache: str, single: bool, scaled: bool | None = None):
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    from k3fuse.kernels.lib.triton import mla_decode as K
    from k3fuse.kernels.lib.triton import mla_decode_gluon as G

    if G.GLUON_IMPORT_ERROR is not None:
        pytest.skip(G.GLUON_IMPORT_ERROR)
    from triton.experimental.gluon._runtime import GluonASTSource

    cfg = K.VARIANTS[variant]
    fp8 = cache == "fp8e4nv"
    fn = G._mla_split_gluon_fp8_ahead if cfg.widen_ahead and fp8 else G._mla_split_gluon  # as launch() picks
    names = fn.arg_names
    constexprs = dict(PAGE=64, BLOCK_H=16, BLOCK_N=cfg.block_n, LATENT=512, ROPE=64, IS_FP8=fp8,
                      HAS_SCALE=fp8 if scaled is None else scaled, SINGLE=single, NBUF=min(cfg.num_stages, G.MAX_RING[1 if fp8 else 2]), PDL=cfg.pdl and not single,
                      BESIDE_VALUES=cfg.widen_ahead == 2, num_warps=G.NUM_WARPS)
    constexprs = {k: v for k, v in constexprs.items() if k in names}
    part = "*bf16" if single else "*fp32"
    types = {"q_ptr": "*bf16", "kv_ptr": f"*{cache}", "bt_ptr": "*i32", "lens_ptr": "*i32",
             "kv_scale_ptr": "*fp32" if fp8 or scaled else "*i32", "out_ptr": "*bf16", "pout_ptr": part,
             "plse_ptr": part, "qk_scale": "fp32"}
    sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    divisible = [n for n in names if n.endswith("_ptr")] + ["q_sb", "q_sh", "kv_sblk", "kv_stok", "o_sb", "o_sh",
                                                            "po_sb", "po_sh", "po_ss"]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    src = GluonASTSource(fn=fn, signature=sig, attrs=attrs, constexprs=constexprs)
    return cfg, triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": G.NUM_WARPS})


def _variants_by_cache():
    from k3fuse.kernels.lib.triton import mla_decode as K

    pairs = [(v, "bf16" if size == 2 else "fp8e4nv") for size, names in K.CACHE_VARIANTS.items() for v in names]
    return pairs + [(v, "bf16" if size == 2 else "fp8e4nv") for size, names in K.TRIAL_VARIANTS.items() for v in names]


@pytest.mark.parametrize("single", [False, True], ids=["split", "single"])
@pytest.mark.parametrize("variant,cache", _variants_by_cache() if HAVE_TRITON else [])
def test_split_kernel_compiles_for_sm90_as_designed(variant, cache, single):
    """Each variant's claims (kernels/lib/triton/mla_decode.py VARIANTS) hold in its sm_90 compile: how
    tiles travel (cp.async buffers, or 16-byte loads into registers), which dots score them (wgmma,
    mma.sync in bf16 or fp16), one table lookup a tile, the PDL signal, and that programs_per_sm of
    its programs fit an SM's registers and shared memory without spilling; ptxas keeps the Gluon kernels'
    wgmma asynchronous (no C7514 / C7515 serialisation)."""
    cfg = _variant(variant)
    cfg, kernel = (_compile_gluon if cfg.gluon else _compile_split)(variant, cache, single)
    ptx = kernel.asm["ptx"]
    tile = cfg.block_n * 576 * (1 if cache == "fp8e4nv" else 2)
    cvts_a_tile = 64 * 576 // 2 // (32 * cfg.num_warps)  # a thread's share of a tile, one cvt a pair: 144
    if cfg.gluon and cfg.widen_ahead:  # tiles into registers, widened once (the prologue's tile and the loop's)
        assert "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16" in ptx and "mma.sync" not in ptx
        assert "ld.global.v4.b32" in ptx and "cp.async" not in ptx and "fence.proxy.async.shared::cta" in ptx
        assert ptx.count("cvt.rn.f16x2.e4m3x2") == 2 * cvts_a_tile
        assert kernel.metadata.shared >= 2 * 64 * 576 * 2  # two fp16 staging tiles
    elif cfg.gluon:  # both dots wgmma from shared memory, the ring by cp.async, fp8 widened once (one cvt a pair)
        assert "wgmma.mma_async.sync.aligned.m64n16k16.f32" in ptx and "mma.sync" not in ptx
        assert "cp.async.cg.shared.global" in ptx and "fence.proxy.async.shared::cta" in ptx
        if cache == "fp8e4nv":
            assert "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16" in ptx
            assert ptx.count("cvt.rn.f16x2.e4m3x2") == cvts_a_tile
    elif cfg.prefetch:
        assert "ld.global.v4.b32" in ptx and "cp.async" not in ptx  # tiles into registers, 16 bytes a load
    else:
        assert "cp.async.cg.shared.global" in ptx
        assert kernel.metadata.shared >= min(cfg.num_stages - 1, 2) * tile  # buffers in flight beside the scored one
    if cfg.gluon:
        pass
    elif cache == "fp8e4nv":
        dots = "f16.f16" if cfg.fp16_dots else "bf16.bf16"
        assert f"mma.sync.aligned.m16n8k16.row.col.f32.{dots}.f32" in ptx and "cvt.rn.f16x2.e4m3x2" in ptx
    else:
        assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx
    # 4-byte loads: the length, the scale, and the block table: a few with a lookup a tile (those before the
    # loop, one an iteration; a lookup a token made 20-28)
    words = ptx.count("ld.global.b32")
    assert words <= 8, words
    assert ("griddepcontrol.launch_dependents" in ptx) == (cfg.pdl and not single)
    assert kernel.metadata.shared * cfg.programs_per_sm <= 227 * 1024
    report = _ptxas_report(ptx)
    assert report["registers"] * cfg.num_warps * 32 * cfg.programs_per_sm <= 65536, report
    # 255 registers at 8 warps (prefetch) or 4 (Gluon fp8): a few words on the stack (L1)
    assert report["spill"] <= (64 if cfg.prefetch or (cfg.gluon and cache == "fp8e4nv") else 0), report
    assert not (cfg.gluon and report["wgmma_serialized"]), report


@pytest.mark.parametrize("variant", ["page32", "gluon64"])
def test_a_scaled_bf16_cache_compiles_with_its_scale_read(variant):
    """What the rule emits on a bf16 cache (the model scales every cache): the scale read for the scores and
    the output, the same dots."""
    cfg = _variant(variant)
    _, plain = (_compile_gluon if cfg.gluon else _compile_split)(variant, "bf16", False, scaled=False)
    _, scaled = (_compile_gluon if cfg.gluon else _compile_split)(variant, "bf16", False, scaled=True)
    loads = [k.asm["ptx"].count("ld.global.b32") + k.asm["ptx"].count("ld.global.f32") for k in (plain, scaled)]
    assert loads[1] > loads[0], loads  # the scale
    dot = "wgmma.mma_async" if cfg.gluon else "mma.sync"
    assert plain.asm["ptx"].count(dot) == scaled.asm["ptx"].count(dot)


def _variant(name):
    from k3fuse.kernels.lib.triton import mla_decode as K

    return K.VARIANTS[name]


def test_combine_compiles_for_sm90_with_its_pdl_wait():
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    from k3fuse.kernels.lib.triton import mla_decode as K

    names = K._mla_combine_kernel.arg_names
    for pdl in (False, True):
        constexprs = dict(BLOCK_D=128, BLOCK_S=64, WRITE_LSE=False, PDL=pdl)
        types = {"pout_ptr": "*fp32", "plse_ptr": "*fp32", "out_ptr": "*bf16", "lse_out_ptr": "*fp32"}
        sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
        src = triton.compiler.ASTSource(fn=K._mla_combine_kernel, signature=sig, constexprs=constexprs)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
        assert ("griddepcontrol.wait" in ptx) == pdl
