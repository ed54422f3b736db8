"""Token embedding and the LM head (which may share the embedding's weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.linear import new_parameter


class VocabEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = new_parameter(num_embeddings, embedding_dim)  # [vocab_size, hidden_size]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden_size]
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """Hidden states to float32 logits. Given ``tied_to``, it reuses that embedding's weight (no copy)."""

    def __init__(self, vocab_size: int, hidden_size: int, tied_to: VocabEmbedding | None = None) -> None:
        super().__init__()
        if tied_to is not None:
            if tuple(tied_to.weight.shape) != (vocab_size, hidden_size):
                raise ValueError(
                    f"tied embedding is {tuple(tied_to.weight.shape)}, expected {(vocab_size, hidden_size)}"
                )
            self.weight = tied_to.weight  # [vocab_size, hidden_size], shared
        else:
            self.weight = new_parameter(vocab_size, hidden_size)  # [vocab_size, hidden_size]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden_size] -> [N, vocab_size] float32
        return F.linear(hidden, self.weight).float()
