"""Gemma (1): the Llama layout with GeGLU (tanh GELU), RMSNorm scaling by ``1 + weight``, embeddings scaled by
``sqrt(hidden_size)`` and the LM head tied to the embedding. Gemma 2 adds local (sliding-window) and global
layers, four norms per layer and tanh soft-capping of attention scores and final logits."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from pagedllm.attention.base import AttentionBackend, AttentionMetadata
from pagedllm.distributed.parallel_state import PPGroup, TPGroup
from pagedllm.layers.attention import Attention
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding, get_rope, rope_config
from pagedllm.models.llama import (
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    head_dim_of,
    layer_types_sliding_window,
)


class GemmaRMSNorm(RMSNorm):
    """``x / rms(x) * (1 + weight)``, all in float32, cast back at the end (as HF Gemma computes it). The
    checkpoint's ``weight`` is kept as stored; no fused kernel (it assumes the plain scale)."""

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)

    def forward(
        self,
        x: torch.Tensor,  # [..., hidden_size]
        residual: torch.Tensor | None = None,  # [..., hidden_size]
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class GemmaModel(LlamaModel):
    norm_cls = GemmaRMSNorm

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden_size]
        hidden = self.embed_tokens(input_ids)
        # HF multiplies by sqrt(hidden_size) rounded to the activation dtype first.
        return hidden * torch.tensor(hidden.shape[-1] ** 0.5, dtype=hidden.dtype)


class GemmaForCausalLM(LlamaForCausalLM):
    model_cls = GemmaModel


# --- Gemma 2 ----------------------------------------------------------------------------------------------


def gemma2_layer_sliding_window(config: Any, layer_idx: int) -> int | None:
    """Gemma 2 alternates local (sliding) and global layers per ``layer_types``; transformers' default when a
    config has none is sliding on even layers (0, 2, ...)."""
    return layer_types_sliding_window(config, layer_idx, default_sliding=layer_idx % 2 == 0)


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(x / cap)`` (identity when ``cap`` is None): squashes values smoothly into (-cap, cap)."""
    return x if cap is None else cap * torch.tanh(x / cap)


class Gemma2Attention(LlamaAttention):
    """Llama attention scaled by ``query_pre_attn_scalar ** -0.5`` (not ``head_dim ** -0.5``), with tanh
    soft-capped scores (``attn_logit_softcapping``) and this layer's window from ``layer_types``."""

    layer_sliding_window = staticmethod(gemma2_layer_sliding_window)

    def __init__(
        self,
        config: Any,
        layer_idx: int,
        attn_backend: AttentionBackend,
        rotary_emb: RotaryEmbedding,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__(config, layer_idx, attn_backend, rotary_emb, tp=tp)
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention (Gemma embedding models) is not supported")
        cap = getattr(config, "attn_logit_softcapping", None)
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            float(config.query_pre_attn_scalar) ** -0.5,
            self.num_kv_heads,
            attn_backend,
            layer_idx,
            sliding_window=self.layer_sliding_window(config, layer_idx),
            logits_soft_cap=float(cap) if cap else None,
        )


class Gemma2DecoderLayer(nn.Module):
    """Pre- and post-norms around both the attention and the MLP (four Gemma RMSNorms)::

        h = h + post_attention_layernorm(attn(input_layernorm(h)))
        h = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))

    Written in the residual-carrying form of ``LlamaDecoderLayer``: the add before a norm happens inside it.
    """

    def __init__(
        self,
        config: Any,
        layer_idx: int,
        attn_backend: AttentionBackend,
        rotary_emb: RotaryEmbedding,
        attention_cls: type[LlamaAttention],
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.self_attn = attention_cls(config, layer_idx, attn_backend, rotary_emb, tp=tp)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.mlp = LlamaMLP(config, tp=tp)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

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
        hidden = self.post_attention_layernorm(hidden)
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        hidden = self.mlp(hidden)
        return self.post_feedforward_layernorm(hidden), residual


class Gemma2Model(GemmaModel):
    decoder_layer_cls: type[nn.Module] = Gemma2DecoderLayer

    def __init__(
        self,
        config: Any,
        attn_backend: AttentionBackend,
        attention_cls: type[LlamaAttention],
        tp: TPGroup | None = None,
        pp: PPGroup | None = None,
    ) -> None:
        nn.Module.__init__(self)  # LlamaModel's layers are Llama layers: build Gemma 2's here
        rotaries = self.make_rotaries(config)
        layer_cls = self.decoder_layer_cls
        self.build_stage(
            config, lambda i: layer_cls(config, i, attn_backend, rotaries[i], attention_cls, tp=tp), tp, pp
        )

    @staticmethod
    def make_rotaries(config: Any) -> list[RotaryEmbedding]:
        """One rotary embedding per layer (Gemma 2: the same one for all)."""
        theta, rope_scaling = rope_config(config)
        rotary = get_rope(head_dim_of(config), config.max_position_embeddings, theta, rope_scaling)
        return [rotary] * config.num_hidden_layers


class Gemma2ForCausalLM(GemmaForCausalLM):
    """Gemma 2: Gemma 1's embedding scale, (1 + w) RMSNorm, GeGLU and tied head, plus local/global layers, four
    norms per layer, soft-capped attention scores and soft-capped final logits (``final_logit_softcapping``)."""

    attention_cls = Gemma2Attention
    model_cls = Gemma2Model

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden_size] -> [N, vocab] float32
        cap = getattr(self.config, "final_logit_softcapping", None)
        return soft_cap(self.lm_head(hidden), float(cap) if cap else None)


# --- Gemma 3 (text) ---------------------------------------------------------------------------------------


def gemma3_layer_sliding_window(config: Any, layer_idx: int) -> int | None:
    """Gemma 3: per ``layer_types``; transformers' default is five local layers then one global."""
    pattern = int(getattr(config, "sliding_window_pattern", None) or 6)
    return layer_types_sliding_window(config, layer_idx, default_sliding=(layer_idx + 1) % pattern != 0)


def gemma3_rope(config: Any, layer_type: str) -> tuple[float, dict[str, Any] | None]:
    """``(theta, rope_scaling)`` of one layer type. transformers 5 keeps one ``rope_parameters`` entry per layer
    type; older configs have ``rope_theta`` + ``rope_scaling`` for global layers and ``rope_local_base_freq``
    (no scaling) for local ones."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and isinstance(params.get(layer_type), dict):
        one = SimpleNamespace(
            rope_parameters=params[layer_type], max_position_embeddings=config.max_position_embeddings
        )
        return rope_config(one)
    if layer_type == "sliding_attention":
        return float(getattr(config, "rope_local_base_freq", None) or 10000.0), None
    return rope_config(config)


class Gemma3Attention(Gemma2Attention):
    """Gemma 2's attention plus (1 + w) RMSNorm over each head's q and k before RoPE."""

    layer_sliding_window = staticmethod(gemma3_layer_sliding_window)
    qk_norm_cls = GemmaRMSNorm


class Gemma3Model(Gemma2Model):
    @staticmethod
    def make_rotaries(config: Any) -> list[RotaryEmbedding]:
        """Local (sliding) layers use their own theta (``rope_local_base_freq``) and no scaling; global layers use
        theirs, with the config's rope scaling when it has one."""
        by_type: dict[str, RotaryEmbedding] = {}
        rotaries = []
        for i in range(config.num_hidden_layers):
            kind = "sliding_attention" if gemma3_layer_sliding_window(config, i) else "full_attention"
            if kind not in by_type:
                theta, rope_scaling = gemma3_rope(config, kind)
                by_type[kind] = get_rope(
                    head_dim_of(config), config.max_position_embeddings, theta, rope_scaling
                )
            rotaries.append(by_type[kind])
        return rotaries


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3, text only (``Gemma3ForCausalLM`` checkpoints): Gemma 2's layout with q/k norms, local layers on
    their own RoPE base, and 5:1 local/global layers per ``layer_types``. Soft-caps apply when the config sets
    them (released Gemma 3 configs do not)."""

    attention_cls = Gemma3Attention
    model_cls = Gemma3Model
