"""SGLang hosts k3fuse: SGLang's own plugin loader, process groups and all-reduce ops, 2 gloo ranks.

SGLang's releases pin CUDA torch builds, so SGLang is not installed: its wheel's source is put on
sys.path (scripts/install_engines.sh unpacks 0.5.21 into .engines/; K3FUSE_TEST_SGLANG_SRC overrides).
What runs is SGLang's code: `sglang.srt.plugins.load_plugins()` discovers k3fuse's entry point and
installs the pass; `init_model_parallel_group` builds SGLang's TP group on gloo; the model calls
`torch.ops.sglang.outplace_all_reduce` / `inplace_all_reduce` / `flashinfer_allreduce`, whose kernels are
CUDA-only: on CPU the compiled model can only run if k3fuse replaced them (the fused op reduces over the same
group). SGLang's RMSNorm module cannot be imported without SGLang's dependencies (torchvision,
...), so its `forward_native` is compiled from the wheel's layernorm.py on its own and bound to a
module with RMSNorm's attributes: the fp32-residual norm is SGLang's code.
"""
from __future__ import annotations

import ast
import json
import os
import sys
import typing
from pathlib import Path

import pytest
import torch

import oproj_norm_case as case
from k3fuse.dist import launch

pytestmark = [pytest.mark.engines, pytest.mark.slow]

REPO_ROOT = Path(__file__).resolve().parents[1]


def _sglang_source() -> str:
    src = os.environ.get("K3FUSE_TEST_SGLANG_SRC") or str(REPO_ROOT / ".engines" / "sglang")
    if not (Path(src) / "sglang" / "srt" / "distributed" / "parallel_state.py").exists():
        pytest.fail(f"no SGLang source at {src}: run scripts/install_engines.sh or set K3FUSE_TEST_SGLANG_SRC")
    return src


def _sglang_rmsnorm_forward(src: str):  # noqa: ANN202
    """SGLang's RMSNorm.forward_native, compiled from its source file alone."""
    path = Path(src) / "sglang" / "srt" / "layers" / "layernorm.py"
    tree = ast.parse(path.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RMSNorm")
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "forward_native")
    namespace = {"torch": torch, "nn": torch.nn, "Optional": typing.Optional, "Union": typing.Union,
                 "Tuple": typing.Tuple}
    exec(compile(ast.Module([fn], []), str(path), "exec"), namespace)  # noqa: S102
    return namespace["forward_native"]


def _sglang_worker(rank: int, world: int, src: str, spelling: str, log_path: str, dtype_name: str,
                   scenario: str | None = None) -> dict:
    sys.path.insert(0, src)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != str(REPO_ROOT)]
    os.environ["SGLANG_PLUGINS"] = "k3fuse"
    if scenario == "rules-differ" and rank == 1:
        os.environ["K3FUSE_RULES"] = "-oproj_allreduce_residual"   # a per-worker environment
    from sglang.srt.distributed import parallel_state
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import get_parallel
    from torch._inductor import config as inductor_config

    import k3fuse
    from k3fuse.engines import EngineError
    from k3fuse.engines.sglang_hook import install
    from k3fuse.spelling import rms_norm

    load_plugins()  # SGLang's loader: every process runs it before building its model
    hook = inductor_config.post_grad_custom_post_pass
    hook.log = k3fuse.RewriteLog.coerce(log_path)
    out: dict = {"hook": (type(hook).__name__, hook.group)}
    try:
        install()
    except EngineError as exc:
        out["twice"] = str(exc)
    parallel_state.init_distributed_environment(world, rank, "env://", rank, backend="gloo")
    tp = parallel_state.init_model_parallel_group([list(range(world))], rank, "gloo", use_pynccl=False,
                                                  use_custom_allreduce=False, group_name="tp", use_mscclpp=False,
                                                  use_torch_symm_mem_allreduce=False)
    get_parallel().override_permanently(tp_group=tp)

    class SGLangRMSNorm(torch.nn.Module):  # RMSNorm's attributes, SGLang's forward_native
        forward = _sglang_rmsnorm_forward(src)

        def __init__(self, weight: torch.Tensor):
            super().__init__()
            self.weight = torch.nn.Parameter(weight, requires_grad=False)
            self.hidden_size, self.variance_epsilon, self.variance_size_override = weight.shape[0], 1e-6, None
            self.override_orig_dtype, self.fp32_residual, self.cast_x_before_out_mul = None, False, False

    dtype = getattr(torch, dtype_name)

    class OutProjNorm(torch.nn.Module):
        def __init__(self, w: torch.Tensor, norm_w: torch.Tensor):
            super().__init__()
            self.w = torch.nn.Parameter(w, requires_grad=False)
            self.norm_w = torch.nn.Parameter(norm_w, requires_grad=False)
            self.norm = SGLangRMSNorm(norm_w)

        def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y = torch.nn.functional.linear(x, self.w)
            if spelling == "inplace":
                torch.ops.sglang.inplace_all_reduce(y, group_name=tp.unique_name)
            elif spelling == "flashinfer":  # SGLang's op under torch.compile where FlashInfer's all-reduce applies
                y = torch.ops.sglang.flashinfer_allreduce(y, tp.unique_name)
            else:
                y = torch.ops.sglang.outplace_all_reduce(y, tp.unique_name, "auto")
            if dtype == torch.float32:  # k3fuse's reference spelling
                r = residual + y
                return r, rms_norm(r, self.norm_w, 1e-6)
            normed, r = self.norm(y, residual)  # SGLang's: the residual added in fp32
            return r, normed

    w_full, norm_w, x_full, residual = case.inputs(world, dtype)
    shard = case.shard(rank)
    model = OutProjNorm(w_full[:, shard].clone(), norm_w)
    torch._dynamo.reset()
    k3fuse.reset_stats()
    if scenario is not None:
        return _scenario(scenario, rank, model, x_full[:, shard].contiguous(), residual)
    with inductor_config.patch(force_disable_caches=True), torch.no_grad(), k3fuse.strict():
        got_res, got_out = torch.compile(model)(x_full[:, shard].contiguous(), residual)
    total, ref = case.reference(w_full, norm_w, x_full, residual)
    out.update(group=(tp.unique_name, tp.device_group.group_name), ctx=(hook.ctx.tp_size, hook.ctx.group_name),
               stats=k3fuse.stats(), err=(float((got_res.double() - total).abs().max()),
                                          float((got_out.double() - ref).abs().max())))
    return out


def _scenario(scenario: str, rank: int, model: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor) -> dict:
    import time

    from torch._inductor import config as inductor_config

    compiled = torch.compile(model)
    if scenario == "rules-differ":   # the ranks disagree: the compile raises on each, never hangs
        t0 = time.monotonic()
        try:
            with inductor_config.patch(force_disable_caches=True), torch.no_grad():
                compiled(x, residual)
            return {"error": None}
        except Exception as exc:   # noqa: BLE001 - the test reads what each rank raised
            return case.compile_refusal(exc, time.monotonic() - t0)
    # step-failure: SGLang's registry holds k3fuse's hook on its worker step (put there by the plugin
    # SGLang loaded); its own wrapper puts it around a step (TpModelWorker itself needs SGLang's
    # CUDA-only dependencies to import)
    from sglang.srt.plugins import hook_registry

    from k3fuse.engines import step_check

    hooks = hook_registry.HookRegistry._hooks.get(step_check.SGLANG_STEP, [])
    registered = [(hook_type.value, hook.__qualname__) for hook_type, hook, _ in hooks]

    def step() -> torch.Tensor:
        return compiled(x, residual)[1]

    for hook_type, hook, _ in hooks:
        step = hook_registry._wrap_fn(step, hook, hook_type)
    fail_next = [False]
    case.inject_device_timeout(rank, lambda weight: fail_next[0], "injected device timeout (test)")
    out: dict = {"registered": registered, "steps": []}
    with inductor_config.patch(force_disable_caches=True), torch.no_grad():
        for i in range(3):
            fail_next[0] = i == 1   # the second step fails (on rank 1)
            try:
                y = step()
                out["steps"].append(("ok", bool(torch.isfinite(y).all())))
            except Exception as exc:   # noqa: BLE001
                out["steps"].append((type(exc).__name__, str(exc)))
                break
            torch.distributed.barrier()   # the ranks step together, as an engine's workers do
    return out


def test_sglang_ranks_that_would_rewrite_differently_fail_at_compile_time_on_every_rank(tmp_path):
    """Issue 48.2 with SGLang's plugin, TP group and all-reduce: rank 1 runs with
    K3FUSE_RULES=-oproj_allreduce_residual; every rank raises one ContextError naming it, at once."""
    results = launch(_sglang_worker, 2, args=(_sglang_source(), "outplace", str(tmp_path / "rw.jsonl"), "float32",
                                              "rules-differ"), timeout_s=300)
    print("\nper-rank errors:", json.dumps(results))
    case.check_rules_differ_refused(results)


def test_sglang_worker_step_hook_surfaces_a_collective_failure(tmp_path):
    """Issue 48.3 with SGLang's hook machinery: SGLang's plugin loader runs k3fuse's plugin, which
    registers an AFTER hook on TpModelWorker.forward_batch_generation in SGLang's HookRegistry;
    wrapped around a step by SGLang's own wrapper, it makes the step in which rank 1's fused
    all-reduce recorded a device timeout raise on both ranks, naming rank 1."""
    results = launch(_sglang_worker, 2, args=(_sglang_source(), "outplace", str(tmp_path / "rw.jsonl"), "float32",
                                              "step-failure"), timeout_s=300)
    print("\nSGLang steps:", json.dumps(results))
    source = (Path(_sglang_source()) / "sglang" / "srt" / "managers" / "tp_worker.py").read_text()
    worker = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "TpModelWorker")
    assert any(isinstance(f, ast.FunctionDef) and f.name == "forward_batch_generation" for f in worker.body)
    for rank, r in enumerate(results):
        assert r["registered"] == [("after", "sglang_after_step")], r
        assert tuple(r["steps"][0]) == ("ok", True), r                 # a healthy step
        kind, message = r["steps"][1]                                   # the step that failed raises
        assert kind == "CollectivePeerError" and "k3fuse.check_collectives" in message, r
        assert "injected device timeout" in message and ("peer rank 1" in message if rank == 0 else True), r
        assert len(r["steps"]) == 2, r


#: max |error| against the float64 reference (bf16: one ulp at |x| < 4)
TOLERANCE = {"float32": 1e-4, "bfloat16": 1.6e-2}


@pytest.mark.parametrize(("spelling", "dtype_name"), [("outplace", "float32"), ("inplace", "float32"),
                                                      ("flashinfer", "float32"), ("outplace", "bfloat16")],
                         ids=["outplace_all_reduce", "inplace_all_reduce", "flashinfer_allreduce",
                              "bf16_fp32_residual_rmsnorm"])
def test_sglang_plugin_installs_the_pass_and_its_all_reduce_is_fused(tmp_path, spelling, dtype_name):
    log_path = str(tmp_path / "rw.jsonl")
    results = launch(_sglang_worker, 2, args=(_sglang_source(), spelling, log_path, dtype_name), timeout_s=540)
    with open(log_path) as f:
        events = [json.loads(line) for line in f if line.strip()]
    applied = [e for e in events if e["rule"] == "oproj_allreduce_residual" and e["decision"] == "applied"]
    print(f"\nSGLang test ({spelling}, {dtype_name}):", json.dumps(results))
    print("applied:", [(e["rank"], e["variant"], e["door"]) for e in applied])
    assert sorted(e["rank"] for e in applied) == [0, 1]
    variant = "plain+norm" if dtype_name == "float32" else "plain+norm[bfloat16]"
    assert all(e["variant"] == variant for e in applied)
    for r in results:
        assert r["hook"] == ("K3FusePass", "sglang")
        assert "already installed" in r["twice"]
        assert r["group"][0] == "tp:0" and r["ctx"] == (2, r["group"][1])
        assert r["stats"].get("gemm_ar_residual_rmsnorm") and max(r["err"]) < TOLERANCE[dtype_name]
