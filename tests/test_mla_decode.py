"""mla_decode on CPU: the op, its reference, plain spelling and merge, the split count, the byte count,
and the Triton kernels through Triton's interpreter.

* the reference and the plain spelling (the op's stock sequence) against a float64 loop over tokens
  (bf16 and fp8 caches, pages of 16 and 64, heads 3 / 6 / 12, lengths 0, 1, odd and past a page),
  with NaN in every cache row and block-table entry a sequence does not own; the merge of split
  partials against the unsplit float64 attention, empty parts (NaN behind a -inf lse) skipped;
* the op in strict mode counts the reference on CPU, the kill switch runs the plain spelling; the fake
  impl names bad shapes; the Spec names each misfit of a call and `accepts` each limit;
* split_count: fills the GPU at batch 1, takes fewer splits as the batch grows, one split when the
  batch fills the GPU over a short context, never more splits than tiles; decode_bytes' arithmetic;
* the Triton kernels run on CPU through TRITON_INTERPRET=1 in a subprocess: batch 1 to 64, contexts
  1 to 4099 tokens (several splits and pages each), mixed lengths (0 included) in one batch, pages
  of 16 and 64, heads 3 / 6 / 12 / 20, bf16 and fp8 caches, both loop forms (cp.async-pipelined and
  register-prefetched), one split and many, into NaN-poisoned outputs and partials over caches whose
  unowned rows hold NaN; the combine alone against a float64 merge; within the bf16 roundings of p
  and of the output of the float64 result;
* the split kernel compiles for sm_90 as designed: bf16 tiles by cp.async, two buffers in flight,
  no spills; fp8 tiles by 16-byte loads widened in registers; tensor-core dots.
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
        n = int(lens[b])
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
               (q, cache.to(FP8), table, lens, None, "an fp8 kv_cache needs kv_scale"),
               (q, cache, table, lens, torch.ones(1), "takes none"))
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
            "an fp8 cache needs its kv_scale, and only an fp8 cache takes one")
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
        cfg = K.config_for(cache_dtype)
        kw = dict(block_n=cfg.block_n, entry_bytes=576 * cache_dtype.itemsize, programs_per_sm=cfg.programs_per_sm)
        for heads in (3, 6, 12):
            for B in (1, 2, 3, 8, 17, 64):
                for ctx in (1, 31, 32, 33, 500, 1024, 4096, 8192, 32768, 131072):
                    s = K.split_count(B, heads, ctx, sms, **kw)
                    where = (cache_dtype, heads, B, ctx, s)
                    assert 1 <= s <= min(K.MAX_SPLITS, -(-ctx // cfg.block_n)), where
                    if ctx >= 32768:  # (almost) every SM streams, at batch 1 too: whole tiles per split
                        assert B * s >= 0.95 * sms, where
                    if ctx >= 32768 and s > 1:  # the partials (written, read) stay a small part of the cache bytes
                        share = (B * heads * s * 512 * 4 * 2) / (B * ctx * 576 * cache_dtype.itemsize)
                        assert share <= 0.4, (where, share)
                    if B == 64 and ctx <= 32768:  # 64 sequences fill the GPU with a few splits each (at 128K,
                        assert s <= 4, where      # more, shorter splits can square the last wave)
        assert K.split_count(1, 6, cfg.block_n, sms, **kw) == 1  # one tile: nothing to split
    with pytest.raises(ValueError, match="must be positive"):
        K.split_count(0, 6, 1024, sms)


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

    def case(name, lengths, heads, page, cache_dtype, config=None, splits=None, seed=0):
        q, cache, table, lens, kv_scale = T.make_case(lengths, heads, page, cache_dtype, seed=seed)
        B = len(lengths)
        cfg = config or K.config_for(cache_dtype)
        S = splits or K.split_count(B, heads, table.shape[1] * page, 132, block_n=cfg.block_n,
                                    entry_bytes=576 * cache.element_size(), programs_per_sm=cfg.programs_per_sm)
        out = torch.full((B, heads, 512), float("nan"), dtype=torch.bfloat16)
        partials = (torch.full((B, heads, S, 512), float("nan")), torch.full((B, heads, S), float("nan")))
        K.run(q, cache, table, lens, T.SCALE, kv_scale, out=out, config=config, splits=S, partials=partials)
        ref, lse, mag = T.f64_attention(q, cache, table, lens, T.SCALE, kv_scale)
        return {"case": name, "B": B, "heads": heads, "page": page, "cache": str(cache_dtype), "splits": S,
                "max_len": max(lengths), "written": not bool(torch.isnan(out).any()),
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
    ]

    # the combine alone: random partials, some parts empty (NaN behind -inf), one row with none
    g = torch.Generator().manual_seed(9)
    B, H, S = 5, 6, 37
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
    results.append({"case": "combine", "written": not bool(torch.isnan(out).any()),
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
    cases = [r for name, r in interpreter_results.items() if name != "combine"]
    assert len(cases) == 12
    for r in cases:
        assert r["written"], r  # every element of the NaN-poisoned output written
        assert r["excess"] <= 0, r  # within the roundings of p and of the output (NaN partials, NaN rows unread)
        assert r["zeros_for_empty"], r
    # what the cases cover: several splits over long contexts, one split, batch 64, both caches and loop forms
    assert interpreter_results["long_b1"]["splits"] > 100 and interpreter_results["b64_one_split"]["splits"] == 1
    assert {r["page"] for r in cases} == {16, 64} and {r["heads"] for r in cases} >= {3, 6, 12, 20}
    assert {r["cache"] for r in cases} == {"torch.bfloat16", "torch.float8_e4m3fn"}


def test_interpreter_combine_matches_a_float64_merge(interpreter_results):
    r = interpreter_results["combine"]
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
            "spill": int(re.search(r"(\d+) bytes spill stores", err).group(1))}


def _compile_split(cache: str, single: bool):
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    from k3fuse.kernels.lib.triton import mla_decode as K

    cfg = K.config_for(FP8 if cache == "fp8e4nv" else torch.bfloat16)
    names = K._mla_split_kernel.arg_names
    constexprs = dict(PAGE=64, BLOCK_H=16, BLOCK_N=cfg.block_n, LATENT=512, ROPE=64, IS_FP8=cache == "fp8e4nv",
                      SINGLE=single, PREFETCH=cfg.prefetch)
    part = "*bf16" if single else "*fp32"
    types = {"q_ptr": "*bf16", "kv_ptr": f"*{cache}", "bt_ptr": "*i32", "lens_ptr": "*i32",
             "kv_scale_ptr": "*fp32" if cache == "fp8e4nv" else "*i32", "out_ptr": "*bf16", "pout_ptr": part,
             "plse_ptr": part, "qk_scale": "fp32"}
    sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    # what a launch specialises: 16-byte aligned pointers, the 16-divisible strides
    divisible = [n for n in names if n.endswith("_ptr")] + ["q_sb", "q_sh", "kv_sblk", "kv_stok", "o_sb", "o_sh",
                                                            "po_sb", "po_sh", "po_ss"]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    src = triton.compiler.ASTSource(fn=K._mla_split_kernel, signature=sig, attrs=attrs, constexprs=constexprs)
    return cfg, triton.compile(src, target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})


@pytest.mark.parametrize("single", [False, True])
def test_split_kernel_compiles_for_sm90_as_designed(single):
    cfg, bf16 = _compile_split("bf16", single)
    ptx = bf16.asm["ptx"]
    tile = cfg.block_n * 576 * 2
    assert "cp.async.cg.shared.global" in ptx and "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx
    assert bf16.metadata.shared >= 2 * tile  # two tiles buffered: one in flight while the other is scored
    assert bf16.metadata.shared * cfg.programs_per_sm <= 227 * 1024
    report = _ptxas_report(ptx)
    assert report["spill"] == 0 and report["registers"] * cfg.num_warps * 32 * cfg.programs_per_sm <= 65536, report

    cfg, fp8 = _compile_split("fp8e4nv", single)
    ptx = fp8.asm["ptx"]
    assert "ld.global.v4.b32" in ptx and "cvt.rn.f16x2.e4m3x2" in ptx and "mma.sync" in ptx  # widened in registers
    assert fp8.metadata.shared * cfg.programs_per_sm <= 227 * 1024
    report = _ptxas_report(ptx)
    assert report["spill"] <= 64, report  # 255 registers at 8 warps: a few words on the stack (L1)
