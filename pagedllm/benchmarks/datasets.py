"""Synthetic benchmark prompts shared by `pagedllm bench serve | throughput | latency`.

``random_token_prompts`` follows vLLM's "random" dataset: every request draws its input and output lengths
uniformly from ``[len * (1 - range_ratio), len * (1 + range_ratio)]`` and its prompt is a run of consecutive token
ids starting at a random offset (``(offset + i + j) % vocab``), so prompts differ from each other and do not share
a prefix by accident. Token ids are drawn from the non-special part of the vocabulary when a tokenizer is given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class SampleRequest:
    """One benchmark request: the prompt as token ids (exact length), and how many tokens to ask for."""

    prompt_token_ids: list[int]
    prompt_len: int
    expected_output_len: int
    prompt: str | None = None  # the decoded text, when the caller asked for text prompts


def _length_range(length: int, range_ratio: float, name: str) -> tuple[int, int]:
    if length < 1:
        raise ValueError(f"{name} must be >= 1, got {length}")
    low = max(1, int(length * (1.0 - range_ratio)))
    high = max(low, int(length * (1.0 + range_ratio)))
    return low, high


def _usable_token_ids(tokenizer_or_vocab: Any) -> np.ndarray:
    """Token ids a random prompt may use: the whole vocabulary for an int, non-special ids for a tokenizer."""
    if isinstance(tokenizer_or_vocab, (int, np.integer)):
        if tokenizer_or_vocab < 1:
            raise ValueError(f"vocab size must be >= 1, got {tokenizer_or_vocab}")
        return np.arange(int(tokenizer_or_vocab))
    tok = tokenizer_or_vocab
    vocab_size = len(tok)
    special = {int(t) for t in (getattr(tok, "all_special_ids", None) or []) if t is not None}
    ids = np.array([i for i in range(vocab_size) if i not in special])
    if ids.size == 0:
        raise ValueError("the tokenizer has no non-special tokens to build prompts from")
    return ids


def random_token_prompts(
    tokenizer_or_vocab: Any,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
    *,
    decode: bool = False,
) -> list[SampleRequest]:
    """``num_prompts`` random prompts (vLLM's random dataset semantics, see the module docstring).

    ``tokenizer_or_vocab`` is a HF tokenizer or a vocabulary size. With ``decode=True`` (needs a tokenizer) each
    request also carries its prompt as text; re-tokenizing that text may give a slightly different length.
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    usable = _usable_token_ids(tokenizer_or_vocab)
    rng = np.random.default_rng(seed)
    in_low, in_high = _length_range(input_len, range_ratio, "input_len")
    out_low, out_high = _length_range(output_len, range_ratio, "output_len")
    input_lens = rng.integers(in_low, in_high + 1, size=num_prompts)
    output_lens = rng.integers(out_low, out_high + 1, size=num_prompts)
    offsets = rng.integers(0, usable.size, size=num_prompts)
    requests = []
    for i in range(num_prompts):
        positions = (offsets[i] + i + np.arange(input_lens[i])) % usable.size
        token_ids = usable[positions].tolist()
        text = None
        if decode:
            if isinstance(tokenizer_or_vocab, (int, np.integer)):
                raise ValueError("decode=True needs a tokenizer, not a vocabulary size")
            text = tokenizer_or_vocab.decode(token_ids)
        requests.append(
            SampleRequest(
                prompt_token_ids=token_ids,
                prompt_len=len(token_ids),
                expected_output_len=int(output_lens[i]),
                prompt=text,
            )
        )
    return requests
