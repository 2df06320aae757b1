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


def _w4a16_launches(T: int, I: int, fmt: str, tmp_path, L: int = 3584, E: int = 896, k: int = 16,
                    layout: str = "rows", pairwise: bool | None = None, **choices):
    """(name, kernel, PTX, where) of the CuTe W4A16 gate/up and down launches W4A16Launch.for_call takes for T
    tokens at I (default K3's latent L, experts E, top-k) over `fmt` tables in `layout`, in the mode imposed
    (`pairwise`) or the call's, with `choices` (split, n_tiles) imposed."""
    import dataclasses

    from k3fuse.kernels.lib.composite.routed_experts_w4a16 import W4A16Launch
    from k3fuse.kernels.lib.cute import routed_experts_w4a16 as w4

    launch = dataclasses.replace(W4A16Launch.for_call(fmt, T, E, I, L, k, layout, pairwise=pairwise), **choices)
    for name, kernel in (("gate_up", launch.gate_up()), ("down", launch.down(4.0, 25.0))):
        key, build = w4.builder(kernel)
        yield name, kernel, compat.compile_to_ptx_on_cpu(key, build, str(tmp_path / name)), (name, T, I, launch)


def _span(kernel) -> int:
    """A launch's K span: the gate/up's split of L, the down's I."""
    from k3fuse.kernels.lib.cute import routed_experts_w4a16 as w4

    return kernel.L // kernel.split if isinstance(kernel, w4.GateUp) else kernel.I


def _x_loads(ptx: str, name: str, where) -> int:
    """Grouped mode's 16-byte activation loads from global memory: the gate/up's read-only (.nc); the down's,
    launched as the SiTU-GLU launch's programmatic dependent, side-effecting plain loads, every one after the
    grid's single wait, which follows the first weight copies (the weight-only rule)."""
    if name == "gate_up":
        assert "griddepcontrol" not in ptx and not re.search(r"ld\.global\.v4\.u32", ptx), where
        return len(re.findall(r"ld\.global\.nc\.v4\.u32", ptx))
    assert ptx.count("griddepcontrol.wait") == 1 and "ld.global.nc.v4" not in ptx, where
    at = ptx.index("griddepcontrol.wait")
    assert ptx.index("cp.async.cg.shared.global") < at < ptx.index("ld.global.v4.u32"), where
    return len(re.findall(r"ld\.global\.v4\.u32", ptx))


@needs_cute
@pytest.mark.parametrize("T,I", W4A16_CASES)
def test_w4a16_expert_gemms_compile_to_ptx(T, I, tmp_path):
    """The CuTe MXFP4 expert GEMMs (gate/up and down) at K3's widths in grouped mode: 16-byte weight and
    activation loads (the down's, launched as the SiTU-GLU launch's dependent, after its one wait), one scale
    byte a row a step, mma.sync m16n8k16 on bf16, the E2M1 pattern by one integer
    multiply a register, one bf16 multiply a register in the loop for ordinary scales and two in the
    loop for wide ones, no spills, no multicast; each k loop is its steps once, marked nounroll
    (ptxas unrolled a 12-step span into straight code that thrashed the instruction cache:
    docs/perf/2026-12-03-w4a16-cute-gemms.md 0i). The ring: the weights and scales by cp.async
    into shared memory, waited for `stages - 1` groups behind, no barrier."""
    from k3fuse.kernels.lib.composite.routed_experts_w4a16 import STAGES
    from k3fuse.kernels.lib.cute import routed_experts_w4a16 as w4

    for name, kernel, ptx, where in _w4a16_launches(T, I, "mxfp4", tmp_path, pairwise=False):
        ops = _ops(ptx)
        mma = len(re.findall(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32", ptx))
        muls = len(re.findall(r"mul\.rn\.bf16x2", ptx))
        stages = kernel.stages
        assert stages == min(STAGES, _span(kernel) // w4.STEP + 1), where
        # the ring's step loops a span: this span's later steps (none if the prologue filled them all),
        # then the next span's first
        ring_loops = 2 if _span(kernel) // w4.STEP > stages - 1 else 1
        # per step and loop copy: 8 mmas; the ordinary loop 32 multiplies for them, the wide one 64
        assert mma == 2 * 8 * ring_loops, (where, mma)
        assert ptx.count('.pragma "nounroll"') >= 3, where
        assert muls == mma // 2 * (4 + 8), (where, muls, mma)
        # the E2M1 pattern by mask, multiply, mask: one integer multiply a register (32 a step), no shifts
        # but the word's one by 8 (docs/perf/2026-12-04-w4a16-cute-few-tokens.md 0l)
        spreads = len(re.findall(r"mul\.lo\.u32 q, q, (?:4160|260);", ptx))
        assert spreads == mma * 4 and "shl.b32 q" not in ptx, (where, spreads)
        # a step: the activations' 4 x 16 bytes from global, the weights' 2 x 16 bytes and the scale
        # words by cp.async (the prologue's stages - 1 steps and one a step loop), read from shared
        assert _x_loads(ptx, name, where) == mma // 8 * 4, where
        cp16 = len(re.findall(r"cp\.async\.cg\.shared\.global \[[^]]+\], \[[^]]+\], 16;", ptx))
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

    for name, kernel, ptx, where in _w4a16_launches(T, I, "int4", tmp_path, pairwise=False):
        ops = _ops(ptx)
        stages = kernel.stages
        ring_loops = 2 if _span(kernel) // w4.STEP > stages - 1 else 1
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
        assert _x_loads(ptx, name, where) == mma // 8 * 4, where
        assert "bar.sync" not in ptx, where
        assert ops["ld.local"] == 0 and ops["st.local"] == 0 and ops["multimem"] == 0, (where, ops)


@needs_cute
@pytest.mark.parametrize("T,I", [(1, 2048), (64, 256)])
def test_w4a16_int4_compiles_at_kimi_k2_widths(T, I, tmp_path):
    """Kimi K2.x's experts (its int4 format's home: 384 experts, top-8, hidden 7168, I = 2048 at TP 1 and
    256 at TP 8): both launches compile with their ring, no spills, in the call's mode (pairwise at 1 token)."""
    from k3fuse.kernels.lib.cute import routed_experts_w4a16 as w4

    for name, kernel, ptx, where in _w4a16_launches(T, I, "int4", tmp_path, L=7168, E=384, k=8):
        ring_loops = 2 if _span(kernel) // w4.STEP > kernel.stages - 1 else 1
        assert len(re.findall(r"mma\.sync\.aligned\.m16n8k16", ptx)) == 8 * ring_loops, where
        assert len(re.findall(r"sub\.rn\.bf16x2", ptx)) == 32 * ring_loops, where
        ops = _ops(ptx)
        assert ops["ld.local"] == 0 and ops["st.local"] == 0, (where, ops)


@needs_cute
@pytest.mark.parametrize("T,I,fmt,choices", [(1, 3072, "mxfp4", {}), (1, 1536, "mxfp4", {}), (2, 1536, "mxfp4", {}),
                                             (1, 384, "mxfp4", {}), (2, 384, "mxfp4", {}), (1, 1536, "int4", {}),
                                             (2, 3072, "int4", {}), (1, 3072, "mxfp4", {"split": 2, "n_tiles": 2})])
def test_w4a16_pairwise_launches_compile_to_ptx(T, I, fmt, choices, tmp_path):
    """The pairwise MLP in two launches whose CTAs stage their activation row in shared memory (among them
    the two MXFP4 launches measured faster unsplit, I = 1536 at 1 token and 384 at 2): the gate/up reads a's
    row (natural order) with 16-byte read-only loads and stores it in word order, the down sums the
    gate/up's fp32 partials and computes the SiTU-GLU (3 exponentials an element), a thread's words
    unrolled; one barrier each, after the staging; the step loops read the activations from shared memory,
    never global; no grid dependency, no spills, no multicast."""
    from k3fuse.kernels.lib.cute import routed_experts_w4a16 as w4

    for name, kernel, ptx, where in _w4a16_launches(T, I, fmt, tmp_path, **choices):
        ops = _ops(ptx)
        ring_loops = 2 if _span(kernel) // w4.STEP > kernel.stages - 1 else 1
        copies = 2 if fmt == "mxfp4" else 1  # MXFP4's ordinary and wide-scale loops
        mma = len(re.findall(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32", ptx))
        assert mma == copies * 8 * ring_loops, (where, mma)
        assert (kernel.pairwise if name == "gate_up" else kernel.situ is not None), where
        # a step: the weights' 2 and the activations' 4 16-byte shared loads, every lane
        assert len(re.findall(r"ld\.shared\.v4\.u32", ptx)) == mma // 8 * 6, (where, ptx.count("ld.shared.v4"))
        assert "@p ld.shared" not in ptx, where
        # the staging, unrolled: a thread's words of the row, 16 bytes each (its loads in flight together)
        words = -(-_span(kernel) // 8 // 128)
        assert len(re.findall(r"st\.shared\.v4\.u32", ptx)) == words, where
        assert len(re.findall(r"bar\.sync|barrier\.sync", ptx)) == 1, where
        # the only 16-byte global loads are the staging's: a's word, or g's and u's halves a split
        loads = len(re.findall(r"ld\.global\.nc\.v4\.u32", ptx))
        assert loads == words * (1 if name == "gate_up" else 4 * kernel.situ.splits), (where, loads)
        assert not re.search(r"ld\.global(\.cg)?\.v4", ptx) and "griddepcontrol" not in ptx, where
        assert ptx.count("ex2.approx") == (0 if name == "gate_up" else 24 * words), where
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
@pytest.mark.parametrize("T,I,fmt,choices", [(1, 1536, "mxfp4", {}), (64, 1536, "mxfp4", {}), (1, 3072, "int4", {}),
                                             (2, 384, "mxfp4", {"split": 2}), (8, 384, "int4", {})])
def test_w4a16_blocked_compiles_to_ptx(T, I, fmt, choices, tmp_path):
    """blocked (block_order's tables): the same launches but `blocked`, as many copies, mmas and shared
    loads, no spills, no multicast (the ring model checks the addresses). At I = 1536 with 1 token its SASS
    step loop is no longer than the row-major one's (the layout moves addresses, not work)."""
    import dataclasses

    rows_major = {n: (k, x) for n, k, x, _ in _w4a16_launches(T, I, fmt, tmp_path / "rows", **choices)}
    for name, kernel, ptx, where in _w4a16_launches(T, I, fmt, tmp_path, layout="blocks", **choices):
        row_kernel, row_ptx = rows_major[name]
        assert kernel == dataclasses.replace(row_kernel, blocked=True), where
        for op in (r"cp\.async\.\w+\.shared\.global", r"mma\.sync", r"ld\.shared"):
            assert len(re.findall(op, ptx)) == len(re.findall(op, row_ptx)), (where, op)
        ops = _ops(ptx)
        assert ops["ld.local"] == 0 and ops["st.local"] == 0 and ops["multimem"] == 0, (where, ops)
        if (T, I, choices) == (1, 1536, {}) and fmt == "mxfp4":
            per_step = _step_loop_sass_per_step(ptx, tmp_path / f"{name}_blocked")
            row_per_step = _step_loop_sass_per_step(row_ptx, tmp_path / f"{name}_row")
            assert per_step <= row_per_step, (where, per_step, row_per_step)
            print(f"{name}: {per_step:.1f} instructions a step blocked, {row_per_step:.1f} row-major")
