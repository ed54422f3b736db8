"""``MultiModalFeature``: one image of a request as the engine core sees it (plain, picklable data).

A prompt holding images has each image's placeholder token expanded to as many tokens as the vision encoder
produces embeddings for it. Positions of one request (``offset`` = 5, ``length`` = 4)::

    prompt:  t0 t1 t2 t3 t4 <img> <img> <img> <img> t9 ...
    embeds:                 e0    e1    e2    e3          (the encoder's output rows for this image)

The model's input at position p in [offset, offset + length) is row p - offset of the image's embeddings instead
of the placeholder token's embedding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class MultiModalFeature:
    """One image: where its placeholder tokens lie in the prompt, its content hash, and the preprocessed
    tensors (numpy, float32) the model's encoder takes."""

    modality: str  # "image"
    mm_hash: str  # hex digest of the preprocessed pixels (same image + same preprocessing -> same hash)
    offset: int  # first placeholder token's position in the prompt
    length: int  # number of placeholder tokens = embeddings the encoder produces
    data: dict[str, Any] = field(default_factory=dict, repr=False)  # e.g. {"pixel_values": [3, H, W] ndarray}

    @property
    def end(self) -> int:
        return self.offset + self.length


def features_in_range(
    features: Sequence[MultiModalFeature], start: int, end: int
) -> list[tuple[int, MultiModalFeature]]:
    """``(index, feature)`` of each feature whose placeholder span overlaps positions [start, end)."""
    return [(i, f) for i, f in enumerate(features) if f.offset < end and f.end > start]


def block_extra_keys(
    features: Sequence[MultiModalFeature], block_index: int, block_size: int
) -> tuple[str, ...]:
    """The content hashes of the images whose placeholders overlap block ``block_index``: they go into the block's
    hash, so a block of placeholder tokens is shared only between requests with the same image there."""
    start = block_index * block_size
    end = start + block_size
    return tuple(f.mm_hash for f in features if f.offset < end and f.end > start)
