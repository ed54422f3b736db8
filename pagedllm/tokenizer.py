"""Loading a Hugging Face tokenizer, plus the few calls the engine makes on one.

transformers 5 returns ``TokenizersBackend`` for fast tokenizers (``PreTrainedTokenizerFast`` is an alias of it);
transformers 4 returns ``PreTrainedTokenizerFast`` or a slow ``PreTrainedTokenizer``. Everything here works with
all three: fast ones are decoded through their Rust ``backend_tokenizer`` (no Python post-processing), the rest
through ``tokenizer.decode``.
"""

from __future__ import annotations

from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

AnyTokenizer = PreTrainedTokenizerBase


def get_tokenizer(name_or_path: str, trust_remote_code: bool = False, **kwargs: Any) -> AnyTokenizer:
    """Load the tokenizer at ``name_or_path`` (a local directory or a hub id) with ``AutoTokenizer``.

    Extra keyword arguments go to ``AutoTokenizer.from_pretrained`` (``revision``, ``use_fast``...).
    Raises ``ValueError`` saying what was tried when nothing usable loads.
    """
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code, **kwargs)
    except Exception as e:
        raise ValueError(
            f"could not load a tokenizer from {name_or_path!r} ({type(e).__name__}: {e}); pass a directory or hub "
            "id that holds tokenizer files (tokenizer.json or tokenizer.model with tokenizer_config.json)"
        ) from e
    if not isinstance(tokenizer, PreTrainedTokenizerBase):
        raise ValueError(
            f"{name_or_path!r} loaded as {type(tokenizer).__name__}, which is not a text tokenizer"
        )
    return tokenizer


def _fast_backend(tokenizer: AnyTokenizer) -> Any | None:
    """The Rust ``tokenizers.Tokenizer`` behind ``tokenizer`` when decoding through it equals
    ``tokenizer.decode(..., clean_up_tokenization_spaces=False)``, else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not getattr(tokenizer, "is_fast", False):
        return None
    # A subclass that overrides decode/_decode post-processes the text; go through it then.
    for cls in type(tokenizer).__mro__:
        if "_decode" in vars(cls) or "decode" in vars(cls):
            return backend if cls.__name__ in ("TokenizersBackend", "PreTrainedTokenizerFast") else None
    return None


def make_decode_fn(
    tokenizer: AnyTokenizer, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True
) -> Any:
    """Return ``decode(token_ids: list[int]) -> str`` with these options fixed and no tokenization clean-up.

    Fast tokenizers ignore ``spaces_between_special_tokens`` (as in transformers and vLLM); slow ones honor it.
    """
    backend = _fast_backend(tokenizer)
    if backend is not None:

        def decode_fast(token_ids: list[int]) -> str:
            return backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

        return decode_fast

    def decode_slow(token_ids: list[int]) -> str:
        kwargs: dict[str, Any] = {"clean_up_tokenization_spaces": False}
        if not getattr(tokenizer, "is_fast", False):
            kwargs["spaces_between_special_tokens"] = spaces_between_special_tokens
        return tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs)

    return decode_slow


class TokenTextCache:
    """Text of single tokens (``decode([token_id])``, specials kept), memoized: what logprobs show per candidate."""

    def __init__(self, tokenizer: AnyTokenizer) -> None:
        self._decode = make_decode_fn(tokenizer, skip_special_tokens=False)
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            try:
                text = self._decode([token_id])
            except Exception:  # an id past the tokenizer's vocabulary (padded embedding rows)
                text = ""
            self._cache[token_id] = text
        return text
