"""The front-end half of a pooling request: prompt -> token ids (a text pair for a cross-encoder), truncation
(``PoolingParams.truncate_prompt_tokens``) and the checks that name the bad field, before anything is queued."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.core.sched_output import EngineCoreRequest
from pagedllm.pooling.params import PoolingParams, check_pooling_prompt
from pagedllm.pooling.pooler import check_params


@dataclass
class PoolingPrompt:
    prompt: str | None  # the text, when it came as text
    token_ids: list[int]
    token_type_ids: list[int] | None = None  # BERT segment ids of a text pair, when any is not 0


def _prompt(text: str, ids: list[int], types: list[int] | None) -> PoolingPrompt:
    """A tokenized text; its segment ids kept only when some are not 0."""
    return PoolingPrompt(text, list(ids), list(types) if types and any(types) else None)


class PoolingInputProcessor:
    def __init__(self, config: EngineConfig, tokenizer: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.max_model_len = config.model_config.max_model_len
        self.vocab_size = config.model_config.vocab_size
        # The token budget the core will use (its defaults resolve the same way here).
        config.scheduler_config.resolve_defaults(config.device_config.device)
        self.max_num_batched_tokens = config.scheduler_config.max_num_batched_tokens

    def _truncation(self, params: PoolingParams) -> int | None:
        k = params.truncate_prompt_tokens
        if k is None:
            return None
        if k == -1:
            return self.max_model_len
        if k > self.max_model_len:
            raise ValueError(
                f"truncate_prompt_tokens ({k}) is larger than the maximum model length ({self.max_model_len})"
            )
        return k

    def _tokenize(self, text: str, text_pair: str | None, max_length: int | None) -> PoolingPrompt:
        kwargs: dict[str, Any] = {"truncation": True, "max_length": max_length} if max_length else {}
        if text_pair is None:
            enc = self.tokenizer(text, **kwargs)
        else:
            if max_length:
                kwargs["truncation"] = "longest_first"
            enc = self.tokenizer(text, text_pair, **kwargs)
        return _prompt(text, enc["input_ids"], enc.get("token_type_ids"))

    @staticmethod
    def plain_text(prompt: Any, params: Any, text_pair: str | None) -> str | None:
        """The text of a prompt ``tokenize_batch`` tokenizes (a non-empty string or ``{"prompt": str}``, no text
        pair, with ``PoolingParams``), else None."""
        if isinstance(prompt, Mapping) and set(prompt) == {"prompt"}:
            prompt = prompt["prompt"]
        if text_pair is None and isinstance(prompt, str) and prompt and isinstance(params, PoolingParams):
            return prompt
        return None

    def tokenize_batch(self, items: list[tuple[Any, Any, str | None]]) -> list[Any]:
        """``items`` (prompt, params, text pair) with each plain text prompt (a non-empty string or
        ``{"prompt": str}``, no text pair) replaced by its ``PoolingPrompt``: one batched tokenizer call per
        truncation length, which a fast tokenizer runs in parallel, instead of one call per text. The same
        tokens as ``to_prompt``; anything else (token ids, pairs, bad input) is left for ``to_prompt``."""
        groups: dict[int | None, list[int]] = {}
        texts: dict[int, str] = {}
        for i, (prompt, params, pair) in enumerate(items):
            text = self.plain_text(prompt, params, pair)
            if text is not None:
                texts[i] = text
                groups.setdefault(self._truncation(params), []).append(i)
        out = [prompt for prompt, _, _ in items]
        for max_length, indices in groups.items():
            kwargs: dict[str, Any] = {"truncation": True, "max_length": max_length} if max_length else {}
            enc = self.tokenizer([texts[i] for i in indices], **kwargs)
            types = enc.get("token_type_ids")
            for j, i in enumerate(indices):
                out[i] = _prompt(texts[i], enc["input_ids"][j], types[j] if types else None)
        return out

    def _token_ids(self, ids: Any, field: str) -> list[int]:
        if not isinstance(ids, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids
        ):
            raise ValueError(f"{field} must be a list of token ids (ints)")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{field} contains ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        return list(ids)

    def to_prompt(self, prompt: Any, params: PoolingParams, text_pair: str | None = None) -> PoolingPrompt:
        """Tokenize (and truncate) one prompt: a string, a list of token ids, ``{"prompt": str}`` or
        ``{"prompt_token_ids": [...]}``; ``text_pair``: the second text of a cross-encoder pair."""
        max_length = self._truncation(params)
        if isinstance(prompt, PoolingPrompt):  # tokenized by tokenize_batch
            check_pooling_prompt(len(prompt.token_ids), self.max_model_len, self.max_num_batched_tokens)
            return prompt
        if isinstance(prompt, Mapping):
            unknown = set(prompt) - {"prompt", "prompt_token_ids"}
            if unknown:
                raise ValueError(
                    f"prompt: unknown keys {sorted(unknown)}; use 'prompt' or 'prompt_token_ids'"
                )
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("prompt: a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt or (text_pair is not None and not text_pair):
                raise ValueError("prompt must not be empty")
            out = self._tokenize(prompt, text_pair, max_length)
        elif isinstance(prompt, (list, tuple)):
            if text_pair is not None:
                raise ValueError("a text pair must be given as two strings")
            ids = self._token_ids(prompt, "prompt_token_ids")
            if max_length is not None:
                ids = ids[-max_length:]  # as vLLM: a token-id prompt keeps its last tokens
            out = PoolingPrompt(None, ids)
        else:
            raise ValueError(
                f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}"
            )
        check_pooling_prompt(len(out.token_ids), self.max_model_len, self.max_num_batched_tokens)
        return out

    def check_params(self, params: Any) -> None:
        """What ``process`` checks of ``params`` before it tokenizes: ``ValueError`` naming the field."""
        if not isinstance(params, PoolingParams):
            raise ValueError(f"pooling_params must be PoolingParams, got {type(params).__name__}")
        check_params(params, self.config.model_config.pooler_config)
        self._truncation(params)

    def process(
        self,
        request_id: str,
        prompt: Any,
        params: PoolingParams,
        arrival_time: float,
        text_pair: str | None = None,
        priority: int = 0,
    ) -> tuple[PoolingPrompt, EngineCoreRequest]:
        """Validate ``params`` against the model and tokenize; ``ValueError`` naming the field, nothing queued.
        ``priority``: its place under ``scheduling_policy="priority"`` (lower first), as for generation."""
        if not isinstance(params, PoolingParams):
            raise ValueError(f"pooling_params must be PoolingParams, got {type(params).__name__}")
        check_params(params, self.config.model_config.pooler_config)
        p = self.to_prompt(prompt, params, text_pair)
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=p.token_ids,
            sampling_params=None,
            eos_token_id=None,
            arrival_time=arrival_time,
            priority=priority,
            pooling_params=params,
            token_type_ids=p.token_type_ids,
        )
        return p, request
