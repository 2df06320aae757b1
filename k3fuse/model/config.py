"""Dimensions and hyper-parameters of the reference Kimi K3 decode model.

One frozen dataclass, a few presets and the divisibility checks tensor parallelism needs. The
`k3` preset carries the published dimensions (for shape and byte arithmetic, or `device="meta"`);
`tiny` and `small` keep the same structure at sizes a CPU test can run, with every sharded width
divisible by TP 2, 4 and 8, and every layer type of the whole model present (`layer_kinds`).
K3's layer pattern: layer 1 (1-based) is KDA with the dense SiTU MLP, MLA replaces KDA at every
`mla_every`-th layer and at the last one (K3: 4, 8, ..., 92 and 93), every other layer is KDA, and
every layer past the dense ones has the LatentMoE; any `n_layers` keeps that pattern. `expert_format` is how the routed experts are stored: `bf16` (the model
dtype), or packed as the checkpoint ships them (`mxfp4`, K3's format and the `k3` preset's; `int4`,
K2.x's); `expert_layout` how packed experts are held: the checkpoint's `rows`, or repacked where they load
in `blocks` for the fused kernel's contiguous copies (the `k3` preset's); see k3fuse/quant.py.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ..quant import BLOCK_STEP, EXPERT_FORMATS, EXPERT_LAYOUTS, GROUP_SIZE
from ..spelling import K3_SITU_BETA, K3_SITU_LINEAR_BETA

RESIDUAL_KINDS = ("plain", "attnres")
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


@dataclass(frozen=True)
class LayerKind:
    """What one decoder layer holds: its attention ("kda" or "mla") and its MLP ("dense" or "moe")."""

    attn: str
    mlp: str

    @property
    def name(self) -> str:
        return f"{self.attn}+{self.mlp}"


@dataclass(frozen=True)
class K3Config:
    """The dimensions of K3's decoder (HF config.json names in the comments).

    `K3DecodeStack` (stack.py) builds every layer as the reference layer, KDA + LatentMoE (68 of K3's
    93 layers); `K3Model` (model.py) builds the whole model in K3's layer pattern (`layer_kinds`), with
    the embedding, the dense first layer, the gated NoPE-MLA layers, the LM head and sampling.
    """

    hidden: int
    n_layers: int
    kda_heads: int
    head_dim: int
    gate_rank: int  # rows of W_fa (the low-rank decay-gate projection), 128 in K3
    n_experts: int
    top_k: int
    moe_inter: int  # routed expert intermediate width I
    latent: int  # LatentMoE latent width L
    shared_inter: int  # fused shared-expert intermediate width S
    conv_kernel: int = 4
    rms_eps: float = 1e-5
    l2_eps: float = 1e-6
    gate_lower_bound: float = -5.0
    routed_scaling: float = 1.0
    situ_beta: float = K3_SITU_BETA  # 4.0
    situ_linear_beta: float = K3_SITU_LINEAR_BETA  # 25.0
    residual: str = "plain"  # "plain" pre-norm residual or "attnres" (Block Attention Residuals)
    attn_res_block: int = 12  # layers per AttnRes block (a bank entry every this many layers)
    dtype: str = "float32"  # model (trunk) dtype name; KDA state, router and SiTU are fp32 anyway
    expert_format: str = "bf16"  # routed experts: "bf16" (the trunk dtype), "mxfp4" or "int4" (packed)
    expert_layout: str = "rows"  # packed experts held as the checkpoint's rows, or repacked in "blocks" (quant.py)
    # the whole model (K3Model): vocabulary, the dense first layer(s), the gated NoPE-MLA layers
    vocab_size: int = 256  # vocab_size (K3 163840)
    dense_inter: int = 256  # intermediate_size of the dense SiTU MLP (K3 33792)
    dense_layers: int = 1  # first_k_dense_replace: the first layers have the dense MLP instead of the MoE
    mla_heads: int = 8  # num_attention_heads (K3 96)
    q_lora: int = 64  # q_lora_rank (K3 1536)
    kv_lora: int = 32  # kv_lora_rank (K3 512): the cached latent c_kv
    qk_nope: int = 16  # qk_nope_head_dim (K3 128)
    qk_shared: int = 8  # qk_rope_head_dim (K3 64): the shared key k_sh, cached; NoPE, so no rotary on it
    v_head: int = 16  # v_head_dim (K3 128)
    mla_every: int = 4  # full_attn_layers: every mla_every-th layer (1-based) and the last
    name: str = "custom"

    def __post_init__(self) -> None:
        for field in ("hidden", "n_layers", "kda_heads", "head_dim", "gate_rank", "n_experts",
                      "top_k", "moe_inter", "latent", "shared_inter", "conv_kernel",
                      "attn_res_block", "vocab_size", "dense_inter", "mla_heads",
                      "q_lora", "kv_lora", "qk_nope", "qk_shared", "v_head", "mla_every"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"K3Config.{field} must be a positive int, got {value!r}")
        if not isinstance(self.dense_layers, int) or isinstance(self.dense_layers, bool) or \
                not 0 <= self.dense_layers <= self.n_layers:
            raise ValueError(f"K3Config.dense_layers must be an int in 0..n_layers={self.n_layers}, "
                             f"got {self.dense_layers!r}")
        if self.conv_kernel < 2:
            raise ValueError(f"K3Config.conv_kernel must be >= 2 (the conv state keeps "
                             f"conv_kernel - 1 inputs), got {self.conv_kernel}")
        if self.top_k > self.n_experts:
            raise ValueError(f"K3Config.top_k={self.top_k} exceeds n_experts={self.n_experts}")
        if self.residual not in RESIDUAL_KINDS:
            raise ValueError(f"K3Config.residual must be one of {RESIDUAL_KINDS}, got {self.residual!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"K3Config.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.expert_format not in EXPERT_FORMATS:
            raise ValueError(f"K3Config.expert_format must be one of {EXPERT_FORMATS}, got {self.expert_format!r}")
        if self.quantized_experts:
            for field in ("latent", "moe_inter"):
                if getattr(self, field) % GROUP_SIZE:
                    raise ValueError(f"K3Config.{field}={getattr(self, field)} must be a multiple of the "
                                     f"{self.expert_format} group size {GROUP_SIZE} (the experts' input widths)")
        if self.expert_layout not in EXPERT_LAYOUTS:
            raise ValueError(f"K3Config.expert_layout must be one of {EXPERT_LAYOUTS}, got {self.expert_layout!r}")
        if self.expert_layout == "blocks":
            if not self.quantized_experts:
                raise ValueError("K3Config.expert_layout='blocks' repacks packed experts: it needs expert_format "
                                 f"mxfp4 or int4, got {self.expert_format!r} (with it, set expert_layout='rows')")
            for field in ("latent", "moe_inter"):
                if getattr(self, field) % BLOCK_STEP:
                    raise ValueError(f"K3Config.{field}={getattr(self, field)} must be a multiple of {BLOCK_STEP} "
                                     "for expert_layout='blocks' (a block's step; its rows, 64, divide that)")
        if not self.gate_lower_bound < 0:
            raise ValueError(f"K3Config.gate_lower_bound must be negative (decay exp(g) < 1), "
                             f"got {self.gate_lower_bound}")
        for field in ("rms_eps", "l2_eps", "situ_beta", "situ_linear_beta", "routed_scaling"):
            if not getattr(self, field) > 0:
                raise ValueError(f"K3Config.{field} must be positive, got {getattr(self, field)}")

    @property
    def kda_dim(self) -> int:
        """P = heads * head_dim, the width of q, k, v and the output gate."""
        return self.kda_heads * self.head_dim

    @property
    def kv_entry(self) -> int:
        """Values cached per token in an MLA layer: [c_kv (kv_lora) | k_sh (qk_shared)], 576 in K3."""
        return self.kv_lora + self.qk_shared

    @property
    def mla_scale(self) -> float:
        """MLA's softmax scale, (qk_nope + qk_shared) ** -0.5: 192 ** -0.5 in K3."""
        return (self.qk_nope + self.qk_shared) ** -0.5

    def layer_kinds(self) -> tuple[LayerKind, ...]:
        """Each layer's attention and MLP in K3's pattern (0-based list; MLA at 1-based multiples of mla_every
        and at the last layer, the dense MLP in the first dense_layers)."""
        return tuple(LayerKind("mla" if (i + 1) % self.mla_every == 0 or i == self.n_layers - 1 else "kda",
                               "dense" if i < self.dense_layers else "moe") for i in range(self.n_layers))

    @property
    def attn_res_blocks(self) -> int:
        """AttnRes bank entries a step writes: one at each block's first layer."""
        return -(-self.n_layers // self.attn_res_block)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def quantized_experts(self) -> bool:
        """The routed experts are stored packed with group scales (`mxfp4` or `int4`)."""
        return self.expert_format != "bf16"

    def sharded_dims(self) -> dict[str, int]:
        """The widths tensor parallelism splits (heads, expert/shared/dense intermediate, the vocabulary) or
        that the sharded-front rule splits (experts = router rows, latent = W_down rows)."""
        return {
            "kda_heads": self.kda_heads,
            "n_experts": self.n_experts,
            "latent": self.latent,
            "moe_inter": self.moe_inter,
            "shared_inter": self.shared_inter,
            "mla_heads": self.mla_heads,
            "dense_inter": self.dense_inter,
            "vocab_size": self.vocab_size,
        }

    def check_expert_layout(self, tp: int) -> None:
        """Raise ValueError where a rank's experts cannot be held in expert_layout at TP `tp` (where the experts are
        built: the GEMM shapes of a TP need no layout)."""
        if self.expert_layout == "blocks" and (self.moe_inter // tp) % BLOCK_STEP:
            raise ValueError(f"TP={tp} leaves moe_inter/tp={self.moe_inter // tp} of config {self.name!r}, not a "
                             f"multiple of {BLOCK_STEP}, which expert_layout='blocks' needs per rank: build it with "
                             "expert_layout='rows' (`--set expert_layout=rows`)")

    def validate_for_tp(self, tp: int) -> None:
        """Raise ValueError naming the first dimension that `tp` does not divide."""
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tp must be a positive int, got {tp!r}")
        for dim, value in self.sharded_dims().items():
            if value % tp:
                raise ValueError(f"TP={tp} does not divide {dim}={value} of config {self.name!r}")
        if self.quantized_experts and (self.moe_inter // tp) % GROUP_SIZE:
            raise ValueError(f"TP={tp} leaves moe_inter/tp={self.moe_inter // tp} of config {self.name!r}, not a "
                             f"multiple of the {self.expert_format} group size {GROUP_SIZE} (w2's input width "
                             f"per rank)")


PRESETS: dict[str, K3Config] = {
    # Published Kimi K3 dimensions (AttnRes block 12, BF16 trunk, MXFP4 routed experts as shipped).
    "k3": K3Config(hidden=7168, n_layers=93, kda_heads=96, head_dim=128, gate_rank=128,
                   n_experts=896, top_k=16, moe_inter=3072, latent=3584, shared_inter=6144,
                   residual="attnres", attn_res_block=12, dtype="bfloat16", expert_format="mxfp4",
                   expert_layout="blocks", vocab_size=163840, dense_inter=33792, dense_layers=1, mla_heads=96,
                   q_lora=1536, kv_lora=512, qk_nope=128, qk_shared=64, v_head=128, mla_every=4, name="k3"),
    # CPU test sizes: same structure, every sharded width divisible by 2, 4 and 8.
    "tiny": K3Config(hidden=128, n_layers=2, kda_heads=8, head_dim=16, gate_rank=16,
                     n_experts=16, top_k=4, moe_inter=32, latent=64, shared_inter=64,
                     attn_res_block=2, dtype="float32", vocab_size=256, dense_inter=256, mla_heads=8, q_lora=64,
                     kv_lora=32, qk_nope=16, qk_shared=8, v_head=16, name="tiny"),
    "small": K3Config(hidden=256, n_layers=4, kda_heads=16, head_dim=32, gate_rank=32,
                      n_experts=32, top_k=4, moe_inter=64, latent=128, shared_inter=128,
                      attn_res_block=2, dtype="float32", vocab_size=512, dense_inter=512, mla_heads=16,
                      q_lora=128, kv_lora=64, qk_nope=32, qk_shared=16, v_head=32, name="small"),
}


# K3 with narrow bf16 routed experts (moe_inter=128, a twelfth of the published width): the layer figures
# before MXFP4, kept under a name that says so.
PRESETS["k3_moe_inter128"] = dataclasses.replace(PRESETS["k3"], moe_inter=128, expert_format="bf16",
                                                 expert_layout="rows", name="k3_moe_inter128")


def get_config(name: str, **overrides: Any) -> K3Config:
    """A preset by name, with fields replaced by `overrides` (validated again)."""
    try:
        base = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown K3 preset {name!r}; known presets: {sorted(PRESETS)}") from None
    fields = {f.name for f in dataclasses.fields(K3Config)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown K3Config field(s) {unknown}; fields are {sorted(fields)}")
    return dataclasses.replace(base, **overrides)
