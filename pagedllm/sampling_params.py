"""Per-request generation settings, with vLLM's names and defaults, validated on construction."""

from __future__ import annotations

import copy
import enum
import json
from dataclasses import dataclass, field
from typing import Any


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output holds everything generated so far
    DELTA = 1  # every output holds only what is new since the last one
    FINAL_ONLY = 2  # one output, when the request finishes


_EPS = 1e-5

_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """One output constraint (vLLM's names): a JSON schema, a regex, a choice of strings, an EBNF grammar, or any
    JSON object. Exactly one must be set. Whether the constraint itself is well formed (a schema xgrammar
    supports, a regex that parses) is checked by the engine when the request is added."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False  # JSON without free whitespace between tokens (compact output)

    def __post_init__(self) -> None:
        given = [name for name in _CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, json_object; "
                f"got {given or 'none'}"
            )
        kind = given[0]
        if kind == "json" and not isinstance(self.json, (str, dict)):
            raise ValueError(
                f"structured_outputs.json must be a JSON schema (dict or str), got {self.json!r}"
            )
        if kind in ("regex", "grammar") and not (
            isinstance(getattr(self, kind), str) and getattr(self, kind)
        ):
            raise ValueError(f"structured_outputs.{kind} must be a non-empty string")
        if kind == "choice" and not (
            isinstance(self.choice, (list, tuple))
            and self.choice
            and all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError(
                f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}"
            )
        if kind == "json_object" and self.json_object is not True:
            raise ValueError("structured_outputs.json_object must be true")
        if kind == "choice":
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        """Which constraint is set: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(name for name in _CONSTRAINTS if getattr(self, name) not in (None, False))

    def key(self) -> tuple[str, str, bool]:
        """A hashable identity of the constraint (equal keys compile to the same grammar)."""
        value = getattr(self, self.kind)
        if isinstance(value, (dict, list)):
            value = json.dumps(value, sort_keys=True, ensure_ascii=False)
        return (self.kind, str(value), self.disable_any_whitespace)


# vLLM's older name for the same settings (``SamplingParams(guided_decoding=GuidedDecodingParams(...))``).
GuidedDecodingParams = StructuredOutputsParams


@dataclass
class SamplingParams:
    """What to generate for one request. Invalid values raise ``ValueError`` naming the field."""

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None  # vLLM's older name; moved to structured_outputs
    # Filled in by the engine: token ids of `bad_words`, one list per word.
    _bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)
    extra_args: dict[str, Any] | None = None
    # Disaggregated prefill/decode (pagedllm/kv_transfer/p2p.py): {"do_remote_decode": true} on the prefill
    # instance; the handle its output returns, on the decode instance. vLLM also reads it from
    # extra_args["kv_transfer_params"]; either works.
    kv_transfer_params: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.kv_transfer_params is None and self.extra_args and "kv_transfer_params" in self.extra_args:
            self.kv_transfer_params = self.extra_args["kv_transfer_params"]
        if self.kv_transfer_params is not None and not isinstance(self.kv_transfer_params, dict):
            raise ValueError(f"kv_transfer_params must be a dict, got {type(self.kv_transfer_params).__name__}")
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.bad_words = list(self.bad_words or [])
        if self.logit_bias is not None:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError, AttributeError) as e:
                raise ValueError(f"logit_bias must map token ids to floats, got {self.logit_bias!r}") from e
        if self.top_k == -1:
            self.top_k = 0
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise ValueError("set structured_outputs or guided_decoding, not both")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            if not isinstance(self.structured_outputs, dict):
                raise ValueError(
                    f"structured_outputs must be a StructuredOutputsParams, got {self.structured_outputs!r}"
                )
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:
                raise ValueError(f"structured_outputs: {e}") from e
        if self.best_of is None:
            self.best_of = self.n
        self._verify()
        if self.temperature < _EPS:
            # Greedy: the other sampling knobs do not apply.
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0

    def _verify(self) -> None:
        def need(cond: bool, name: str, msg: str) -> None:
            if not cond:
                raise ValueError(f"{name} {msg}, got {getattr(self, name)!r}.")

        def is_int(x: Any) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        need(is_int(self.n) and self.n >= 1, "n", "must be an integer >= 1")
        need(
            is_int(self.best_of) and self.best_of >= self.n, "best_of", f"must be an integer >= n ({self.n})"
        )
        need(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        need(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        need(self.repetition_penalty > 0.0, "repetition_penalty", "must be > 0")
        need(self.temperature >= 0.0, "temperature", "must be non-negative")
        need(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        need(
            is_int(self.top_k) and self.top_k >= 0, "top_k", "must be -1 (disable), 0 (disable) or at least 1"
        )
        need(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        need(self.seed is None or is_int(self.seed), "seed", "must be an integer or None")
        need(
            self.max_tokens is None or (is_int(self.max_tokens) and self.max_tokens >= 1),
            "max_tokens",
            "must be at least 1",
        )
        need(is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None:
            need(
                self.min_tokens <= self.max_tokens, "min_tokens", f"must be <= max_tokens ({self.max_tokens})"
            )
        need(
            self.logprobs is None or (is_int(self.logprobs) and self.logprobs >= 0),
            "logprobs",
            "must be >= 0",
        )
        need(
            self.prompt_logprobs is None or (is_int(self.prompt_logprobs) and self.prompt_logprobs >= 0),
            "prompt_logprobs",
            "must be >= 0",
        )
        need(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        need(all(is_int(t) for t in self.stop_token_ids), "stop_token_ids", "must be integers")
        need(all(isinstance(w, str) for w in self.bad_words), "bad_words", "must be strings")
        if self.allowed_token_ids is not None:
            need(
                len(self.allowed_token_ids) > 0 and all(is_int(t) for t in self.allowed_token_ids),
                "allowed_token_ids",
                "must be a non-empty list of token ids",
            )
        if self.logit_bias:
            need(
                all(-100.0 <= v <= 100.0 for v in self.logit_bias.values()),
                "logit_bias",
                "values must be in [-100, 100]",
            )

    @property
    def sampling_type_greedy(self) -> bool:
        return self.temperature < _EPS

    def verify_vocab(self, vocab_size: int) -> None:
        """Raise ``ValueError`` if a token id given in these params is outside ``[0, vocab_size)``."""
        for name in ("stop_token_ids", "allowed_token_ids"):
            ids = getattr(self, name) or []
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(
                    f"{name} contains token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}"
                )
        if self.logit_bias:
            bad = [t for t in self.logit_bias if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(
                    f"logit_bias contains token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}"
                )

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)
