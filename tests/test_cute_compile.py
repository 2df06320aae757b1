"""CPU CI for the GPU kernels: they compile to PTX without a GPU, or their import is guarded.

With nvidia-cutlass-dsl installed (CI installs 4.8.1 + apache-tvm-ffi), every CuTe kernel variant
the ops use is compiled for sm_90a and its PTX is checked for what makes it fast or correct
(16-byte loads, no local-memory spills, acquire/release flags, no multicast). 4.8.x compiles fully
on CPU; 4.3.5 lowers to PTX and stops at its driver check, which compat accepts only once the PTX
exists. Without the DSL the tests that need it are skipped with the reason and the guard test
checks that the ops still run their reference path. With triton installed, the split-K kernel is
compiled for sm_90 as well.
"""
from __future__ import annotations

import os
import re

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest  # noqa: E402
import torch  # noqa: E402

import k3fuse.kernels  # noqa: F401,E402
from k3fuse import runtime  # noqa: E402
from k3fuse.kernels.lib.cute import compat  # noqa: E402

needs_cute = pytest.mark.skipif(not compat.HAVE_CUTE,
                                reason=f"nvidia-cutlass-dsl not importable: {compat.IMPORT_ERROR}")

GEMV_CASES = [  # (M, N, K, out dtype): K3 per-rank shapes
    (1, 7168, 6144, torch.bfloat16), (2, 7168, 12288, torch.bfloat16), (1, 7168, 1536, torch.bfloat16),
    (2, 7168, 768, torch.bfloat16), (1, 896, 7168, torch.float32), (2, 3584, 7168, torch.bfloat16),
    (1, 7168, 3584, torch.bfloat16), (8, 7168, 6144, torch.bfloat16),
]


def _ops(ptx: str) -> dict[str, int]:
    pats = {"ld.global.v4": r"ld\.global(\.[\w:]+)*\.v4", "ld.local": r"\bld\.local", "st.local": r"\bst\.local",
            "ld.acquire.sys": r"ld\.acquire\.sys", "st.release.sys": r"st\.release\.sys",
            "fence.acq_rel.sys": r"fence\.acq_rel\.sys", "globaltimer": r"%globaltimer",
            "ld.volatile.v4": r"ld\.volatile\.global\.v4", "st.v4.sentinel": r"st\.global\.v4\.u32",
            "st.global.b32": r"st\.global\.(f32|b32)\b",
            "multimem": r"multimem", "atom": r"\batom\."}
    return {k: len(re.findall(p, ptx)) for k, p in pats.items()}


@needs_cute
@pytest.mark.parametrize("M,N,K,out_dtype", GEMV_CASES)
def test_gemv_compiles_to_ptx(M, N, K, out_dtype, tmp_path):
    from k3fuse.kernels.lib.cute import gemv as decode_gemv

    cfg = decode_gemv.pick_config(M, N, K)
    assert cfg is not None, f"GEMV must cover K3 shape {N}x{K} at M={M}"
    key, build = decode_gemv.builder(M, K, *cfg, y_dtype=out_dtype)
    ptx = compat.compile_to_ptx_on_cpu(key, build, str(tmp_path))
    ops = _ops(ptx)
    rows, threads = cfg
    iters = K // 8 // threads
    assert ".target sm_90a" in ptx
    assert ops["ld.global.v4"] >= iters * (rows + M), ops   # every weight/activation load is 16 B
    assert ops["ld.local"] == 0 and ops["st.local"] == 0, ops  # no spills
    assert ops["multimem"] == 0


@needs_cute
@pytest.mark.parametrize("world,addend,norm,pdl", [
    (2, False, True, True), (2, True, True, True), (2, True, False, False),
    (8, False, True, False), (4, True, False, True),
])
def test_oneshot_ar_compiles_to_ptx(world, addend, norm, pdl, tmp_path):
    from k3fuse.kernels.lib.cute import oneshot_epilogue as oneshot_ar

    key, build = oneshot_ar.builder(world, 7168, 64, addend, norm, torch.bfloat16, torch.bfloat16, pdl)
    ptx = compat.compile_to_ptx_on_cpu(key, build, str(tmp_path))
    ops = _ops(ptx)
    vpt = 7168 // 4 // oneshot_ar.pick_threads(7168)
    # Lamport poll: one 16-byte volatile load per (chunk, source rank), issued in batches
    assert ops["ld.volatile.v4"] == vpt * world, ops
    assert ops["st.v4.sentinel"] >= vpt * world, ops   # reset of the buffer used two generations ago
    assert ops["atom"] == 1, ops                         # the generation's arrival counter
    assert "atom.acq_rel.gpu.global.add.u64" in ptx      # ... on the int64 protocol words
    assert ops["multimem"] == 0, "multicast instructions must never appear"
    # issue 10: the spin is always bounded (a timer in every build, not only debug builds)
    assert ops["globaltimer"] >= 2, ops
    assert ops["ld.local"] == 0 and ops["st.local"] == 0, ops
    assert ("griddepcontrol.wait" in ptx) == pdl          # PDL builds wait for the GEMM before exit
    assert "nanosleep" in ptx                             # polls back off
    _assert_wrap_safe_indexing(ptx)


def _assert_wrap_safe_indexing(ptx: str) -> None:
    """Issue 10: no remainder of the generation (the old int32 `g % 3` compiled to rem.s32 and
    went negative after 2^31 calls); the buffer index is its own rotated word, addresses 64-bit."""
    assert not re.search(r"\brem\.s(32|64)\b", ptx), "signed remainder in the index arithmetic"
    assert not re.search(r"\brem\.", ptx), "the buffer index must be rotated, not a remainder"
    assert "ld.global.u64" in ptx or "ld.global.s64" in ptx or "ld.global.b64" in ptx or \
        re.search(r"ld\.global(\.\w+)*\.(u|s|b)64", ptx), "the protocol words are 64-bit"


@needs_cute
@pytest.mark.parametrize("world,rank,addend,norm", [
    (2, 0, False, True), (2, 1, True, True), (2, 1, True, False), (8, 5, False, True),
])
def test_oneshot_ar_flags_compiles_to_ptx(world, rank, addend, norm, tmp_path):
    """K3FUSE_AR_PROTOCOL=flags: release flags to every rank, acquire spin, then one data load."""
    from k3fuse.kernels.lib.cute import oneshot_epilogue as oneshot_ar

    key, build = oneshot_ar.builder(world, 7168, 64, addend, norm, torch.bfloat16, torch.bfloat16,
                                    flags_rank=rank)
    assert key[0] == "flag_ar"
    ptx = compat.compile_to_ptx_on_cpu(key, build, str(tmp_path))
    ops = _ops(ptx)
    vpt = 7168 // 4 // oneshot_ar.pick_threads(7168)
    assert ops["st.release.sys"] == world, ops            # one epoch flag per destination rank
    assert "st.release.sys.global.s64" in ptx and "ld.acquire.sys.global.s64" in ptx  # 64-bit epochs
    assert ops["fence.acq_rel.sys"] == world, ops         # data fenced before each flag
    assert ops["ld.acquire.sys"] == 1, ops                # the flag spin
    assert ops["ld.volatile.v4"] == vpt * world, ops      # peer slots read once, after the wait
    assert ptx.rindex("ld.acquire.sys") < ptx.index("ld.volatile.global.v4")
    assert ops["st.v4.sentinel"] == 0 and "0x80000000" not in ptx, ops   # no Lamport sentinel
    assert ops["atom"] == 1, ops                          # the epoch's arrival counter
    assert ops["globaltimer"] >= 2, ops                   # bounded spin in every build
    assert ops["ld.local"] == 0 and ops["st.local"] == 0, ops
    assert ops["multimem"] == 0 and "griddepcontrol" not in ptx
    assert "nanosleep" in ptx
    _assert_wrap_safe_indexing(ptx)


def test_protocol_selection(monkeypatch):
    """K3FUSE_AR_PROTOCOL picks one of two distinctly named Impls; once a TP group agreed it, the
    agreed value (k3fuse.runtime.path_setting: a change on one rank alone is refused)."""
    from k3fuse import runtime
    from k3fuse.kernels import collective, dispatch
    from k3fuse.kernels.ops import oproj_allreduce as g

    monkeypatch.setenv("K3FUSE_AR_PROTOCOL", "flags")
    assert collective.protocol() == "flags" and collective.flags_rank(1) == 1 and not g._pdl("gemv")
    runtime.pin_path_settings({"K3FUSE_AR_PROTOCOL": "flags"})   # what a group's agreement does
    try:
        monkeypatch.setenv("K3FUSE_AR_PROTOCOL", "lamport")
        assert collective.protocol() == "flags"                    # the agreed value, not this rank's change
        spec = g.OProjSpec(H=7168, K=6144, dtype=torch.bfloat16, res_dtype=torch.bfloat16, addend=False,
                           norm_dtype=None, world_size=2, max_tokens=64)
        assert g._accepts("lamport")(spec) == "K3FUSE_AR_PROTOCOL=flags"
    finally:
        runtime.unpin_path_settings()
    monkeypatch.delenv("K3FUSE_AR_PROTOCOL")
    assert collective.protocol() == "lamport" and collective.flags_rank(1) is None
    names = {i.name for i in dispatch.implementations("gemm_ar_residual_rmsnorm")}
    assert {"cute.oneshot_ar", "cute.oneshot_ar.flags"} <= names


@needs_cute
@pytest.mark.parametrize("M,world,rank", [(1, 2, 0), (2, 2, 1), (4, 8, 5)])
def test_gemv_push_epilogue_compiles(M, world, rank, tmp_path):
    from k3fuse.kernels.lib.cute import gemv as decode_gemv

    N, K = 7168, 6144
    rows, threads = decode_gemv.pick_config(M, N, K)
    key, build = decode_gemv.builder(M, K, rows, threads, y_dtype=torch.float32,
                                     push=(world, rank, 64, N))
    ptx = compat.compile_to_ptx_on_cpu(key, build, str(tmp_path))
    ops = _ops(ptx)
    assert ops["ld.global.v4"] >= (K // 8 // threads) * (rows + M), ops
    assert ops["st.global.b32"] >= world, ops          # one fp32 store per destination rank
    assert not re.search(r"\brem\.", ptx), "buffer index must be the rotated word, not gen % 3"
    assert "griddepcontrol.launch_dependents" in ptx   # lets the all-reduce kernel launch early
    assert ops["multimem"] == 0 and ops["ld.local"] == 0, ops


def test_no_multicast_anywhere_in_kernels():
    """The kernels, workspace and benchmarks never touch NVLink multicast."""
    root = os.path.join(os.path.dirname(__file__), "..")
    banned = re.compile(r"multimem|multicast_ptr|cuMulticast|MulticastCreate")
    for sub in ("kernels", "bench"):
        for dirpath, _, files in os.walk(os.path.join(root, sub)):
            for f in files:
                if f.endswith(".py"):
                    text = open(os.path.join(dirpath, f)).read()
                    assert not banned.search(text), f"{sub}/{f} mentions a multicast API"


def test_import_guard_and_reference_on_cpu():
    """Without a GPU (and with or without the DSL) the op runs its reference path, counted as such."""
    runtime.reset_stats()
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    w = torch.randn(128, 256, dtype=torch.bfloat16)
    with runtime.strict():
        y = torch.ops.k3fuse.decode_gemm(x, w, None, None)
    ref = (x.double() @ w.double().T).to(torch.bfloat16)
    torch.testing.assert_close(y, ref, rtol=1.6e-2, atol=1e-2)
    assert runtime.stats()["decode_gemm"] == {"reference": 1}
    if not compat.HAVE_CUTE:
        assert not compat.available() and compat.IMPORT_ERROR


def test_compile_refused_while_capturing(monkeypatch):
    monkeypatch.setattr(compat, "_capturing", lambda: True)
    with pytest.raises(compat.CompileWhileCapturing):
        compat.compiled(("never-compiled-key",), lambda: None)


def test_splitk_compiles_for_sm90():
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    from k3fuse.kernels.lib.triton import splitk_gemm

    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "ws_ptr": "*fp32",
           "cnt_ptr": "*i32", "push_ptr": "*i64", "gen_ptr": "*i64", "w2_ptr": "*bf16", "M": "i32", "N": "i32",
           "N1": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_w2n": "i32", "stride_ym": "i32",
           "K_SPLIT": "constexpr", "SPLIT_K": "constexpr", "BLOCK_N": "constexpr", "BLOCK_M": "constexpr",
           "BLOCK_K": "constexpr", "HAS_BIAS": "constexpr", "PUSH_WORLD": "constexpr", "PUSH_RANK": "constexpr",
           "PUSH_MAXT": "constexpr", "EVEN_N": "constexpr", "TWO_W": "constexpr", "PDL_TRIGGER": "constexpr"}
    attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 13, 14, 15)}
    # (split, push, block_n, even_n, two_w): a skinny N (W_b, 48 rows) in masked tiles; two weights
    # (the sharded MoE front: router slice + latent slice in one launch) with and without a push
    for split, push, block_n, even_n, two_w in ((8, 0, 64, True, False), (1, 0, 64, True, False),
                                                (2, 2, 64, True, False), (1, 8, 64, True, False),
                                                (28, 0, 16, False, False), (1, 0, 16, False, False),
                                                (2, 2, 64, True, True), (1, 0, 32, True, True)):
        src = triton.compiler.ASTSource(
            fn=splitk_gemm._splitk_kernel, signature=sig, attrs=attrs,
            constexprs={"K_SPLIT": 6144 // split if split != 28 else 256, "SPLIT_K": split,
                        "BLOCK_N": block_n, "BLOCK_M": 16, "BLOCK_K": 128, "HAS_BIAS": False,
                        "PUSH_WORLD": push, "PUSH_RANK": push // 2, "PUSH_MAXT": 64, "EVEN_N": even_n,
                        "TWO_W": two_w, "PDL_TRIGGER": two_w})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 5})
        ptx = k.asm["ptx"]
        # wgmma needs 64-row tiles: the 16-column skinny tiles run on mma.sync (a 688 KB weight)
        assert ("wgmma.mma_async" if block_n == 64 else "mma.sync") in ptx and "cp.async" in ptx
        assert ("atom.global.gpu.acq_rel.add" in ptx) == (split > 1)
        assert "multimem" not in ptx
        assert ("griddepcontrol.launch_dependents" in ptx) == two_w   # the MoE front's gather starts early
        if push:   # issue 10: buffer index is the rotated int64 word [3], never a remainder
            assert not re.search(r"\brem\.", ptx), "signed remainder in the push index"
            assert re.search(r"ld\.global(\.\w+)*\.b64", ptx) or re.search(r"ld\.global(\.\w+)*\.(u|s)64", ptx)


def test_l2_prefetch_compiles_to_bulk_prefetch_for_sm90():
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    from k3fuse.kernels.lib.triton import l2_prefetch

    src = triton.compiler.ASTSource(
        fn=l2_prefetch._prefetch_kernel, signature={"addr_ptr": "*i64", "size_ptr": "*i32", "n": "i32",
                                                     "BLOCK": "constexpr"},
        constexprs={"BLOCK": 128})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    assert "cp.async.bulk.prefetch.L2.global" in ptx and "multimem" not in ptx


def test_l2_prefetch_chunks_follow_the_list_and_stop_at_the_budget():
    from k3fuse.kernels.lib.triton import l2_prefetch

    a, b = torch.empty(100_000, dtype=torch.bfloat16), torch.empty(50_000, dtype=torch.bfloat16)
    assert a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0
    chunks = l2_prefetch.chunk_table([a, b], budget_bytes=250_008)
    assert sum(s for _, s in chunks) == 250_000  # the budget, trimmed to 16-byte multiples
    assert all(addr % 16 == 0 and size % 16 == 0 and 0 < size <= l2_prefetch.CHUNK_BYTES for addr, size in chunks)
    in_a = [s for addr, s in chunks if a.data_ptr() <= addr < a.data_ptr() + 200_000]
    in_b = [addr for addr, s in chunks if b.data_ptr() <= addr < b.data_ptr() + 100_000]
    assert sum(in_a) == 200_000 and chunks[: len(in_a)] == [c for c in chunks if c[0] < a.data_ptr() + 200_000
                                                         and c[0] >= a.data_ptr()]  # a first, whole
    assert in_b[0] == b.data_ptr() and len(in_a) + len(in_b) == len(chunks)  # then the head of b


def test_glu_activation_compiles_for_sm90():
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    from k3fuse.kernels.lib.triton import glu_act

    src = triton.compiler.ASTSource(
        fn=glu_act._situ_glu_kernel, signature={"g_ptr": "*bf16", "u_ptr": "*bf16", "out_ptr": "*bf16",
                                                "n": "i32", "beta": "fp32", "linear_beta": "fp32",
                                                "BLOCK": "constexpr"},
        constexprs={"BLOCK": 1024})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    assert "ld.global" in ptx and "st.global" in ptx


@needs_cute
@pytest.mark.parametrize("world,flags_rank", [(2, None), (8, None), (2, 1)])
def test_oneshot_ar_without_residual_compiles_to_ptx(world, flags_rank, tmp_path):
    """allreduce_rmsnorm's epilogue (has_residual=False, L = 3584): the same poll / flags, sum and
    norm, no residual load; the residual variants' cache keys are unchanged."""
    from k3fuse.kernels.lib.cute import oneshot_epilogue as oneshot_ar

    L = 3584
    args = (world, L, 64, False, True, torch.bfloat16, torch.bfloat16, False, flags_rank)
    key, build = oneshot_ar.builder(*args, has_residual=False)
    assert key[-1] == "nores" and key[:-1] == oneshot_ar.builder(*args)[0]
    assert oneshot_ar.builder(*args, has_residual=True)[0] == oneshot_ar.builder(*args)[0]
    ptx = compat.compile_to_ptx_on_cpu(key, build, str(tmp_path))
    ops = _ops(ptx)
    vpt = L // 4 // oneshot_ar.pick_threads(L)
    assert ops["ld.volatile.v4"] == vpt * world, ops
    assert ops["atom"] == 1 and ops["globaltimer"] >= 2 and "nanosleep" in ptx, ops
    assert ops["ld.local"] == 0 and ops["st.local"] == 0 and ops["multimem"] == 0, ops
    if flags_rank is None:
        assert ops["st.v4.sentinel"] >= vpt * world, ops
    else:
        assert ops["st.release.sys"] == world and ops["ld.acquire.sys"] == 1, ops
    _assert_wrap_safe_indexing(ptx)
    # no residual: the with-residual build of the same shape loads one more bf16 vector per chunk
    _, build_res = oneshot_ar.builder(*args)
    ptx_res = compat.compile_to_ptx_on_cpu(oneshot_ar.builder(*args)[0], build_res, str(tmp_path / "res"))
    n_ld = lambda p: len(re.findall(r"\bld\.global\b(?!\.v4\.u32)", p))  # noqa: E731
    assert n_ld(ptx) < n_ld(ptx_res), (n_ld(ptx), n_ld(ptx_res))


def test_lamport_push_compiles_for_sm90():
    """The MoE tail's push (allreduce_rmsnorm): buffer index from the int64 word gen[3] on the
    device (no remainder), -0.0 canonicalised, one store per destination rank, no multicast."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    from k3fuse.kernels.lib.triton import lamport_push

    sig = {"x_ptr": "*bf16", "push_ptr": "*i64", "gen_ptr": "*i64", "n": "i32", "WORLD": "constexpr",
           "RANK": "constexpr", "MAXT": "constexpr", "H": "constexpr", "BLOCK": "constexpr"}
    attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2)}
    for world, rank in ((2, 0), (2, 1), (8, 5)):
        src = triton.compiler.ASTSource(fn=lamport_push._push_kernel, signature=sig, attrs=attrs,
                                        constexprs={"WORLD": world, "RANK": rank, "MAXT": 64, "H": 3584,
                                                    "BLOCK": lamport_push.BLOCK})
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
        assert not re.search(r"\brem\.", ptx), "the buffer index must be the rotated word, not a remainder"
        assert re.search(r"ld\.global(\.\w+)*\.(b|u|s)64", ptx), "gen[3] and the peer pointers are 64-bit loads"
        assert re.search(r"setp\.(eq|neu)\.(f32|bf16)", ptx) and "selp" in ptx, "-0.0 -> +0.0 is kept"
        assert len(re.findall(r"st\.global(\.\w+)*\.(b32|f32)", ptx)) >= world, "a store per destination rank"
        assert "multimem" not in ptx and "atom." not in ptx and ".local" not in ptx


W4A16_CASES = [  # (T, I): K3's widths per rank at TP 1, 2 and 8; one and two tokens pairwise, 8 / 64 grouped
    (1, 3072), (2, 1536), (8, 384), (64, 1536), (64, 3072),
]
#: the four-launch form (the activations in word order from global memory) in both modes; the pairwise
#: two-launch form (x_stage) has its own test
FOUR_LAUNCHES = {"x_stage": False}


def _w4a16_launches(T: int, I: int, fmt: str, tmp_path, L: int = 3584, E: int = 896, k: int = 16,
                    config: dict | None = None, **choices):
    """(name, builder params, PTX, where) of the CuTe W4A16 gate/up and down launches cute_config picks for
    T tokens at I (default K3's latent L, experts E, top-k), over `fmt` tables; or of `config`'s."""
    from k3fuse.kernels.lib.cute import routed_experts_w4a16 as w4
    from k3fuse.kernels.ops.routed_experts_w4a16 import cute_config

    cfg = config or cute_config(T, E, I, L, k, **choices)
    for name, params in (("gate_up", w4.gate_up_params(I, L, k, cfg, fmt)),
                         ("down", w4.down_params(I, L, cfg, fmt, betas=(4.0, 25.0)))):
        key, build = w4.builder(**params)
        yield name, params, compat.compile_to_ptx_on_cpu(key, build, str(tmp_path / name)), (name, T, I, cfg)


def _x_loads(ptx: str, params: dict, where) -> int:
    """The four-launch forms' 16-byte activation loads from global memory: read-only (.nc), or in a down
    launched as the SiTU-GLU launch's programmatic dependent (act_pdl), side-effecting plain loads, every
    one after the grid's single wait, which follows the first weight copies (the weight-only rule)."""
    if params.get("pdl") != "wait":
        assert "griddepcontrol" not in ptx and not re.search(r"ld\.global\.v4\.u32", ptx), where
        return len(re.findall(r"ld\.global\.nc\.v4\.u32", ptx))
    assert ptx.count("griddepcontrol.wait") == 1 and "ld.global.nc.v4" not in ptx, where
    at = ptx.index("griddepcontrol.wait")
    assert ptx.index("cp.async.cg.shared.global") < at < ptx.index("ld.global.v4.u32"), where
    return len(re.findall(r"ld\.global\.v4\.u32", ptx))


@needs_cute
@pytest.mark.parametrize("T,I", W4A16_CASES)
def test_w4a16_expert_gemms_compile_to_ptx(T, I, tmp_path):
    """The CuTe MXFP4 expert GEMMs (gate/up and down) at K3's widths: 16-byte weight and activation
    loads (the down's, launched as the SiTU-GLU launch's dependent, after its one wait), one scale byte a
    row a step, mma.sync m16n8k16 on bf16, the E2M1 pattern by one integer
    multiply a register, one bf16 multiply a register in the loop for ordinary scales and two in the
    loop for wide ones, no spills, no multicast; each k loop is its steps once, marked nounroll
    (ptxas unrolled a 12-step span into straight code that thrashed the instruction cache:
    docs/perf.md 0i). The ring: the weights and scales by cp.async
    into shared memory, waited for `stages - 1` groups behind, no barrier."""
    from k3fuse.kernels.lib.cute import routed_experts_w4a16 as w4

    for name, params, ptx, where in _w4a16_launches(T, I, "mxfp4", tmp_path, **FOUR_LAUNCHES):
        ops = _ops(ptx)
        mma = len(re.findall(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32", ptx))
        muls = len(re.findall(r"mul\.rn\.bf16x2", ptx))
        stages = params["stages"]
        assert stages == min(w4.STAGES, params["k_span"] // w4.STEP + 1), where
        # the ring's step loops a span: this span's later steps (none if the prologue filled them all),
        # then the next span's first
        ring_loops = 2 if params["k_span"] // w4.STEP > stages - 1 else 1
        # per step and loop copy: 8 mmas; the ordinary loop 32 multiplies for them, the wide one 64
        assert mma == 2 * 8 * ring_loops, (where, mma)
        assert ptx.count('.pragma "nounroll"') >= 3, where
        assert muls == mma // 2 * (4 + 8), (where, muls, mma)
        # the E2M1 pattern by mask, multiply, mask: one integer multiply a register (32 a step), no shifts
        # but the word's one by 8 (docs/perf.md 0l)
        spreads = len(re.findall(r"mul\.lo\.u32 q, q, (?:4160|260);", ptx))
        assert spreads == mma * 4 and "shl.b32 q" not in ptx, (where, spreads)
        # a step: the activations' 4 x 16 bytes from global, the weights' 2 x 16 bytes and the scale
        # words by cp.async (the prologue's stages - 1 steps and one a step loop), read from shared
        v4 = _x_loads(ptx, params, where)
        assert v4 == mma // 8 * 4, (where, v4)
        assert (params.get("pdl") == "wait") == (name == "down" and w4.ACT_PDL), where
        cp16 = len(re.findall(r"cp\.async\.cg\.shared\.global \[[^]]+\], \[[^]]+\], 16;", ptx))
        # (pairwise one tile a CTA has one span: the compiler drops the next span's copies)
        assert 2 * (stages - 1 + 2) <= cp16 <= 2 * (stages - 1 + 2 * ring_loops), (where, cp16)
        assert f"cp.async.wait_group {stages - 1};" in ptx and "bar.sync" not in ptx, where
        assert len(re.findall(r"ld\.shared\.v4\.u32", ptx)) == mma // 8 * 2, where
        assert "vote.sync.any.pred" in ptx, where
        assert ops["ld.local"] == 0 and ops["st.local"] == 0 and ops["multimem"] == 0, (where, ops)
        assert ("st.global.f32" in ptx) == (name == "gate_up") and ("cvt.rn.bf16.f32" in ptx) == (name == "down")


@needs_cute
@pytest.mark.parametrize("T,I", W4A16_CASES)
def test_w4a16_int4_expert_gemms_compile_to_ptx(T, I, tmp_path):
    """The CuTe expert GEMMs over int4 tables with bf16 scales: the same ring and mmas as MXFP4's, one
    loop copy (no wide-scale loop: a bf16 scale is one multiply at any value), each register by shift,
    LOP3, subtract, multiply (int4x8_ptx), the step's 8 scale bytes a row by one 8-byte cp.async and
    this thread's bf16 read back as a u16; no spills, no multicast."""
    from k3fuse.kernels.lib.cute import routed_experts_w4a16 as w4

    for name, params, ptx, where in _w4a16_launches(T, I, "int4", tmp_path, **FOUR_LAUNCHES):
        ops = _ops(ptx)
        stages = params["stages"]
        ring_loops = 2 if params["k_span"] // w4.STEP > stages - 1 else 1
        mma = len(re.findall(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32", ptx))
        assert mma == 8 * ring_loops, (where, mma)
        # a step: 8 words (rows a and b, 4 each) of 4 registers, each one LOP3, a subtract, a multiply
        for pattern in (r"lop3\.b32 q, \S+, 0x000F000F, 0x43004300, 0xEA;", r"sub\.rn\.bf16x2", r"mul\.rn\.bf16x2"):
            assert len(re.findall(pattern, ptx)) == mma * 4, (where, pattern)
        assert len(re.findall(r"shr\.u32 q, \S+, (?:4|8|12);", ptx)) == mma * 3, where
        assert "mul.lo.u32 q" not in ptx and "vote.sync" not in ptx, where  # no E2M1 spread, no scale vote
        scale8 = len(re.findall(r"cp\.async\.ca\.shared\.global \[[^]]+\], \[[^]]+\], 8;", ptx))
        assert 2 * (stages - 1 + 1) <= scale8 <= 2 * (stages - 1 + ring_loops), (where, scale8)
        assert len(re.findall(r"ld\.shared\.u16", ptx)) == mma // 8 * 2 and "ld.shared.u8" not in ptx, where
        assert _x_loads(ptx, params, where) == mma // 8 * 4, where
        assert "bar.sync" not in ptx, where
        assert ops["ld.local"] == 0 and ops["st.local"] == 0 and ops["multimem"] == 0, (where, ops)


@needs_cute
@pytest.mark.parametrize("T,I", [(1, 2048), (64, 256)])
def test_w4a16_int4_compiles_at_kimi_k2_widths(T, I, tmp_path):
    """Kimi K2.x's experts (its int4 format's home: 384 experts, top-8, hidden 7168, I = 2048 at TP 1 and
    256 at TP 8): both launches compile with their ring, no spills."""
    from k3fuse.kernels.lib.cute import routed_experts_w4a16 as w4

    for name, params, ptx, where in _w4a16_launches(T, I, "int4", tmp_path, L=7168, E=384, k=8, **FOUR_LAUNCHES):
        ring_loops = 2 if params["k_span"] // w4.STEP > params["stages"] - 1 else 1
        assert len(re.findall(r"mma\.sync\.aligned\.m16n8k16", ptx)) == 8 * ring_loops, where
        assert len(re.findall(r"sub\.rn\.bf16x2", ptx)) == 32 * ring_loops, where
        ops = _ops(ptx)
        assert ops["ld.local"] == 0 and ops["st.local"] == 0, (where, ops)


@needs_cute
@pytest.mark.parametrize("T,I,fmt,choices", [(1, 3072, "mxfp4", {}), (2, 1536, "mxfp4", {}), (1, 384, "mxfp4", {}),
                                             (1, 1536, "int4", {}), (1, 1536, "mxfp4", {"pdl": True}),
                                             (1, 3072, "int4", {"pdl": True, "balanced": True}),
                                             (1, 3072, "mxfp4", {"gate_up_tiles": 2, "n_tiles": 2, "stages": 5}),
                                             (1, 1536, "mxfp4", {"x_quads": True}),
                                             (2, 3072, "int4", {"x_quads": True, "pdl": True})])
def test_w4a16_x_stage_compiles_to_ptx(T, I, fmt, choices, tmp_path):
    """The pairwise MLP in two launches whose CTAs stage their activation row in shared memory: the
    gate/up reads a's row (natural order) with 16-byte read-only loads and stores it in word order (each
    step's words in quad order with x_quads), the down sums the gate/up's fp32 partials and computes the
    SiTU-GLU (3 exponentials an element), a thread's words unrolled; one barrier each, after the staging;
    the step loops read the activations from shared memory, never global (with x_quads, lanes 0-3 alone:
    predicated loads); no spills, no multicast. With PDL the gate/up lets the down launch
    first thing, and the down waits for its grid after its first weight copies, before any partial,
    which it reads through L2 (a read-only load may move above the wait); the balanced gate/up (two
    step loops a copy) stages the same way."""
    from k3fuse.kernels.lib.cute import routed_experts_w4a16 as w4

    for name, params, ptx, where in _w4a16_launches(T, I, fmt, tmp_path, x_stage=True, **choices):
        ops = _ops(ptx)
        ring_loops = 2 if params["k_span"] // w4.STEP > params["stages"] - 1 else 1
        copies = 2 if fmt == "mxfp4" else 1  # MXFP4's ordinary and wide-scale loops
        mma = len(re.findall(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32", ptx))
        assert mma == copies * 8 * ring_loops, (where, mma)
        assert params["x_stage"] == ("natural" if name == "gate_up" else "situ"), where
        assert params["n_tiles"] == choices.get("gate_up_tiles" if name == "gate_up" else "n_tiles", 1), where
        # a step: the weights' 2 and the activations' 4 16-byte shared loads, in quad order by lanes 0-3 alone
        assert len(re.findall(r"ld\.shared\.v4\.u32", ptx)) == mma // 8 * 6, (where, ptx.count("ld.shared.v4"))
        assert len(re.findall(r"@p ld\.shared\.v4\.u32", ptx)) == (mma // 8 * 4 if params["x_quads"] else 0), where
        # the staging, unrolled: a thread's words of the row, 16 bytes each (its loads in flight together)
        words = -(-params["k_span"] // 8 // 128)
        assert len(re.findall(r"st\.shared\.v4\.u32", ptx)) == words, where
        assert len(re.findall(r"bar\.sync|barrier\.sync", ptx)) == 1, where
        # the only 16-byte global loads are the staging's: a's word, or g's and u's halves a split
        pdl = choices.get("pdl", False)
        loads = len(re.findall(r"ld\.global\.(?:nc|cg)\.v4\.u32", ptx))
        assert loads == words * (1 if name == "gate_up" else 4 * params["gu_splits"]), (where, loads)
        assert ("ld.global.cg.v4" in ptx) == (pdl and name == "down"), where
        assert ptx.count("ex2.approx") == (0 if name == "gate_up" else 24 * words), where
        assert ptx.count("griddepcontrol.launch_dependents") == (pdl and name == "gate_up"), where
        assert ptx.count("griddepcontrol.wait") == (pdl and name == "down"), where
        assert ("shares" in params) == (choices.get("balanced", False) and name == "gate_up"), where
        if pdl and name == "down":  # the wait after the first weight copies and before the first partial
            at = ptx.index("griddepcontrol.wait")
            assert ptx.index("cp.async.cg.shared.global") < at < ptx.index("ld.global.cg.v4.u32"), where
        assert ops["ld.local"] == 0 and ops["st.local"] == 0 and ops["multimem"] == 0, (where, ops)


def _step_loop_sass_per_step(ptx: str, tmp_path) -> float:
    """Instructions a step in the ordinary (one-multiply) step loop, the first backward-branching SASS loop
    with mmas, as ptxas for sm_90a (Triton's) builds it from `ptx`."""
    import subprocess

    import triton

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    tmp_path.mkdir(parents=True, exist_ok=True)
    # Triton's ptxas (CUDA 12.8) reads PTX up to ISA 8.7; these kernels use nothing newer than 8.0 (cp.async,
    # mma.sync, griddepcontrol), so a newer DSL's header is lowered for it
    ptx = re.sub(r"^\.version 8\.(8|9)$", ".version 8.7", ptx, flags=re.M)
    (tmp_path / "k.ptx").write_text(ptx)
    subprocess.run([os.path.join(tools, "ptxas"), "-arch=sm_90a", "-O3", str(tmp_path / "k.ptx"), "-o",
                    str(tmp_path / "k.cubin")], check=True, capture_output=True)
    sass = subprocess.run([os.path.join(tools, "nvdisasm"), "-c", str(tmp_path / "k.cubin")], check=True,
                          capture_output=True, text=True).stdout
    lines, labels = [], {}
    for line in sass.splitlines():
        if m := re.match(r"\s*(\.L_x_\d+):", line):
            labels[m.group(1)] = len(lines)
        elif re.match(r"\s*/\*[0-9a-f]{4}\*/", line):
            lines.append(line.split("*/")[1])
    for i, line in enumerate(lines):
        if (m := re.search(r"BRA `\((\.L_x_\d+)\)", line)) and labels.get(m.group(1), i) < i:
            body = lines[labels[m.group(1)]:i + 1]
            if mmas := sum("HMMA" in b for b in body):
                return len(body) / (mmas / 8)
    raise AssertionError("no step loop in the SASS")


@needs_cute
@pytest.mark.parametrize("T,I,fmt,choices", [(1, 1536, "mxfp4", {}), (1, 3072, "mxfp4", {}), (2, 1536, "mxfp4", {}),
                                             (1, 384, "mxfp4", {}), (1, 1536, "int4", {}),
                                             (1, 1536, "mxfp4", {"pdl": True, "x_quads": True}),
                                             (1, 3072, "mxfp4", {"gate_up_tiles": 2, "n_tiles": 2, "stages": 5}),
                                             (1, 1536, "mxfp4", {"x_stage": False})])
def test_w4a16_rounds_compiles_to_ptx(T, I, fmt, choices, tmp_path):
    """rounds: a span's steps that issue one of its own as a loop of `stages` steps, the others unrolled, each
    row tile a span (the mma count); the stream's weight copies (at least half of them) and a weight read a
    step at a constant offset in the instruction on a base register (the point: no address or slot arithmetic
    a step); no spills, no multicast. At
    I = 1536 with 1 token, its SASS step loop has at least 10 fewer instructions a step than the loop's."""
    from k3fuse.kernels.lib.cute import routed_experts_w4a16 as w4

    measured = (T, I, fmt, choices) == (1, 1536, "mxfp4", {})
    loop_ptx = {n: p for n, _, p, _ in _w4a16_launches(T, I, fmt, tmp_path / "loop")} if measured else {}
    for name, params, ptx, where in _w4a16_launches(T, I, fmt, tmp_path, rounds=True, **choices):
        assert params["rounds"], where
        D, S = params["stages"], params["k_span"] // w4.STEP
        rounds_loop = D if (S - (D - 1)) // D else 0
        steps = params["n_tiles"] * (rounds_loop + S - (S - (D - 1)) // D * D)
        copies = 2 if fmt == "mxfp4" else 1  # MXFP4's ordinary and wide-scale loops
        mma = len(re.findall(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32", ptx))
        assert mma == copies * 8 * steps, (where, mma, steps)
        weights = re.findall(r"cp\.async\.cg\.shared\.global \[%r\d+(\+\d+)?\], \[%rd\d+(\+\d+)?\], 16;", ptx)
        prologue = 2 * (D - 1)  # the ring's first steps, issued before the stream as the loop form issues them
        folded = [w for w in weights[prologue:] if w[1]]
        assert len(weights) > prologue and len(folded) >= (len(weights) - prologue) // 2, (where, weights)
        reads = re.findall(r"ld\.shared\.v4\.u32 \{[^}]*\}, \[%r\d+\+(\d+)\];", ptx)
        assert len(reads) >= mma // 8, (where, len(reads))  # a step's row b (at least) at a constant offset
        ops = _ops(ptx)
        assert ops["ld.local"] == 0 and ops["st.local"] == 0 and ops["multimem"] == 0, (where, ops)
        if measured:
            per_step = _step_loop_sass_per_step(ptx, tmp_path / f"{name}_rounds")
            loop_per_step = _step_loop_sass_per_step(loop_ptx[name], tmp_path / f"{name}_loop")
            assert per_step <= loop_per_step - 10, (where, per_step, loop_per_step)
            print(f"{name}: {per_step:.1f} instructions a step in rounds, {loop_per_step:.1f} in the loop")


def _tuned_launches() -> list[tuple]:
    """The tuned table's entries that launch other than the rule (an empty entry is the rule's launch)."""
    from k3fuse.kernels.lib.cute.routed_experts_w4a16_tuned import TUNED

    return [key for key, choices in sorted(TUNED.items()) if choices]


@needs_cute
@pytest.mark.parametrize("key", _tuned_launches(), ids=lambda k: "_".join(map(str, k)))
def test_w4a16_tuned_launches_compile_to_ptx(key, tmp_path, monkeypatch):
    """Every launch the tuned table puts in place of the rule's, as the op's own configuration picks it for
    the entry's shape, compiles for sm_90a with no spills and no multicast."""
    from k3fuse.kernels.ops.routed_experts_w4a16 import LAUNCH_FORM_SETTINGS, cute_config

    for name in (*LAUNCH_FORM_SETTINGS, "K3FUSE_W4A16_TUNED"):
        monkeypatch.delenv(name, raising=False)
    fmt, E, I, L, k, T = key
    tuned = cute_config(T, E, I, L, k, format=fmt)
    assert tuned != cute_config(T, E, I, L, k), key
    for name, params, ptx, where in _w4a16_launches(T, I, fmt, tmp_path, L=L, E=E, k=k, config=tuned):
        ops = _ops(ptx)
        assert "mma.sync.aligned.m16n8k16" in ptx, where
        assert ops["ld.local"] == 0 and ops["st.local"] == 0 and ops["multimem"] == 0, (where, ops)


@needs_cute
@pytest.mark.parametrize("T,I,fmt,x_stage", [(1, 3072, "mxfp4", True), (2, 1536, "mxfp4", True),
                                             (1, 384, "mxfp4", True), (1, 1536, "int4", True),
                                             (1, 3072, "mxfp4", False)])
def test_w4a16_balanced_gate_up_compiles_to_ptx(T, I, fmt, x_stage, tmp_path):
    """The balanced gate/up (a share of a table's steps a CTA): per loop copy a block's two step loops
    (issuing the same block's step, then the next block's first), each one step of 8 mmas, marked
    nounroll; the ring's copies predicated on the share (the prologue's stages - 1 steps, 4 copies a
    step); fp32 partials stored, the zero slots in a loop; staged or not, the activations as in the
    other launches; no spills, no multicast. The down is the launch the rule would pair with it."""
    launches = list(_w4a16_launches(T, I, fmt, tmp_path, balanced=True, x_stage=x_stage))
    (name, params, ptx, where), down = launches[0], launches[1]
    assert name == "gate_up" and params["shares"] == (33 if T == 1 else 16) and params["k_span"] == 3584, where
    assert down[1]["gu_splits" if x_stage else "K"] == (params["slots"] if x_stage else I), down[3]
    ops = _ops(ptx)
    copies = 2 if fmt == "mxfp4" else 1  # MXFP4's ordinary and wide-scale loops
    mma = len(re.findall(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32", ptx))
    assert mma == copies * 2 * 8, (where, mma)
    assert ptx.count('.pragma "nounroll"') >= copies * 3, where  # a copy's block loop and its two step loops
    cp16 = len(re.findall(r"cp\.async\.cg\.shared\.global(?:\.L2::\w+)? \[[^]]+\], \[[^]]+\], 16;", ptx))
    assert cp16 == 2 * (params["stages"] - 1 + copies * 2), (where, cp16)
    assert len(re.findall(r"st\.global\.f32", ptx)) >= 2 * copies and "st.global.b16" not in ptx, where
    shared_x = 4 if x_stage else 0
    assert len(re.findall(r"ld\.shared\.v4\.u32", ptx)) == mma // 8 * (2 + shared_x), where
    assert "@p ld.shared" not in ptx, where  # (balanced stages in word order: every lane reads)
    assert len(re.findall(r"bar\.sync|barrier\.sync", ptx)) == (1 if x_stage else 0), where
    nc = len(re.findall(r"ld\.global\.nc\.v4\.u32", ptx))
    assert nc == (-(-3584 // 8 // 128) if x_stage else mma // 8 * 4), (where, nc)
    assert ops["ld.local"] == 0 and ops["st.local"] == 0 and ops["multimem"] == 0, (where, ops)


@needs_cute
@pytest.mark.parametrize("T,I,quads,fmt", [(1, 3072, False, "mxfp4"), (2, 1536, False, "mxfp4"),
                                           (1, 384, False, "mxfp4"), (2, 1536, True, "mxfp4"),
                                           (1, 1536, False, "int4")])
def test_w4a16_one_launch_compiles_to_ptx(T, I, quads, fmt, tmp_path):
    """The pairwise MLP in one launch: a ticket, the word-order tile, the gate/up and down row loops
    (their activations through L2, `.cg`, since other CTAs of the launch wrote them), each wait on an
    acquired flag after the weights' first copies, bounded by a trap; a group's count, its SiTU-GLU and
    its released flag; the exit count whose last CTA zeroes the state. No spills, no multicast."""
    from k3fuse.kernels.lib.cute import routed_experts_w4a16 as w4
    from k3fuse.kernels.lib.cute import routed_experts_w4a16_one_launch as one
    from k3fuse.kernels.ops.routed_experts_w4a16 import cute_config

    L, E, k = 3584, 896, 16
    cfg = cute_config(T, E, I, L, k, one_launch=True, x_quads=quads)
    params = one.params(I, L, k, cfg, fmt)
    key, build = one.builder(**params, beta=4.0, linear_beta=25.0)
    ptx = compat.compile_to_ptx_on_cpu(key, build, str(tmp_path))
    ops = _ops(ptx)
    where = (T, I, fmt, cfg)
    loops = sum(2 if p["k_span"] // w4.STEP > p["stages"] - 1 else 1 for p in params.values())
    mma = len(re.findall(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32", ptx))
    copies = 2 if fmt == "mxfp4" else 1  # MXFP4's loops in their ordinary and wide-scale copy
    assert mma == copies * 8 * loops, (where, mma)
    assert ".target sm_90a" in ptx
    assert ops["ld.local"] == 0 and ops["st.local"] == 0 and ops["multimem"] == 0, (where, ops)
    # the ticket (relaxed), a group's gate/up count and the exit count (acquire-release)
    assert len(re.findall(r"atom\.relaxed\.gpu\.global\.add\.s32", ptx)) == 1, where
    assert len(re.findall(r"atom\.acq_rel\.gpu\.global\.add\.s32", ptx)) == 2, where
    # two waits (x's flag, a group's), each polled with an acquire, backing off, trapping past its bound
    assert len(re.findall(r"trap;", ptx)) == 2 and len(re.findall(r"nanosleep", ptx)) == 2, where
    assert len(re.findall(r"ld\.acquire\.gpu\.global\.s32", ptx)) >= 2, where
    assert len(re.findall(r"st\.release\.gpu\.global\.s32", ptx)) == 2, where  # x's flag, a group's
    # the step loops' 4 activation loads and the SiTU-GLU's g and u halves a split, all through L2; the
    # only read-only 16-byte load is a's, in the word-order tile
    cg = len(re.findall(r"ld\.global\.cg\.v4\.u32", ptx))
    assert cg == mma // 8 * 4 + 4 * cfg["split"], (where, cg)
    assert len(re.findall(r"ld\.global\.nc\.v4\.u32", ptx)) == 1, where
    assert len(re.findall(r"prmt\.b32 [^;]+0x(5410|7632);", ptx)) == 4, where
    # the SiTU-GLU: 8 elements a thread a pass, 3 exponentials each, packed in word-order pairs
    assert len(re.findall(r"ex2\.approx\.ftz\.f32", ptx)) == 24, where
    assert len(re.findall(r"cvt\.rn\.bf16x2\.f32", ptx)) == 4, where
    assert len(re.findall(r"st\.global\.v4\.u32", ptx)) == 2, where  # x's words, h's words
    assert len(re.findall(r"st\.relaxed\.gpu\.global\.s32", ptx)) == 1, where  # the state's zeroing


@needs_cute
@pytest.mark.parametrize("T,I", [(1, 3072), (64, 1536), (8, 384)])
def test_w4a16_scale_blocks_compile_to_ptx(T, I, tmp_path):
    """scale_steps 4: a row's scale words of 4 steps by one 16-byte cp.async through L1 (`.ca`), issued
    with a block's first step, read back one byte a step, no barrier; a launch whose K or span is not
    whole 4-step blocks (I = 384's down: 3 steps, 12-byte scale rows) keeps the 4-byte copies."""
    from k3fuse.kernels.lib.cute import routed_experts_w4a16 as w4

    launches = {}
    for name, params, ptx, where in _w4a16_launches(T, I, "mxfp4", tmp_path, scale_steps=4, **FOUR_LAUNCHES):
        launches[name] = params
        blocks = w4.scale_blocks_fit(params["K"], params["k_span"])
        assert params["scale_steps"] == (4 if blocks else 1), where
        mma = len(re.findall(r"mma\.sync\.aligned\.m16n8k16", ptx))
        scale16 = len(re.findall(r"cp\.async\.ca\.shared\.global \[[^]]+\], \[[^]]+\], 16;", ptx))
        scale4 = len(re.findall(r"cp\.async\.ca\.shared\.global \[[^]]+\], \[[^]]+\], 4;", ptx))
        if blocks:
            # the prologue's block and one issue site in each step loop, rows a and b each
            assert scale16 >= 2 * 2 and scale4 == 0, (where, scale16, scale4)
        else:
            assert scale16 == 0 and scale4 >= 2 * 2, (where, scale16, scale4)
        assert len(re.findall(r"ld\.shared\.u8", ptx)) == mma // 8 * 2, where  # rows a, b a step
        assert "bar.sync" not in ptx and "bar.warp.sync" not in ptx, where
    assert launches["down"]["scale_steps"] == (1 if I == 384 else 4)


@needs_cute
@pytest.mark.parametrize("T,I,fmt,choices", [(1, 1536, "mxfp4", {}), (1, 1536, "mxfp4", {"rounds": True}),
                                             (64, 1536, "mxfp4", {}), (1, 3072, "int4", {}),
                                             (2, 384, "mxfp4", {"split": 1})])
def test_w4a16_blocked_compiles_to_ptx(T, I, fmt, choices, tmp_path):
    """blocked (block_order's tables): the same launches' keys but `blocked`, as many copies, mmas and shared
    loads, no spills, no multicast (the ring model checks the addresses). At I = 1536 with 1 token its SASS
    step loop is no longer than the row-major one's (the layout moves addresses, not work)."""
    rows_major = {n: (p, x) for n, p, x, _ in _w4a16_launches(T, I, fmt, tmp_path / "rows", **choices)}
    for name, params, ptx, where in _w4a16_launches(T, I, fmt, tmp_path, blocked=True, **choices):
        row_params, row_ptx = rows_major[name]
        assert params == {**row_params, "blocked": True}, where
        for op in (r"cp\.async\.\w+\.shared\.global", r"mma\.sync", r"ld\.shared"):
            assert len(re.findall(op, ptx)) == len(re.findall(op, row_ptx)), (where, op)
        ops = _ops(ptx)
        assert ops["ld.local"] == 0 and ops["st.local"] == 0 and ops["multimem"] == 0, (where, ops)
        if (T, I, choices) == (1, 1536, {}) and fmt == "mxfp4":
            per_step = _step_loop_sass_per_step(ptx, tmp_path / f"{name}_blocked")
            row_per_step = _step_loop_sass_per_step(row_ptx, tmp_path / f"{name}_row")
            assert per_step <= row_per_step, (where, per_step, row_per_step)
            print(f"{name}: {per_step:.1f} instructions a step blocked, {row_per_step:.1f} row-major")
