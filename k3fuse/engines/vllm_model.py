"""Kimi K3 in vLLM, built from k3fuse's K3 model and compiled by vLLM (importing this module imports vLLM).

vLLM's own K3 class (`vllm/models/kimi_k3/nvidia/model.py`) has no `@support_torch_compile`: vLLM runs it eagerly
and no compiler pass ever sees it. `K3FuseForCausalLM` is the same model as k3fuse's `K3Model` (the decoder layers
of k3fuse/model, in K3's layer order, with their parameter table) behind vLLM's interfaces:

* **compiled by vLLM**: `K3FuseDecoder` (embedding, every decoder layer, AttnRes output mix, final norm) is marked
  `@support_torch_compile`, so vLLM's compilation runs it through its pass manager and the post-grad pass
  (`k3fuse.vllm_pass`) sees the whole K3 decode step: the out-projections and their all-reduces, the router, the
  routed experts, the KDA short conv and delta rule, all in ATen;
* **vLLM's caches**: the MLA layers' paged latent cache and the KDA layers' state cache are vLLM's (allocated,
  paged and scheduled by vLLM; `vllm_cache.py`), reached through three custom ops;
* **vLLM's weight loading**: `load_weights` takes vLLM's (name, tensor) stream of the checkpoint as K3 ships it
  and builds each rank's slice with k3fuse's checkpoint layout (k3fuse/model/checkpoint_layout.py);
* **vLLM's TP group**: the all-reduces run over vLLM's TP device group (gloo on CPU, NCCL on GPUs);
* the LM head runs in `compute_logits`; vLLM samples.

Prompts run as consecutive decode sub-steps (vllm_cache.StepPlan), so the compiled graph is one decode step.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
from collections import Counter
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size, get_tp_group
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.mamba_utils import get_temporal_copy_spec
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid

from ..model import params
from ..model.checkpoint_layout import Stored, param_layouts
from ..model.config import DTYPES, K3Config, LayerKind
from ..model.hf_config import k3_config
from ..model.layers import KDADecode, MLADecode, TensorParallel, VocabEmbedding, WeightSource, attn_res_mix_bank
from ..model.model import DecoderLayer, Head
from ..model.sampling import SamplingConfig
from . import vllm_cache
from .base import EngineError
from .vllm_cache import KDAShapes, KDAStateCache, MLACache, MLAShapes

logger = logging.getLogger("vllm.k3fuse")  # under vLLM's logger: its handler prints it

_ops = torch.ops.k3fuse_vllm


def k3_config_for(vllm_config: VllmConfig) -> K3Config:
    """The K3Config of the checkpoint vLLM serves, read from its config.json as vLLM parsed it."""
    hf = vllm_config.model_config.hf_config
    raw = copy.deepcopy(hf.to_dict() if hasattr(hf, "to_dict") else dict(vars(hf)))
    # vLLM's K3 config hook renames the experts' compressed-tensors MXFP4 to its own "mxfp4" method in place
    # (model_executor/models/config.py, KimiK3ForConditionalGenerationConfig): read the checkpoint's own name
    for holder in (raw, raw.get("text_config") or {}):
        quant = holder.get("quantization_config")
        if isinstance(quant, dict) and quant.get("quant_method") == "mxfp4" and \
                quant.get("format") == "mxfp4-pack-quantized":
            quant["quant_method"] = "compressed-tensors"
    try:
        return k3_config(raw, name="vllm")
    except ValueError as exc:
        raise EngineError(f"k3fuse's vLLM model serves Kimi K3 checkpoints only: {exc}",
                          "unset K3FUSE_VLLM_MODEL to serve this checkpoint with vLLM's own model class") from None


def kda_shapes(cfg: K3Config, tp_size: int, dtype: torch.dtype) -> KDAShapes:
    return KDAShapes(cfg.kda_heads // tp_size, cfg.head_dim, 3 * cfg.kda_dim // tp_size, cfg.conv_kernel - 1, dtype)


# --- the decoder layers, with their state in vLLM's caches ------------------------------------------------------
class VllmKDALayer(DecoderLayer):
    """A KDA decoder layer (k3fuse/model's `KDADecode`) whose states live in vLLM's state cache `cache_name`."""

    def __init__(self, cfg: K3Config, layer: int, kind: LayerKind, src: WeightSource, tp: TensorParallel,
                 cache_name: str):
        super().__init__(cfg, layer, kind, src, tp)
        self.attn = KDADecode(cfg, layer, src, tp)
        self.cache_name = cache_name

    # each layer class its own forward, as k3fuse/model's layers: Dynamo keeps its graphs per code object
    def forward(self, r: torch.Tensor, bank: torch.Tensor | None, stores: list[torch.Tensor]) -> torch.Tensor:
        return self._step(r, bank, stores)

    def _attend(self, h: torch.Tensor, stores: list[torch.Tensor]) -> torch.Tensor:  # type: ignore[override]
        recurrent, conv = _ops.kda_states(h, self.cache_name)
        y, new_recurrent, new_conv = self.attn(h, recurrent, conv)
        stores.append(_ops.kda_store(new_recurrent, new_conv, self.cache_name))
        return y


class VllmMLADecode(MLADecode):
    """K3's gated NoPE MLA (k3fuse/model's `MLADecode`, its weights and math) over vLLM's paged latent cache: the
    append and the attention are `k3fuse_vllm.mla_attend`."""

    def forward(self, x: torch.Tensor, cache_name: str) -> torch.Tensor:  # type: ignore[override]
        cfg = self.cfg
        T, h = x.shape[0], self.local_heads
        c_q = self.q_a_norm(torch.nn.functional.linear(x, self.w_q_a))
        q = torch.nn.functional.linear(c_q, self.w_q_b).view(T, h, cfg.qk_nope + cfg.qk_shared)
        q_nope, q_sh = q.split([cfg.qk_nope, cfg.qk_shared], dim=-1)
        c_kv, k_sh = torch.nn.functional.linear(x, self.w_kv_a).split([cfg.kv_lora, cfg.qk_shared], dim=-1)
        entry = torch.cat([self.kv_a_norm(c_kv), k_sh], dim=-1)
        w_uk, w_uv = self.absorbed_weights()
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        o_lat = _ops.mla_attend(torch.cat([q_lat, q_sh], dim=-1).contiguous(), entry, cache_name, cfg.mla_scale,
                                cfg.kv_lora)
        o = torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
        gate = torch.nn.functional.linear(x, self.w_g).view(T, h, cfg.v_head)
        o = (o.float() * torch.sigmoid(gate.float())).reshape(T, h * cfg.v_head).to(x.dtype)
        return self.tp.all_reduce(torch.nn.functional.linear(o, self.w_o))


class VllmMLALayer(DecoderLayer):
    """An MLA decoder layer whose latent cache is vLLM's paged cache `cache_name`."""

    def __init__(self, cfg: K3Config, layer: int, kind: LayerKind, src: WeightSource, tp: TensorParallel,
                 cache_name: str):
        super().__init__(cfg, layer, kind, src, tp)
        self.attn = VllmMLADecode(cfg, layer, src, tp)
        self.cache_name = cache_name

    def forward(self, r: torch.Tensor, bank: torch.Tensor | None, stores: list[torch.Tensor]) -> torch.Tensor:
        return self._step(r, bank, stores)

    def _attend(self, h: torch.Tensor, stores: list[torch.Tensor]) -> torch.Tensor:  # type: ignore[override]
        return self.attn(h, self.cache_name)


@support_torch_compile(dynamic_arg_dims={"input_ids": 0})
class K3FuseDecoder(nn.Module):
    """One K3 decode step, token ids [T] -> final-normed hidden states [T, H]: what vLLM compiles."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        dtype = vllm_config.model_config.dtype
        # the layers compute in vLLM's dtype (`--dtype`), not the checkpoint's torch_dtype
        cfg = dataclasses.replace(k3_config_for(vllm_config),
                                  dtype=next(name for name, d in DTYPES.items() if d == dtype))
        tp_size, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        cfg.validate_for_tp(tp_size)
        self.cfg = cfg
        group = get_tp_group().device_group if tp_size > 1 else None
        tp = TensorParallel(tp_size, rank, group)
        # the parameters are drawn here and replaced by load_weights (the draws only give them their shapes)
        src = WeightSource(0, dtype, vllm_config.device_config.device or torch.device("cpu"))
        (embed_spec,) = params.embed_params(cfg)
        self.embed = VocabEmbedding(src.build(embed_spec, -1, tp_size, rank), tp)
        self.caches: list[nn.Module] = []  # vLLM's cache layers (not submodules: vLLM finds them by name)
        layers = []
        for i, kind in enumerate(cfg.layer_kinds()):
            name = f"{prefix}.layers.{i}.cache"
            if kind.attn == "kda":
                self.caches.append(KDAStateCache(vllm_config, name, kda_shapes(cfg, tp_size, dtype)))
                layers.append(VllmKDALayer(cfg, i, kind, src, tp, name))
            else:
                self.caches.append(MLACache(vllm_config, name, MLAShapes(cfg.kv_entry, dtype)))
                layers.append(VllmMLALayer(cfg, i, kind, src, tp, name))
        self.layers = nn.ModuleList(layers)
        self.head = Head(cfg, src, tp, SamplingConfig())  # final norm, AttnRes output mix; its LM head: compute_logits
        self.cache_names = [c.prefix for c in self.caches]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        r = self.embed(input_ids)
        bank = (torch.zeros(cfg.attn_res_blocks + 1, r.shape[0], cfg.hidden, dtype=r.dtype, device=r.device)
                if cfg.residual == "attnres" else None)
        stores: list[torch.Tensor] = []
        for layer in self.layers:
            r = layer(r, bank, stores)
        if bank is not None:
            n = cfg.attn_res_blocks
            r = attn_res_mix_bank(bank[:n], r, self.head.final_res_query, torch.zeros_like(bank[:n, 0, 0]).float(),
                                  cfg.rms_eps)
        return _ops.after(self.head.final_norm(r), stores)


class K3FuseForCausalLM(nn.Module, HasInnerState, IsHybrid):
    """Kimi K3 for vLLM from k3fuse's K3 layers (registered for `KimiK3ForConditionalGeneration` and
    `KimiLinearForCausalLM` by k3fuse's vLLM plugin when K3FUSE_VLLM_MODEL=1)."""

    served_by: ClassVar[str] = f"{__name__}.K3FuseForCausalLM"

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        self.vllm_config = vllm_config
        self.model = K3FuseDecoder(vllm_config=vllm_config, prefix=f"{prefix}.model" if prefix else "model")
        self.cfg = self.model.cfg
        self._served = False
        logger.info("k3fuse: %s is served by %s (k3fuse's K3 layers, compiled by vLLM with its post-grad passes; "
                    "TP %d)", vllm_config.model_config.architecture, self.served_by,
                    get_tensor_model_parallel_world_size())

    # --- vLLM's model interface ---------------------------------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors: Any = None,
                inputs_embeds: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        if input_ids is None:
            raise EngineError("k3fuse's vLLM model takes token ids, not input embeddings",
                              "serve text prompts (no multimodal inputs)")
        plans = self._plans()
        state = vllm_cache.current()
        if plans is None:  # vLLM's dummy and profiling runs: no caches, no metadata
            state.plan = None
            return self.model(input_ids)
        if not self._served:
            self._served = True
            logger.info("k3fuse: serving requests with %s", self.served_by)
        hidden = torch.zeros(input_ids.shape[0], self.cfg.hidden, dtype=self.vllm_config.model_config.dtype,
                             device=input_ids.device)
        try:
            for plan in plans:
                state.plan = plan
                tokens = plan.tokens.to(input_ids.device)
                hidden[tokens] = self.model(input_ids[tokens].contiguous())
        finally:
            state.plan = None
        return hidden

    def _plans(self) -> list[vllm_cache.StepPlan] | None:
        try:
            metadata = get_forward_context().attn_metadata
        except AssertionError:
            return None
        if isinstance(metadata, list):
            metadata = metadata[0] if metadata else None
        first = metadata.get(self.model.cache_names[0]) if metadata else None
        if first is None:
            return None
        return vllm_cache.plan_steps(first.query_start_loc, first.seq_lens)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.model.head.lm_head(hidden_states)

    # --- weights ------------------------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint as vLLM streams it (full tensors, K3's names) -> this rank's slice of every parameter,
        built by k3fuse's checkpoint layout. Tensors outside the language model (vision tower, projector) are
        skipped. Returns the names of the parameters loaded (vLLM checks that every parameter was)."""
        tensors = {name: t for name, t in weights if name.startswith(params.HF_MODEL_PREFIX)}
        tp, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        own = dict(self.model.named_parameters())
        own.update(self.model.named_buffers())

        def read(stored: Stored) -> torch.Tensor | None:
            value = tensors.get(stored.name)
            if value is None:
                if stored.optional:
                    return None
                raise EngineError(f"the checkpoint has no tensor {stored.name!r}",
                                  "serve a Kimi K3 checkpoint with every language-model tensor")
            for shape, dim in stored.forms:
                if tuple(value.shape) == tuple(shape):
                    return value if dim is None else value.chunk(tp, dim)[rank]
            raise EngineError(f"checkpoint tensor {stored.name!r} has shape {tuple(value.shape)}, expected "
                              f"{' or '.join(str(s) for s, _ in stored.forms)}", "serve a matching K3 checkpoint")

        loaded: set[str] = set()
        layouts = param_layouts(self.cfg)
        dtypes = {name: own[name].dtype for layout in layouts for name in layout.params()}
        for layout in layouts:
            for name, value in layout.assemble(read, tp, dtypes).items():
                target = own[name]
                if target.shape != value.shape:
                    raise EngineError(f"parameter {name} of TP rank {rank}: checkpoint slice {tuple(value.shape)}, "
                                      f"model {tuple(target.shape)}", "serve a checkpoint of this model's config")
                with torch.no_grad():
                    target.copy_(value)
                loaded.add(f"model.{name}")
        kinds = Counter(str(own[name.removeprefix("model.")].dtype).removeprefix("torch.") for name in loaded)
        logger.info("k3fuse: TP rank %d loaded %d parameters from %d checkpoint tensors (%s)", rank, len(loaded),
                    len(tensors), ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())))
        return loaded

    # --- vLLM's hybrid (state cache) interface --------------------------------------------------------------------
    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig) -> tuple[tuple[int, ...], ...]:
        cfg = k3_config_for(vllm_config)
        return kda_shapes(cfg, vllm_config.parallel_config.tensor_parallel_size,
                          vllm_config.model_config.dtype).state_shapes()

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig) -> tuple[torch.dtype, ...]:
        return torch.float32, vllm_config.model_config.dtype

    @classmethod
    def get_mamba_state_copy_func(cls) -> tuple:
        return get_temporal_copy_spec, get_temporal_copy_spec


__all__ = ["K3FuseForCausalLM", "K3FuseDecoder", "k3_config_for"]
