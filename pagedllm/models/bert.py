"""BERT and XLM-RoBERTa encoders (embedding models, cross-encoder rerankers), bidirectional attention, no KV cache.

Module names follow transformers' checkpoints (``embeddings.word_embeddings``, ``encoder.layer.N.attention.self.
query``, ...) so that tensors load as they are; ``checkpoint_name`` drops the ``bert.`` / ``roberta.`` prefix of
task models and the tensors a pooling model does not use. Post-layer-norm residual blocks, as BERT.

Interface of a pooling model (``pagedllm/worker/pooling_runner.py``): ``forward(input_ids [T], positions [T],
batch: PoolingBatch) -> hidden [T, hidden_size]`` and ``head(pooled [N, hidden_size]) -> [N, D]`` (the identity
for an embedding model, the classifier for a sequence-classification model).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.encoder import PoolingBatch, encoder_attention
from pagedllm.pooling.config import config_num_labels

_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


def _activation(name: str):
    if name not in _ACTIVATIONS:
        raise ValueError(
            f"hidden_act {name!r} is not supported by the encoder models ({', '.join(_ACTIVATIONS)})"
        )
    return _ACTIVATIONS[name]


class BertEmbeddings(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(
            getattr(config, "type_vocab_size", 2) or 1, config.hidden_size
        )
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor | None
    ) -> torch.Tensor:  # [T] -> [T, hidden_size]
        if token_type_ids is None or self.token_type_embeddings.num_embeddings == 1:  # XLM-R: one segment
            token_type_ids = torch.zeros_like(input_ids)
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        x = x + self.position_embeddings(positions)
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor, batch: PoolingBatch) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        shape = (x.shape[0], self.num_heads, self.head_dim)  # [T, num_heads, head_dim]
        q, k, v = self.query(x).view(shape), self.key(x).view(shape), self.value(x).view(shape)
        return encoder_attention(q, k, v, batch, 1.0 / math.sqrt(self.head_dim)).reshape(x.shape)


class BertDenseNorm(nn.Module):
    """``LayerNorm(dense(x) + residual)``: BERT's ``attention.output`` and ``output`` blocks."""

    def __init__(self, in_size: int, config: Any) -> None:
        super().__init__()
        self.dense = nn.Linear(in_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertDenseNorm(config.hidden_size, config)

    def forward(self, x: torch.Tensor, batch: PoolingBatch) -> torch.Tensor:
        return self.output(self.self(x, batch), x)


class BertIntermediate(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = _activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, intermediate]
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertDenseNorm(config.intermediate_size, config)

    def forward(self, x: torch.Tensor, batch: PoolingBatch) -> torch.Tensor:
        x = self.attention(x, batch)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))


class BertModel(nn.Module):
    """A BERT encoder as an embedding model (BGE, E5, MiniLM shapes): the last layer's hidden states."""

    # Checkpoint prefixes of the task models that wrap the encoder (BertForMaskedLM's "bert.", ...).
    prefixes: tuple[str, ...] = ("bert.", "model.")
    uses_pooler_layer = False  # BertModel's own pooler (dense + tanh over CLS); only the classifier uses it

    def __init__(self, config: Any, attn_backend: Any = None, **_: Any) -> None:
        super().__init__()
        if getattr(config, "position_embedding_type", "absolute") not in (None, "absolute"):
            raise ValueError(
                f"position_embedding_type {config.position_embedding_type!r} is not supported (absolute is)"
            )
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        if self.uses_pooler_layer:
            self.pooler = nn.Module()
            self.pooler.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def checkpoint_name(self, name: str) -> str | None:
        """The parameter a checkpoint tensor loads into, or None to skip it (heads a pooling model does not use)."""
        for prefix in self.prefixes:
            if name.startswith(prefix):
                name = name[len(prefix) :]
                break
        if name.startswith(("pooler.", "cls.", "lm_head.")) and not (
            self.uses_pooler_layer and name.startswith("pooler.")
        ):
            return None
        if name.endswith(("position_ids", "token_type_ids")):  # buffers some checkpoints carry
            return None
        return name

    def positions(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: PoolingBatch
    ) -> torch.Tensor:
        return positions

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: PoolingBatch) -> torch.Tensor:
        """``input_ids`` / ``positions`` [T] (positions from 0 within each request) -> hidden [T, hidden_size]."""
        x = self.embeddings(input_ids, self.positions(input_ids, positions, batch), batch.token_type_ids)
        for layer in self.encoder.layer:
            x = layer(x, batch)
        return x

    def head(self, pooled: torch.Tensor) -> torch.Tensor:
        return pooled


class XLMRobertaModel(BertModel):
    """XLM-RoBERTa (and RoBERTa): BERT's layers; positions count from ``pad_token_id + 1`` over non-pad tokens,
    as transformers' ``create_position_ids_from_input_ids``."""

    prefixes = ("roberta.", "model.")

    def positions(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: PoolingBatch
    ) -> torch.Tensor:
        pad = int(self.config.pad_token_id)
        mask = (input_ids != pad).long()  # [T]
        counts = torch.cumsum(mask, 0)  # [T] running count over the whole step...
        starts = batch.cu_device[:-1].long()  # [num_reqs]
        before = torch.where(starts > 0, counts[(starts - 1).clamp_min(0)], torch.zeros_like(starts))
        if batch.owner is not None:
            counts = counts - before[batch.owner]  # ... restarted at each request
        else:
            lens = torch.from_numpy(np.diff(batch.cu).astype(np.int64)).to(input_ids.device)
            counts = counts - torch.repeat_interleave(before, lens)
        return counts * mask + pad


class BertForSequenceClassification(BertModel):
    """BERT cross-encoder / classifier: the pooler (dense + tanh over CLS), then ``classifier``."""

    uses_pooler_layer = True

    def __init__(self, config: Any, attn_backend: Any = None, **_: Any) -> None:
        super().__init__(config)
        self.classifier = nn.Linear(config.hidden_size, config_num_labels(config))

    def checkpoint_name(self, name: str) -> str | None:
        if name.startswith("classifier."):
            return name
        return super().checkpoint_name(name)

    def head(self, pooled: torch.Tensor) -> torch.Tensor:  # [N, hidden] CLS -> [N, num_labels]
        return self.classifier(torch.tanh(self.pooler.dense(pooled)))


class XLMRobertaForSequenceClassification(XLMRobertaModel):
    """XLM-RoBERTa cross-encoder (BGE reranker shape): ``classifier.dense`` + tanh + ``classifier.out_proj`` over
    the first token."""

    def __init__(self, config: Any, attn_backend: Any = None, **_: Any) -> None:
        super().__init__(config)
        self.classifier = nn.Module()
        self.classifier.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.classifier.out_proj = nn.Linear(config.hidden_size, config_num_labels(config))

    def checkpoint_name(self, name: str) -> str | None:
        if name.startswith("classifier."):
            return name
        return super().checkpoint_name(name)

    def head(self, pooled: torch.Tensor) -> torch.Tensor:  # [N, hidden] first token -> [N, num_labels]
        return self.classifier.out_proj(torch.tanh(self.classifier.dense(pooled)))
