"""NgramProposer: vLLM's prompt-lookup rule, checked by hand-made cases and against a brute-force reference."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.spec_decode import NgramProposer


def reference_propose(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The rule as stated: longest n first, earliest occurrence ending before the final position."""
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= length:
            continue
        pattern = tokens[length - n :]
        for start in range(0, length - n):  # occurrence ends at start + n - 1 <= length - 2
            if tokens[start : start + n] == pattern:
                return tokens[start + n : start + n + k]
    return []


def propose(tokens: list[int], k: int = 3, min_n: int = 1, max_n: int = 4) -> list[int]:
    out = NgramProposer(k, min_n, max_n).propose(np.array(tokens, dtype=np.int64))
    assert out.dtype == np.int64 and out.ndim == 1
    return out.tolist()


def test_repeat_found() -> None:
    assert propose([1, 2, 3, 4, 5, 1, 2, 3]) == [4, 5, 1]


def test_longest_n_wins() -> None:
    # Suffix [7, 8, 9]: the 1-gram [9] first occurs at index 0 (followed by 50), but the 3-gram [7, 8, 9]
    # occurs at 4..6 (followed by 60, 61); the longer pattern wins.
    tokens = [9, 50, 51, 8, 7, 8, 9, 60, 61, 7, 8, 9]
    assert propose(tokens, k=2, max_n=3) == [60, 61]
    # Limiting the pattern length to 1 finds the earliest [9] instead.
    assert propose(tokens, k=2, max_n=1) == [50, 51]


def test_earliest_occurrence_wins() -> None:
    tokens = [5, 6, 10, 11, 5, 6, 20, 21, 5, 6]
    assert propose(tokens, k=2, min_n=2, max_n=2) == [10, 11]


def test_overlapping_occurrence_counts() -> None:
    # [1, 1] occurs at 0..1, which overlaps the suffix 1..2 but ends before the final position.
    assert propose([1, 1, 1], k=3, min_n=2, max_n=2) == [1]


def test_fewer_than_k_tokens_available() -> None:
    # The only earlier [3, 4] is followed by just 2 tokens before the history ends.
    assert propose([0, 3, 4, 3, 4], k=5, min_n=2, max_n=2) == [3, 4]


def test_no_match() -> None:
    assert propose([1, 2, 3, 4, 5]) == []
    assert propose([1, 2, 3, 1, 2, 4], min_n=2) == []  # [2, 4] and [4] never occurred before


def test_history_shorter_than_n() -> None:
    assert propose([], min_n=1) == []
    assert propose([7], min_n=1) == []
    assert propose([7, 7], min_n=2, max_n=4) == []  # a 2-gram needs an earlier occurrence: 3+ tokens
    assert propose([7, 7], min_n=1, max_n=4) == [7]


def test_k_equals_one() -> None:
    assert propose([1, 2, 3, 1, 2], k=1) == [3]


def test_min_n_is_respected() -> None:
    tokens = [1, 9, 2, 3, 1]  # only the 1-gram [1] repeats
    assert propose(tokens, min_n=1) == [9, 2, 3]
    assert propose(tokens, min_n=2) == []


def test_accepts_lists_and_batch() -> None:
    proposer = NgramProposer(2)
    outs = proposer.propose_batch([np.array([1, 2, 1]), [4, 5, 6], np.array([], dtype=np.int64)])
    assert [o.tolist() for o in outs] == [[2, 1], [], []]
    assert all(o.dtype == np.int64 for o in outs)


def test_result_is_a_copy() -> None:
    tokens = np.array([1, 2, 3, 1], dtype=np.int64)
    out = NgramProposer(2).propose(tokens)
    out[:] = 0
    assert tokens.tolist() == [1, 2, 3, 1]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_max"),
    ],
)
def test_bad_config(kwargs: dict[str, int], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        NgramProposer(**kwargs)


def test_rejects_non_1d() -> None:
    with pytest.raises(ValueError, match="1-D"):
        NgramProposer(2).propose(np.zeros((2, 3), dtype=np.int64))


@settings(max_examples=100, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), max_size=40),
    k=st.integers(1, 5),
    min_n=st.integers(1, 4),
    extra=st.integers(0, 3),
)
def test_matches_reference(tokens: list[int], k: int, min_n: int, extra: int) -> None:
    max_n = min_n + extra
    assert propose(tokens, k, min_n, max_n) == reference_propose(tokens, k, min_n, max_n)


def test_fast_on_long_history() -> None:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 32000, size=4096, dtype=np.int64)
    tokens[-3:] = tokens[100:103]  # a 3-gram match far back, so every pattern length is tried
    proposer = NgramProposer(5, 1, 4)
    assert proposer.propose(tokens).tolist() == tokens[103:108].tolist()
    calls = 200
    start = time.perf_counter()
    for _ in range(calls):
        proposer.propose(tokens)
    per_call = (time.perf_counter() - start) / calls
    assert per_call < 2e-3, f"{per_call * 1e3:.3f} ms per call"
