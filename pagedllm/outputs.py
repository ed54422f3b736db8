"""What users receive: ``RequestOutput`` holding one ``CompletionOutput`` per sampled sequence (vLLM's shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Logprob:
    """One candidate token's log-probability, its 1-based rank in the distribution, and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position: {token_id: Logprob}; the sampled (or prompt) token is always in it.
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = field(default=None, repr=False)
    # A KV connector's handle for another instance (disaggregated prefill: where the prompt's KV waits)
    kv_transfer_params: dict[str, Any] | None = None


# ---------------------------------------------------------------------------------------------- pooling models


class PoolingOutput:
    """A pooling request's raw result: ``data`` is a float32 tensor on the host (``[hidden_size]`` for an
    embedding model, ``[num_labels]`` for a classifier). Built from a tensor, a float32 numpy array (the engine's
    row of its step's results; ``data`` shares its memory) or a list of floats; each form is made from the other
    when first read (``values`` gives the list)."""

    __slots__ = ("_data", "_values")

    def __init__(self, data: Any) -> None:
        if isinstance(data, list):
            self._data, self._values = None, list(data)
        elif isinstance(data, np.ndarray):
            import torch

            self._data, self._values = torch.from_numpy(data), None
        else:
            self._data, self._values = data, None

    @property
    def data(self) -> Any:  # torch.Tensor
        if self._data is None:
            import torch

            self._data = torch.tensor(self._values, dtype=torch.float32)
        return self._data

    @property
    def values(self) -> list[float]:
        if self._values is None:
            self._values = self._data.tolist()
        return self._values

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PoolingOutput) and bool((self.data == other.data).all())

    def __repr__(self) -> str:
        return f"PoolingOutput(data={self.data!r})"


@dataclass
class PoolingRequestOutput:
    request_id: str
    outputs: Any  # PoolingOutput, or the task's view of it (EmbeddingOutput, ClassificationOutput, ScoringOutput)
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None


class EmbeddingOutput:
    """``embedding``: the vector as a list of floats, made from the engine's tensor when first read (a large
    batch whose embeddings are read as tensors, through ``PoolingRequestOutput.outputs.data``, or not at all,
    never builds the lists)."""

    __slots__ = ("_embedding", "_source")

    def __init__(self, embedding: list[float] | None = None, *, source: PoolingOutput | None = None) -> None:
        if embedding is None and source is None:
            raise ValueError("EmbeddingOutput needs an embedding")
        self._embedding = embedding
        self._source = source

    @property
    def embedding(self) -> list[float]:
        if self._embedding is None:
            self._embedding = self._source.values
        return self._embedding

    @property
    def data(self) -> Any:  # torch.Tensor
        """The embedding as a float32 tensor (no list is built when it came from the engine)."""
        if self._source is None:
            self._source = PoolingOutput(self._embedding)
        return self._source.data

    @property
    def hidden_size(self) -> int:
        return len(self._embedding) if self._embedding is not None else int(self._source.data.shape[-1])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EmbeddingOutput) and self.embedding == other.embedding

    def __repr__(self) -> str:
        return f"EmbeddingOutput(embedding={self.embedding!r})"


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class EmbeddingRequestOutput(PoolingRequestOutput):
    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return cls(out.request_id, EmbeddingOutput(source=out.outputs), out.prompt_token_ids,
                   out.finished, out.prompt)


@dataclass
class ClassificationRequestOutput(PoolingRequestOutput):
    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> ClassificationRequestOutput:
        return cls(out.request_id, ClassificationOutput(out.outputs.values), out.prompt_token_ids,
                   out.finished, out.prompt)


@dataclass
class ScoringRequestOutput(PoolingRequestOutput):
    pass
