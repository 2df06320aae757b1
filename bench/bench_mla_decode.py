"""MLA decode benchmark: k3fuse.mla_decode, its kernel variants and split counts, beside the peers.

K3's attention core at decode on one GPU: batch x context x heads a rank x cache dtype, every
sequence at the full context (page 64). Arms, all in one run:
  k3fuse     torch.ops.k3fuse.mla_decode in strict mode (the default variant at split_count's S);
  <variant>  the split kernel + combine as kernels/lib/triton/mla_decode.py VARIANTS[<variant>]
             configures them, at split_count's S for that variant (--variants-bf16 / --variants-fp8);
  <variant>@S  the same at S splits (--splits: counts, or xF for F times the model's S), to check and
             recalibrate split_count;
  compiled   the op's stock sequence (lib/reference/mla_decode.py plain_spelling: gather, fp32
             scores, mask, softmax, weighted sum) under torch.compile(dynamic=True) (--arms compiled);
  vllm       vLLM's Triton MLA decode kernel (decode_attention_fwd over the paged cache, page 64,
             num_kv_splits by vLLM's TRITON_MLA rule), from .mla_peer/ (scripts/prep_mla_peer.py);
  flashinfer FlashInfer's BatchMLAPagedAttentionWrapper (SM90: FA3, JIT-compiled with nvcc on first
             use; bf16 and fp8 with its per-tensor scale), from .mla_peer/.
Each arm's output is checked once against the fp32 plain spelling before it is timed (a mismatch
is reported, not timed). Timing: CUDA events over CUDA-graph replays (k3fuse.tools.bench.timing),
medians; a graph holds STEPS calls, each over its own copy of the cache when one cache is smaller
than ROTATE_L2 x the L2, so every call reads from HBM. Bandwidth: the op's floor bytes
(kernels/ops/mla_decode.py decode_bytes: the cache entries, q, out) over the time; the floor is
those bytes at the card's nominal HBM bandwidth (k3fuse.tools.bench.report.NOMINAL_HBM_BPS), and
a device-to-device copy's rate (read + write bytes) and a streaming read's, both measured in this
run, are shown beside it. The latency probes time what no kernel of this op can avoid: an empty
launch in a graph, and the op on one page of 64 tokens (one split; two splits + the combine, with
and without PDL). Points that do not fit in memory are skipped and say so. The JSON is rewritten after every
point, so a run cut short keeps what it measured.

    python scripts/prep_mla_peer.py --vllm-wheel W --flashinfer-wheel W --tvm-ffi-wheel W   # once, anywhere
    python -m bench.bench_mla_decode --json out/bench_mla_decode.json
    python -m bench.bench_mla_decode --prepare-peer   # compile FlashInfer's MLA modules only
    python -m bench.bench_mla_decode --gate-layer --batch 1,8,64 --context 4096,32768   # the output gate's arms

--gate-layer times K3's MLA attention block instead (MLADecode: the q / kv projections, the append, the core, W_UV,
the output gate, W_o and its all-reduce; rank 0 of TP 16: 6 heads, K3's widths, a stand-in for the collective),
compiled by k3fuse with the mla_decode rule's two output-gate arms (patterns/mla_decode.py: "inline",
"side_stream") under the eager compiler (the only one that keeps the side stream), and "inline" under Inductor
(what serving compiles), each in a CUDA graph of STEPS_MIN calls, pages of 64.
"""
from __future__ import annotations

import argparse
import dataclasses
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
PROBE_CALLS = 1024
PEER_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".mla_peer")
PEER_SITE = "/tmp/k3fuse_mla_peer"
FP8 = torch.float8_e4m3fn
CACHE_DTYPES = {"bf16": torch.bfloat16, "fp8": FP8}
PEERS = ("vllm", "flashinfer")


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
    # decode_attention_fwd makes a CPU tensor of 1.0 for a missing scale, which a graph capture refuses
    # to copy: the unit scales are made here, on the GPU, before the capture, as vLLM's backend does
    scale = kv_scale if kv_scale is not None else torch.ones((), dtype=torch.float32, device=q.device)

    def call():
        module.decode_attention_fwd(q, k_buffer, k_buffer[..., :512], out, lse, table, lens, logits, splits, SCALE,
                                    page_size=cache.shape[1], k_scale=scale, v_scale=scale, is_mla=True)
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
    import flashinfer.mla

    return flashinfer.mla


def flashinfer_arm(mla, q, cache, table, lens, kv_scale, out):
    """FlashInfer's current API: a plan from canonical CSR metadata (MLAPlanMetadata.csr), packed
    query and cache tensors ([B, H, 576], [pages, page, 576]) at run."""
    B, H, _ = q.shape
    dev, page = q.device, cache.shape[1]
    pages = (lens + page - 1) // page
    kv_indptr = torch.zeros(B + 1, dtype=torch.int32, device=dev)
    kv_indptr[1:] = torch.cumsum(pages, 0)
    kv_indices = torch.cat([table[b, :int(pages[b])] for b in range(B)])
    qo_indptr = torch.arange(B + 1, dtype=torch.int32, device=dev)
    workspace = torch.empty(256 << 20, dtype=torch.int8, device=dev)
    wrapper = mla.BatchMLAPagedAttentionWrapper(workspace, use_cuda_graph=True, qo_indptr=qo_indptr,
                                                kv_indptr=kv_indptr, kv_indices=kv_indices, kv_len_arr=lens,
                                                backend="fa3")
    fp8 = cache.dtype == FP8
    wrapper.plan(metadata=mla.MLAPlanMetadata.csr(qo_indptr, kv_indptr, kv_indices, lens), num_heads=H,
                 head_dim_ckv=512, head_dim_kpe=64, page_size=page, causal=False, sm_scale=SCALE,
                 q_data_type=q.dtype, kv_data_type=cache.dtype,
                 **({"scale_mode": "kv-per-tensor"} if fp8 else {}))
    scale = float(kv_scale) if fp8 else None
    extra = {"ckv_scale": scale, "kpe_scale": scale} if fp8 else {}

    def call():
        wrapper.run(query=q, kv_cache=cache, out=out, **extra)
    return call


def prepare_flashinfer() -> None:
    """Compile FlashInfer's SM90 MLA modules (bf16 and fp8 caches) into its JIT cache, on a tiny call."""
    mla = flashinfer_import()
    for cache_dtype in (torch.bfloat16, FP8):
        t0 = time.perf_counter()
        q, cache, table, lens, kv_scale = make_inputs(1, 6, 128, cache_dtype, copies=1)[0]
        out = torch.empty(1, 6, 512, dtype=torch.bfloat16, device="cuda")
        flashinfer_arm(mla, q, cache, table, lens, kv_scale, out)()
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


def fits(nbytes: float) -> bool:
    free, _ = torch.cuda.mem_get_info()
    return nbytes < 0.85 * free


def split_arms(spec: str, chosen: int) -> list[int]:
    """--splits entries: counts as given, xF as F times the model's choice (at least 1)."""
    out = []
    for item in (s for s in spec.split(",") if s):
        n = max(1, round(chosen * float(item[1:]))) if item.startswith("x") else int(item)
        if n != chosen and n not in out:
            out.append(n)
    return out


def probes(kernel, replays: int) -> dict[str, float]:
    """What no call of this op escapes, in µs a call inside a CUDA graph of PROBE_CALLS calls: an empty
    Triton launch; the op on one page of 64 tokens (its own copy each call, PROBE_CALLS x 74 KB past
    the L2, so its reads come from HBM) in one split (the split kernel alone), and in two splits (split
    kernel + combine) with the combine launched plainly and behind PDL."""
    import triton
    import triton.language as tl  # noqa: F401  (triton.jit needs it importable)

    from k3fuse.tools.bench.timing import capture, median, time_graph

    @triton.jit
    def _empty(x):
        pass

    x = torch.zeros(1, device="cuda")
    n = PROBE_CALLS
    result = {"empty_launch": median(time_graph(capture(lambda: [_empty[(1,)](x) for _ in range(n)]), n, replays))}
    sets = make_inputs(1, 6, PAGE, torch.bfloat16, copies=n)
    outs = [torch.empty(1, 6, 512, dtype=torch.bfloat16, device="cuda") for _ in range(n)]
    base = kernel.config_for(torch.bfloat16)
    for name, splits, cfg in (("page_S1", 1, base),
                              ("page_S2_combine", 2, dataclasses.replace(base, pdl=False)),
                              ("page_S2_combine_pdl", 2, dataclasses.replace(base, pdl=True))):
        calls = [(lambda s=s, o=o, c=cfg, k=splits: kernel.run(*s[:4], SCALE, None, out=o, config=c, splits=k))
                 for s, o in zip(sets, outs)]
        result[name] = median(time_graph(capture(lambda calls=calls: [f() for f in calls]), n, replays))
    return result


def _warm_task(task: tuple) -> str:
    """One compile (a worker process of `warm`): the kernel `task` names, launched once on tiny inputs."""
    t0 = time.perf_counter()
    try:
        from k3fuse.kernels.lib.triton import mla_decode as kernel

        kind, *spec = task
        if kind == "split":
            variant, cache_name, page, splits = spec
            cache_dtype = CACHE_DTYPES[cache_name]
            kv_scale = torch.ones(1, device="cuda") if cache_dtype == FP8 else None
            cache = torch.zeros(8, page, 576, device="cuda").to(cache_dtype)
            table = torch.arange(8, dtype=torch.int32, device="cuda").view(2, 4)
            lens = torch.tensor([4 * page, 3], dtype=torch.int32, device="cuda")
            q = torch.zeros(2, 6, 576, dtype=torch.bfloat16, device="cuda")
            kernel.run(q, cache, table, lens, SCALE, kv_scale, config=kernel.config_for(cache_dtype, variant),
                       splits=splits)
        elif kind == "combine":
            S, pdl = spec
            kernel.combine(torch.zeros(1, 6, S, 512, device="cuda"), torch.zeros(1, 6, S, device="cuda"),
                           out_dtype=torch.bfloat16, pdl=pdl)
        elif kind == "vllm":
            cache_name, heads, ctx = spec
            q, cache, table, lens, kv_scale = make_inputs(1, heads, ctx, CACHE_DTYPES[cache_name], copies=1)[0]
            out = torch.empty(1, heads, 512, dtype=q.dtype, device="cuda")
            vllm_arm(load_vllm_peer(), q, cache, table, lens, kv_scale, out)()
        elif kind == "flashinfer":
            q, cache, table, lens, kv_scale = make_inputs(1, 6, 128, CACHE_DTYPES[spec[0]], copies=1)[0]
            out = torch.empty(1, 6, 512, dtype=q.dtype, device="cuda")
            flashinfer_arm(flashinfer_import(), q, cache, table, lens, kv_scale, out)()
        torch.cuda.synchronize()
        return f"{task}: {time.perf_counter() - t0:.1f} s"
    except Exception as exc:  # a failed compile shows here and again, with its arm, in the timed run
        return f"{task}: failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


def warm(jobs: int, with_peers: bool) -> None:
    """Compile, `jobs` processes at once, what the tests and the timed arms launch (every variant on both
    caches, pages of 16 and 64, one split and several; the combines of 2-512 splits, plain and behind
    PDL; vLLM's kernels at every split count its rule picks for heads 6; FlashInfer's two
    MLA modules) into Triton's and FlashInfer's on-disk caches: one process compiles one kernel at a time."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from k3fuse.kernels.lib.triton import mla_decode as kernel

    tasks = [("flashinfer", c) for c in CACHE_DTYPES] if with_peers else []
    tasks += [("split", v, c, page, splits) for v in kernel.VARIANTS for c in CACHE_DTYPES for page in (64, 16)
              for splits in (3, 1)]
    tasks += [("combine", 1 << k, pdl) for k in range(1, 10) for pdl in (True, False)]
    if with_peers:
        tasks += [("vllm", c, 6, 512 * (1 << k)) for c in CACHE_DTYPES for k in range(9)]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
        for line in pool.map(_warm_task, tasks):
            print("warm", line, flush=True)
    print(f"warm: {len(tasks)} launches in {time.perf_counter() - t0:.0f} s", flush=True)


GATE_ARMS = (("inline", "eager"), ("side_stream", "eager"), ("inline", "inductor"))


def gate_layer(args, cache_names: list[str]) -> dict:
    """The MLA attention block's time per call for each output-gate arm (GATE_ARMS), µs, by cache, batch,
    context."""
    import k3fuse
    from k3fuse.model import K3Model, get_config
    from k3fuse.patterns.mla_decode import MLADecodeSettings
    from k3fuse.tools.bench.timing import capture, median, time_graph
    from k3fuse.tools.model_run import fill_context

    dev = torch.device("cuda")
    model = K3Model(get_config("k3", n_layers=4), tp_size=16, rank=0, standin=True, device=dev,
                    init_on_device=True).eval()
    index = next(i for i, k in enumerate(model.kinds) if k.attn == "mla")
    rows = []
    for cache_name in cache_names:
        for B in (int(b) for b in args.batch.split(",")):
            for ctx in (int(c) for c in args.context.split(",")):
                state = model.new_state(B, ctx + STEPS_MIN + 1, block_size=PAGE,
                                        kv_dtype="fp8" if cache_name == "fp8" else "auto", kv_scale=0.25)
                fill_context(model, state, [ctx] * B, seed=B)
                x = torch.randn(B, model.config.hidden, device=dev, dtype=model.dtype)
                row = {"cache": cache_name, "batch": B, "context": ctx}
                for gate, compiler in GATE_ARMS:
                    torch._dynamo.reset()
                    options = {"compiler": compiler, "context": k3fuse.DecodeContext(
                        strict=True, rule_settings={"mla_decode": MLADecodeSettings(gate=gate)})}
                    block = torch.compile(model.layers[index].attn, backend="k3fuse", options=options, fullgraph=True)
                    args_ = (x, *model.layer_state(index, state))
                    with torch.no_grad():
                        graph = capture(lambda: [block(*args_) for _ in range(STEPS_MIN)])
                        row[f"{gate}/{compiler}"] = median(time_graph(graph, STEPS_MIN, args.replays))
                    del graph
                rows.append(row)
                print("  ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
                      flush=True)
    return {"device": torch.cuda.get_device_name(), "arms": [f"{g}/{c}" for g, c in GATE_ARMS], "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="1,8,64")
    ap.add_argument("--context", default="1024,4096,8192,32768,131072")
    ap.add_argument("--heads", default="6,3,12", help="heads a rank: 6 (TP16), 3 (TP32), 12 (TP8)")
    ap.add_argument("--cache", default="bf16,fp8")
    ap.add_argument("--arms", default="k3fuse,vllm,flashinfer", help="k3fuse, compiled, vllm, flashinfer")
    ap.add_argument("--variants-bf16", default=None, help="kernel variants timed on a bf16 cache (default: those "
                    "made for it, kernels/lib/triton/mla_decode.py CACHE_VARIANTS)")
    ap.add_argument("--variants-fp8", default=None,
                    help="kernel variants timed on an fp8 cache (default: those made for it)")
    ap.add_argument("--splits", default="", help="each variant also at these split counts: N or xF (F x its model's)")
    ap.add_argument("--sweep-batch", default="1,8", help="the batches --splits applies to")
    ap.add_argument("--compiled-heads", default="6", help="heads the compiled arm runs at (its compiles are slow)")
    ap.add_argument("--no-probe", action="store_true", help="skip the latency probes")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--json", default=None)
    ap.add_argument("--prepare-peer", action="store_true", help="only compile FlashInfer's MLA modules")
    ap.add_argument("--gate-layer", action="store_true", help="time the MLA + MoE layer's output-gate arms instead")
    ap.add_argument("--warm", type=int, default=0, metavar="JOBS",
                    help="only compile every kernel the tests and arms launch, JOBS processes at once")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.prepare_peer:
        prepare_flashinfer()
        return 0
    if args.warm:
        import k3fuse  # noqa: F401

        warm(args.warm, with_peers="vllm" in args.arms or "flashinfer" in args.arms)
        return 0
    if args.gate_layer:
        doc = gate_layer(args, args.cache.split(","))
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=1)
        return 0

    import k3fuse  # noqa: F401  (registers torch.ops.k3fuse)
    from k3fuse.kernels.lib.reference import mla_decode as reference
    from k3fuse.kernels.lib.triton import mla_decode as kernel
    from k3fuse.kernels.ops.mla_decode import decode_bytes
    from k3fuse.tools.bench.report import nominal_bandwidth
    from k3fuse.tools.bench.timing import capture, copy_bandwidth, median, read_bandwidth, time_graph

    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    name = torch.cuda.get_device_name()
    nominal = nominal_bandwidth(name)
    copy_bw, read_bw = copy_bandwidth(torch.device("cuda")), read_bandwidth(torch.device("cuda"))
    print(f"{name}: {sms} SMs, L2 {props.L2_cache_size / 2**20:.0f} MiB; copy {copy_bw / 1e12:.2f} TB/s "
          f"(read + write), read {read_bw / 1e12:.2f} TB/s, nominal "
          f"{nominal / 1e12 if nominal else float('nan'):.2f} TB/s", flush=True)
    doc = {"device": name, "sms": sms, "copy_bandwidth": copy_bw, "read_bandwidth": read_bw,
           "nominal_bandwidth": nominal, "page": PAGE, "scale": SCALE, "torch": torch.__version__,
           "variants": {k: dataclasses.asdict(v) for k, v in kernel.VARIANTS.items()}, "rows": []}

    def save():
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=1)

    if not args.no_probe:
        doc["probes_us"] = probes(kernel, args.replays)
        probe_line = ", ".join(f"{k} {v:.2f}" for k, v in doc["probes_us"].items())
        print(f"latency probes (µs a call, in a graph): {probe_line}", flush=True)
        save()

    arms = [a for a in args.arms.split(",") if a]
    peers, peer_errors = {}, {}
    if "vllm" in arms:
        try:
            peers["vllm"] = load_vllm_peer()
        except Exception as exc:  # the table says why the peer did not run
            peer_errors["vllm"] = f"{type(exc).__name__}: {exc}"
    if "flashinfer" in arms:
        try:
            peers["flashinfer"] = flashinfer_import()
        except Exception as exc:
            peer_errors["flashinfer"] = f"{type(exc).__name__}: {exc}"
    for peer, error in peer_errors.items():
        print(f"peer {peer} unavailable: {error}", flush=True)
    doc["peer_errors"] = peer_errors
    compiled = torch.compile(reference.plain_spelling, dynamic=True) if "compiled" in arms else None
    compiled_heads = {int(h) for h in args.compiled_heads.split(",") if h}
    variants = {name: [v for v in (spec if spec is not None else ",".join(kernel.CACHE_VARIANTS[size])).split(",") if v]
                for name, spec, size in (("bf16", args.variants_bf16, 2), ("fp8", args.variants_fp8, 1))}
    for v in variants["bf16"] + variants["fp8"]:
        kernel.config_for(torch.bfloat16, v)  # an unknown name fails here, before any measurement
    sweep_batches = {int(b) for b in args.sweep_batch.split(",") if b}

    for cache_name in args.cache.split(","):
        cache_dtype = CACHE_DTYPES[cache_name]
        for heads in (int(h) for h in args.heads.split(",")):
            for B in (int(b) for b in args.batch.split(",")):
                for ctx in (int(c) for c in args.context.split(",")):
                    row = {"cache": cache_name, "heads": heads, "batch": B, "context": ctx, "splits": {}, "arms": []}
                    floor = decode_bytes(B * ctx, B, heads, cache_dtype)
                    row["cache_bytes"], row["bytes"] = floor.cache, floor.total
                    row["floor_us"] = floor.total / nominal * 1e6 if nominal else None
                    copies = max(1, min(64, -(-ROTATE_L2 * props.L2_cache_size // floor.cache)))
                    if not fits(copies * floor.cache * 1.1):
                        row["skipped"] = f"cache {copies * floor.cache / 1e9:.1f} GB does not fit"
                        doc["rows"].append(row)
                        print(f"{cache_name} h{heads} B{B} ctx{ctx}: {row['skipped']}", flush=True)
                        continue
                    sets = make_inputs(B, heads, ctx, cache_dtype, copies, seed=B + ctx)
                    steps = max(STEPS_MIN, copies)
                    sets = (sets * steps)[:steps]
                    outs = [torch.empty(B, heads, 512, dtype=torch.bfloat16, device="cuda") for _ in range(steps)]
                    expect = reference.plain_spelling(*sets[0][:4], SCALE, sets[0][4]).float()
                    calls = {}
                    if "k3fuse" in arms:
                        calls["k3fuse"] = [(lambda s=s: torch.ops.k3fuse.mla_decode(*s[:4], SCALE, s[4], True))
                                           for s in sets]  # strict: a fallback raises
                        row["splits"]["k3fuse"] = kernel.splits_for(B, heads, ctx, sms, cache_dtype)
                    for v in variants[cache_name]:
                        cfg = kernel.config_for(cache_dtype, v)
                        if kernel.resolve(cfg, cache_dtype, torch.device("cuda"), PAGE) is not cfg:
                            row[v] = "n/a: " + (kernel.gluon_kernel.usable(torch.device("cuda"), PAGE, cfg.block_n)
                                                or "resolves to another variant")
                            row["arms"].append(v)
                            continue
                        chosen = kernel.splits_for(B, heads, ctx, sms, cache_dtype, v)
                        others = split_arms(args.splits, chosen) if B in sweep_batches else []
                        for n, arm in [(chosen, v)] + [(n, f"{v}@{n}") for n in others]:
                            row["splits"][arm] = n
                            calls[arm] = [(lambda s=s, o=o, n=n, c=cfg: kernel.run(*s[:4], SCALE, s[4], out=o, config=c,
                                                                                  splits=n))
                                          for s, o in zip(sets, outs)]
                    if compiled is not None and heads in compiled_heads:
                        if fits(floor.cache * 2 / cache_dtype.itemsize * 4 + floor.cache * copies):
                            calls["compiled"] = [(lambda s=s: compiled(*s[:4], SCALE, s[4])) for s in sets]
                        else:
                            row["compiled"] = "skipped: its fp32 gather does not fit"
                            row["arms"].append("compiled")
                    for peer, module in peers.items():
                        try:
                            build = vllm_arm if peer == "vllm" else flashinfer_arm
                            calls[peer] = [build(module, *s, o) for s, o in zip(sets, outs)]
                        except Exception as exc:
                            row[peer] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                            row["arms"].append(peer)
                    row["arms"] += list(calls)
                    for arm, fns in calls.items():
                        try:
                            got = fns[0]()
                            got = outs[0] if got is None else got
                            torch.cuda.synchronize()
                            err = float((got.float() - expect).abs().max() / expect.abs().max().clamp_min(1e-6))
                            if not err < 2e-2:
                                row[arm] = f"mismatch: max error {err:.3g} of the largest output"
                                continue
                            graph = capture(lambda fns=fns: [f() for f in fns], warmup=2)
                            row[arm] = median(time_graph(graph, steps, args.replays))
                            del graph
                        except Exception as exc:
                            row[arm] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                            if os.environ.get("K3FUSE_BENCH_TRACEBACK"):
                                traceback.print_exc()
                        torch.cuda.synchronize()
                    ours = {a: row[a] for a in calls if a not in ("compiled", *PEERS) and isinstance(row.get(a), float)}
                    if ours:
                        best = min(ours, key=ours.get)
                        bw = floor.total / (ours[best] * 1e-6)
                        row.update(best=best, best_us=ours[best], pct_copy=100 * bw / copy_bw,
                                   pct_read=100 * bw / read_bw, pct_nominal=100 * bw / nominal if nominal else None)
                    doc["rows"].append(row)
                    print_row(row, flush=True)
                    save()
                    del sets, outs, calls, expect
                    torch.cuda.empty_cache()
    print_summary(doc["rows"])
    save()
    return 0


def print_row(row: dict, flush=True) -> None:
    """One line a point: µs of each arm (its S in brackets), then the best k3fuse arm's bandwidth."""
    head = f"{row['cache']:>4} h{row['heads']:<2} B{row['batch']:<2} ctx{row['context']:<6}"
    if "skipped" in row:
        print(f"{head} skipped: {row['skipped']}", flush=flush)
        return
    cells = []
    for arm in row["arms"]:
        v = row.get(arm)
        s = row["splits"].get(arm)
        label = f"{arm}[{s}]" if s is not None and "@" not in arm else arm
        cells.append(f"{label} {v:.1f}" if isinstance(v, float) else f"{label} {v}")
    stats = ""
    if "best" in row:
        stats = (f" | best {row['best']} {row['best_us']:.1f}µs: {row['pct_copy']:.0f}% copy, "
                 f"{row['pct_read']:.0f}% read"
                 + (f", {row['pct_nominal']:.0f}% nominal ({row['best_us'] / row['floor_us']:.2f}x floor)"
                    if row.get("pct_nominal") else ""))
        for peer in PEERS:
            if isinstance(row.get(peer), float):
                stats += f", {row[peer] / row['best_us']:.2f}x vs {peer}"
    print(head + " " + "  ".join(cells) + stats, flush=flush)


def print_summary(rows: list[dict]) -> None:
    """The table the issue's targets read off: per point the floor, the default arm, the best arm, the peers."""
    print("\ncache heads B  ctx    | floor µs | k3fuse µs | best arm            µs   %copy x floor |"
          " flashinfer  vllm   | best vs FI")
    for r in rows:
        if "skipped" in r or "best" not in r:
            continue
        fi, vl, k3 = r.get("flashinfer"), r.get("vllm"), r.get("k3fuse")
        f = (lambda v: f"{v:9.1f}" if isinstance(v, float) else f"{'-':>9}")
        print(f"{r['cache']:>5} {r['heads']:>5} {r['batch']:<2} {r['context']:<6} | {r['floor_us'] or 0:8.1f} |"
              f"{f(k3)} | {r['best']:<18}{r['best_us']:7.1f} {r['pct_copy']:6.0f}% "
              f"{r['best_us'] / (r['floor_us'] or 1):6.2f} |"
              f"{f(fi)} {f(vl)} | " + (f"{fi / r['best_us']:.2f}x" if isinstance(fi, float) else "-"))


if __name__ == "__main__":
    sys.exit(main())
