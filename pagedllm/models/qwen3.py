"""Qwen3: Llama layout plus RMSNorm over each head's q and k before RoPE."""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.attention.base import AttentionBackend
from pagedllm.distributed.parallel_state import TPGroup
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.models.llama import LlamaAttention, LlamaForCausalLM, qwen_layer_sliding_window


class Qwen3Attention(LlamaAttention):
    layer_sliding_window = staticmethod(qwen_layer_sliding_window)  # the Qwen2 rule

    def __init__(
        self,
        config: Any,
        layer_idx: int,
        attn_backend: AttentionBackend,
        rotary_emb: RotaryEmbedding,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__(config, layer_idx, attn_backend, rotary_emb, tp=tp)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)  # [head_dim] weight, shared by heads
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def qk_norm(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
