"""Qwen3: Llama layout plus RMSNorm over each head's q and k before RoPE."""

from __future__ import annotations

from pagedllm.layers.norm import RMSNorm
from pagedllm.models.llama import LlamaAttention, LlamaForCausalLM, qwen_layer_sliding_window


class Qwen3Attention(LlamaAttention):
    layer_sliding_window = staticmethod(qwen_layer_sliding_window)  # the Qwen2 rule
    qk_norm_cls = RMSNorm


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
