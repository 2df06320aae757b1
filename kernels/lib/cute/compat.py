"""Every CuTe DSL version difference k3fuse meets (nvidia-cutlass-dsl 4.3.5 .. 4.8.x) lives here.

Kernels import `cutlass`/`cute` and the helpers below from this module only, so a version
change touches one file. What differs between the versions we run:

- version string: `cutlass.__version__` exists only from 4.4.0 -> `importlib.metadata`.
- `SmemAllocator`: `cutlass.utils` (4.3.5) vs `cutlass.memory` (4.8, the old one deprecated).
- memory-ordered loads/stores: `CopyUniversalOp(memory_order=...)` is honoured on 4.3.x, silently
  ignored on 4.6/4.7 and rejected on 4.8 -> never use it; flags, fences, atomics, the global timer
  and L2 prefetch are inline PTX through `llvm.inline_asm` in `@dsl_user_op`, which all versions share.
- 4.3.5's AST preprocessor re-executes the imports of a kernel's module and resolves
  `from . import x` to `<pkg>.None` (ImportError); kernel modules therefore import this module as
  `from .compat import SELF as compat`.
- compiling without a GPU: 4.8 compiles fully with CUTE_DSL_ARCH=sm_90a; 4.3.5 lowers to PTX and then
  fails its driver check (`compile_to_ptx_on_cpu` handles both).

The compile cache also lives here: one `cute.compile(..., options="--enable-tvm-ffi")` per
specialisation key on fake tensors, never while a CUDA graph is being captured.

The DSL's own on-disk kernel cache: by default it lives under $TMPDIR/<user>/cutlass_python_cache
and compiled kernels are loaded back from it with only a CRC check, so in a shared /tmp another
user could create that directory first and plant one. Before the DSL is imported (k3fuse's kernels
import it only through this module), `own_kernel_cache` points CUTE_DSL_CACHE_DIR at a directory
this user owns and nobody else may write (~/.cache/k3fuse/cute-dsl, or the one already set), or
turns the file cache off (CUTE_DSL_DISABLE_FILE_CACHING=1) when there is none, saying so in a warning.
"""
from __future__ import annotations

import glob
import importlib.metadata
import logging
import os
import stat
import sys
import threading
from typing import Any, Callable

import torch

from k3fuse import runtime

CACHE_DIR_VAR = "CUTE_DSL_CACHE_DIR"
NO_FILE_CACHE_VAR = "CUTE_DSL_DISABLE_FILE_CACHING"


def _private(path: str) -> bool:
    """A real directory (no symlink) owned by this user that nobody else may write."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def own_kernel_cache() -> str | None:
    """Point the CuTe DSL's file cache at a directory this user owns (returned), or turn it off
    (None); must run before the DSL is imported. A directory already given in CUTE_DSL_CACHE_DIR
    is kept if it passes the same check."""
    if os.environ.get(NO_FILE_CACHE_VAR, "").strip() not in ("", "0"):
        return None
    given = os.environ.get(CACHE_DIR_VAR)
    if given:
        path, parents = given, [given]
    else:
        home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        parent = os.path.join(home, "k3fuse")
        path, parents = os.path.join(parent, "cute-dsl"), [parent, os.path.join(parent, "cute-dsl")]
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError:
        pass
    if all(_private(p) for p in parents):
        os.environ[CACHE_DIR_VAR] = path
        return path
    os.environ[NO_FILE_CACHE_VAR] = "1"
    logging.getLogger("k3fuse").warning(
        "k3fuse: the CuTe DSL's kernel file cache is off: %s is not a directory only this user can write "
        "(kernels are compiled in each process; set %s to such a directory to keep them)", path, CACHE_DIR_VAR)
    return None


own_kernel_cache()

try:  # CuTe DSL is optional: without it the Triton / reference paths run.
    import cutlass  # noqa: F401
    import cutlass.cute as cute
    from cutlass import BFloat16, Float16, Float32, Int32, Int64  # noqa: F401
    from cutlass._mlir import ir
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T, dsl_user_op

    HAVE_CUTE = True
    IMPORT_ERROR: str | None = None
except Exception as exc:  # ImportError, or a broken install (missing driver libs, bad wheel)
    HAVE_CUTE = False
    IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
    cute = None  # type: ignore[assignment]


SELF = sys.modules[__name__]  # `from .compat import SELF as compat` (see the 4.3.5 note above)


def cute_version() -> str | None:
    """The installed nvidia-cutlass-dsl version (4.3.5 has no cutlass.__version__)."""
    if not HAVE_CUTE:
        return None
    try:
        return importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:
        import cutlass as _c

        return getattr(_c, "__version__", "unknown")


def version_tuple() -> tuple[int, ...]:
    v = cute_version() or "0"
    return tuple(int(p) for p in v.split(".")[:3] if p.isdigit())


def available() -> bool:
    """CuTe kernels may run: the DSL imports and K3FUSE_DISABLE_CUTE is off, as the TP group agreed
    it (k3fuse.runtime.path_setting: a change on one rank alone is refused)."""
    return HAVE_CUTE and not runtime.path_setting("K3FUSE_DISABLE_CUTE")


if HAVE_CUTE:
    try:  # 4.8: cutlass.memory; 4.3.5: cutlass.utils (deprecated in 4.8)
        from cutlass.memory import SmemAllocator  # type: ignore[attr-defined]
    except Exception:
        from cutlass.utils import SmemAllocator  # type: ignore[no-redef]

    # torch dtype <-> cutlass numeric type
    TORCH2CUTE = {torch.bfloat16: BFloat16, torch.float16: Float16, torch.float32: Float32}

    # ---------------- inline PTX (same in 4.3.5 .. 4.8) -----------------------------------------
    def _addr(ptr, loc, ip):
        """A global pointer's, or an Int64 byte address's, i64 operand."""
        if hasattr(ptr, "toint"):
            return ptr.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip)
        return Int64(ptr).ir_value(loc=loc, ip=ip)

    def _asm(ret, args, text, cons):
        return llvm.inline_asm(ret, args, text, cons, has_side_effects=True,
                               is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)

    def _at(operand: int, offset: int) -> str:
        """A PTX address: operand $n, plus `offset` bytes in the instruction itself (a constant the caller
        knows at compile time: one base register serves several addresses, not an add and a register each)."""
        return f"[${operand}+{int(offset)}]" if offset else f"[${operand}]"

    @dsl_user_op
    def ld_acquire_sys_s32(ptr, *, loc=None, ip=None) -> Int32:
        """Acquire load at system scope: what a peer released before its flag is visible after."""
        return Int32(_asm(T.i32(), [_addr(ptr, loc, ip)], "ld.acquire.sys.global.s32 $0, [$1];", "=r,l"))

    @dsl_user_op
    def ld_relaxed_gpu_s32(ptr, *, loc=None, ip=None) -> Int32:
        """Relaxed (never hoisted, never cached stale) load of a device-local counter."""
        return Int32(_asm(T.i32(), [_addr(ptr, loc, ip)], "ld.relaxed.gpu.global.s32 $0, [$1];", "=r,l"))

    @dsl_user_op
    def st_release_sys_s32(ptr, val, *, loc=None, ip=None) -> None:
        """Release store at system scope: publishes this thread's (and, after a barrier, its CTA's) writes."""
        _asm(None, [_addr(ptr, loc, ip), Int32(val).ir_value(loc=loc, ip=ip)],
             "st.release.sys.global.s32 [$0], $1;", "l,r")

    @dsl_user_op
    def st_relaxed_gpu_s32(ptr, val, *, loc=None, ip=None) -> None:
        _asm(None, [_addr(ptr, loc, ip), Int32(val).ir_value(loc=loc, ip=ip)],
             "st.relaxed.gpu.global.s32 [$0], $1;", "l,r")

    @dsl_user_op
    def atom_add_acq_rel_gpu_s32(ptr, val, *, loc=None, ip=None) -> Int32:
        """Arrival counter: returns the old value; acq_rel so the last arriver sees everyone's work."""
        return Int32(_asm(T.i32(), [_addr(ptr, loc, ip), Int32(val).ir_value(loc=loc, ip=ip)],
                          "atom.acq_rel.gpu.global.add.s32 $0, [$1], $2;", "=r,l,r"))

    @dsl_user_op
    def ld_acquire_sys_s64(ptr, *, loc=None, ip=None) -> Int64:
        """64-bit acquire load at system scope (the flag protocol's epochs never wrap)."""
        return Int64(_asm(T.i64(), [_addr(ptr, loc, ip)], "ld.acquire.sys.global.s64 $0, [$1];", "=l,l"))

    @dsl_user_op
    def st_release_sys_s64(ptr, val, *, loc=None, ip=None) -> None:
        """64-bit release store at system scope (an epoch flag into a peer's memory)."""
        _asm(None, [_addr(ptr, loc, ip), Int64(val).ir_value(loc=loc, ip=ip)],
             "st.release.sys.global.s64 [$0], $1;", "l,l")

    @dsl_user_op
    def atom_add_acq_rel_gpu_u64(ptr, val, *, loc=None, ip=None) -> Int64:
        """64-bit arrival counter (the generation words are int64): returns the old value."""
        return Int64(_asm(T.i64(), [_addr(ptr, loc, ip), Int64(val).ir_value(loc=loc, ip=ip)],
                          "atom.acq_rel.gpu.global.add.u64 $0, [$1], $2;", "=l,l,l"))

    @dsl_user_op
    def fence_acq_rel_sys(*, loc=None, ip=None) -> None:
        """Orders this thread's peer-memory stores before a later flag store (threadfence_system)."""
        _asm(None, [], "fence.acq_rel.sys;", "")

    @dsl_user_op
    def globaltimer_ns(*, loc=None, ip=None) -> Int64:
        """%globaltimer in ns, for the debug spin timeout only (coarse, but monotonic)."""
        return Int64(_asm(T.i64(), [], "mov.u64 $0, %globaltimer;", "=l"))

    # ---------------- pure inline PTX: register math, read-only loads, mma (the W4A16 kernel) --------
    def asm_pure(ret, args, text, cons):
        """Inline PTX without side effects: the compiler may schedule, combine or drop it."""
        return llvm.inline_asm(ret, args, text, cons, has_side_effects=False,
                               is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)

    def struct_type(n: int, elem: str):
        return ir.Type.parse("!llvm.struct<(" + ",".join([elem] * n) + ")>")

    def unpack(st, n: int, cls, loc, ip):
        elem = T.i32() if cls is Int32 else T.f32()
        return tuple(cls(llvm.extractvalue(elem, st, [i], loc=loc, ip=ip)) for i in range(n))

    @dsl_user_op
    def address(ptr, *, loc=None, ip=None) -> Int64:
        """A pointer's address as an Int64 (byte arithmetic past 2^31 elements)."""
        return Int64(ptr.toint(loc=loc, ip=ip))

    @dsl_user_op
    def ld_nc_v4(addr, offset: int = 0, *, loc=None, ip=None):
        """16 read-only bytes (non-coherent path) at addr + offset as four 32-bit words; 16-byte aligned."""
        st = asm_pure(struct_type(4, "i32"), [Int64(addr).ir_value(loc=loc, ip=ip)],
                      f"ld.global.nc.v4.u32 {{$0, $1, $2, $3}}, {_at(4, offset)};", "=r,=r,=r,=r,l")
        return unpack(st, 4, Int32, loc, ip)

    @dsl_user_op
    def ld_v4(addr, offset: int = 0, *, loc=None, ip=None):
        """16 bytes at addr + offset by a plain (weak, L1-cached) load as four 32-bit words: bytes the preceding
        grid wrote (PDL); side-effecting, so never moved above the griddepcontrol.wait that orders it."""
        st = _asm(struct_type(4, "i32"), [Int64(addr).ir_value(loc=loc, ip=ip)],
                  f"ld.global.v4.u32 {{$0, $1, $2, $3}}, {_at(4, offset)};", "=r,=r,=r,=r,l")
        return unpack(st, 4, Int32, loc, ip)

    @dsl_user_op
    def st_v4_b32(addr, v0, v1, v2, v3, *, loc=None, ip=None) -> None:
        """16 bytes, four 32-bit words, to a 16-byte aligned global address."""
        words = [Int32(v).ir_value(loc=loc, ip=ip) for v in (v0, v1, v2, v3)]
        _asm(None, [Int64(addr).ir_value(loc=loc, ip=ip)] + words, "st.global.v4.u32 [$0], {$1, $2, $3, $4};",
             "l,r,r,r,r")

    @dsl_user_op
    def prmt(a, b, selector: int, *, loc=None, ip=None) -> Int32:
        """Bytes of (b:a) picked by `selector`'s nibbles (0x5410: both low halves, 0x7632: both high)."""
        return Int32(asm_pure(T.i32(), [Int32(a).ir_value(loc=loc, ip=ip), Int32(b).ir_value(loc=loc, ip=ip)],
                              f"prmt.b32 $0, $1, $2, {selector:#06x};", "=r,r,r"))

    @dsl_user_op
    def round_bf16(x, *, loc=None, ip=None) -> Float32:
        """x rounded to bf16 (nearest even), as fp32."""
        return Float32(asm_pure(T.f32(), [Float32(x).ir_value(loc=loc, ip=ip)],
                                "{\n.reg .b16 h, z;\nmov.b16 z, 0;\ncvt.rn.bf16.f32 h, $1;\nmov.b32 $0, {z, h};\n}",
                                "=f,f"))

    @dsl_user_op
    def bf16x2(lo, hi, *, loc=None, ip=None) -> Int32:
        """Two fp32 rounded to bf16 (nearest even) in one word, lo in the low half."""
        return Int32(asm_pure(T.i32(), [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)],
                              "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f"))

    @dsl_user_op
    def exp2(x, *, loc=None, ip=None) -> Float32:
        """2^x (ex2.approx, as Triton's exp)."""
        return Float32(asm_pure(T.f32(), [Float32(x).ir_value(loc=loc, ip=ip)], "ex2.approx.ftz.f32 $0, $1;",
                                "=f,f"))

    @dsl_user_op
    def ld_nc_b32(addr, *, loc=None, ip=None) -> Int32:
        """One read-only 32-bit word; addr 4-byte aligned."""
        return Int32(asm_pure(T.i32(), [Int64(addr).ir_value(loc=loc, ip=ip)], "ld.global.nc.b32 $0, [$1];",
                              "=r,l"))

    @dsl_user_op
    def warp_any(v, *, loc=None, ip=None) -> Int32:
        """1 on every lane of the (converged) warp if any lane's v is nonzero, else 0."""
        return Int32(_asm(T.i32(), [Int32(v).ir_value(loc=loc, ip=ip)],
                          "{\n.reg .pred p, q;\nsetp.ne.s32 p, $1, 0;\nvote.sync.any.pred q, p, 0xffffffff;\n"
                          "selp.s32 $0, 1, 0, q;\n}", "=r,r"))

    @dsl_user_op
    def mma_m16n8k16_bf16(a, b, c, *, loc=None, ip=None):
        """d = A (16x16 bf16, 4 regs) @ B (16x8 bf16, 2 regs) + C (fp32, 4 regs): one warp's mma.sync,
        fragments in PTX's m16n8k16 .row.col layout."""
        args = ([Int32(v).ir_value(loc=loc, ip=ip) for v in (*a, *b)]
                + [Float32(v).ir_value(loc=loc, ip=ip) for v in c])
        st = asm_pure(struct_type(4, "f32"), args,
                      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, "
                      "{$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
                      "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
        return unpack(st, 4, Float32, loc, ip)

    # ---------------- cp.async into a thread's own shared-memory slots (the W4A16 kernel's ring) -----
    # side-effecting asm: the compiler keeps them, and the shared loads, in program order, so a slot
    # is read before the copy that reuses it is issued
    @dsl_user_op
    def smem_address(ptr, *, loc=None, ip=None) -> Int32:
        """A shared-memory pointer's 32-bit address in the shared window (cp.async / ld.shared operand)."""
        return Int32(ptr.toint(loc=loc, ip=ip))

    @dsl_user_op
    def cp_async(smem, addr, nbytes: int, cache: str | None = None, smem_offset: int = 0, offset: int = 0, *,
                 loc=None, ip=None) -> None:
        """nbytes (4, 8 or 16) global (addr + offset) -> shared (smem + smem_offset), aligned to them; by
        default 16 bytes skip L1 (`.cg`: the weights are read once), smaller copies must go through it
        (`.ca`); `cache` "ca" keeps a 16-byte copy's line in L1 (bytes that neighbouring copies read again)."""
        cache = cache or ("cg" if nbytes == 16 else "ca")
        assert cache == "ca" or cache == "cg" and nbytes == 16, (cache, nbytes)
        _asm(None, [Int32(smem).ir_value(loc=loc, ip=ip), Int64(addr).ir_value(loc=loc, ip=ip)],
             f"cp.async.{cache}.shared.global {_at(0, smem_offset)}, {_at(1, offset)}, {int(nbytes)};", "r,l")

    @dsl_user_op
    def cp_async_commit(*, loc=None, ip=None) -> None:
        _asm(None, [], "cp.async.commit_group;", "")

    @dsl_user_op
    def cp_async_wait(pending: int, *, loc=None, ip=None) -> None:
        """Wait until at most `pending` of this thread's committed groups are still in flight."""
        _asm(None, [], f"cp.async.wait_group {int(pending)};", "")

    @dsl_user_op
    def ld_shared_v4(smem, offset: int = 0, *, loc=None, ip=None):
        """16 bytes from shared memory (smem + offset) as four 32-bit words; 16-byte aligned."""
        st = _asm(struct_type(4, "i32"), [Int32(smem).ir_value(loc=loc, ip=ip)],
                  f"ld.shared.v4.u32 {{$0, $1, $2, $3}}, {_at(4, offset)};", "=r,=r,=r,=r,r")
        return unpack(st, 4, Int32, loc, ip)

    @dsl_user_op
    def st_shared_v4(smem, v0, v1, v2, v3, *, loc=None, ip=None) -> None:
        """16 bytes, four 32-bit words, to shared memory; 16-byte aligned."""
        words = [Int32(v).ir_value(loc=loc, ip=ip) for v in (v0, v1, v2, v3)]
        _asm(None, [Int32(smem).ir_value(loc=loc, ip=ip)] + words, "st.shared.v4.u32 [$0], {$1, $2, $3, $4};",
             "r,r,r,r,r")

    @dsl_user_op
    def ld_shared_u8(smem, offset: int = 0, *, loc=None, ip=None) -> Int32:
        return Int32(_asm(T.i32(), [Int32(smem).ir_value(loc=loc, ip=ip)], f"ld.shared.u8 $0, {_at(1, offset)};",
                          "=r,r"))

    @dsl_user_op
    def ld_shared_u16(smem, offset: int = 0, *, loc=None, ip=None) -> Int32:
        return Int32(_asm(T.i32(), [Int32(smem).ir_value(loc=loc, ip=ip)], f"ld.shared.u16 $0, {_at(1, offset)};",
                          "=r,r"))

    @dsl_user_op
    def st_f32(addr, v, *, loc=None, ip=None) -> None:
        _asm(None, [Int64(addr).ir_value(loc=loc, ip=ip), Float32(v).ir_value(loc=loc, ip=ip)],
             "st.global.f32 [$0], $1;", "l,f")

    @dsl_user_op
    def st_bf16(addr, v, *, loc=None, ip=None) -> None:
        """v rounded to bf16 (nearest even) and stored."""
        _asm(None, [Int64(addr).ir_value(loc=loc, ip=ip), Float32(v).ir_value(loc=loc, ip=ip)],
             "{\n.reg .b16 h;\ncvt.rn.bf16.f32 h, $1;\nst.global.b16 [$0], h;\n}", "l,f")

    SENTINEL = -2147483648  # bit pattern of fp32 -0.0 (0x80000000): "not written yet" (Lamport)

    @dsl_user_op
    def ld_volatile_v4_b32(ptr, *, loc=None, ip=None):
        """16-byte volatile load (re-read from memory on every poll), as four 32-bit words."""
        st = _asm(ir.Type.parse("!llvm.struct<(i32,i32,i32,i32)>"), [_addr(ptr, loc, ip)],
                  "ld.volatile.global.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l")
        return tuple(Int32(llvm.extractvalue(T.i32(), st, [i], loc=loc, ip=ip)) for i in range(4))

    @dsl_user_op
    def any_sentinel4(v0, v1, v2, v3, *, loc=None, ip=None) -> Int32:
        """1 if any of the four words is the Lamport sentinel 0x80000000, else 0."""
        args = [Int32(v).ir_value(loc=loc, ip=ip) for v in (v0, v1, v2, v3)]
        return Int32(_asm(T.i32(), args,
                          "{\n.reg .pred p0, p1, p2, p3;\n"
                          "setp.eq.s32 p0, $1, 0x80000000;\nsetp.eq.s32 p1, $2, 0x80000000;\n"
                          "setp.eq.s32 p2, $3, 0x80000000;\nsetp.eq.s32 p3, $4, 0x80000000;\n"
                          "or.pred p0, p0, p1;\nor.pred p2, p2, p3;\nor.pred p0, p0, p2;\n"
                          "selp.s32 $0, 1, 0, p0;\n}", "=r,r,r,r,r"))

    @dsl_user_op
    def st_v4_b32_splat(ptr, val, *, loc=None, ip=None) -> None:
        """16-byte store of one 32-bit word four times (Lamport buffer reset to the sentinel)."""
        _asm(None, [_addr(ptr, loc, ip), Int32(val).ir_value(loc=loc, ip=ip)],
             "st.global.v4.u32 [$0], {$1, $1, $1, $1};", "l,r")

    @dsl_user_op
    def b32_as_f32(v, *, loc=None, ip=None) -> Float32:
        return Float32(llvm.bitcast(T.f32(), Int32(v).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))

    @dsl_user_op
    def griddep_launch_dependents(*, loc=None, ip=None) -> None:
        """PDL: let the next kernel (launched with use_pdl) start while this grid still runs."""
        _asm(None, [], "griddepcontrol.launch_dependents;", "")

    @dsl_user_op
    def griddep_wait(*, loc=None, ip=None) -> None:
        """PDL: wait until the preceding grid has completed and its memory is visible."""
        _asm(None, [], "griddepcontrol.wait;", "")

    @dsl_user_op
    def nanosleep(ns, *, loc=None, ip=None) -> None:
        """Back off between polls so a spinning CTA does not steal issue slots or L2 bandwidth."""
        _asm(None, [Int32(ns).ir_value(loc=loc, ip=ip)], "nanosleep.u32 $0;", "r")

    @dsl_user_op
    def prefetch_l2_bulk(ptr, nbytes, *, loc=None, ip=None) -> None:
        """Bulk L2 prefetch (sm_90): size and address 16 B aligned."""
        _asm(None, [_addr(ptr, loc, ip), Int32(nbytes).ir_value(loc=loc, ip=ip)],
             "cp.async.bulk.prefetch.L2.global [$0], $1;", "l,r")

    # ---------------- fake tensors for compile-once ---------------------------------------------
    def fake_tensor(dtype, shape, stride, align: int = 16):
        """A compile-time tensor; ints in shape/stride are static, `cute.sym_int*` dynamic."""
        return cute.runtime.make_fake_tensor(dtype, shape, stride=stride, assumed_align=align)

    def fake_stream():
        """The TVM-FFI env stream: calls run on torch's current stream (graph capture included)."""
        return cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)


# ---------------- compile cache -----------------------------------------------------------------
class CompileWhileCapturing(RuntimeError):
    """A kernel variant was first needed inside CUDA-graph capture: warm it up before capturing."""


_cache: dict[Any, Any] = {}
_cache_lock = threading.Lock()   # cute.compile is not thread-safe (MLIR thread-local state)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def compiled(key: Any, build: Callable[[], Any], options: str = "--enable-tvm-ffi") -> Any:
    """The compiled kernel for `key`, compiling once with `build() -> (jit_fn, *fake_args)`."""
    fn = _cache.get(key)
    if fn is not None:
        return fn
    if _capturing():
        raise CompileWhileCapturing(
            f"CuTe kernel {key!r} is not compiled yet and a CUDA graph is being captured; "
            "call the op once (warm-up) before capture")
    with _cache_lock:
        fn = _cache.get(key)
        if fn is None:
            jit_fn, *args = build()
            fn = cute.compile(jit_fn, *args, options=options)
            _cache[key] = fn
    return fn


def compile_to_ptx_on_cpu(key: Any, build: Callable[[], Any], dump_dir: str) -> str:
    """Compile without a GPU and return the PTX text (CPU CI).

    4.8.x with CUTE_DSL_ARCH=sm_90a compiles fully; 4.3.5 lowers to PTX, writes it to the dump
    directory and then fails at its driver check / JIT link, which is accepted here only on 4.3.x
    and only if this compile wrote a PTX file. Any other failure propagates.
    """
    os.makedirs(dump_dir, exist_ok=True)
    jit_fn, *args = build()
    import time

    t0 = time.time() - 1.0   # a re-compile overwrites a same-named file: compare times, not names
    try:
        fn = cute.compile(jit_fn, *args, options=f"--enable-tvm-ffi --keep-ptx --dump-dir {dump_dir}")
        ptx = getattr(fn, "__ptx__", None)
        if ptx:
            return ptx
    except Exception:
        # 4.3.x without a driver: the first compile raises CudaDriverDependencyError, later ones
        # fail to JIT-link the driver runtime ("Unknown function"); both after the PTX is written.
        # From 4.4 on a CPU compile must succeed, so any error there is real.
        if version_tuple() >= (4, 4):
            raise
    new = sorted((f for f in glob.glob(os.path.join(dump_dir, "*.ptx")) if os.path.getmtime(f) >= t0),
                 key=os.path.getmtime)
    if not new:
        raise RuntimeError(f"CuTe compile of {key!r} wrote no PTX to {dump_dir}")
    with open(new[-1]) as f:
        return f.read()
