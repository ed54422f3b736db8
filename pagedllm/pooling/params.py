"""``PoolingParams``: per-request settings of a pooling model, with vLLM's names, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# What a pooling request asks for: "embed" (one normalized vector), "classify" (class probabilities), "score"
# (a cross-encoder's relevance for a text pair), "encode" (the raw pooled hidden state).
POOLING_TASKS = ("embed", "classify", "score", "encode")


def _check_positive_int(name: str, value: Any, allow_minus_one: bool = False) -> None:
    if value is None:
        return
    ok = (
        isinstance(value, int)
        and not isinstance(value, bool)
        and (value >= 1 or (allow_minus_one and value == -1))
    )
    if not ok:
        extra = " (or -1 for max_model_len)" if allow_minus_one else ""
        raise ValueError(f"{name} must be a positive integer{extra}, got {value!r}")


@dataclass
class PoolingParams:
    """Settings of one pooling request.

    ``normalize``: L2-normalize an embedding (None: the checkpoint's choice, true unless its sentence-transformers
    modules say otherwise). ``dimensions``: keep the first ``dimensions`` features of the embedding, then
    normalize (Matryoshka models only; ``ValueError`` naming ``dimensions`` on others, when the request is added).
    ``truncate_prompt_tokens``: cut the prompt to this many tokens (-1: to ``max_model_len``) instead of refusing
    a prompt that is too long; text is truncated by the tokenizer (its truncation side, special tokens kept), a
    token-id prompt keeps its last tokens. ``activation``: apply the classifier's activation (softmax over the
    labels, sigmoid for one label) for classify and score (None: true). ``task``: filled by the ``LLM`` method or
    the endpoint (see ``POOLING_TASKS``).
    """

    normalize: bool | None = None
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None
    activation: bool | None = None
    task: str | None = None

    def __post_init__(self) -> None:
        for name in ("normalize", "activation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be a boolean or None, got {value!r}")
        _check_positive_int("dimensions", self.dimensions)
        _check_positive_int("truncate_prompt_tokens", self.truncate_prompt_tokens, allow_minus_one=True)
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}")

    def clone(self) -> PoolingParams:
        return PoolingParams(**self.__dict__)

    def with_task(self, task: str) -> PoolingParams:
        """A copy for ``task``; ``ValueError`` when these params were made for another task."""
        if task not in POOLING_TASKS:
            raise ValueError(f"pooling_task must be one of {', '.join(POOLING_TASKS)}, got {task!r}")
        if self.task is not None and self.task != task:
            raise ValueError(f"pooling_params.task is {self.task!r} but this call runs {task!r}")
        params = self.clone()
        params.task = task
        if task not in ("embed",) and self.dimensions is not None:
            raise ValueError(f"dimensions applies to embeddings only, not to task {task!r}")
        return params


def check_pooling_prompt(num_tokens: int, max_model_len: int, max_num_batched_tokens: int | None) -> None:
    """``ValueError`` naming the limit when a pooling prompt of ``num_tokens`` tokens can never run."""
    if num_tokens == 0:
        raise ValueError("the prompt must not be empty")
    hint = "; set truncate_prompt_tokens to truncate it"
    if num_tokens > max_model_len:
        raise ValueError(
            f"the prompt ({num_tokens} tokens) is longer than the maximum model length of {max_model_len}{hint}"
        )
    if max_num_batched_tokens is not None and num_tokens > max_num_batched_tokens:
        raise ValueError(
            f"the prompt ({num_tokens} tokens) is longer than max_num_batched_tokens ({max_num_batched_tokens}): "
            f"a pooling request runs its whole prompt in one step{hint}, or raise max_num_batched_tokens"
        )
