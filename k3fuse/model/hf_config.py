"""config.json as Kimi K3 publishes it, to and from `K3Config`.

K3's config.json (model_type ``kimi_k3``, architectures ``KimiK3ForConditionalGeneration``) holds the language
model's fields under ``text_config`` with vLLM's and SGLang's `KimiLinearConfig` names, and compressed-tensors'
``quantization_config`` at the top level or inside ``text_config`` (the engines' `KimiK3Config` lifts the latter).
`k3_config` derives a preset-free `K3Config` from such a dict and refuses, with one `CheckpointError` naming the
field, a config of another model, a missing or mistyped field, or a feature the model does not build (a SiLU MLP,
an MLA without its output gate, a layer pattern that is not K3's...). `hf_config` writes the same dict back for a
`K3Config`, so that `k3_config(hf_config(cfg)) == cfg` for every field config.json can express.

Fields the file has no name for are derived as the engines derive them: the shared experts' width is
``num_shared_experts * moe_intermediate_size``; the KDA decay gate's rank (``f_a_proj``'s rows) is
``linear_attn_config.head_dim``; AttnRes is on where ``attn_res_block_size`` is set. `expert_layout` is how a
model holds its experts, not a property of the file: the caller chooses it.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from .. import quant
from .checkpoint_error import CheckpointError, shown
from .config import DTYPES, K3Config

CONFIG_FILE = "config.json"
MODEL_TYPE = "kimi_k3"
ARCHITECTURE = "KimiK3ForConditionalGeneration"
TEXT_MODEL_TYPE = "kimi_linear"
QUANT_METHOD = "compressed-tensors"

#: K3Config field <- text_config integer field
_INTS = (("hidden", "hidden_size"), ("n_layers", "num_hidden_layers"), ("vocab_size", "vocab_size"),
         ("dense_inter", "intermediate_size"), ("dense_layers", "first_k_dense_replace"),
         ("n_experts", "num_experts"), ("top_k", "num_experts_per_token"), ("moe_inter", "moe_intermediate_size"),
         ("latent", "routed_expert_hidden_size"), ("mla_heads", "num_attention_heads"), ("q_lora", "q_lora_rank"),
         ("kv_lora", "kv_lora_rank"), ("qk_nope", "qk_nope_head_dim"), ("qk_shared", "qk_rope_head_dim"),
         ("v_head", "v_head_dim"))
#: K3Config field <- linear_attn_config integer field
_KDA_INTS = (("kda_heads", "num_heads"), ("head_dim", "head_dim"), ("conv_kernel", "short_conv_kernel_size"))
#: K3Config field <- text_config float field, and its value where the file leaves it out (None: required)
_FLOATS = (("rms_eps", "rms_norm_eps", None), ("situ_beta", "activation_situ_beta", None),
           ("situ_linear_beta", "activation_situ_linear_beta", None),
           ("routed_scaling", "routed_scaling_factor", 1.0))
#: text_config fields the model builds only one value of: (field, that value, the engines' default when absent);
#: a default that differs from the value means the field must be present
_FIXED = (("hidden_act", "situ", "silu"), ("moe_router_activation_func", "sigmoid", "sigmoid"),
          ("topk_method", "noaux_tc", "noaux_tc"), ("num_expert_group", 1, 1), ("topk_group", 1, 1),
          ("moe_renormalize", True, True), ("latent_moe_use_norm", True, False), ("mla_use_nope", True, False),
          ("mla_use_output_gate", True, False), ("tie_word_embeddings", False, False), ("moe_layer_freq", 1, 1))


def _where(path: str) -> str:
    return f"{CONFIG_FILE}: {path}"


_JSON_NAMES = {dict: "an object", list: "a list", str: "a string", int: "an integer", float: "a number",
               bool: "true or false", type(None): "null"}


def described(value: Any) -> str:
    """A JSON value as a message shows it: its type, and the value itself where it is not a container."""
    kind = _JSON_NAMES.get(type(value), type(value).__name__)
    return kind if isinstance(value, (dict, list)) else f"{kind} {shown(value)}"


def _get(obj: dict[str, Any], key: str, path: str, kind: type | tuple[type, ...], required: bool = True) -> Any:
    """obj[key] of `kind` (bool is not an int here); None where absent and not required."""
    if key not in obj:
        if required:
            raise CheckpointError(f"{_where(path + key)} is missing", "a K3 config.json names it (text_config "
                                  "holds the language model's fields)")
        return None
    value = obj[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        want = " or ".join(_JSON_NAMES.get(k, k.__name__) for k in kinds)
        raise CheckpointError(f"{_where(path + key)} is {described(value)}, expected {want}")
    return value


def _mla_every(full: list[int], n_layers: int, preferred: int) -> int:
    """The K3Config.mla_every whose pattern (every m-th layer, 1-based, and the last) is `full`: `preferred` where
    it fits, else the first MLA layer (or the last layer, where it is the only one)."""
    def pattern(m: int) -> list[int]:
        return [i + 1 for i in range(n_layers) if (i + 1) % m == 0 or i == n_layers - 1]
    for m in (preferred, full[0] if full else n_layers, n_layers):
        if m >= 1 and pattern(m) == full:
            return m
    raise CheckpointError(f"{_where('text_config.linear_attn_config.full_attn_layers')} is {shown(full)}, which "
                          "is not K3's layer pattern", "MLA layers are every m-th layer (1-based) and the last")


def quantization_format(config: dict[str, Any]) -> str:
    """The routed experts' format ("mxfp4", "int4", or "bf16" where the file quantizes nothing) that a
    config.json's compressed-tensors `quantization_config` describes."""
    text = config.get("text_config")
    candidates = [(p, c["quantization_config"]) for p, c in (("", config), ("text_config.", text))
                  if isinstance(c, dict) and "quantization_config" in c]
    if len(candidates) == 2 and candidates[0][1] != candidates[1][1]:
        raise CheckpointError(f"{CONFIG_FILE} has different quantization_config at the top level and in "
                              "text_config", "keep one")
    if not candidates:
        return "bf16"
    where, qc = candidates[0][0] + "quantization_config", candidates[0][1]
    if not isinstance(qc, dict):
        raise CheckpointError(f"{_where(where)} is {described(qc)}, expected an object")
    method = qc.get("quant_method")
    if method != QUANT_METHOD:
        raise CheckpointError(f"{_where(where + '.quant_method')} is {shown(method)}, expected {QUANT_METHOD!r}")
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise CheckpointError(f"{_where(where + '.quantization_status')} is {shown(status)}, expected "
                              "'compressed' (packed weights)")
    by_name = {v: k for k, v in quant.CHECKPOINT_FORMATS.items()}
    groups = _get(qc, "config_groups", where + ".", dict)
    if not groups:
        raise CheckpointError(f"{_where(where + '.config_groups')} is empty", "it names the experts' weights")
    found: set[str] = set()
    for gname, group in groups.items():
        path = f"{where}.config_groups.{gname}."
        if not isinstance(group, dict):
            raise CheckpointError(f"{_where(path[:-1])} is {described(group)}, expected an object")
        name = group.get("format", qc.get("format"))
        if not isinstance(name, str) or name not in by_name:
            raise CheckpointError(f"{_where(path + 'format')} is {shown(name)}, expected one of {sorted(by_name)}")
        fmt = by_name[name]
        found.add(fmt)
        weights = _get(group, "weights", path, dict)
        scale_type = "float" if fmt == "mxfp4" else "int"
        for key, want, required in (("num_bits", 4, True), ("strategy", "group", True),
                                    ("group_size", quant.GROUP_SIZE, True), ("type", scale_type, False),
                                    ("symmetric", True, False), ("dynamic", False, False), ("actorder", None, False)):
            if key not in weights:
                if required:
                    raise CheckpointError(f"{_where(path + 'weights.' + key)} is missing", f"{name} needs "
                                          f"{key} {want!r}")
                continue
            if weights[key] != want or type(weights[key]) is not type(want):
                raise CheckpointError(f"{_where(path + 'weights.' + key)} is {shown(weights[key])}, expected "
                                      f"{want!r} for {name}")
        if fmt == "mxfp4" and weights.get("scale_dtype", "torch.uint8") != "torch.uint8":
            raise CheckpointError(f"{_where(path + 'weights.scale_dtype')} is {shown(weights['scale_dtype'])}, "
                                  "expected 'torch.uint8' (E8M0 bytes)")
    if len(found) > 1:
        raise CheckpointError(f"{_where(where)} names more than one expert format: {sorted(found)}")
    return found.pop()


def k3_config(config: Any, *, name: str = "checkpoint", expert_layout: str = "rows") -> K3Config:
    """The K3Config a parsed config.json describes (see the module docstring); CheckpointError where it is not
    K3's or the model cannot build it."""
    if not isinstance(config, dict):
        raise CheckpointError(f"{CONFIG_FILE} holds {described(config)}, expected an object")
    model_type = config.get("model_type")
    architectures = config.get("architectures", [ARCHITECTURE])
    if model_type != MODEL_TYPE or not isinstance(architectures, list) or ARCHITECTURE not in architectures:
        raise CheckpointError(f"{CONFIG_FILE} describes model_type {shown(model_type)}, architectures "
                              f"{shown(architectures)}: not Kimi K3", f"expected model_type {MODEL_TYPE!r} and "
                              f"architectures [{ARCHITECTURE!r}]")
    text = _get(config, "text_config", "", dict)
    fields: dict[str, Any] = {}
    for field, key in _INTS:
        fields[field] = _get(text, key, "text_config.", int)
    kda = _get(text, "linear_attn_config", "text_config.", dict)
    for field, key in _KDA_INTS:
        fields[field] = _get(kda, key, "text_config.linear_attn_config.", int)
    for field, key, default in _FLOATS:
        value = _get(text, key, "text_config.", (int, float), required=default is None)
        fields[field] = float(default if value is None else value)
    fields["gate_lower_bound"] = float(_get(kda, "gate_lower_bound", "text_config.linear_attn_config.",
                                            (int, float)))
    for key, want, default in _FIXED:
        value = text.get(key, default)
        if value != want or type(value) is not type(want):
            where = _where("text_config." + key)
            raise CheckpointError(f"{where} is {shown(value)}{' (absent)' if key not in text else ''}, but the "
                                  f"model builds only {want!r}")
    if not kda.get("use_full_rank_gate", False) is True:
        raise CheckpointError(f"{_where('text_config.linear_attn_config.use_full_rank_gate')} is "
                              f"{shown(kda.get('use_full_rank_gate'))}, but the model builds only K3's full-rank "
                              "KDA gate (true)")
    heads = fields["mla_heads"]
    kv_heads = _get(text, "num_key_value_heads", "text_config.", int, required=False)
    if kv_heads not in (None, heads):
        raise CheckpointError(f"{_where('text_config.num_key_value_heads')} is {kv_heads}, expected "
                              f"num_attention_heads={heads} (MLA)")
    shared = _get(text, "num_shared_experts", "text_config.", int)
    fields["shared_inter"] = shared * fields["moe_inter"]
    fields["gate_rank"] = fields["head_dim"]
    block = _get(text, "attn_res_block_size", "text_config.", (int, type(None)), required=False)
    fields["residual"] = "plain" if block is None else "attnres"
    if block is not None:
        fields["attn_res_block"] = block
    n = fields["n_layers"]
    full = _get(kda, "full_attn_layers", "text_config.linear_attn_config.", list)
    kda_layers = _get(kda, "kda_layers", "text_config.linear_attn_config.", list)
    for key, layers in (("full_attn_layers", full), ("kda_layers", kda_layers)):
        if not all(type(i) is int for i in layers):
            raise CheckpointError(f"{_where('text_config.linear_attn_config.' + key)} holds a non-integer: "
                                  f"{shown(layers)}")
    if len(full) + len(kda_layers) != n or sorted(full + kda_layers) != list(range(1, n + 1)) or full != sorted(full):
        raise CheckpointError(f"{_where('text_config.linear_attn_config')}: full_attn_layers and kda_layers do "
                              f"not split layers 1..{n} (num_hidden_layers)", "each layer is in exactly one, "
                              "in order")
    fields["mla_every"] = _mla_every(full, n, K3Config.__dataclass_fields__["mla_every"].default)
    dtype = text.get("torch_dtype", text.get("dtype", config.get("torch_dtype", "bfloat16")))
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise CheckpointError(f"{_where('text_config.torch_dtype')} is {shown(dtype)}, expected one of "
                              f"{sorted(DTYPES)}")
    fields["dtype"] = dtype
    fields["expert_format"] = quantization_format(config)
    try:
        return K3Config(**fields, expert_layout=expert_layout, name=name)
    except ValueError as exc:
        raise CheckpointError(f"{CONFIG_FILE} describes a model K3Config refuses: {exc}") from None


def quantization_config(fmt: str) -> dict[str, Any]:
    """compressed-tensors' `quantization_config` of routed experts in `fmt` as K3 ships it: one group of 4-bit
    weights in groups of 32, every other linear ignored (kept BF16)."""
    name = quant.CHECKPOINT_FORMATS[fmt]
    weights = {"num_bits": 4, "type": "float" if fmt == "mxfp4" else "int", "symmetric": True, "strategy": "group",
               "group_size": quant.GROUP_SIZE, "dynamic": False, "actorder": None}
    if fmt == "mxfp4":
        weights["scale_dtype"] = "torch.uint8"
    return {"quant_method": QUANT_METHOD, "format": name, "quantization_status": "compressed",
            "config_groups": {"group_0": {"format": name, "targets": ["Linear"], "weights": weights,
                                          "input_activations": None, "output_activations": None}},
            "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                       "re:.*block_sparse_moe\\.(gate|routed_expert_down_proj|routed_expert_up_proj)$",
                       "re:.*lm_head.*"]}


def hf_config(cfg: K3Config) -> dict[str, Any]:
    """config.json for `cfg` in K3's published layout; ValueError where config.json cannot express `cfg`."""
    if cfg.gate_rank != cfg.head_dim:
        raise ValueError(f"K3Config.gate_rank={cfg.gate_rank} differs from head_dim={cfg.head_dim}: K3's config.json "
                         "has no field for it (f_a_proj's rows are linear_attn_config.head_dim)")
    if cfg.shared_inter % cfg.moe_inter:
        raise ValueError(f"K3Config.shared_inter={cfg.shared_inter} is not a multiple of moe_inter={cfg.moe_inter}: "
                         "config.json gives it as num_shared_experts * moe_intermediate_size")
    kinds = cfg.layer_kinds()
    text: dict[str, Any] = {key: getattr(cfg, field) for field, key in _INTS}
    text.update({key: getattr(cfg, field) for field, key, _ in _FLOATS})
    text.update({key: want for key, want, _ in _FIXED})
    text.update({"model_type": TEXT_MODEL_TYPE, "num_key_value_heads": cfg.mla_heads,
                 "num_shared_experts": cfg.shared_inter // cfg.moe_inter, "torch_dtype": cfg.dtype,
                 "attn_res_block_size": cfg.attn_res_block if cfg.residual == "attnres" else None,
                 "num_nextn_predict_layers": 0})
    text["linear_attn_config"] = {
        **{key: getattr(cfg, field) for field, key in _KDA_INTS}, "gate_lower_bound": cfg.gate_lower_bound,
        "use_full_rank_gate": True,
        "full_attn_layers": [i + 1 for i, k in enumerate(kinds) if k.attn == "mla"],
        "kda_layers": [i + 1 for i, k in enumerate(kinds) if k.attn == "kda"]}
    out: dict[str, Any] = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "text_config": text}
    if cfg.quantized_experts:
        out["quantization_config"] = quantization_config(cfg.expert_format)
    return out


def differences(a: K3Config, b: K3Config, skip: tuple[str, ...] = ()) -> list[str]:
    """The fields config.json determines on which `a` and `b` differ, as "field a vs b" (not `name`,
    `expert_layout` or `l2_eps`, which are the caller's, nor a plain model's unused `attn_res_block`)."""
    ignored = {"name", "expert_layout", "l2_eps", *skip}
    if a.residual == b.residual == "plain":
        ignored.add("attn_res_block")
    return [f"{f.name} {getattr(a, f.name)!r} vs {getattr(b, f.name)!r}" for f in dataclasses.fields(K3Config)
            if f.name not in ignored and getattr(a, f.name) != getattr(b, f.name)]


__all__ = ["CONFIG_FILE", "MODEL_TYPE", "ARCHITECTURE", "k3_config", "hf_config", "quantization_config",
           "quantization_format", "differences"]
