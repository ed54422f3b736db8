"""pagedllm: high-throughput LLM inference and serving with vLLM's interfaces."""

from pagedllm.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from pagedllm.pooling.params import PoolingParams
from pagedllm.sampling_params import (
    GuidedDecodingParams,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "AsyncLLM",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "RequestOutputKind",
    "StructuredOutputsParams",
    "GuidedDecodingParams",
    "PoolingParams",
    "PoolingOutput",
    "PoolingRequestOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "ClassificationOutput",
    "ClassificationRequestOutput",
    "ScoringOutput",
    "ScoringRequestOutput",
    "__version__",
]


def __getattr__(name: str):
    # Heavy imports (torch, transformers, the engine) only when the class is asked for.
    if name == "LLM":
        from pagedllm.entrypoints.llm import LLM

        return LLM
    if name == "AsyncLLM":
        from pagedllm.engine.async_llm import AsyncLLM

        return AsyncLLM
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
