"""K3's caches inside vLLM: the MLA layers' paged latent cache and the KDA layers' state cache, allocated, paged and
scheduled by vLLM, read and written by k3fuse's K3 layers through small custom ops.

vLLM owns the memory: every MLA layer registers an `MLACache` (an `AttentionLayerBase` whose spec is vLLM's
`MLAAttentionSpec`: one [c_kv | k_sh] latent entry per token, paged in vLLM's blocks) and every KDA layer a
`KDAStateCache` (a `MambaBase` whose `MambaSpec` holds the fp32 recurrent state and the conv window per request,
with vLLM's own linear-attention metadata for the state slots). vLLM's KV-cache manager sizes, allocates and binds
them, and its scheduler hands out the blocks and state slots.

k3fuse's layers reach them the way vLLM's own layers do, through ops that name their layer and look the cache and
the step's metadata up at run time (vLLM compiles the model once, before the caches exist):

    kda_states(x, layer) -> (recurrent [T, h, d, d] fp32, conv [T, 3P, K-1])    this step's tokens' states (a copy)
    kda_store(recurrent, conv, layer) -> token [1]                              the new states into their slots
    mla_attend(q, entry, layer, scale, kv_lora) -> o_lat [T, h, kv_lora]        append the entries, attend
    after(hidden, tokens) -> hidden                                             the step's end, after every store

The KDA math between `kda_states` and `kda_store` (the short conv, the delta rule, the out-projection and its
all-reduce) stays in the compiled graph, where k3fuse's rules see it; the MLA attention itself is opaque (vLLM's
MLA attention ops are too). The state is read into a copy and written back: one extra read and write of the
state per step compared with an in-place kernel, the price of keeping the recurrence in ATen.

**One token per sequence per call.** The ops serve the *decode* spelling of K3 (one token per sequence). A vLLM
batch with prompt tokens is run as consecutive sub-steps (`StepPlan`): sub-step t takes the t-th new token of
every request that has one, so the recurrence and the causal attention see exactly the decode step they would
see token by token. A decode batch is one sub-step.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from vllm.config import VllmConfig
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.v1.attention.backend import (AttentionBackend, AttentionCGSupport, AttentionMetadataBuilder,
                                       CommonAttentionMetadata)
from vllm.v1.attention.backends.linear_attn import LinearAttentionBackend
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import MLAAttentionSpec

from ..spelling import paged_mla_attention

#: the custom-op namespace (one library, defined when this module is imported)
NAMESPACE = "k3fuse_vllm"


@dataclass(frozen=True)
class KDAShapes:
    """One KDA layer's per-request states on this rank."""

    heads: int
    head_dim: int
    conv_width: int  # 3P/tp: the [q; k; v] channels the short conv keeps
    conv_len: int  # K-1
    conv_dtype: torch.dtype

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (self.heads, self.head_dim, self.head_dim), (self.conv_width, self.conv_len)

    def state_dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        return torch.float32, self.conv_dtype


@dataclass(frozen=True)
class MLAShapes:
    """One MLA layer's paged latent cache entry."""

    entry: int  # kv_lora + qk_shared
    dtype: torch.dtype


#: layer name -> its cache's shapes (what the ops' fake implementations need while vLLM traces)
_KDA: dict[str, KDAShapes] = {}
_MLA: dict[str, MLAShapes] = {}


@dataclass
class StepPlan:
    """Which tokens of vLLM's batch the current sub-step runs: `tokens[i]` is the i-th row of the sub-step, the
    `offset`-th new token of request `requests[i]`. `fresh[i]`: that request starts from empty states (its first
    token ever). `seq_lens[i]`: the tokens that request has in its cache once this token is appended."""

    requests: torch.Tensor  # int64 [n]
    tokens: torch.Tensor  # int64 [n]
    offset: int
    fresh: torch.Tensor  # bool [n]
    seq_lens: torch.Tensor  # int32 [n]


@dataclass
class _Current:
    plan: StepPlan | None = None  # the sub-step running now (None: vLLM's dummy and profiling runs)


_current = threading.local()


def current() -> _Current:
    if not hasattr(_current, "value"):
        _current.value = _Current()
    return _current.value


def plan_steps(query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> list[StepPlan]:
    """The sub-steps of a batch: vLLM's query_start_loc [R + 1] and seq_lens [R] (tokens per request after the
    step), on the host. Sub-step t takes every request with more than t new tokens."""
    qsl = query_start_loc.to("cpu", torch.int64)
    lens = seq_lens.to("cpu", torch.int64)
    query = qsl[1:] - qsl[:-1]
    before = lens - query  # tokens already in the cache
    plans = []
    for t in range(int(query.max()) if query.numel() else 0):
        requests = torch.nonzero(query > t).flatten()
        plans.append(StepPlan(requests, qsl[requests] + t, t, (before[requests] + t) == 0,
                              (before[requests] + t + 1).to(torch.int32)))
    return plans


# --- the layers vLLM allocates caches for ---------------------------------------------------------------------
def _register(vllm_config: VllmConfig, prefix: str, layer: torch.nn.Module) -> None:
    context = vllm_config.compilation_config.static_forward_context
    if prefix in context:
        raise ValueError(f"duplicate layer name {prefix!r} in vLLM's static forward context")
    context[prefix] = layer


class KDAStateCache(torch.nn.Module, MambaBase):
    """A KDA layer's state cache in vLLM: (recurrent [h, d, d] fp32, conv [3P, K-1]) per request slot, with vLLM's
    linear-attention metadata (query_start_loc, seq_lens, state_indices_tensor)."""

    def __init__(self, vllm_config: VllmConfig, prefix: str, shapes: KDAShapes):
        super().__init__()
        self.shapes = shapes
        self.prefix = prefix
        self.kv_cache = (torch.tensor([]), torch.tensor([]))
        _KDA[prefix] = shapes
        _register(vllm_config, prefix, self)

    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        return self.shapes.state_shapes()

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        return self.shapes.state_dtypes()

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.LINEAR

    def get_attn_backend(self) -> type[AttentionBackend]:
        return LinearAttentionBackend


class MLACache(torch.nn.Module, AttentionLayerBase):
    """An MLA layer's paged latent cache in vLLM: [num_blocks, block_size, kv_lora + qk_shared]."""

    supports_dcp = False

    def __init__(self, vllm_config: VllmConfig, prefix: str, shapes: MLAShapes):
        super().__init__()
        self.shapes = shapes
        self.prefix = prefix
        self.kv_cache = torch.tensor([])
        _MLA[prefix] = shapes
        _register(vllm_config, prefix, self)

    def get_attn_backend(self) -> type[AttentionBackend]:
        return K3MLABackend

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> MLAAttentionSpec:
        return MLAAttentionSpec(block_size=vllm_config.cache_config.block_size, num_kv_heads=1,
                                head_size=self.shapes.entry, dtype=self.shapes.dtype, cache_dtype_str="auto")

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        # vLLM hands a raw byte page view [blocks, 1, block_size, bytes]: read it as entries
        blocks = kv_cache.shape[0]
        self.kv_cache = kv_cache.reshape(blocks, -1).view(self.shapes.dtype).view(blocks, -1, self.shapes.entry)


# --- vLLM's attention backend for the MLA cache: the block table, slots and lengths, nothing else -------------
@dataclass
class K3MLAMetadata:
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor


class K3MLAMetadataBuilder(AttentionMetadataBuilder[K3MLAMetadata]):
    _cudagraph_support = AttentionCGSupport.NEVER
    reorder_batch_threshold = 1

    def __init__(self, kv_cache_spec: MLAAttentionSpec, layer_names: list[str], vllm_config: VllmConfig,
                 device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> K3MLAMetadata:
        m = common_attn_metadata
        return K3MLAMetadata(m.query_start_loc, m.seq_lens, m.block_table_tensor, m.slot_mapping)


class K3MLABackend(AttentionBackend):
    """The paged latent cache's backend: metadata only (k3fuse_vllm.mla_attend attends)."""

    supported_dtypes = [torch.float32, torch.bfloat16, torch.float16]

    @staticmethod
    def get_name() -> str:
        return "K3_PAGED_LATENT"

    @staticmethod
    def get_impl_cls() -> type:
        raise NotImplementedError("k3fuse's MLA layers attend through k3fuse_vllm.mla_attend, not an impl")

    @staticmethod
    def get_builder_cls() -> type[K3MLAMetadataBuilder]:
        return K3MLAMetadataBuilder

    @classmethod
    def is_mla(cls) -> bool:
        return True


# --- the ops --------------------------------------------------------------------------------------------------
def _layer_and_metadata(layer: str):  # type: ignore[no-untyped-def]
    from vllm.forward_context import get_forward_context

    context = get_forward_context()
    metadata = context.attn_metadata
    if isinstance(metadata, list):  # per micro-batch lists (vLLM's DBO); one here
        metadata = metadata[0]
    return context.no_compile_layers[layer], (metadata or {}).get(layer)


def _kv(layer_module) -> tuple[torch.Tensor, ...]:  # noqa: ANN001
    cache = layer_module.kv_cache
    if isinstance(cache, list):  # older vLLM: one entry per virtual engine
        cache = cache[0]
    return cache


@torch.library.custom_op(f"{NAMESPACE}::kda_states", mutates_args=())
def kda_states(x: torch.Tensor, layer: str) -> tuple[torch.Tensor, torch.Tensor]:
    shapes = _KDA[layer]
    (rec_shape, conv_shape), (rec_dtype, conv_dtype) = shapes.state_shapes(), shapes.state_dtypes()
    T = x.shape[0]
    module, metadata = _layer_and_metadata(layer)
    plan = current().plan
    if metadata is None or plan is None:  # vLLM's dummy and profiling runs: no cache yet
        return (torch.zeros((T, *rec_shape), dtype=rec_dtype, device=x.device),
                torch.zeros((T, *conv_shape), dtype=conv_dtype, device=x.device))
    recurrent, conv = _kv(module)
    slots = metadata.state_indices_tensor[plan.requests.to(x.device)].long()
    fresh = plan.fresh.to(x.device)  # a request's first token starts from zero states, whatever its slot holds
    rec = torch.where(fresh.view(-1, 1, 1, 1), 0.0, recurrent[slots])
    cv = torch.where(fresh.view(-1, 1, 1), 0.0, conv[slots])
    return rec.to(rec_dtype), cv.to(conv_dtype)


@kda_states.register_fake
def _(x: torch.Tensor, layer: str) -> tuple[torch.Tensor, torch.Tensor]:
    shapes = _KDA[layer]
    (rec_shape, conv_shape), (rec_dtype, conv_dtype) = shapes.state_shapes(), shapes.state_dtypes()
    T = x.shape[0]
    return x.new_empty((T, *rec_shape), dtype=rec_dtype), x.new_empty((T, *conv_shape), dtype=conv_dtype)


@torch.library.custom_op(f"{NAMESPACE}::kda_store", mutates_args=())
def kda_store(recurrent: torch.Tensor, conv: torch.Tensor, layer: str) -> torch.Tensor:
    module, metadata = _layer_and_metadata(layer)
    plan = current().plan
    if metadata is not None and plan is not None:
        cache_rec, cache_conv = _kv(module)
        slots = metadata.state_indices_tensor[plan.requests.to(recurrent.device)].long()
        cache_rec[slots] = recurrent.to(cache_rec.dtype)
        cache_conv[slots] = conv.to(cache_conv.dtype)
    return recurrent.new_zeros(1)


@kda_store.register_fake
def _(recurrent: torch.Tensor, conv: torch.Tensor, layer: str) -> torch.Tensor:
    return recurrent.new_empty(1)


@torch.library.custom_op(f"{NAMESPACE}::mla_attend", mutates_args=())
def mla_attend(q: torch.Tensor, entry: torch.Tensor, layer: str, scale: float, kv_lora: int) -> torch.Tensor:
    module, metadata = _layer_and_metadata(layer)
    plan = current().plan
    T, heads = q.shape[0], q.shape[1]
    if metadata is None or plan is None:
        return q.new_zeros(T, heads, kv_lora)
    cache = _kv(module)
    device = q.device
    tokens = plan.tokens.to(device)
    slots = metadata.slot_mapping[tokens].long()
    cache.view(-1, cache.shape[-1])[slots] = entry.to(cache.dtype)
    block_table = metadata.block_table[plan.requests.to(device)].to(torch.int32)
    one = torch.ones(1, device=device)
    return paged_mla_attention(q, cache, one, block_table, plan.seq_lens.to(device), scale, kv_lora)


@mla_attend.register_fake
def _(q: torch.Tensor, entry: torch.Tensor, layer: str, scale: float, kv_lora: int) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1], kv_lora)


@torch.library.custom_op(f"{NAMESPACE}::after", mutates_args=())
def after(hidden: torch.Tensor, tokens: list[torch.Tensor]) -> torch.Tensor:
    """`hidden`, once every token (the KDA state stores) exists: keeps the stores in the graph (nothing else
    reads their outputs) and ahead of the step's end."""
    return hidden.clone()


@after.register_fake
def _(hidden: torch.Tensor, tokens: list[torch.Tensor]) -> torch.Tensor:
    return torch.empty_like(hidden)


__all__ = ["KDAShapes", "MLAShapes", "StepPlan", "plan_steps", "current", "KDAStateCache", "MLACache",
           "K3MLABackend", "kda_states", "kda_store", "mla_attend", "after", "NAMESPACE"]
