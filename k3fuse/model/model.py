"""The whole Kimi K3 decoder for one TP rank: token ids in, the next token out, every layer type in K3's order.

    model = K3Model(get_config("small"), seed=0)
    state = model.new_state(batch=4, context=256)          # KDA states, paged latent KV cache, block table
    step = DecodeStep(model)                                 # eager; DecodeStep(model, backend="k3fuse") compiles
    logits = prefill(step, state, prompts)                   # the prompt by stepping
    next_tokens, logits = step(tokens, state)                # one decode step (writes the state in place)

Layers (config.layer_kinds): vocab-parallel embedding; layer 1 KDA + the dense SiTU MLP; KDA + LatentMoE;
gated NoPE-MLA + LatentMoE at every 4th layer and the last; plain pre-norm or Block-AttnRes residuals; final
norm; vocab-parallel LM head with its logits gathered; sampling (sampling.py). Parameters come from params.py's
tables (the one definition of names, shapes, sharding and checkpoint names).

**The state is written in place.** A step appends each MLA layer's latent entry to its paged cache with
`index_put_` (spelling.kv_cache_append) and copies the KDA layers' new recurrent and conv states into theirs
(`copy_`), increments `seq_lens` and returns only the tokens and logits, so a captured CUDA graph of the step
replays on the same buffers. Under torch.compile + Inductor the cache write stays in place (the cache is a graph
input that Inductor writes where it lies: no copy of the cache, tests/test_model_k3.py reads the generated
code); torch.export records it as a mutation of that input (its runner then copies the written cache back, a
full copy: fine for an offline program, not for serving). The KDA states are copied into their buffers after
being computed (one extra write of the state per step, in Inductor's kernel or a copy after a fused op).

**Compiling costs one compile per layer type, not one per layer.** `DecodeStep(model, backend=...)` compiles
the embedding, each decoder layer and the head separately (torch.compile of each module): Dynamo inlines
nn.Modules and lifts their parameters to graph inputs, so every layer of one class and MLP kind reuses one
compiled graph (K3: KDA + dense, KDA + MoE, MLA + MoE; about two graphs each where a second batch size makes the
token count dynamic). Nothing per layer may change the graph: the AttnRes bookkeeping that differs from layer to
layer (which bank entries exist yet, where this layer writes) is held in per-layer buffers, not Python ints. The
parameters reach k3fuse's rules as static inputs, as a whole-model compile would hand them over. A graph ends at
each layer, so the MoE's final reduction is fused with its residual add but not with the next layer's norm.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from .. import dist as k3dist
from . import params
from .config import DTYPES, K3Config, LayerKind
from .layers import (DenseMLP, KDADecode, LMHead, MLADecode, MoEBlock, TensorParallel, VocabEmbedding, WeightSource,
                     attn_res_mix_bank, build)
from .sampling import SamplingConfig, draw_uniforms, sample, step_uniform

#: the KV cache's dtypes: the trunk dtype ("auto", bf16 for K3) or FP8 e4m3 with a per-layer fp32 scale
KV_DTYPES = ("auto", "fp8")
#: tokens per block of the paged latent cache (vLLM's MLA default is 64 on Hopper; any size works here)
DEFAULT_BLOCK_SIZE = 64


@dataclass(frozen=True)
class ModelState:
    """Everything a decode step reads and writes, for `batch` sequences.

    recurrent[j], conv[j]: the j-th KDA layer's states, [B, h/tp, d, d] fp32 and [B, 3P/tp, K-1] (trunk dtype).
    kv[j]: the j-th MLA layer's paged latent cache [num_blocks, block_size, kv_lora + qk_shared], each entry
        [c_kv (after its RMSNorm) | k_sh]; trunk dtype, or float8_e4m3fn holding entry / kv_scale[j] (fp32 [1]).
    block_table: int32 [B, max_blocks_per_seq], the cache blocks of each sequence in order.
    seq_lens: int32 [B], the tokens of each sequence in the cache (after a step: including its token).
    bank: the AttnRes block snapshots of the current step, [blocks + 1, B, H] (the last row takes the writes of
        layers that start no block), None with plain residuals. Scratch: rewritten every step.
    uniforms: fp32 [B, capacity], the sampler's number for each sequence and position (sampling.py).
    """

    recurrent: tuple[torch.Tensor, ...]
    conv: tuple[torch.Tensor, ...]
    kv: tuple[torch.Tensor, ...]
    kv_scale: tuple[torch.Tensor, ...]
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    bank: torch.Tensor | None
    uniforms: torch.Tensor

    @property
    def batch(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def block_size(self) -> int:
        return self.kv[0].shape[1] if self.kv else 0

    @property
    def capacity(self) -> int:
        """Tokens each sequence's cache blocks can hold (the longest context a step may reach)."""
        return self.block_table.shape[1] * self.block_size if self.kv else 1 << 62

    def kv_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv)

    def state_bytes(self) -> int:
        """KDA recurrent and conv states of every layer (read and written once per step)."""
        return sum(t.numel() * t.element_size() for t in self.recurrent + self.conv)


torch.export.register_dataclass(ModelState, serialized_type_name="k3fuse.model.ModelState")
torch.serialization.add_safe_globals([ModelState])


class DecoderLayer(nn.Module):
    """norm -> attention -> residual, norm -> MLP -> residual, plain or Block AttnRes (shared/docs/reference/
    k3-model.md 2.2); subclasses say which attention and what state it reads."""

    def __init__(self, cfg: K3Config, layer: int, kind: LayerKind, src: WeightSource, tp: TensorParallel):
        super().__init__()
        self.cfg = cfg
        self.kind = kind
        build(self, params.residual_params(cfg), cfg, src, layer, tp)
        self.mlp = DenseMLP(cfg, layer, src, tp) if kind.mlp == "dense" else MoEBlock(cfg, layer, src, tp)
        if cfg.residual == "attnres":
            n, block = cfg.attn_res_blocks, cfg.attn_res_block
            written_before = -(-layer // block)  # bank entries the earlier layers wrote this step
            writes = layer % block == 0
            position = torch.arange(n)
            hidden = torch.tensor(float("-inf"))
            self.register_buffer("attn_res_mask", torch.where(position < written_before, 0.0, hidden),
                                 persistent=False)
            self.register_buffer("mlp_res_mask", torch.where(position < layer // block + 1, 0.0, hidden),
                                 persistent=False)
            # where this layer's pre-attention partial goes: its block's entry, or the scratch row n
            self.register_buffer("attn_res_write", torch.tensor([layer // block if writes else n]), persistent=False)
            self.register_buffer("attn_res_keep", torch.tensor(0.0 if writes else 1.0), persistent=False)

    def _attend(self, h: torch.Tensor, *state: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _step(self, r: torch.Tensor, bank: torch.Tensor | None, *state: torch.Tensor) -> torch.Tensor:
        if bank is None:  # plain pre-norm residuals: r is the residual stream
            r = r + self._attend(self.attn_norm(r), *state)
            return r + self.mlp(self.mlp_norm(r))
        # AttnRes: r is the prefix sum p of the current block; the bank holds the earlier blocks' snapshots
        cfg, n = self.cfg, self.cfg.attn_res_blocks
        h = attn_res_mix_bank(bank[:n], r, self.attn_res_query, self.attn_res_mask, cfg.rms_eps)
        bank.index_put_((self.attn_res_write,), r.unsqueeze(0))  # a block's first layer snapshots p ...
        r = r * self.attn_res_keep.to(r.dtype)  # ... and restarts it (times exactly 0 or 1)
        r = r + self._attend(self.attn_norm(h), *state)
        h = attn_res_mix_bank(bank[:n], r, self.mlp_res_query, self.mlp_res_mask, cfg.rms_eps)
        return r + self.mlp(self.mlp_norm(h))


class KDALayer(DecoderLayer):
    """KDA attention; state (recurrent, conv), written in place."""

    def __init__(self, cfg: K3Config, layer: int, kind: LayerKind, src: WeightSource, tp: TensorParallel):
        super().__init__(cfg, layer, kind, src, tp)
        self.attn = KDADecode(cfg, layer, src, tp)

    # each layer class its own forward: Dynamo keeps its compiled graphs (and counts its recompiles) per code object
    def forward(self, r: torch.Tensor, bank: torch.Tensor | None, recurrent: torch.Tensor,
                conv: torch.Tensor) -> torch.Tensor:
        return self._step(r, bank, recurrent, conv)

    def _attend(self, h: torch.Tensor, recurrent: torch.Tensor, conv: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        y, new_recurrent, new_conv = self.attn(h, recurrent, conv)
        recurrent.copy_(new_recurrent)
        conv.copy_(new_conv)
        return y


class MLALayer(DecoderLayer):
    """Gated NoPE-MLA attention; state (kv_cache, kv_scale, block_table, seq_lens), the cache appended in place."""

    def __init__(self, cfg: K3Config, layer: int, kind: LayerKind, src: WeightSource, tp: TensorParallel):
        super().__init__(cfg, layer, kind, src, tp)
        self.attn = MLADecode(cfg, layer, src, tp)

    def forward(self, r: torch.Tensor, bank: torch.Tensor | None, kv: torch.Tensor, kv_scale: torch.Tensor,
                block_table: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        return self._step(r, bank, kv, kv_scale, block_table, seq_lens)

    def _attend(self, h: torch.Tensor, kv: torch.Tensor, kv_scale: torch.Tensor, block_table: torch.Tensor,  # type: ignore[override]
                seq_lens: torch.Tensor) -> torch.Tensor:
        return self.attn(h, kv, kv_scale, block_table, seq_lens)


class Head(nn.Module):
    """(AttnRes output mix) -> final norm -> vocab-parallel LM head, logits gathered -> the next token."""

    def __init__(self, cfg: K3Config, src: WeightSource, tp: TensorParallel, sampling: SamplingConfig):
        super().__init__()
        self.cfg = cfg
        self.sampling = sampling
        specs = {s.name: s for s in params.head_params(cfg)}
        build(self, [specs["final_norm.weight"]] + ([specs["final_res_query"]] if "final_res_query" in specs
                                                    else []), cfg, src, -1, tp)
        self.lm_head = LMHead(src.build(specs["lm_head.weight"], -1, tp.tp_size, tp.rank), tp)

    def forward(self, r: torch.Tensor, bank: torch.Tensor | None, seq_lens: torch.Tensor, uniforms: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if bank is not None:
            n = self.cfg.attn_res_blocks
            r = attn_res_mix_bank(bank[:n], r, self.final_res_query, torch.zeros_like(bank[:n, 0, 0]).float(),
                                  self.cfg.rms_eps)
        logits = self.lm_head(self.final_norm(r))
        return sample(logits, step_uniform(uniforms, seq_lens), self.sampling), logits


class K3Model(nn.Module):
    """Kimi K3 for one TP rank: `forward(tokens [B], state) -> (next tokens [B], logits fp32 [B, V])`.

    tp_size / rank / group: this rank of a TP group (group None at tp_size 1). standin=True builds rank `rank`'s
    slice of a TP `tp_size` model to run alone, with local stand-ins for the collectives (layers.TensorParallel).
    init_on_device draws the weights on a CUDA device, only this rank's slice of each; `draw` picks the drawing
    ("randn" or "hash", weights.WeightSource; default: hash on a CUDA device, randn on the host).
    """

    def __init__(self, config: K3Config, *, tp_size: int = 1, rank: int = 0, group: dist.ProcessGroup | None = None,
                 seed: int = 0, dtype: torch.dtype | str | None = None, device: torch.device | str = "cpu",
                 init_on_device: bool = False, standin: bool = False,
                 sampling: SamplingConfig | None = None, draw: str | None = None):
        super().__init__()
        config.validate_for_tp(tp_size)
        if standin:
            if group is not None:
                raise ValueError("a stand-in rank (standin=True) runs without a process group")
            if not 0 <= rank < tp_size:
                raise ValueError(f"rank {rank} is outside TP {tp_size} (ranks 0..{tp_size - 1})")
        elif tp_size > 1:
            group = k3dist.require_group(group)
            if dist.get_world_size(group) != tp_size:
                raise ValueError(f"tp_size={tp_size} but the process group has {dist.get_world_size(group)} ranks")
            if rank != dist.get_rank(group):
                raise ValueError(f"rank={rank} but this process is rank {dist.get_rank(group)} of the group")
        elif rank != 0:
            raise ValueError(f"rank={rank} with tp_size=1; rank must be 0")
        if isinstance(dtype, str):
            if dtype not in DTYPES:
                raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)}")
            dtype = DTYPES[dtype]
        self.config = config
        self.tp_size, self.rank, self.group, self.standin = tp_size, rank, group, standin
        self.dtype = dtype or config.torch_dtype
        self.device = torch.device(device)
        src = WeightSource(seed, self.dtype, device, on_device=init_on_device, draw=draw)  # type: ignore[arg-type]
        tp = TensorParallel(tp_size, rank, None if standin or tp_size == 1 else group, standin=standin)
        (embed_spec,) = params.embed_params(config)
        self.embed = VocabEmbedding(src.build(embed_spec, -1, tp_size, rank), tp)
        self.kinds = config.layer_kinds()
        layer_class = {"kda": KDALayer, "mla": MLALayer}
        self.layers = nn.ModuleList(layer_class[k.attn](config, i, k, src, tp) for i, k in enumerate(self.kinds))
        self.head = Head(config, src, tp, sampling or SamplingConfig())
        # each layer's place in the state's per-type tuples
        self.state_index = [sum(1 for k in self.kinds[:i] if k.attn == kind.attn) for i, kind in enumerate(self.kinds)]

    @property
    def sampling(self) -> SamplingConfig:
        return self.head.sampling

    # --- state ---------------------------------------------------------------------------------------------
    def new_state(self, batch: int, context: int, *, block_size: int = DEFAULT_BLOCK_SIZE, kv_dtype: str = "auto",
                  kv_scale: float = 1.0, shuffle_blocks: bool = True, pool_blocks: int | None = None) -> ModelState:
        """Zero states for `batch` sequences and a paged cache holding `context` tokens each (rounded up to whole
        blocks). shuffle_blocks: the sequences' blocks are drawn from a fixed permutation of the pool (not in
        order), so the paging is exercised; pool_blocks: the cache's blocks (default: exactly the batch's)."""
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
        if batch < 1 or context < 1 or block_size < 1:
            raise ValueError(f"batch, context and block_size must be >= 1, got {batch}, {context}, {block_size}")
        cfg, dev = self.config, self.device
        h, conv_width = cfg.kda_heads // self.tp_size, 3 * cfg.kda_dim // self.tp_size
        n_kda = sum(1 for k in self.kinds if k.attn == "kda")
        n_mla = len(self.kinds) - n_kda
        recurrent = tuple(torch.zeros(batch, h, cfg.head_dim, cfg.head_dim, dtype=torch.float32, device=dev)
                          for _ in range(n_kda))
        conv = tuple(torch.zeros(batch, conv_width, cfg.conv_kernel - 1, dtype=self.dtype, device=dev)
                     for _ in range(n_kda))
        per_seq = -(-context // block_size)
        blocks = pool_blocks or batch * per_seq
        if blocks < batch * per_seq:
            raise ValueError(f"pool_blocks={blocks} cannot hold {batch} sequences of {per_seq} blocks")
        cache_dtype = torch.float8_e4m3fn if kv_dtype == "fp8" else self.dtype
        kv = tuple(torch.zeros(blocks, block_size, cfg.kv_entry, dtype=cache_dtype, device=dev) for _ in range(n_mla))
        scale = tuple(torch.full((1,), kv_scale if kv_dtype == "fp8" else 1.0, device=dev) for _ in range(n_mla))
        order = (torch.randperm(blocks, generator=torch.Generator().manual_seed(blocks)) if shuffle_blocks
                 else torch.arange(blocks))
        block_table = order[:batch * per_seq].view(batch, per_seq).to(device=dev, dtype=torch.int32).contiguous()
        bank = (torch.zeros(cfg.attn_res_blocks + 1, batch, cfg.hidden, dtype=self.dtype, device=dev)
                if cfg.residual == "attnres" else None)
        # the cache's size follows the context: compiled MLA layers take it as a dynamic dim from the first
        # compile, so another context does not compile the layer again (the batch dim is Dynamo's to decide)
        for t in kv:
            torch._dynamo.maybe_mark_dynamic(t, 0)
        torch._dynamo.maybe_mark_dynamic(block_table, 1)
        uniforms = draw_uniforms(self.sampling.seed, batch, per_seq * block_size, dev)
        return ModelState(recurrent, conv, kv, scale, block_table, torch.zeros(batch, dtype=torch.int32, device=dev),
                          bank, uniforms)

    def layer_state(self, i: int, state: ModelState) -> tuple[torch.Tensor, ...]:
        j = self.state_index[i]
        if self.kinds[i].attn == "kda":
            return state.recurrent[j], state.conv[j]
        return state.kv[j], state.kv_scale[j], state.block_table, state.seq_lens

    # --- one step, eager (DecodeStep runs the same pieces compiled) -------------------------------------------
    def forward(self, tokens: torch.Tensor, state: ModelState) -> tuple[torch.Tensor, torch.Tensor]:
        state.seq_lens.add_(1)
        r = self.embed(tokens)
        for i, layer in enumerate(self.layers):
            r = layer(r, state.bank, *self.layer_state(i, state))
        return self.head(r, state.bank, state.seq_lens, state.uniforms)


class DecodeStep:
    """One decode step of `model`, eager or compiled region by region: the embedding, each decoder layer and the
    head are each `torch.compile`d (backend and options as torch.compile takes them), so layers of one type share
    one compiled graph. Calling it: `(next_tokens, logits) = step(tokens, state)`; the state is written in place.
    """

    def __init__(self, model: K3Model, backend: str | Callable[..., Any] | None = None,
                 options: dict[str, Any] | None = None, fullgraph: bool = True):
        self.model = model
        if backend is None:
            compile_: Callable[[nn.Module], Callable[..., Any]] = lambda m: m  # noqa: E731
        else:
            compile_ = lambda m: torch.compile(m, backend=backend, options=options, fullgraph=fullgraph)  # noqa: E731
        self.embed = compile_(model.embed)
        self.layers = [compile_(layer) for layer in model.layers]
        self.head = compile_(model.head)

    def __call__(self, tokens: torch.Tensor, state: ModelState) -> tuple[torch.Tensor, torch.Tensor]:
        # a layer type past Dynamo's recompile limit would run eager, no rule applied, silently: raise instead
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            model = self.model
            state.seq_lens.add_(1)
            r = self.embed(tokens)
            for i, layer in enumerate(self.layers):
                r = layer(r, state.bank, *model.layer_state(i, state))
            return self.head(r, state.bank, state.seq_lens, state.uniforms)


def check_room(state: ModelState, steps: int) -> None:
    """ValueError when `steps` more tokens do not fit every sequence's cache blocks (a host-side check: the step
    itself never reads a length back, so it can be captured in a CUDA graph)."""
    longest = int(state.seq_lens.max()) + steps
    if longest > state.capacity:
        raise ValueError(f"a context of {longest} tokens does not fit the cache ({state.capacity} tokens a "
                         f"sequence: {state.block_table.shape[1]} blocks of {state.block_size}); give new_state a "
                         f"context of at least {longest} tokens, or decode fewer steps")


def prefill(step: Callable[[torch.Tensor, ModelState], tuple[torch.Tensor, torch.Tensor]], state: ModelState,
            prompts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Feed prompts [B, P] (int64 ids, one prompt per sequence, equal lengths) one token per step; returns the
    last step's (next tokens, logits)."""
    if prompts.dim() != 2 or prompts.shape[0] != state.batch or prompts.shape[1] < 1:
        raise ValueError(f"prompts must be [batch={state.batch}, length >= 1] token ids, got {tuple(prompts.shape)}")
    check_room(state, prompts.shape[1])
    out: tuple[torch.Tensor, torch.Tensor] | None = None
    for t in range(prompts.shape[1]):
        out = step(prompts[:, t].contiguous(), state)
    assert out is not None
    return out


__all__ = ["K3Model", "ModelState", "DecodeStep", "prefill", "check_room", "KV_DTYPES", "DEFAULT_BLOCK_SIZE",
           "SamplingConfig"]
