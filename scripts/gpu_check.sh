#!/usr/bin/env bash
# One script for anyone with a GPU: install the CuTe DSL wheel if present, print versions, run the
# GPU tests, then the benchmarks. Logs and JSON go to ${OUT:-out}.
#
#   scripts/gpu_check.sh [all | x2-tests | x2-safety | x2-layer | x2-bench | STEP...]
#   steps: versions test-gemm bench-gemm test-ar bench-ar test-safety test-guard tests sweep test-layer bench-layer
#          bench-attnres test-moe bench-moe test-front bench-front test-tail bench-tail
#          test-model bench-model validate-model
#          tests/gpu/<file>.py[::test][,...]  (those tests, one step)
#   all      = test-gemm bench-gemm test-ar bench-ar test-front bench-front test-tail bench-tail test-moe
#              bench-moe test-layer bench-layer
#   what needs 2 GPUs (NVLink), grouped to fit a device call of 10 minutes each (rough times on
#   2 x H200 from earlier runs and the step timeouts):
#   x2-tests  = test-ar test-front test-tail         (~5 min: both protocols, world 1 and 2)
#   x2-safety = test-safety                          (~8-10 min: the hang/corruption tests and the
#                                                      collective guard's, test-guard alone: world 1 + 2)
#   x2-layer  = test-layer bench-layer               (~8 min: strict TP 1/2 sweep 1..64, layer bench)
#   x2-bench  = bench-front bench-tail bench-ar bench-attnres   (~6 min)
#   test-moe: the routed-experts (BF16 and W4A16), route top-k and combine kernels, bench-moe their benchmarks,
#   bench-w4a16 the W4A16 table alone (W4A16_ARGS replace its formats and widths; --cute-choices adds CuTe
#   arms with imposed launch choices beside the op's own), ncu-w4a16 the CuTe
#   op's launches under Nsight Compute (NCU_ARGS: bench/ncu_w4a16.py's --formats / --inter / --tokens /
#   --choices)
#   (W4A16: stock / k3fuse / BF16 kernel / humming at I = 3072, 1536, 384; humming from
#   .whl/humming_kernels-*.whl; W4A16_ARGS adds options, e.g. --humming-inter 1536); test-front /
#   bench-front: the sharded MoE front, test-tail / bench-tail: the MoE tail (latent all-reduce +
#   RMSNorm, W_up replicated vs sharded): 2 ranks on 2 GPUs, on one GPU their 1-rank tests and the
#   benchmark of one rank's TP-N slice (bench-front: N in FRONT_AS_TP=2,4,8,16; bench-tail: N=2). Each step has a timeout, logs go to $OUT/<step>.log;
#   PYTEST_K selects tests by -k; BENCH_ARGS are added to the layer benches, SWEEP_ARGS to the split-K
#   sweep (--sites qkvg_tp1,shared_gate_tp1: K3's TP 1 sites the tuned table lacks); PACK=1 packs everything
#   under $OUT into $OUT/results.tgz, for transports that return few files.
#   test-model / bench-model / validate-model: the whole K3 model (issue 50) as one rank of a real deployment on
#   one GPU: rank 0 of TP MODEL_TP (default 16 on a card of >= 120 GB, an H200; 32 on an 80 GB H100) at K3's
#   widths; bench-model times one decode step (stock / k3fuse / humming peer, batch 1, 8, 64, contexts 4K, 32K,
#   128K; MODEL_ARGS adds options, e.g. --arms stock,k3fuse or --context 4096), validate-model runs 1000 steps
#   of a 4-layer slice against its float32 copy (VALIDATE_ARGS adds options)
#   test-ar runs both all-reduce protocols (lamport, flags); K3FUSE_TEST_AR_TOKENS=1,2,64 limits its
#   token sweep, PYTEST_X=-x stops a step at its first failure (default: runs on, so one run
#   reports every test), PYTEST_ARGS adds pytest options
#
# NVLink multicast stays off everywhere (it can take the host's shared GPUs down): these three are
# exported explicitly and never unset; k3fuse never creates a multicast object.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 CUDA_MODULE_LOADING=EAGER
OUT="${OUT:-out}"
mkdir -p "$OUT"
STEPS=()
for s in "${@:-all}"; do
  case "$s" in
    all) STEPS+=(test-gemm bench-gemm test-ar bench-ar test-front bench-front test-tail bench-tail test-moe bench-moe
                 test-layer bench-layer) ;;
    x2-tests) STEPS+=(test-ar test-front test-tail) ;;
    x2-safety) STEPS+=(test-safety) ;;
    x2-layer) STEPS+=(test-layer bench-layer) ;;
    x2-bench) STEPS+=(bench-front bench-tail bench-ar bench-attnres) ;;
    *) STEPS+=("$s") ;;
  esac
done
PY="${PYTHON:-python3}"

# CuTe DSL (+ apache-tvm-ffi for --enable-tvm-ffi) from local wheels, never from a registry.
if ls .whl/nvidia_cutlass_dsl-*.whl >/dev/null 2>&1; then
  if [ ! -d .cute_site/nvidia_cutlass_dsl ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target .cute_site .whl/nvidia_cutlass_dsl-*.whl \
      $(ls .whl/apache_tvm_ffi-*.whl 2>/dev/null) || echo "WARN: CuTe DSL wheel install failed"
  fi
  export PYTHONPATH=".cute_site:.cute_site/nvidia_cutlass_dsl/python_packages:${PYTHONPATH:-}"
fi
# humming-kernels (the W4A16 MoE peer in bench-moe) from a local wheel the same way; its own
# dependencies are on the GPU machine already
if ls .whl/humming_kernels-*.whl >/dev/null 2>&1; then
  if [ ! -d .humming_site/humming ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target .humming_site .whl/humming_kernels-*.whl \
      || echo "WARN: humming wheel install failed"
  fi
  export PYTHONPATH="$(pwd)/.humming_site:${PYTHONPATH:-}"
fi
# the repo itself: editable install offline, else PYTHONPATH
if ! "$PY" -c "import k3fuse.kernels" >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 \
    || export PYTHONPATH="$(pwd)/.k3fuse_path:${PYTHONPATH:-}"
fi
PYTEST_ROOT=""
if ! "$PY" -c "import k3fuse.kernels" >/dev/null 2>&1; then
  # package-dir mapping by symlinks (k3fuse.kernels -> kernels, k3fuse.patterns -> patterns). The checkout's
  # own k3fuse/ has neither, so the root must not come first on sys.path (PYTHONSAFEPATH: not for -m, -c or
  # stdin; pytest: no pythonpath): it comes last, where `python -m bench.<name>` finds bench/
  mkdir -p .k3fuse_path && rm -rf .k3fuse_path/k3fuse && cp -r k3fuse .k3fuse_path/k3fuse
  ln -sfn "$(pwd)/kernels" .k3fuse_path/k3fuse/kernels; ln -sfn "$(pwd)/patterns" .k3fuse_path/k3fuse/patterns
  export PYTHONSAFEPATH=1 PYTHONPATH="$(pwd)/.k3fuse_path:${PYTHONPATH:-}:$(pwd)"
  PYTEST_ROOT="-o pythonpath="
fi

{
  echo "== versions"; date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nvidia-smi topo -m 2>/dev/null | head -5
  "$PY" - <<'EOF'
import importlib.metadata as md, sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "gpus", torch.cuda.device_count())
for p in ("triton", "nvidia-cutlass-dsl", "apache-tvm-ffi", "cuda-bindings", "humming-kernels"):
    try: print(p, md.version(p))
    except Exception as e: print(p, "missing")
from k3fuse.kernels.lib.cute import compat
print("cute available", compat.available(), compat.cute_version(), compat.IMPORT_ERROR or "")
EOF
  env | grep -E "NCCL_NVLS_ENABLE|TORCH_SYMM_MEM_DISABLE_MULTICAST|NVSHMEM_DISABLE_NVLS"
} 2>&1 | tee "$OUT/versions.log"

rc=0
step() {  # step NAME TIMEOUT CMD...: run with a time limit, log to $OUT/NAME.log, remember failures
  local name=$1 limit=$2; shift 2
  echo "== $name"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local r=${PIPESTATUS[0]}; [[ $r -ne 0 ]] && { echo "== $name FAILED rc=$r"; rc=1; }
  return 0
}
# -v: one line per test as it finishes, so a run cut short by the device's time limit still says
# which tests passed and failed; -rA --tb=short: every outcome and a short traceback at the end
PYTEST=("$PY" -m pytest -m gpu ${PYTEST_X:-} -v --tb=short -rA -p no:cacheprovider -o addopts= $PYTEST_ROOT
        --timeout=${PYTEST_TIMEOUT:-400} ${PYTEST_K:+-k "$PYTEST_K"})
for s in "${STEPS[@]}"; do
  case "$s" in
    test-gemm) step pytest_gemm "${TEST_TIMEOUT:-300}" "${PYTEST[@]}" tests/gpu/test_decode_gemm_gpu.py ;;
    test-ar)   step pytest_ar "${TEST_TIMEOUT:-300}" "${PYTEST[@]}" ${PYTEST_ARGS:-} tests/gpu/test_fused_ar_gpu.py ;;
    test-safety) step pytest_safety "${TEST_TIMEOUT:-500}" "${PYTEST[@]}" ${PYTEST_ARGS:-} \
                   tests/gpu/test_collective_safety_gpu.py tests/gpu/test_collective_guard_gpu.py ;;
    test-guard) step pytest_guard "${TEST_TIMEOUT:-300}" "${PYTEST[@]}" ${PYTEST_ARGS:-} \
                   tests/gpu/test_collective_guard_gpu.py ;;
    tests)     step pytest_gpu "${TEST_TIMEOUT:-420}" "${PYTEST[@]}" tests/gpu ;;
    test-layer) step pytest_layer "${TEST_TIMEOUT:-400}" "${PYTEST[@]}" -s tests/gpu/test_layer_gpu.py ;;
    bench-layer) step bench_layer "${BENCH_TIMEOUT:-500}" "$PY" -m k3fuse.tools.cli bench --residual plain --layers 1 \
                   --json "$OUT/bench_layer_plain.json" --plots "$OUT/plots_plain" ${BENCH_ARGS:-} ;;
    bench-attnres) step bench_attnres "${BENCH_TIMEOUT:-500}" "$PY" -m k3fuse.tools.cli bench --residual attnres --layers 2 \
                   --json "$OUT/bench_layer_attnres.json" --plots "$OUT/plots_attnres" ${BENCH_ARGS:-} ;;
    bench-gemm) step bench_decode_gemm "${BENCH_TIMEOUT:-300}" "$PY" -m bench.bench_decode_gemm \
                  --json "$OUT/bench_decode_gemm.json" ${GEMM_ARGS:-} ;;
    sweep)     step sweep_decode_gemm "${BENCH_TIMEOUT:-500}" "$PY" -m bench.sweep_decode_gemm \
                  --json "$OUT/sweep.json" --emit "$OUT/splitk_tuned.py" ${SWEEP_ARGS:-} ;;
    test-moe)  step pytest_moe "${TEST_TIMEOUT:-300}" "${PYTEST[@]}" tests/gpu/test_routed_experts_gpu.py \
                 tests/gpu/test_route_topk_gpu.py tests/gpu/test_moe_combine_gpu.py
               step pytest_moe_w4a16 "${TEST_TIMEOUT:-400}" "${PYTEST[@]}" tests/gpu/test_routed_experts_w4a16_gpu.py ;;
    bench-moe) step bench_routed_experts "${BENCH_TIMEOUT:-300}" "$PY" -m bench.bench_routed_experts \
                 --json "$OUT/bench_routed_experts.json"
               step bench_routed_experts_w4a16 "${BENCH_TIMEOUT:-600}" "$PY" -m bench.bench_routed_experts \
                 --formats mxfp4,int4 --inter 3072,1536,384 --json "$OUT/bench_routed_experts_w4a16.json" \
                 ${W4A16_ARGS:-}
               step bench_route_topk "${BENCH_TIMEOUT:-300}" "$PY" -m bench.bench_route_topk \
                 --json "$OUT/bench_route_topk.json" ;;
    bench-w4a16) step bench_routed_experts_w4a16 "${BENCH_TIMEOUT:-600}" "$PY" -m bench.bench_routed_experts \
                   --json "$OUT/bench_routed_experts_w4a16.json" ${W4A16_ARGS:---formats mxfp4,int4 --inter 3072,1536,384} ;;
    test-front) step pytest_front "${TEST_TIMEOUT:-400}" "${PYTEST[@]}" ${PYTEST_ARGS:-} tests/gpu/test_moe_front_gpu.py ;;
    bench-front) if [[ $("$PY" -c "import torch; print(torch.cuda.device_count())") -ge 2 ]]; then FRONT=(--world 2)
                 else FRONT=(--world 1 --as-tp "${FRONT_AS_TP:-2,4,8,16}"); fi
                 step bench_moe_front "${BENCH_TIMEOUT:-600}" "$PY" -m bench.bench_moe_front "${FRONT[@]}" \
                   --json "$OUT/bench_moe_front.json" ;;
    test-tail) step pytest_tail "${TEST_TIMEOUT:-400}" "${PYTEST[@]}" ${PYTEST_ARGS:-} tests/gpu/test_moe_tail_gpu.py ;;
    bench-tail) if [[ $("$PY" -c "import torch; print(torch.cuda.device_count())") -ge 2 ]]; then TAIL=(--world 2)
                else TAIL=(--world 1 --as-tp 2); fi
                step bench_moe_tail "${BENCH_TIMEOUT:-300}" "$PY" -m bench.bench_moe_tail "${TAIL[@]}" \
                  --json "$OUT/bench_moe_tail.json" ;;
    bench-ar)  step bench_fused_ar "${BENCH_TIMEOUT:-300}" "$PY" -m bench.bench_fused_ar --json "$OUT/bench_fused_ar.json" ;;
    ncu-w4a16) NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
               step ncu_w4a16 "${BENCH_TIMEOUT:-500}" "$NCU" --profile-from-start off --clock-control none \
                 -k regex:W4A16RowsDot --section SpeedOfLight --section MemoryWorkloadAnalysis \
                 --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats \
                 "$PY" -m bench.ncu_w4a16 ${NCU_ARGS:-} ;;
    test-model) step pytest_model "${TEST_TIMEOUT:-500}" "${PYTEST[@]}" ${PYTEST_ARGS:-} tests/gpu/test_model_gpu.py ;;
    bench-model) MTP=${MODEL_TP:-$("$PY" -c "import torch; print(16 if torch.cuda.get_device_properties(0).total_memory > 120e9 else 32)")}
                 step bench_model "${BENCH_TIMEOUT:-590}" "$PY" -m k3fuse.tools.cli bench --model --device cuda --preset k3 \
                   --as-rank 0 --of "$MTP" --json "$OUT/bench_model_tp$MTP.json" ${MODEL_ARGS:-} ;;
    validate-model) step validate_model "${BENCH_TIMEOUT:-590}" "$PY" -m k3fuse.tools.cli validate --model --device cuda \
                   --preset k3 --layers 4 --as-rank 0 --of 16 --batch 8 --steps 1000 --context 4096 \
                   --json "$OUT/validate_model.json" --plots "$OUT/plots_validate_model" ${VALIDATE_ARGS:-} ;;
    versions)  ;;
    tests/*)   # test files or node ids, comma-separated: one step, logged as pytest_<first file>.log
               IFS=, read -ra IDS <<< "$s"; first=$(basename "${IDS[0]%%::*}" .py)
               step "pytest_${first#test_}" "${TEST_TIMEOUT:-300}" "${PYTEST[@]}" ${PYTEST_ARGS:-} "${IDS[@]}" ;;
    *) echo "unknown step $s"; rc=1 ;;
  esac
done
if [[ "${PACK:-0}" == 1 ]]; then
  tar czf /tmp/results.tgz -C "$OUT" . && mv /tmp/results.tgz "$OUT/results.tgz"
fi
exit $rc
