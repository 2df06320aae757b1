"""Every parameter of the whole K3 model, per layer type: full shape, TP sharding, dtype, checkpoint name.

The modules of layers.py and model.py build their parameters from these tables (`WeightSource.build`), so the
table is the one definition of what the model holds; a checkpoint loader iterates `model_table(cfg)`, which
gives each parameter's name in `K3Model.named_parameters()`, its Hugging Face tensor name(s) and its spec.

Checkpoint names are K3's Hugging Face layout as vLLM's and SGLang's K3 loaders read it
(`vllm/models/kimi_k3/nvidia/model.py` `KimiLinearModel.load_weights`, `sglang/srt/models/kimi_k3.py`): decoder
layers under `language_model.model.layers.{i}.` (what the released index holds, as a third-party binder read it
from moonshotai/Kimi-K3's model.safetensors.index.json; both engines also map the older
`language_model.layers.{i}.` onto it), the MoE under `block_sparse_moe.` (SGLang renames it `mlp`), the
embedding, final norm and AttnRes output mix under `language_model.model.`, the head
`language_model.lm_head.weight`. Sharding is vLLM's TP layout:

| shard | meaning | K3 examples |
|---|---|---|
| column | dim 0 split: each rank its rows (heads, intermediate) | KDA q/k/v/g/f_b/b, MLA q_b/kv_b/g, shared and dense gate/up |
| row | dim 1 split: each rank its input columns, output all-reduced | KDA and MLA o_proj, shared and dense down |
| vocab | the vocabulary rows split | embed_tokens, lm_head (logits gathered) |
| replicated | whole on every rank | f_a, MLA q_a/kv_a, router, latent down/up, norms |
| experts_column / experts_row | routed experts by their intermediate I | w1/w3 [E, I, L] rows, w2 [E, L, I] columns |

Notes a loader needs (`ParamSpec.note`): the KDA conv weights are stacked [q; k; v] (checkpoint [P, 1, K]
each); A_log may be stored [1, 1, h, 1] or zero-padded; an AttnRes query is folded from two checkpoint
tensors (`*_res_norm.weight * *_res_proj.weight[0]`); MLA's kv_b_proj is held as stored and viewed as
W_UK / W_UV (per head [qk_nope rows | v_head rows] x kv_lora); quantized experts are `weight_packed` /
`weight_scale` per expert, held stacked [E, ...] in the config's expert_layout.
"""
from __future__ import annotations

from dataclasses import dataclass

from .config import K3Config, LayerKind
from .weights import NORM_INIT, ParamSpec, normal, uniform

import math

#: where the decoder layers and the rest of the language model live in the checkpoint
HF_LAYER_PREFIX = "language_model.model.layers.{layer}."
HF_MODEL_PREFIX = "language_model."


def norm(name: str, hf: str, width: int, key: str, note: str = "") -> ParamSpec:
    return ParamSpec(name, hf, (width,), "replicated", NORM_INIT, key, note=note)


def kda_params(cfg: K3Config) -> list[ParamSpec]:
    """KDADecode's parameters (checkpoint prefix `self_attn.`)."""
    H, P, R, h, d, K = cfg.hidden, cfg.kda_dim, cfg.gate_rank, cfg.kda_heads, cfg.head_dim, cfg.conv_kernel
    col = lambda name, hf, rows, cols: ParamSpec(name, hf, (rows, cols), "column", normal(cols ** -0.5),  # noqa: E731
                                                 f"kda.{name}")
    return [
        col("w_q", "self_attn.q_proj.weight", P, H),
        col("w_k", "self_attn.k_proj.weight", P, H),
        col("w_v", "self_attn.v_proj.weight", P, H),
        col("w_g", "self_attn.g_proj.weight", P, H),
        ParamSpec("w_fa", "self_attn.f_a_proj.weight", (R, H), "replicated", normal(H ** -0.5), "kda.w_fa"),
        col("w_fb", "self_attn.f_b_proj.weight", P, R),
        col("w_b", "self_attn.b_proj.weight", h, H),
        ParamSpec("dt_bias", "self_attn.dt_bias", (P,), "column", normal(0.5), "kda.dt_bias", dtype="float32"),
        ParamSpec("A_log", "self_attn.A_log", (h,), "column", uniform(math.log(0.5), math.log(2.0)), "kda.A_log",
                  dtype="float32", note="checkpoints store [h], [1, 1, h, 1] or zero-padded; the first h are used"),
        ParamSpec("conv_weight", "self_attn.{q,k,v}_conv1d.weight", (3 * P, K), "column", normal(0.5),
                  "kda.conv", dtype="float32", parts=("kda.conv_q", "kda.conv_k", "kda.conv_v"),
                  note="rank r holds [q_r; k_r; v_r]: each of q/k/v_conv1d ([P, 1, K] in checkpoints) split by "
                       "rows, then stacked"),
        ParamSpec("w_onorm", "self_attn.o_norm.weight", (d,), "replicated", NORM_INIT, "kda.w_onorm",
                  dtype="float32"),
        ParamSpec("w_o", "self_attn.o_proj.weight", (H, P), "row", normal(P ** -0.5), "kda.w_o"),
    ]


def mla_params(cfg: K3Config) -> list[ParamSpec]:
    """MLADecode's parameters (checkpoint prefix `self_attn.`)."""
    H, h, Q, C = cfg.hidden, cfg.mla_heads, cfg.q_lora, cfg.kv_lora
    nope, sh, v = cfg.qk_nope, cfg.qk_shared, cfg.v_head
    return [
        ParamSpec("w_q_a", "self_attn.q_a_proj.weight", (Q, H), "replicated", normal(H ** -0.5), "mla.w_q_a"),
        norm("q_a_norm.weight", "self_attn.q_a_layernorm.weight", Q, "mla.q_a_norm"),
        ParamSpec("w_q_b", "self_attn.q_b_proj.weight", (h * (nope + sh), Q), "column", normal(Q ** -0.5),
                  "mla.w_q_b", note="per head [q_nope | q_sh] rows"),
        ParamSpec("w_kv_a", "self_attn.kv_a_proj_with_mqa.weight", (C + sh, H), "replicated", normal(H ** -0.5),
                  "mla.w_kv_a", note="rows [c_kv | k_sh]"),
        norm("kv_a_norm.weight", "self_attn.kv_a_layernorm.weight", C, "mla.kv_a_norm"),
        ParamSpec("w_kv_b", "self_attn.kv_b_proj.weight", (h * (nope + v), C), "column", normal(C ** -0.5),
                  "mla.w_kv_b", note="per head [W_UK (qk_nope rows) | W_UV (v_head rows)], absorbed at decode"),
        ParamSpec("w_g", "self_attn.g_proj.weight", (h * v, H), "column", normal(H ** -0.5), "mla.w_g"),
        ParamSpec("w_o", "self_attn.o_proj.weight", (H, h * v), "row", normal((h * v) ** -0.5), "mla.w_o"),
    ]


def dense_mlp_params(cfg: K3Config) -> list[ParamSpec]:
    """DenseMLP's parameters (layer 1's SiTU MLP; checkpoint prefix `mlp.`)."""
    H, D = cfg.hidden, cfg.dense_inter
    return [
        ParamSpec("w_gate", "mlp.gate_proj.weight", (D, H), "column", normal(H ** -0.5), "dense.w_gate"),
        ParamSpec("w_up", "mlp.up_proj.weight", (D, H), "column", normal(H ** -0.5), "dense.w_up"),
        ParamSpec("w_down", "mlp.down_proj.weight", (H, D), "row", normal(D ** -0.5), "dense.w_down"),
    ]


def router_params(cfg: K3Config) -> list[ParamSpec]:
    H, E = cfg.hidden, cfg.n_experts
    return [
        ParamSpec("w_r", "block_sparse_moe.gate.weight", (E, H), "replicated", normal(H ** -0.5), "moe.w_r"),
        ParamSpec("b_corr", "block_sparse_moe.gate.e_score_correction_bias", (E,), "replicated", normal(0.05),
                  "moe.b_corr", dtype="float32"),
    ]


def latent_params(cfg: K3Config) -> list[ParamSpec]:
    """LatentMoE's dense parameters (the router is Router's, the experts `expert_params`)."""
    H, L = cfg.hidden, cfg.latent
    return [
        ParamSpec("w_down", "block_sparse_moe.routed_expert_down_proj.weight", (L, H), "replicated",
                  normal(H ** -0.5), "moe.w_down"),
        norm("latent_norm.weight", "block_sparse_moe.routed_expert_norm.weight", L, "moe.latent_norm"),
        ParamSpec("w_up", "block_sparse_moe.routed_expert_up_proj.weight", (H, L), "replicated", normal(L ** -0.5),
                  "moe.w_up"),
    ]


def expert_params(cfg: K3Config) -> list[ParamSpec]:
    """The routed experts, stacked [E, ...]: bf16 `w1`/`w3`/`w2`, or `<proj>_packed` + `<proj>_scale` in the
    config's quantized format (checkpoint: one `weight_packed` / `weight_scale` pair per expert)."""
    E, L, I = cfg.n_experts, cfg.latent, cfg.moe_inter
    specs = []
    for proj, shape, shard, std in (("w1", (E, I, L), "experts_column", L ** -0.5),
                                    ("w3", (E, I, L), "experts_column", L ** -0.5),
                                    ("w2", (E, L, I), "experts_row", I ** -0.5)):
        hf = f"block_sparse_moe.experts.{{e}}.{proj}." + ("weight" if not cfg.quantized_experts else
                                                          "{weight_packed,weight_scale}")
        specs.append(ParamSpec(proj, hf, shape, shard, normal(std), f"moe.{proj}", dtype="expert",
                               note="" if not cfg.quantized_experts else
                               f"{cfg.expert_format}: held as {proj}_packed / {proj}_scale, layout "
                               f"{cfg.expert_layout!r}"))
    return specs


def shared_params(cfg: K3Config) -> list[ParamSpec]:
    H, S = cfg.hidden, cfg.shared_inter
    return [
        ParamSpec("w_gate", "block_sparse_moe.shared_experts.gate_proj.weight", (S, H), "column", normal(H ** -0.5),
                  "shared.w_gate"),
        ParamSpec("w_up", "block_sparse_moe.shared_experts.up_proj.weight", (S, H), "column", normal(H ** -0.5),
                  "shared.w_up"),
        ParamSpec("w_down", "block_sparse_moe.shared_experts.down_proj.weight", (H, S), "row", normal(S ** -0.5),
                  "shared.w_down"),
    ]


def residual_params(cfg: K3Config, layer_names: tuple[str, str] = ("attn", "mlp")) -> list[ParamSpec]:
    """A decoder layer's own parameters: its two pre-norms and, with AttnRes, its two depth-mix queries."""
    H = cfg.hidden
    a, m = layer_names
    specs = [norm(f"{a}_norm.weight", "input_layernorm.weight", H, f"{a}_norm"),
             norm(f"{m}_norm.weight", "post_attention_layernorm.weight", H, f"{m}_norm")]
    if cfg.residual == "attnres":
        fold = "folded: {0}_res_norm.weight * {0}_res_proj.weight[0] (the key norm's weight into the query)"
        specs += [ParamSpec(f"{a}_res_query", "self_attention_res_{norm,proj}.weight", (H,), "replicated",
                            normal(H ** -0.5), f"{a}_res_query", dtype="float32",
                            note=fold.format("self_attention")),
                  ParamSpec(f"{m}_res_query", "mlp_res_{norm,proj}.weight", (H,), "replicated", normal(H ** -0.5),
                            f"{m}_res_query", dtype="float32", note=fold.format("mlp"))]
    return specs


def embed_params(cfg: K3Config) -> list[ParamSpec]:
    """The vocab-parallel embedding (checkpoint prefix `language_model.`)."""
    return [ParamSpec("weight", "model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden), "vocab", normal(1.0),
                      "embed")]


def head_params(cfg: K3Config) -> list[ParamSpec]:
    """The head's parameters: final norm (and the AttnRes output mix), LM head (prefix `language_model.`)."""
    H, V = cfg.hidden, cfg.vocab_size
    specs = [norm("final_norm.weight", "model.norm.weight", H, "final_norm"),
             ParamSpec("lm_head.weight", "lm_head.weight", (V, H), "vocab", normal(H ** -0.5), "lm_head")]
    if cfg.residual == "attnres":
        specs.append(ParamSpec("final_res_query", "model.output_attn_res_{norm,proj}.weight", (H,), "replicated",
                               normal(H ** -0.5), "final_res_query", dtype="float32",
                               note="folded: output_attn_res_norm.weight * output_attn_res_proj.weight[0]"))
    return specs


def layer_params(cfg: K3Config, kind: LayerKind) -> dict[str, list[ParamSpec]]:
    """A decoder layer of `kind`: its parameters by submodule path ("" the layer itself)."""
    tables = {"": residual_params(cfg), "attn.": kda_params(cfg) if kind.attn == "kda" else mla_params(cfg)}
    if kind.mlp == "dense":
        tables["mlp."] = dense_mlp_params(cfg)
    else:
        tables["mlp.routed.router."] = router_params(cfg)
        tables["mlp.routed."] = latent_params(cfg) + expert_params(cfg)
        tables["mlp.shared."] = shared_params(cfg)
    return tables


@dataclass(frozen=True)
class TableEntry:
    """One parameter of the whole model: its name in `K3Model.named_parameters()` (experts: the stacked
    tensor's name, `<name>_packed` / `<name>_scale` where quantized), its checkpoint name and its spec."""

    param: str
    hf: str
    spec: ParamSpec
    layer: int  # -1 for the embedding, head and final norm


def model_table(cfg: K3Config) -> list[TableEntry]:
    """Every parameter of K3Model(cfg), in module order: what a checkpoint loader iterates."""
    out = [TableEntry(f"embed.{s.name}", HF_MODEL_PREFIX + s.hf, s, -1) for s in embed_params(cfg)]
    for i, kind in enumerate(cfg.layer_kinds()):
        for path, specs in layer_params(cfg, kind).items():
            out += [TableEntry(f"layers.{i}.{path}{s.name}", HF_LAYER_PREFIX.format(layer=i) + s.hf, s, i)
                    for s in specs]
    return out + [TableEntry(f"head.{s.name}", HF_MODEL_PREFIX + s.hf, s, -1) for s in head_params(cfg)]


def print_table(cfg: K3Config, tp: int = 1) -> str:
    """The table as text: one line per parameter kind (the first layer of each kind), full and rank shapes."""
    seen: set[str] = set()
    lines = [f"{'parameter':40} {'shard':15} {'full shape':22} {'TP ' + str(tp) + ' shape':22} checkpoint"]
    for e in model_table(cfg):
        kind = cfg.layer_kinds()[e.layer].name if e.layer >= 0 else "model"
        key = f"{kind}:{e.param.split('.', 2)[-1] if e.layer >= 0 else e.param}"
        if key in seen:
            continue
        seen.add(key)
        lines.append(f"{key:40} {e.spec.shard:15} {str(e.spec.shape):22} {str(e.spec.local_shape(tp)):22} {e.hf}")
    return "\n".join(lines)


__all__ = ["HF_LAYER_PREFIX", "HF_MODEL_PREFIX", "TableEntry", "model_table", "layer_params", "kda_params",
           "mla_params", "dense_mlp_params", "router_params", "latent_params", "expert_params", "shared_params",
           "residual_params", "embed_params", "head_params", "print_table"]
