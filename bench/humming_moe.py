"""The peer: humming-kernels' W4A16 MoE GEMMs (vLLM's preferred SM90 backend for K3's MXFP4 experts).

Builds humming's layers from the checkpoint's compressed-tensors tensors (k3fuse/quant.py layouts:
`mxfp4-pack-quantized`, or `pack-quantized` int4 with bf16 group scales): one layer for w1 and w3
stacked ([E, 2I, L], the gate/up GEMM) and one for w2 ([E, L, I]), both indexed MoE GEMMs over the
(token, slot) pairs, as vLLM's fused-MoE path runs them. `align` lays the pairs out by expert in
blocks of the GEMM's row tile (what vLLM's moe_align_block_size kernel does), into fixed buffers so
a captured graph replays on new routing. `step` is the two GEMMs only: the alignment and the
activation between them (vLLM's own kernels) are left out of the timing, which favours the peer.

humming JIT-compiles with the GPU machine's nvcc / NVRTC on first use of a shape (seconds each).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import torch

CT_FORMATS = {"mxfp4": {"format": "mxfp4-pack-quantized", "type": "float"},
              "int4": {"format": "pack-quantized", "type": "int"}}


def _layer(fmt: str, n: int, k: int, n_experts: int, packed: torch.Tensor, scale: torch.Tensor):
    from humming.layer import HummingLayer

    config = {"quant_method": "compressed-tensors", "num_bits": 4, "strategy": "group", "group_size": 32,
              "symmetric": True, **CT_FORMATS[fmt]}
    layer = HummingLayer(shape_n=n, shape_k=k, num_experts=n_experts, weight_config=config,
                         torch_dtype=torch.bfloat16)
    params = dict(layer.named_parameters())
    layer.weight_packed = torch.nn.Parameter(packed, requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(scale, requires_grad=False)
    if "weight_shape" in params:  # int4's [rows, cols] per expert
        shape = torch.tensor([n, k], dtype=params["weight_shape"].dtype)
        layer.weight_shape = torch.nn.Parameter(shape.expand(params["weight_shape"].shape).contiguous().cuda(),
                                                requires_grad=False)
    layer.transform(allow_inplace=True)
    return layer


@dataclass
class _Gemm:
    layer: object
    top_k: int
    block: int
    compute: str
    tuning: str


def _gemm(layer, routed_rows: int, top_k: int) -> _Gemm:
    from humming.config import GemmType
    from humming.tune import get_heuristics_config

    tuning = get_heuristics_config(layer_config=layer.humming_config, use_f16_accum=False,
                                   use_m_major_input_scale=False, gemm_type=GemmType.INDEXED)
    block = next(cfg["block_shape"][0] for lo, hi, cfg in tuning if lo < routed_rows <= hi)
    compute = json.dumps({"use_f16_accum": False, "use_m_major_input_scale": False, "gemm_type": "indexed"})
    return _Gemm(layer, top_k, block, compute, json.dumps(tuning))


class HummingMoE:
    """Gate/up and down W4A16 MoE GEMMs for T tokens of top_k experts, over `slots` sets of fixed
    routing buffers (one per call of a captured graph of several steps)."""

    def __init__(self, fmt: str, w1, s1, w3, s3, w2, s2, tokens: int, top_k: int, slots: int = 1):
        E, I = w1.shape[0], w1.shape[1]
        L = w2.shape[1]
        self.E, self.I, self.L, self.T, self.top_k = E, I, L, tokens, top_k
        self.P = tokens * top_k
        self.gate_up = _gemm(_layer(fmt, 2 * I, L, E, torch.cat([w1, w3], 1), torch.cat([s1, s3], 1)), self.P, top_k)
        self.down = _gemm(_layer(fmt, L, I, E, w2.clone(), s2.clone()), self.P, 1)
        self.buffers = [{} for _ in range(slots)]
        for buffers in self.buffers:
            for name, g in (("gate_up", self.gate_up), ("down", self.down)):
                rows = self.P + min(E, self.P) * (g.block - 1)
                buffers[name] = (torch.full((rows,), self.P, dtype=torch.int32, device="cuda"),
                                 torch.zeros((-(-rows // g.block),), dtype=torch.int32, device="cuda"),
                                 torch.zeros((1,), dtype=torch.int32, device="cuda"))
        self.gu = torch.empty((self.P, 2 * I), dtype=torch.bfloat16, device="cuda")
        self.act = torch.randn((self.P, I), dtype=torch.bfloat16, device="cuda")
        self.z = torch.empty((self.P, L), dtype=torch.bfloat16, device="cuda")

    def align(self, experts: torch.Tensor, slot: int = 0) -> None:
        """Pairs grouped by expert, each expert's rows padded to the block (sentinel P), per GEMM."""
        P, E = self.P, self.E
        counts = torch.bincount(experts, minlength=E)
        order = torch.argsort(experts, stable=True)
        sorted_e = experts[order]
        first = torch.cumsum(counts, 0) - counts
        rank = torch.arange(P, device=experts.device) - first[sorted_e]
        for name, g in (("gate_up", self.gate_up), ("down", self.down)):
            ids, blocks, padded_rows = self.buffers[slot][name]
            padded = (counts + g.block - 1) // g.block * g.block
            ends = torch.cumsum(padded, 0)
            dest = (ends - padded)[sorted_e] + rank
            ids.fill_(P)
            ids[dest] = order.to(torch.int32)
            starts = torch.arange(blocks.shape[0], device=experts.device) * g.block
            blocks.copy_(torch.searchsorted(ends, starts, right=True).clamp(max=E - 1).to(torch.int32))
            padded_rows.copy_(ends[-1:].to(torch.int32))

    def _run(self, g: _Gemm, name: str, inputs: torch.Tensor, outputs: torch.Tensor, slot: int) -> torch.Tensor:
        ids, blocks, padded_rows = self.buffers[slot][name]
        return g.layer(inputs=inputs, outputs=outputs, sorted_ids=ids, expert_ids=blocks,
                       num_tokens_padded=padded_rows, top_k=g.top_k, compute_config=g.compute,
                       tuning_config=g.tuning)

    def step(self, a: torch.Tensor, slot: int = 0) -> torch.Tensor:
        """The two GEMMs: gu [P, 2I] = a . w13, then z [P, L] = act . w2 (act a fixed buffer)."""
        self._run(self.gate_up, "gate_up", a, self.gu, slot)
        return self._run(self.down, "down", self.act, self.z, slot)

    def forward(self, a: torch.Tensor, situ, slot: int = 0) -> torch.Tensor:
        """The whole routed experts with the activation between (the cross-check, untimed)."""
        self._run(self.gate_up, "gate_up", a, self.gu, slot)
        g, u = self.gu[:, :self.I], self.gu[:, self.I:]
        self.act.copy_(situ(g, u))
        return self._run(self.down, "down", self.act, self.z, slot).clone()


__all__ = ["HummingMoE"]
