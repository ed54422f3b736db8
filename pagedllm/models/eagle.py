"""EAGLE draft heads for Llama-family targets, in the layout the published checkpoints use.

EAGLE (``method="eagle"``; e.g. yuhuili/EAGLE-LLaMA3-Instruct-8B): one Llama decoder layer without its input
norm, fed ``fc(cat(embed(token), target_hidden))`` (``fc``: ``[H, 2H]``, optional bias). Its output goes through
the target's LM head (no final norm) and is the next step's hidden input. Checkpoint names: ``fc.*``,
``layers.0.{self_attn,mlp,post_attention_layernorm}.*`` (``embed_tokens.weight``, a copy of the target's, is
ignored: the target's embedding is used).

EAGLE-3 (``method="eagle3"``; e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B): ``fc`` (``[H, 3H]``) mixes the target's
hidden states entering three of its layers (2, L/2, L-3); one decoder layer ``midlayer`` whose attention reads
``cat(input_layernorm(embed(token)), hidden_norm(hidden))`` (``2H`` wide) with the hidden as residual; its output
(before ``norm``) is the next step's hidden; ``lm_head(norm(out))`` scores a draft vocabulary of
``draft_vocab_size`` tokens, mapped to target ids by ``d2t`` (target id = draft id + d2t[draft id]).

Token/position convention (as EAGLE trains it): the head's input at position p is the token at p + 1 and the
target's hidden state at p; its output at p predicts the token at p + 2.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.attention.base import AttentionBackend, AttentionMetadata
from pagedllm.layers.embedding import LMHead
from pagedllm.layers.linear import Linear, QKVLinear
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import get_rope, rope_config
from pagedllm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP, head_dim_of


def eagle3_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """The target layers whose input hidden states EAGLE-3 reads (vLLM's and EAGLE-3's choice)."""
    return (2, num_layers // 2, num_layers - 3)


class EagleLlamaHead(nn.Module):
    """EAGLE-1 head. ``forward`` returns the head's hidden ``[T, H]``; logits come from the target's LM head."""

    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    method = "eagle"

    def __init__(self, config: Any, attn_backend: AttentionBackend, fc_bias: bool = False) -> None:
        super().__init__()
        h = config.hidden_size
        self.fc = Linear(2 * h, h, bias=fc_bias)
        theta, scaling = rope_config(config)
        rotary = get_rope(head_dim_of(config), config.max_position_embeddings, theta, scaling)
        layer = LlamaDecoderLayer(config, 0, attn_backend, rotary, LlamaAttention)
        layer.input_layernorm = nn.Identity()  # EAGLE's first layer has none
        self.layers = nn.ModuleList([layer])

    def forward(
        self,
        embeds: torch.Tensor,  # [T, H] embedding of the token at p + 1
        hidden: torch.Tensor,  # [T, H] the target's (or the previous head step's) hidden at p
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],  # one layer: [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        x = self.fc(torch.cat([embeds, hidden], dim=-1))
        out, residual = self.layers[0](positions, x, None, kv_caches[0], meta)
        return out + residual


class Eagle3Attention(LlamaAttention):
    """Llama attention whose q/k/v read ``2H`` features (normed embedding and normed hidden, concatenated)."""

    def __init__(self, config: Any, layer_idx: int, attn_backend: AttentionBackend, rotary_emb: Any) -> None:
        super().__init__(config, layer_idx, attn_backend, rotary_emb)
        qkv_bias, _ = self.biases(config)
        self.qkv_proj = QKVLinear(
            2 * config.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads, qkv_bias
        )


class Eagle3MidLayer(nn.Module):
    def __init__(self, config: Any, attn_backend: AttentionBackend, rotary: Any) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.self_attn = Eagle3Attention(config, 0, attn_backend, rotary)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = LlamaMLP(config)


class Eagle3LlamaHead(nn.Module):
    """EAGLE-3 head. ``forward`` returns the pre-norm hidden ``[T, H]``; ``compute_logits`` gives target-vocab
    logits (tokens outside the draft vocabulary at -inf)."""

    packed_modules_mapping = EagleLlamaHead.packed_modules_mapping
    method = "eagle3"

    def __init__(self, config: Any, attn_backend: AttentionBackend, target_vocab_size: int) -> None:
        super().__init__()
        h = config.hidden_size
        target_h = getattr(config, "target_hidden_size", None) or h
        self.fc = Linear(3 * target_h, h, bias=False)
        theta, scaling = rope_config(config)
        rotary = get_rope(head_dim_of(config), config.max_position_embeddings, theta, scaling)
        self.midlayer = Eagle3MidLayer(config, attn_backend, rotary)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.draft_vocab_size = getattr(config, "draft_vocab_size", None) or config.vocab_size
        self.lm_head = LMHead(self.draft_vocab_size, h)
        self.target_vocab_size = target_vocab_size
        # draft id -> target id offset (loaded from the checkpoint's d2t; zeros when the vocabularies agree)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long), persistent=False)
        self.target_ids: torch.Tensor | None = None  # [draft_vocab] (map_draft_vocab)
        self._vocab_mapped = False

    def forward(
        self,
        embeds: torch.Tensor,  # [T, H]
        hidden: torch.Tensor,  # [T, 3H] the target's aux hidden states, or [T, H] the previous head step's
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H] pre-norm hidden
        if hidden.shape[-1] != embeds.shape[-1]:
            hidden = self.fc(hidden)
        layer = self.midlayer
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)  # [T, 2H]
        attn = layer.self_attn(positions, x, kv_caches[0], meta)
        attn, residual = layer.post_attention_layernorm(attn, hidden)
        return layer.mlp(attn) + residual

    def map_draft_vocab(self) -> None:
        """Read ``d2t`` (once its weights are loaded): the target ids of the draft vocabulary, or None when the
        two vocabularies agree. ``compute_logits`` then reads nothing back to the host (CUDA graphs capture it)."""
        same = self.draft_vocab_size == self.target_vocab_size and not bool(self.d2t.any())
        self.target_ids = None if same else torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t
        self._vocab_mapped = True

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, target vocab] float32
        draft_logits = self.lm_head(self.norm(hidden))  # [N, draft_vocab]
        if not self._vocab_mapped:
            self.map_draft_vocab()
        if self.target_ids is None:
            return draft_logits
        logits = draft_logits.new_full((hidden.shape[0], self.target_vocab_size), float("-inf"))
        return logits.index_copy_(1, self.target_ids, draft_logits)
