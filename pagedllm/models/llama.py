"""Llama-family decoder models: Llama (2, 3, 3.1 rope scaling), Mistral, Qwen2 (= Llama + q/k/v bias), Phi-3.

Variants differ only in their attention block (``attention_cls``); everything else is shared. That block also
says which layers attend over a sliding window (``LlamaAttention.layer_sliding_window``).

Pipeline parallelism (``pp``): a stage builds only its layer range, the first stage the embedding, the last the
final norm and LM head; the rest are ``PPMissingLayer`` (pagedllm/distributed/pipeline.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pagedllm.attention.base import AttentionBackend, AttentionMetadata
from pagedllm.distributed.parallel_state import PPGroup, TPGroup
from pagedllm.distributed.pipeline import IntermediateTensors, PPMissingLayer
from pagedllm.layers.activation import SiluAndMul, get_act_and_mul
from pagedllm.layers.attention import Attention
from pagedllm.layers.embedding import LMHead, VocabEmbedding
from pagedllm.layers.linear import MergedLinear, QKVLinear, RowParallelLinear, act_then_linear
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.placement import decoder_layer_device
from pagedllm.layers.rotary import RotaryEmbedding, get_rope, rope_config, rotary_dim_of
from pagedllm.platform import use_fused_kernels


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def config_sliding_window(config: Any) -> int | None:
    """The config's window, or None when it has none or switches it off (``use_sliding_window: false``, as
    Qwen2/3 configs do while still carrying a ``sliding_window`` value)."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    return int(window)


def layer_types_sliding_window(config: Any, layer_idx: int, default_sliding: bool) -> int | None:
    """The window of layer ``layer_idx`` when the config lists per-layer attention kinds, as transformers does:
    ``layer_types[i] == "sliding_attention"`` slides, ``"full_attention"`` does not. Configs without
    ``layer_types`` (older transformers) fall back to ``default_sliding``, the model's own rule."""
    window = config_sliding_window(config)
    if window is None:
        return None
    layer_types = getattr(config, "layer_types", None)
    sliding = layer_types[layer_idx] == "sliding_attention" if layer_types else default_sliding
    return window if sliding else None


class LlamaAttention(nn.Module):
    """Under tensor parallelism (``tp``) this rank runs ``num_heads`` = heads / T query heads and
    ``num_kv_heads`` = KV heads / T (or 1, replicated) KV heads: q/k/v column-parallel, o_proj row-parallel."""

    qk_norm_cls: type[RMSNorm] | None = None  # per-head q/k norm before RoPE (None: none)

    def __init__(
        self,
        config: Any,
        layer_idx: int,
        attn_backend: AttentionBackend,
        rotary_emb: RotaryEmbedding,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        total_num_heads = config.num_attention_heads
        total_num_kv_heads = getattr(config, "num_key_value_heads", None) or total_num_heads
        self.head_dim = head_dim_of(config)
        qkv_bias, o_bias = self.biases(config)
        self.qkv_proj = QKVLinear(
            config.hidden_size, self.head_dim, total_num_heads, total_num_kv_heads, qkv_bias, tp=tp
        )
        self.num_heads = self.qkv_proj.num_heads  # this rank's
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(total_num_heads * self.head_dim, config.hidden_size, o_bias, tp=tp)
        self.rotary_emb = rotary_emb  # shared by all layers
        if self.qk_norm_cls is not None:  # one [head_dim] weight each, shared by the heads
            self.q_norm = self.qk_norm_cls(self.head_dim, config.rms_norm_eps)
            self.k_norm = self.qk_norm_cls(self.head_dim, config.rms_norm_eps)
        # The plain RMSNorm (Qwen3) and rotary table: on the fused kernels' devices, the q/k norm and RoPE run as one
        # Triton launch (kernels/qk_norm_rope.py). Gemma's norm keeps the unfused path.
        self.norm_rope_fusable = self.qk_norm_cls is RMSNorm and type(rotary_emb) is RotaryEmbedding
        # The plain rotary table's kernels (with or without the q/k norm) can write the KV cache as well.
        self.rope_writes_cache = type(rotary_emb) is RotaryEmbedding
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            self.num_kv_heads,
            attn_backend,
            layer_idx,
            sliding_window=self.layer_sliding_window(config, layer_idx),
        )

    @staticmethod
    def layer_sliding_window(config: Any, layer_idx: int) -> int | None:
        """This layer's attention window (None: full causal). Llama has none."""
        return None

    @staticmethod
    def biases(config: Any) -> tuple[bool, bool]:
        """Whether ``(qkv_proj, o_proj)`` have a bias."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    def qk_norm(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head RMSNorm of q and k before RoPE when ``qk_norm_cls`` is set (Qwen3, Gemma 3); Llama has none."""
        if self.qk_norm_cls is None:
            return q, k
        return self.q_norm(q), self.k_norm(k)

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, hidden_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden_size]
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [T, (num_heads + 2 * num_kv_heads) * head_dim]
        q, k, v = qkv.split([self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, num_heads, head_dim]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, num_kv_heads, head_dim]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, num_kv_heads, head_dim]
        # On the fused kernels the RoPE kernel also writes this step's keys and values into the cache (one launch
        # per layer fewer); kv_write is None where the attention backend writes them itself.
        kv_write = self.attn.kv_write(v, kv_cache, attn_metadata) if self.rope_writes_cache else None
        if self.norm_rope_fusable and use_fused_kernels(q):
            from pagedllm.kernels.qk_norm_rope import qk_norm_rope

            half = self.rotary_emb.rotary_dim // 2
            cos_sin = self.rotary_emb.cos_sin_cache  # [max_position, rotary_dim]: [cos | sin]
            qk_norm_rope(
                positions, q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                cos_sin[:, :half], cos_sin[:, half:], cache=kv_write,
            )  # fmt: skip
        else:
            q, k = self.qk_norm(q, k)
            q, k = self.rotary_emb(positions, q, k, cache=kv_write)
        o = self.attn(q, k, v, kv_cache, attn_metadata, kv_written=kv_write is not None)  # [T, num_heads, head_dim]
        return self.o_proj(o.reshape(num_tokens, self.num_heads * self.head_dim))


class MistralAttention(LlamaAttention):
    @staticmethod
    def layer_sliding_window(config: Any, layer_idx: int) -> int | None:
        """Every layer uses ``sliding_window`` when set (transformers' Mistral and Phi-3 ignore ``layer_types``)."""
        return config_sliding_window(config)


def qwen_layer_sliding_window(config: Any, layer_idx: int) -> int | None:
    """Qwen2/Qwen3: only with ``use_sliding_window``; then the layers ``layer_types`` marks, which transformers
    derives as ``layer_idx >= max_window_layers`` (the rule used when a config has no ``layer_types``)."""
    max_window_layers = getattr(config, "max_window_layers", None)
    default = max_window_layers is not None and layer_idx >= max_window_layers
    return layer_types_sliding_window(config, layer_idx, default)


class Qwen2Attention(LlamaAttention):
    layer_sliding_window = staticmethod(qwen_layer_sliding_window)

    @staticmethod
    def biases(config: Any) -> tuple[bool, bool]:
        return True, False


class LlamaMLP(nn.Module):
    """gate_up_proj column-parallel, down_proj row-parallel (this rank: intermediate_size / T channels)."""

    def __init__(self, config: Any, tp: TPGroup | None = None) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        inter = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, [inter, inter], bias, tp=tp)
        # Gemma names its activation hidden_activation (hidden_act is a legacy field there).
        self.act_fn = get_act_and_mul(getattr(config, "hidden_activation", None) or config.hidden_act)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden_size] -> [T, hidden_size]
        gate_up = self.gate_up_proj(x)  # [T, 2 * intermediate_size]
        if isinstance(self.act_fn, SiluAndMul) and gate_up.shape[0] == 1:  # batch-1 decode: one GEMV launch
            out = act_then_linear(self.down_proj, gate_up, "silu_and_mul")
            if out is not None:
                return out
        return self.down_proj(self.act_fn(gate_up))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: Any,
        layer_idx: int,
        attn_backend: AttentionBackend,
        rotary_emb: RotaryEmbedding,
        attention_cls: type[LlamaAttention],
        norm_cls: type[RMSNorm] = RMSNorm,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        self.input_layernorm = norm_cls(config.hidden_size, config.rms_norm_eps)
        self.self_attn = attention_cls(config, layer_idx, attn_backend, rotary_emb, tp=tp)
        self.post_attention_layernorm = norm_cls(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, tp=tp)

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, hidden_size]
        residual: torch.Tensor | None,  # [T, hidden_size]; None for the first layer
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (hidden, residual), each [T, hidden_size]
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, attn_metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.run_mlp(hidden), residual

    def run_mlp(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, hidden_size] -> [T, hidden_size]
        """The feed-forward block (a mixture-of-experts layer overrides it)."""
        return self.mlp(hidden)


def _build_layer(make_layer: Callable[[int], nn.Module], index: int) -> nn.Module:
    """``make_layer(index)``, in host memory when weight offload keeps that layer there (layers/placement.py)."""
    with decoder_layer_device(index):
        return make_layer(index)


class LlamaModel(nn.Module):
    norm_cls: type[RMSNorm] = RMSNorm
    aux_hidden_state_layers: tuple[int, ...] = ()  # set on the instance for an EAGLE-3 draft
    # This pipeline stage's layers are [start_layer, end_layer) (None: to the end); bodies that build every layer
    # themselves (the MoE models) keep these defaults: one stage.
    start_layer: int = 0
    end_layer: int | None = None
    is_last_stage: bool = True

    def __init__(
        self,
        config: Any,
        attn_backend: AttentionBackend,
        attention_cls: type[LlamaAttention],
        tp: TPGroup | None = None,
        pp: PPGroup | None = None,
    ) -> None:
        super().__init__()
        rotary_emb = self.make_rotary(config)
        norm_cls = self.norm_cls
        self.build_stage(
            config,
            lambda i: LlamaDecoderLayer(config, i, attn_backend, rotary_emb, attention_cls, norm_cls, tp=tp),
            tp,
            pp,
        )

    @staticmethod
    def make_rotary(config: Any) -> RotaryEmbedding:
        """The rotary embedding all layers share (a family with its own rope overrides this)."""
        theta, rope_scaling = rope_config(config)
        return get_rope(head_dim_of(config), config.max_position_embeddings, theta, rope_scaling)

    def build_stage(
        self,
        config: Any,
        make_layer: Callable[[int], nn.Module],
        tp: TPGroup | None,
        pp: PPGroup | None,
    ) -> None:
        """Set ``embed_tokens``, ``layers`` and ``norm`` for this pipeline stage (the whole model when ``pp`` is
        None): ``make_layer(i)`` builds the stage's decoder layers, ``PPMissingLayer`` stands for the others; the
        first stage holds the embedding, the last the final norm (``norm_cls``) and, when tied, the embedding its
        LM head reads. A layer weight offload keeps in host memory is built there (``layers/placement.py``)."""
        pp = PPGroup.single() if pp is None else pp
        self.start_layer, self.end_layer = pp.layer_range(config.num_hidden_layers)
        self.is_last_stage = pp.is_last
        tied = bool(getattr(config, "tie_word_embeddings", False))
        if pp.is_first or (pp.is_last and tied):
            self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, tp=tp)
        else:
            self.embed_tokens = PPMissingLayer()
        self.layers = nn.ModuleList(
            _build_layer(make_layer, i) if self.start_layer <= i < self.end_layer else PPMissingLayer()
            for i in range(config.num_hidden_layers)
        )
        norm_cls = self.norm_cls
        self.norm = norm_cls(config.hidden_size, config.rms_norm_eps) if pp.is_last else PPMissingLayer()

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],  # per own layer [2, num_blocks, block_size, num_kv_heads, head_dim]
        attn_metadata: AttentionMetadata,
        intermediate: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,  # [T, hidden_size] instead of embedding input_ids (images)
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | IntermediateTensors:
        """The final hidden states ``[T, hidden_size]``; with ``aux_hidden_state_layers`` set (an EAGLE-3 draft
        reads them), also the residual stream entering each of those layers, concatenated ``[T, A * hidden_size]``.

        Pipeline stages: the first embeds ``input_ids``, the others start from ``intermediate`` (the previous
        stage's output); ``kv_caches`` holds this stage's layers only; a stage before the last returns its
        ``IntermediateTensors`` instead of normed hidden states."""
        aux = []  # [T, hidden_size] each: the residual stream entering each EAGLE-3 layer, in layer order
        if intermediate is None:
            hidden = self.embed(input_ids) if inputs_embeds is None else inputs_embeds  # [T, hidden_size]
            residual = None
        else:
            hidden, residual = intermediate.hidden, intermediate.residual
            if intermediate.aux is not None:  # the earlier stages' (pipeline parallelism)
                aux.extend(intermediate.aux)
        aux_layers = self.aux_hidden_state_layers
        end = len(self.layers) if self.end_layer is None else self.end_layer
        for i, kv_cache in zip(range(self.start_layer, end), kv_caches, strict=True):
            if i in aux_layers:
                aux.append(hidden if residual is None else hidden + residual)
            hidden, residual = self.layers[i](positions, hidden, residual, kv_cache, attn_metadata)
        if not self.is_last_stage:
            return IntermediateTensors(hidden, residual, torch.stack(aux) if aux else None)
        hidden, _ = self.norm(hidden, residual)
        if aux:
            return hidden, torch.cat(aux, dim=-1)
        return hidden

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden_size]
        return self.embed_tokens(input_ids)


class LlamaForCausalLM(nn.Module):
    attention_cls: type[LlamaAttention] = LlamaAttention
    model_cls: type[LlamaModel] = LlamaModel
    # fused parameter -> checkpoint modules stacked into it, in shard order
    packed_modules_mapping: dict[str, list[str]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    def __init__(
        self,
        config: Any,
        attn_backend: AttentionBackend,
        tp: TPGroup | None = None,
        pp: PPGroup | None = None,
    ) -> None:
        """``pp``: this rank's pipeline stage (the whole model when None); only bodies built by ``LlamaModel``
        take one (pagedllm.distributed.parallel_state.PP_ARCHITECTURES)."""
        super().__init__()
        self.config = config
        pp_kwargs = {} if pp is None or pp.size == 1 else {"pp": pp}
        self.model = self.model_cls(config, attn_backend, self.attention_cls, tp=tp, **pp_kwargs)
        if pp is not None and not pp.is_last:
            self.lm_head = PPMissingLayer()
            return
        tied = self.model.embed_tokens if getattr(config, "tie_word_embeddings", False) else None
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, tied_to=tied, tp=tp)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],  # per own layer [2, num_blocks, block_size, num_kv_heads, head_dim]
        attn_metadata: AttentionMetadata,
        intermediate: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:  # [T, hidden_size], or what a stage before the last hands on
        """``intermediate``: the previous pipeline stage's output (None on the first stage)."""
        if intermediate is None:
            return self.model(input_ids, positions, kv_caches, attn_metadata)
        return self.model(input_ids, positions, kv_caches, attn_metadata, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden_size] -> [N, vocab] float32
        return self.lm_head(hidden)


class MistralForCausalLM(LlamaForCausalLM):
    """Same weights and math as Llama, with every layer attending over ``sliding_window`` when the config sets
    one."""

    attention_cls = MistralAttention


class Qwen2ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen2Attention


class Phi3Model(LlamaModel):
    @staticmethod
    def make_rotary(config: Any) -> RotaryEmbedding:
        """Phi-3's rope: plain or LongRoPE (Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini), over the first
        ``int(head_dim * partial_rotary_factor)`` features of each head (Phi-4-mini: 0.75). LongRoPE's short/long
        choice depends on each token's request length, which the model runner folds into the positions it passes
        (``pagedllm.layers.rotary.longrope_positions``)."""
        theta, rope_scaling = rope_config(config, allow_partial=True, allow_longrope=True)
        head_dim = head_dim_of(config)
        return get_rope(
            head_dim, config.max_position_embeddings, theta, rope_scaling, rotary_dim_of(config, head_dim)
        )


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3: the Llama layout, with qkv_proj and gate_up_proj already fused in the checkpoint (the loader
    copies fused tensors whole). Every layer attends over ``sliding_window`` when the config sets one. Its rope
    may be LongRoPE and may rotate only part of each head (``Phi3Model``)."""

    attention_cls = MistralAttention
    model_cls = Phi3Model
