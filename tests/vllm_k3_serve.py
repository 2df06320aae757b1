"""Serve a K3 checkpoint with vLLM's LLM(...).generate, greedy, and print the tokens as JSON on the line starting
with RESULT.

    python tests/vllm_k3_serve.py CHECKPOINT --tp 2 --prompts '[[1,2,3],[7,9]]' --max-tokens 24

Run as its own process by tests/test_engine_vllm_model.py (vLLM starts an engine process and one worker per TP
rank; the environment says whether k3fuse's model and passes are on: K3FUSE_VLLM_MODEL, K3FUSE_DISABLE, K3FUSE_LOG).
The compilation is vLLM's default compile mode with k3fuse's pass in its pass manager (`k3fuse.vllm_pass`), decode
in its own compile range, vLLM's own all-reduce + norm fusion off.
"""
from __future__ import annotations

import argparse
import json
import time

#: the prefix of the result line (vLLM logs to stdout too)
RESULT = "vllm_k3_serve result: "


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--dtype", default="float32", help="vLLM's model dtype (an MXFP4 checkpoint needs bfloat16)")
    parser.add_argument("--repeat", type=int, default=2, help="generate this many times (state slots are reused)")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import k3fuse

    start = time.monotonic()
    llm = LLM(args.checkpoint, skip_tokenizer_init=True, dtype=args.dtype, tensor_parallel_size=args.tp,
              max_model_len=64, max_num_seqs=4, enable_prefix_caching=False, kv_cache_memory_bytes=64 << 20,
              compilation_config={"mode": 3, "compile_ranges_endpoints": [64],
                                  "inductor_compile_config": {"post_grad_custom_post_pass": k3fuse.VllmK3FusePass()},
                                  "pass_config": {"fuse_allreduce_rms": False}})
    started = time.monotonic() - start
    prompts = [TokensPrompt(prompt_token_ids=p) for p in json.loads(args.prompts)]
    runs = []
    for _ in range(args.repeat):
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True))
        runs.append([list(o.outputs[0].token_ids) for o in outs])
    print(RESULT + json.dumps({"tokens": runs, "startup_s": round(started, 1),
                      "total_s": round(time.monotonic() - start, 1)}), flush=True)


if __name__ == "__main__":
    main()
