"""Decoder models as pooling models: a Llama-family body (Llama, Qwen2, Qwen3) without its LM head, as an
embedder (``Qwen3ForCausalLM`` served with ``runner="pooling"``, Qwen3-Embedding's shape) or with a
sequence-classification ``score`` head (``Qwen3ForSequenceClassification``, ``LlamaForSequenceClassification``).

The body is the generation model's own (``LlamaModel`` with the family's attention block); its causal paged
attention writes each step's keys into scratch caches the pooling runner hands in (``PoolingBatch.kv_caches``)
and reads them back the same step. Interface as in ``pagedllm/models/bert.py``.

Checkpoint names: ``model.*`` (a causal-LM or classification checkpoint) or bare (``Qwen3Model`` as
sentence-transformers saves it); an ``lm_head`` is skipped.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.attention.encoder import PoolingBatch
from pagedllm.models.llama import LlamaAttention, LlamaForCausalLM, LlamaModel, Qwen2Attention
from pagedllm.models.qwen3 import Qwen3Attention
from pagedllm.pooling.config import config_num_labels


class DecoderEmbeddingModel(nn.Module):
    attention_cls: type[LlamaAttention] = LlamaAttention
    model_cls: type[LlamaModel] = LlamaModel
    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping

    def __init__(self, config: Any, attn_backend: Any, **_: Any) -> None:
        super().__init__()
        self.config = config
        self.model = self.model_cls(config, attn_backend, self.attention_cls)

    def checkpoint_name(self, name: str) -> str | None:
        if name.startswith("lm_head."):
            return None
        return name if name.startswith("model.") else f"model.{name}"

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: PoolingBatch) -> torch.Tensor:
        """[T] ids and positions -> the final (normed) hidden states [T, hidden_size]."""
        return self.model(input_ids, positions, batch.kv_caches, batch.attn_metadata)

    def head(self, pooled: torch.Tensor) -> torch.Tensor:
        return pooled


class DecoderForSequenceClassification(DecoderEmbeddingModel):
    """``score``: a bias-free linear layer over the last token's hidden state (transformers' layout)."""

    def __init__(self, config: Any, attn_backend: Any, **_: Any) -> None:
        super().__init__(config, attn_backend)
        self.score = nn.Linear(config.hidden_size, config_num_labels(config), bias=False)

    def checkpoint_name(self, name: str) -> str | None:
        return name if name.startswith("score.") else super().checkpoint_name(name)

    def head(self, pooled: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, num_labels]
        return self.score(pooled)


class Qwen2EmbeddingModel(DecoderEmbeddingModel):
    attention_cls = Qwen2Attention


class Qwen3EmbeddingModel(DecoderEmbeddingModel):
    attention_cls = Qwen3Attention


class Qwen2ForSequenceClassification(DecoderForSequenceClassification):
    attention_cls = Qwen2Attention


class Qwen3ForSequenceClassification(DecoderForSequenceClassification):
    attention_cls = Qwen3Attention


class LlamaForSequenceClassification(DecoderForSequenceClassification):
    pass
