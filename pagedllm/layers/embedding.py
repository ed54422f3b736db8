"""Token embedding and the LM head (which may share the embedding's weight), vocabulary-parallel.

With a ``TPGroup`` of ``T`` ranks the vocabulary is padded to ``V' = ceil(V / T) * T`` rows and rank ``r`` holds
rows ``[r * V' / T, (r + 1) * V' / T)``; padding rows are zeros. The embedding looks up the ids in its range
(others give zeros) and all-reduces; the LM head computes its vocabulary slice of the logits, gathers the
slices once and trims the padding, so padded entries never reach the sampler. With one rank (the default)
the weight is the plain ``[V, hidden_size]`` table.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.communicator import all_gather, all_reduce
from pagedllm.distributed.parallel_state import TPGroup
from pagedllm.layers.cpu_gemm import linear, pack_weight
from pagedllm.layers.linear import new_parameter


class VocabParallelTable(nn.Module):
    """A ``[V, hidden_size]`` table split by rows over the ranks of ``tp`` (see the module docstring)."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, tp: TPGroup | None = None, make_weight: bool = True
    ) -> None:
        super().__init__()
        self.tp = tp if tp is not None else TPGroup.single()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_embeddings_per_rank = -(-num_embeddings // self.tp.size)  # V' / T
        self.num_embeddings_padded = self.num_embeddings_per_rank * self.tp.size  # V'
        self.vocab_start = self.tp.rank * self.num_embeddings_per_rank  # this rank's ids [start, end)
        self.vocab_end = min(self.vocab_start + self.num_embeddings_per_rank, num_embeddings)
        if make_weight:
            self.weight = new_parameter(  # [V' / T, hidden_size]; rows past vocab_end - vocab_start: padding
                self.num_embeddings_per_rank, embedding_dim, weight_loader=self.weight_loader
            )

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
        """Copy this rank's rows of the checkpoint's ``[V, hidden_size]`` table; zero the padding rows."""
        if tuple(loaded_weight.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(
                f"shape mismatch: parameter {(self.num_embeddings, self.embedding_dim)} vs checkpoint "
                f"{tuple(loaded_weight.shape)}"
            )
        num_rows = max(0, self.vocab_end - self.vocab_start)
        param.data[:num_rows].copy_(loaded_weight[self.vocab_start : self.vocab_start + num_rows])
        param.data[num_rows:].zero_()


class VocabEmbedding(VocabParallelTable):
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden_size]
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        in_range = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)  # [T]
        local_ids = torch.where(in_range, input_ids - self.vocab_start, 0)  # [T]
        hidden = F.embedding(local_ids, self.weight)  # [T, hidden_size]
        hidden = hidden.masked_fill(~in_range.unsqueeze(-1), 0)
        return all_reduce(hidden, self.tp)  # exactly one rank contributes each row


class LMHead(VocabParallelTable):
    """Hidden states to float32 logits. Given ``tied_to``, it reuses that embedding's weight (no copy), which is
    split the same way (``tied_to`` must be built with the same ``tp``)."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        tied_to: VocabEmbedding | None = None,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__(vocab_size, hidden_size, tp, make_weight=tied_to is None)
        if tied_to is not None:
            if (tied_to.num_embeddings, tied_to.embedding_dim) != (vocab_size, hidden_size):
                raise ValueError(
                    f"tied embedding is {(tied_to.num_embeddings, tied_to.embedding_dim)}, expected "
                    f"{(vocab_size, hidden_size)}"
                )
            if tied_to.tp.size != self.tp.size or tied_to.tp.rank != self.tp.rank:
                raise ValueError(
                    "a tied LM head must be split like its embedding (same tensor-parallel group)"
                )
            self.weight = tied_to.weight  # [V' / T, hidden_size], shared
        self.packed_weight: torch.Tensor | None = None

    def process_weights_after_loading(self) -> None:
        """On CPU, a oneDNN-packed copy of the weight (``cpu_gemm.py``; its own copy when tied)."""
        self.packed_weight = pack_weight(self.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden_size] -> [N, vocab_size] float32
        logits = linear(hidden, self.weight, self.packed_weight).float()  # [N, V' / T]
        if self.tp.size == 1:
            return logits
        logits = all_gather(logits, self.tp, dim=-1)  # [N, V'], gathered once
        if self.num_embeddings_padded == self.vocab_size:
            return logits
        return logits[:, : self.vocab_size].contiguous()  # [N, V]: padded entries are never sampled

    @property
    def vocab_size(self) -> int:
        return self.num_embeddings
