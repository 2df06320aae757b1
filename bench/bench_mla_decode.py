"""MLA decode benchmark: k3fuse.mla_decode vs the plain spelling under torch.compile vs the peers.

K3's attention core at decode on one GPU: batch x context x heads a rank x cache dtype, every
sequence at the full context (page 64). Arms, all in one run:
  k3fuse     torch.ops.k3fuse.mla_decode in strict mode (the Triton split kernel + combine);
  compiled   the op's stock sequence (lib/reference/mla_decode.py plain_spelling: gather, fp32
             scores, mask, softmax, weighted sum) under torch.compile(dynamic=True);
  vllm       vLLM's Triton MLA decode kernel (decode_attention_fwd over the paged cache, page 64,
             num_kv_splits by vLLM's TRITON_MLA rule), from .mla_peer/ (scripts/prep_mla_peer.py);
  flashinfer FlashInfer's BatchMLAPagedAttentionWrapper (SM90: FA3, JIT-compiled with nvcc on first
             use; bf16 and fp8 with its per-tensor scale), from .mla_peer/;
  k3fuse_sN  (--splits) the kernel at other split counts, to check split_count's choice.
Each arm's output is checked once against the fp32 plain spelling before it is timed (a mismatch
is reported, not timed). Timing: CUDA events over CUDA-graph replays (k3fuse.tools.bench.timing),
medians; a graph holds STEPS calls, each over its own copy of the cache when one cache is smaller
than ROTATE_L2 x the L2, so every call reads from HBM. Bandwidth: the op's floor bytes
(kernels/ops/mla_decode.py decode_bytes: the cache entries, q, out) over the time; % of the
nominal HBM bandwidth (H100 SXM 3.35 TB/s, H200 4.8 TB/s), of a device-to-device copy (read +
write bytes) and of a streaming read, both measured in this run. Points that do not fit in memory
are skipped and say so.

    python scripts/prep_mla_peer.py --vllm-wheel W --flashinfer-wheel W --tvm-ffi-wheel W   # once, anywhere
    python bench/bench_mla_decode.py --json out/bench_mla_decode.json
    python bench/bench_mla_decode.py --prepare-peer   # compile FlashInfer's MLA modules only (CPU, nvcc)
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import time
import traceback
import types

import torch

SCALE = 192 ** -0.5
PAGE = 64
STEPS_MIN = 4
ROTATE_L2 = 4  # copies of a small cache so that a graph's calls read ROTATE_L2 x the L2 from HBM
NOMINAL = {"H100": 3.35e12, "H200": 4.8e12}
PEER_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".mla_peer")
PEER_SITE = "/tmp/k3fuse_mla_peer"
FP8 = torch.float8_e4m3fn
CACHE_DTYPES = {"bf16": torch.bfloat16, "fp8": FP8}


# --- the peers ---------------------------------------------------------------------------------------------
def load_vllm_peer():
    """vLLM's triton_decode_attention.py as extracted from its wheel; its two vLLM imports (the
    platform, triton re-exported) answered by stand-ins: a CUDA platform, the real triton."""
    path = os.path.join(PEER_DIR, "vllm_triton_decode_attention.py")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} missing: run scripts/prep_mla_peer.py --vllm-wheel ...")
    import triton
    import triton.language as tl

    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = types.SimpleNamespace(is_rocm=lambda: False)
    triton_utils = types.ModuleType("vllm.triton_utils")
    triton_utils.triton, triton_utils.tl = triton, tl
    for name, module in (("vllm", types.ModuleType("vllm")), ("vllm.platforms", platforms),
                         ("vllm.triton_utils", triton_utils)):
        sys.modules.setdefault(name, module)
    spec = importlib.util.spec_from_file_location("vllm_triton_decode_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def vllm_num_kv_splits(max_seq_len: int, sm_count: int) -> int:
    """vLLM's TRITON_MLA rule (v1/attention/backends/mla/triton_mla.py): next_pow2(max_len // 512),
    at most 2 x the SMs."""
    ideal = 1 << max(0, (max(1, max_seq_len // 512) - 1).bit_length())
    return min(ideal, 2 * sm_count)


def vllm_arm(module, q, cache, table, lens, kv_scale, out):
    B, H, _ = q.shape
    k_buffer = cache.unsqueeze(2)  # [pages, page, 1 kv head, 576]
    splits = vllm_num_kv_splits(int(lens.max()), torch.cuda.get_device_properties(q.device).multi_processor_count)
    logits = torch.empty((B, H, splits, 513), dtype=torch.float32, device=q.device)
    lse = torch.empty((B, H), dtype=q.dtype, device=q.device)

    def call():
        module.decode_attention_fwd(q, k_buffer, k_buffer[..., :512], out, lse, table, lens, logits, splits, SCALE,
                                    page_size=cache.shape[1], k_scale=kv_scale, v_scale=kv_scale, is_mla=True)
    return call


def flashinfer_import():
    """FlashInfer from .mla_peer/flashinfer.tar.xz (unpacked once into PEER_SITE), its JIT cache there."""
    archive = os.path.join(PEER_DIR, "flashinfer.tar.xz")
    if not os.path.exists(archive):
        raise FileNotFoundError(f"{archive} missing: run scripts/prep_mla_peer.py --flashinfer-wheel ...")
    if not os.path.isdir(os.path.join(PEER_SITE, "flashinfer")):
        os.makedirs(PEER_SITE, exist_ok=True)
        with tarfile.open(archive) as tar:
            tar.extractall(PEER_SITE, filter="data")
        wheels = [w for w in os.listdir(PEER_DIR) if w.startswith("apache_tvm_ffi") and w.endswith(".whl")]
        if wheels:
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                            "--target", PEER_SITE, os.path.join(PEER_DIR, wheels[0])], check=True)
    os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", PEER_SITE)
    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    if PEER_SITE not in sys.path:
        sys.path.insert(0, PEER_SITE)
    import flashinfer
    from flashinfer.mla import BatchMLAPagedAttentionWrapper

    return flashinfer, BatchMLAPagedAttentionWrapper


def flashinfer_arm(wrapper_type, q, cache, table, lens, kv_scale, out):
    B, H, _ = q.shape
    dev, page = q.device, cache.shape[1]
    pages = (lens + page - 1) // page
    kv_indptr = torch.zeros(B + 1, dtype=torch.int32, device=dev)
    kv_indptr[1:] = torch.cumsum(pages, 0)
    kv_indices = torch.cat([table[b, :int(pages[b])] for b in range(B)])
    qo_indptr = torch.arange(B + 1, dtype=torch.int32, device=dev)
    workspace = torch.empty(256 << 20, dtype=torch.int8, device=dev)
    wrapper = wrapper_type(workspace, use_cuda_graph=True, qo_indptr=qo_indptr, kv_indptr=kv_indptr,
                           kv_indices=kv_indices, kv_len_arr=lens, backend="fa3")
    fp8 = cache.dtype == FP8
    wrapper.plan(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_len_arr=lens, num_heads=H,
                 head_dim_ckv=512, head_dim_kpe=64, page_size=page, causal=False, sm_scale=SCALE,
                 q_data_type=q.dtype, kv_data_type=cache.dtype,
                 **({"scale_mode": "kv-per-tensor"} if fp8 else {}))
    scale = float(kv_scale) if fp8 else None
    extra = {"ckv_scale": scale, "kpe_scale": scale} if fp8 else {}

    def call():
        wrapper.run(q_nope=q[..., :512], q_pe=q[..., 512:], ckv_cache=cache[..., :512], kpe_cache=cache[..., 512:],
                    out=out, **extra)
    return call


def prepare_flashinfer() -> None:
    """Compile FlashInfer's SM90 MLA modules (bf16 and fp8 caches) into its JIT cache, on a tiny call."""
    _, wrapper_type = flashinfer_import()
    for cache_dtype in (torch.bfloat16, FP8):
        t0 = time.perf_counter()
        q, cache, table, lens, kv_scale = make_inputs(1, 6, 128, cache_dtype, copies=1)[0]
        out = torch.empty(1, 6, 512, dtype=torch.bfloat16, device="cuda")
        flashinfer_arm(wrapper_type, q, cache, table, lens, kv_scale, out)()
        torch.cuda.synchronize()
        print(f"flashinfer MLA {cache_dtype}: ready in {time.perf_counter() - t0:.0f} s", flush=True)


# --- inputs, measurement -------------------------------------------------------------------------------------
def make_inputs(B, heads, ctx, cache_dtype, copies, seed=0):
    """`copies` independent (q, cache, table, lens, kv_scale), pages shuffled within each cache;
    entries N(0, 1/4) (fp8: stored / its scale of 1/4), filled a slab at a time (no full fp32 copy)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    width = -(-ctx // PAGE)
    kv_scale = torch.tensor([0.25], device="cuda") if cache_dtype == FP8 else None
    out = []
    for _ in range(copies):
        blocks = B * width
        cache = torch.empty(blocks, PAGE, 576, dtype=cache_dtype, device="cuda")
        slab = max(1, (1 << 26) // (PAGE * 576))
        for i in range(0, blocks, slab):
            part = torch.randn(cache[i:i + slab].shape, generator=g, device="cuda") * 0.5
            cache[i:i + slab] = (part / kv_scale if kv_scale is not None else part).to(cache_dtype)
        table = torch.randperm(blocks, generator=g, device="cuda").int().view(B, width)
        lens = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
        q = (torch.randn(B, heads, 576, generator=g, device="cuda") * 0.5).bfloat16()
        out.append((q, cache, table, lens, kv_scale))
    return out


def read_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes/s of a streaming read (a Triton sum over 16-byte vectors), the read-only floor."""
    import triton
    import triton.language as tl

    @triton.jit
    def _read(x, out, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(x + i, mask=i < n, other=0, eviction_policy="evict_first")
        tl.atomic_add(out, tl.sum(v, 0))

    x = torch.ones(nbytes // 4, dtype=torch.int32, device="cuda")
    acc = torch.zeros(1, dtype=torch.int32, device="cuda")
    grid = (triton.cdiv(x.numel(), 8192),)
    _read[grid](x, acc, x.numel(), BLOCK=8192, num_warps=8)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        _read[grid](x, acc, x.numel(), BLOCK=8192, num_warps=8)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return nbytes / sorted(times)[len(times) // 2]


def fits(nbytes: float) -> bool:
    free, _ = torch.cuda.mem_get_info()
    return nbytes < 0.85 * free


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="1,8,64")
    ap.add_argument("--context", default="1024,4096,8192,32768,131072")
    ap.add_argument("--heads", default="6,3,12", help="heads a rank: 6 (TP16), 3 (TP32), 12 (TP8)")
    ap.add_argument("--cache", default="bf16,fp8")
    ap.add_argument("--arms", default="k3fuse,compiled,vllm,flashinfer")
    ap.add_argument("--compiled-heads", default="6", help="heads the compiled arm runs at (its compiles are slow)")
    ap.add_argument("--splits", default="", help="extra k3fuse arms at these split counts, e.g. 1,32,132")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--json", default=None)
    ap.add_argument("--prepare-peer", action="store_true", help="only compile FlashInfer's MLA modules")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.prepare_peer:
        prepare_flashinfer()
        return 0

    import k3fuse
    from k3fuse.kernels.lib.reference import mla_decode as reference
    from k3fuse.kernels.lib.triton import mla_decode as kernel
    from k3fuse.kernels.ops.mla_decode import decode_bytes
    from k3fuse.tools.bench.timing import capture, copy_bandwidth, median, time_graph

    props = torch.cuda.get_device_properties(0)
    name = torch.cuda.get_device_name()
    nominal = next((v for k, v in NOMINAL.items() if k in name), None)
    copy_bw, read_bw = copy_bandwidth(torch.device("cuda")), read_bandwidth()
    print(f"{name}: {props.multi_processor_count} SMs, L2 {props.L2_cache_size / 2**20:.0f} MiB; copy "
          f"{copy_bw / 1e12:.2f} TB/s (read + write), read {read_bw / 1e12:.2f} TB/s, nominal "
          f"{nominal / 1e12 if nominal else float('nan'):.2f} TB/s", flush=True)

    arms = [a for a in args.arms.split(",") if a]
    peers, peer_errors = {}, {}
    if "vllm" in arms:
        try:
            peers["vllm"] = load_vllm_peer()
        except Exception as exc:  # the table says why the peer did not run
            peer_errors["vllm"] = f"{type(exc).__name__}: {exc}"
    if "flashinfer" in arms:
        try:
            peers["flashinfer"] = flashinfer_import()[1]
        except Exception as exc:
            peer_errors["flashinfer"] = f"{type(exc).__name__}: {exc}"
    for peer, error in peer_errors.items():
        print(f"peer {peer} unavailable: {error}", flush=True)
    compiled = torch.compile(reference.plain_spelling, dynamic=True)
    compiled_heads = {int(h) for h in args.compiled_heads.split(",") if h}
    extra_splits = [int(s) for s in args.splits.split(",") if s]

    rows = []
    for cache_name in args.cache.split(","):
        cache_dtype = CACHE_DTYPES[cache_name]
        for heads in (int(h) for h in args.heads.split(",")):
            for B in (int(b) for b in args.batch.split(",")):
                for ctx in (int(c) for c in args.context.split(",")):
                    row = {"cache": cache_name, "heads": heads, "batch": B, "context": ctx}
                    floor = decode_bytes(B * ctx, B, heads, cache_dtype)
                    row["cache_bytes"], row["bytes"] = floor.cache, floor.total
                    copies = max(1, min(64, -(-ROTATE_L2 * props.L2_cache_size // floor.cache)))
                    if not fits(copies * floor.cache * 1.1):
                        row["skipped"] = f"cache {copies * floor.cache / 1e9:.1f} GB does not fit"
                        rows.append(row)
                        print(f"{cache_name} h{heads} B{B} ctx{ctx}: {row['skipped']}", flush=True)
                        continue
                    sets = make_inputs(B, heads, ctx, cache_dtype, copies, seed=B + ctx)
                    steps = max(STEPS_MIN, copies)
                    outs = [torch.empty(B, heads, 512, dtype=torch.bfloat16, device="cuda") for _ in range(steps)]
                    expect = reference.plain_spelling(*sets[0][:4], SCALE, sets[0][4]).float()
                    calls = {}
                    if "k3fuse" in arms:
                        calls["k3fuse"] = [(lambda s=s: torch.ops.k3fuse.mla_decode(*s[:4], SCALE, s[4], True))
                                           for s in (sets * steps)[:steps]]  # strict: a fallback raises
                        row["splits"] = kernel.split_count(B, heads, ctx, props.multi_processor_count,
                                                           block_n=kernel.config_for(cache_dtype).block_n,
                                                           entry_bytes=576 * cache_dtype.itemsize,
                                                           programs_per_sm=kernel.config_for(cache_dtype).programs_per_sm)
                    for n in extra_splits:
                        calls[f"k3fuse_s{n}"] = [(lambda s=s, o=o, n=n: kernel.run(*s[:4], SCALE, s[4], out=o, splits=n))
                                                 for s, o in zip(sets * steps, outs)]
                    if "compiled" in arms and heads in compiled_heads:
                        if fits(floor.cache * 2 / cache_dtype.itemsize * 4 + floor.cache * copies):
                            calls["compiled"] = [(lambda s=s: compiled(*s[:4], SCALE, s[4])) for s in sets * steps]
                        else:
                            row["compiled"] = "skipped: its fp32 gather does not fit"
                    for peer, module in peers.items():
                        try:
                            build = vllm_arm if peer == "vllm" else flashinfer_arm
                            calls[peer] = [build(module, *s, o) for s, o in zip(sets * steps, outs)]
                        except Exception as exc:
                            row[peer] = f"failed: {type(exc).__name__}: {exc}"
                    for arm, fns in calls.items():
                        fns = fns[:steps]
                        try:
                            got = fns[0]()
                            got = outs[0] if got is None else got
                            torch.cuda.synchronize()
                            err = float((got.float() - expect).abs().max() / expect.abs().max().clamp_min(1e-6))
                            if not err < 2e-2:
                                row[arm] = f"mismatch: max error {err:.3g} of the largest output"
                                continue
                            graph = capture(lambda: [f() for f in fns], warmup=2)
                            us = median(time_graph(graph, steps, args.replays))
                            row[arm] = us
                            row[f"{arm}_gbs"] = floor.total / us / 1e3
                            del graph
                        except Exception as exc:
                            row[arm] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                            if os.environ.get("K3FUSE_BENCH_TRACEBACK"):
                                traceback.print_exc()
                        torch.cuda.synchronize()
                    us = row.get("k3fuse")
                    if isinstance(us, float):
                        bw = floor.total / (us * 1e-6)
                        row["pct_nominal"] = 100 * bw / nominal if nominal else None
                        row["pct_copy"] = 100 * bw / copy_bw
                        row["pct_read"] = 100 * bw / read_bw
                        row["floor_copy_us"] = floor.total / copy_bw * 1e6
                    rows.append(row)
                    print_row(row, extra_splits, flush=True)
                    del sets, outs, calls, expect
                    torch.cuda.empty_cache()
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"device": name, "sms": props.multi_processor_count, "copy_bandwidth": copy_bw,
                       "read_bandwidth": read_bw, "nominal_bandwidth": nominal, "page": PAGE, "scale": SCALE,
                       "peer_errors": peer_errors, "torch": torch.__version__, "rows": rows}, f, indent=2)
    return 0


def print_row(row: dict, extra_splits, flush=True) -> None:
    """One line a point: µs of each arm, the kernel's GB/s and % of nominal / copy / read, speedups."""
    head = f"{row['cache']:>4} h{row['heads']:<2} B{row['batch']:<2} ctx{row['context']:<6}"
    if "skipped" in row:
        print(f"{head} skipped: {row['skipped']}", flush=flush)
        return

    def cell(arm):
        v = row.get(arm)
        return f"{arm} {v:8.1f}µs" if isinstance(v, float) else (f"{arm} {v}" if v else "")

    parts = [cell(a) for a in ("k3fuse", "compiled", "vllm", "flashinfer", *[f"k3fuse_s{n}" for n in extra_splits])]
    stats = ""
    if isinstance(row.get("k3fuse"), float):
        stats = (f" | {row['k3fuse_gbs']:6.0f} GB/s, {row['pct_copy']:5.1f}% copy, {row['pct_read']:5.1f}% read"
                 + (f", {row['pct_nominal']:5.1f}% nominal" if row.get("pct_nominal") else "")
                 + f", floor {row['floor_copy_us']:.1f}µs, S={row.get('splits')}")
        for peer in ("vllm", "flashinfer", "compiled"):
            if isinstance(row.get(peer), float):
                stats += f", {row[peer] / row['k3fuse']:.2f}x vs {peer}"
    print(head + " " + "  ".join(p for p in parts if p) + stats, flush=flush)


if __name__ == "__main__":
    sys.exit(main())
