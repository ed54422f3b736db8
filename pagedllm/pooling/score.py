"""Pairing texts for scoring (vLLM's rules), shared by ``LLM.score`` and the server's /score and /rerank."""

from __future__ import annotations

from collections.abc import Sequence


def score_pairs(
    data_1: str | Sequence[str], data_2: str | Sequence[str], names: tuple[str, str] = ("data_1", "data_2")
) -> list[tuple[str, str]]:
    """One text against each of a list (either side), or two lists pairwise. ``ValueError`` naming the side
    (``names``) on empty input, a non-string, or lists of different lengths."""
    side_1 = [data_1] if isinstance(data_1, str) else list(data_1)
    side_2 = [data_2] if isinstance(data_2, str) else list(data_2)
    for name, side in zip(names, (side_1, side_2)):
        if not side:
            raise ValueError(f"{name} must not be empty")
        if not all(isinstance(t, str) for t in side):
            raise ValueError(f"{name} must be a string or a list of strings")
        if not all(side):
            raise ValueError(f"{name} must not contain empty strings")
    if len(side_1) == 1:
        side_1 = side_1 * len(side_2)
    elif len(side_2) == 1:
        side_2 = side_2 * len(side_1)
    if len(side_1) != len(side_2):
        raise ValueError(
            f"{names[0]} and {names[1]} must have the same length, or one of them one text: got {len(side_1)} "
            f"and {len(side_2)}"
        )
    return list(zip(side_1, side_2))
