"""Request and response schemas of the pooling endpoints: /v1/embeddings (OpenAI), /pooling and /classify,
/score (and /v1/score), /rerank (and /v1/rerank, /v2/rerank: Jina's and Cohere's shape), with vLLM's extras.

``input``-like fields are typed loosely (``Any``) and checked in ``serving_embedding.parse_inputs``, so that a bad
one (empty, a mix of strings and token ids) is a 400 that says what is wrong with it.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field

from pagedllm.entrypoints.openai.protocol import OpenAIBaseModel


class _PoolingFields(OpenAIBaseModel):
    model: str | None = None
    truncate_prompt_tokens: int | None = None  # vLLM: cut each input to this many tokens (-1: max_model_len)
    user: str | None = None


class EmbeddingRequest(_PoolingFields):
    input: Any = None  # a string, a list of strings, a list of token ids, or a list of token-id lists
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    normalize: bool | None = None  # vLLM extra


class PoolingRequest(_PoolingFields):
    input: Any = None
    encoding_format: Literal["float", "base64"] = "float"


class ClassificationRequest(_PoolingFields):
    input: Any = None


class ScoreRequest(_PoolingFields):
    text_1: Any = None  # a string or a list of strings (queries)
    text_2: Any = None  # a string or a list of strings (documents)


class RerankRequest(_PoolingFields):
    query: Any = None
    documents: Any = None
    top_n: int | None = None  # None or 0: every document
    return_documents: bool = True


class PoolingUsage(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class EmbeddingData(OpenAIBaseModel):
    index: int
    object: str = "embedding"
    embedding: list[float] | str


class EmbeddingResponse(OpenAIBaseModel):
    id: str
    object: str = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage


class PoolingData(OpenAIBaseModel):
    index: int
    object: str = "pooling"
    data: list[float] | str


class PoolingResponse(OpenAIBaseModel):
    id: str
    object: str = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[PoolingData]
    usage: PoolingUsage


class ClassificationData(OpenAIBaseModel):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(OpenAIBaseModel):
    id: str
    object: str = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ClassificationData]
    usage: PoolingUsage


class ScoreData(OpenAIBaseModel):
    index: int
    object: str = "score"
    score: float


class ScoreResponse(OpenAIBaseModel):
    id: str
    object: str = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankDocument(OpenAIBaseModel):
    text: str


class RerankResult(OpenAIBaseModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(OpenAIBaseModel):
    total_tokens: int = 0


class RerankResponse(OpenAIBaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
