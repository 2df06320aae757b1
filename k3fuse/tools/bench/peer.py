"""The engine-like peer of `k3fuse bench --model`: the model compiled by stock torch.compile, its routed experts
run through humming's W4A16 MoE GEMMs as vLLM runs K3's MXFP4 experts on Hopper.

Each MoE layer's experts become two humming layers (gate/up [E, 2I, L], down [E, L, I]; the repository's
bench/humming_moe.py builds them), called through one custom op, `k3fuse_peer::humming_experts`, which stock
Inductor leaves opaque: per call it lays the (token, slot) pairs out by expert in blocks of the GEMM's row tile
(vLLM's moe_align_block_size), runs the gate/up GEMM, K3's SiTU-GLU in torch, and the down GEMM, z [T*k, L] in
pair order (what the model's spelling returns). The layer is found by its `w2_scale` tensor, so every layer
shares one compiled graph. humming JIT-compiles with the machine's nvcc/NVRTC on a shape's first use.

Converting is destructive where memory is short (`keep_model=False`): humming transforms the tables in place
and the model's own copies are freed, so the peer runs after the other arms.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch

_LAYERS: dict[int, "_PeerLayer"] = {}


def humming_moe_module() -> Any:
    """bench/humming_moe.py of this checkout (not installed with the package): ImportError naming why not."""
    import humming  # noqa: F401  (the peer's kernels; ImportError when the wheel is absent)

    path = Path(__file__).resolve().parents[3] / "bench" / "humming_moe.py"
    if not path.exists():
        raise ImportError(f"the peer needs the repository's {path} (run from a k3fuse checkout)")
    spec = importlib.util.spec_from_file_location("k3fuse_bench_humming_moe", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


class _PeerLayer:
    """One MoE layer's humming layers, and per token count its GEMM tiles and alignment buffers."""

    def __init__(self, hm: Any, fmt: str, gate_up: Any, down: Any, E: int, I: int, L: int, top_k: int):
        self.hm, self.fmt, self.gate_up, self.down = hm, fmt, gate_up, down
        self.E, self.I, self.L, self.top_k = E, I, L, top_k
        self.per_tokens: dict[int, Any] = {}

    def runner(self, T: int) -> Any:
        """A HummingMoE-shaped object at T tokens sharing this layer's transformed weights."""
        if T not in self.per_tokens:
            hm, P = self.hm, T * self.top_k
            moe = object.__new__(hm.HummingMoE)
            moe.E, moe.I, moe.L, moe.T, moe.top_k, moe.P = self.E, self.I, self.L, T, self.top_k, P
            moe.gate_up = hm._gemm(self.gate_up, P, self.top_k)
            moe.down = hm._gemm(self.down, P, 1)
            buffers = {}
            for name, g in (("gate_up", moe.gate_up), ("down", moe.down)):
                rows = P + min(self.E, P) * (g.block - 1)
                buffers[name] = (torch.full((rows,), P, dtype=torch.int32, device="cuda"),
                                 torch.zeros((-(-rows // g.block),), dtype=torch.int32, device="cuda"),
                                 torch.zeros((1,), dtype=torch.int32, device="cuda"))
            moe.buffers = [buffers]
            moe.gu = torch.empty((P, 2 * self.I), dtype=torch.bfloat16, device="cuda")
            moe.act = torch.empty((P, self.I), dtype=torch.bfloat16, device="cuda")
            moe.z = torch.empty((P, self.L), dtype=torch.bfloat16, device="cuda")
            self.per_tokens[T] = moe
        return self.per_tokens[T]


@torch.library.custom_op("k3fuse_peer::humming_experts", mutates_args=())
def humming_experts(a: torch.Tensor, experts: torch.Tensor, key: torch.Tensor, beta: float,
                    linear_beta: float) -> torch.Tensor:
    from k3fuse.spelling import situ_glu

    layer = _LAYERS[key.data_ptr()]
    moe = layer.runner(a.shape[0])
    moe.align(experts)
    moe._run(moe.gate_up, "gate_up", a, moe.gu, 0)
    moe.act.copy_(situ_glu(moe.gu[:, :moe.I], moe.gu[:, moe.I:], beta, linear_beta))
    return moe._run(moe.down, "down", moe.act, moe.z, 0).clone()


@humming_experts.register_fake
def _(a: torch.Tensor, experts: torch.Tensor, key: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    return a.new_empty((experts.shape[0], a.shape[1]))


def _override(module: Any, a: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    cfg = module.cfg
    return torch.ops.k3fuse_peer.humming_experts(a, experts, module.w2_scale, cfg.situ_beta, cfg.situ_linear_beta)


def install_peer(model: Any, keep_model: bool) -> None:
    """Give every MoE layer of `model` humming experts; keep_model=False frees the model's expert tables as it
    goes (the model's own spelling cannot run afterwards)."""
    cfg = model.config
    if not cfg.quantized_experts:
        raise ValueError(f"the peer runs humming's W4A16 GEMMs: the model's experts are {cfg.expert_format}, "
                         "not mxfp4/int4")
    if model.device.type != "cuda":
        raise ValueError("the peer runs humming's CUDA kernels: it needs --device cuda")
    hm = humming_moe_module()
    for layer in model.layers:
        routed = getattr(layer.mlp, "routed", None)
        if routed is None:
            continue
        w1, w3, w2 = (routed.quantized_weight(p) for p in ("w1", "w3", "w2"))  # the checkpoint's row order
        E, I, L = w1.packed.shape[0], w1.packed.shape[1], w2.packed.shape[1]
        gate_up = hm._layer(cfg.expert_format, 2 * I, L, E, torch.cat([w1.packed, w3.packed], 1),
                            torch.cat([w1.scale, w3.scale], 1))
        # humming transforms what it is given in place: the model's own tables only when they may go
        down = hm._layer(cfg.expert_format, L, I, E, w2.packed.clone() if keep_model else w2.packed, w2.scale.clone())
        if not keep_model:
            for name in ("w1_packed", "w3_packed", "w2_packed"):
                getattr(routed, name).data = torch.empty(0, dtype=getattr(routed, name).dtype, device="cuda")
        _LAYERS[routed.w2_scale.data_ptr()] = _PeerLayer(hm, cfg.expert_format, gate_up, down, E, I, L, cfg.top_k)
        routed.experts_override = _override
    torch.cuda.empty_cache()


def remove_peer(model: Any) -> None:
    for layer in model.layers:
        routed = getattr(layer.mlp, "routed", None)
        if routed is not None:
            routed.experts_override = None
            _LAYERS.pop(routed.w2_scale.data_ptr(), None)


__all__ = ["install_peer", "remove_peer", "humming_moe_module"]
