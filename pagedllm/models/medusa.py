"""Medusa heads (Cai et al., 2024) in the layouts published checkpoints use.

Each of ``num_heads`` heads reads the target's final hidden state ``h`` at position p (the one its LM head turns
into the token at p + 1) and predicts the token at p + 2 + i (head i): ``num_hidden_layers`` residual blocks
``x = x + silu(W x + b)``, then the head's own LM head ``[vocab, H]``. Proposals are a chain: head i's argmax is
draft i + 1, as vLLM proposes them (no tree).

Config (``config.json``): ``hidden_size``, ``vocab_size``, ``num_heads`` and ``num_hidden_layers`` (vLLM's
names), or FasterDecoding's ``medusa_num_heads`` / ``medusa_num_layers`` (their ``hidden_size`` / ``vocab_size``
default to the target's). ``original_lm_head: true`` (vLLM's name): every head shares one LM head, the
checkpoint's ``lm_head.weight`` or, when the checkpoint has none, the target's own.

Weights: ``blocks.{i}.layers.{j}.{weight,bias}`` + ``lm_heads.{i}.weight`` (vLLM's
layout) or FasterDecoding's ``medusa_head.{i}.{j}.linear.{weight,bias}`` (j < layers) + ``medusa_head.{i}.{L}.weight``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedllm.layers.linear import Linear


@dataclass
class MedusaConfig:
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_hidden_layers: int
    original_lm_head: bool = False

    @classmethod
    def from_dict(cls, raw: dict[str, Any], target_hidden: int, target_vocab: int) -> MedusaConfig:
        """Read either naming; ``ValueError`` naming ``speculative_config.model`` for a head that does not fit."""
        num_heads = raw.get("num_heads", raw.get("medusa_num_heads"))
        num_layers = raw.get("num_hidden_layers", raw.get("medusa_num_layers", 1))
        config = cls(
            int(raw.get("hidden_size", target_hidden)),
            int(raw.get("vocab_size", target_vocab)),
            int(num_heads) if num_heads is not None else 0,
            int(num_layers),
            bool(raw.get("original_lm_head", False)),
        )
        if config.num_heads < 1:
            raise ValueError("speculative_config.model: a Medusa config needs num_heads (or medusa_num_heads) >= 1")
        if config.num_hidden_layers < 0:
            raise ValueError("speculative_config.model: the Medusa heads' num_hidden_layers must be >= 0")
        if config.hidden_size != target_hidden:
            raise ValueError(
                f"speculative_config.model: the Medusa heads' hidden_size ({config.hidden_size}) differs from "
                f"the target's ({target_hidden})"
            )
        if config.vocab_size != target_vocab:
            raise ValueError(
                f"speculative_config.model: the Medusa heads' vocab_size ({config.vocab_size}) differs from the "
                f"target's ({target_vocab})"
            )
        return config


class ResidualBlock(nn.Module):
    def __init__(self, hidden: int, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Linear(hidden, hidden, bias=True) for _ in range(num_layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + nn.functional.silu(layer(x))
        return x


class MedusaHeads(nn.Module):
    """``forward(hidden [n, H]) -> logits [num_heads, n, vocab]`` (float32). With ``original_lm_head`` every head
    uses ``lm_head`` (the checkpoint's copy) or, without one, ``target_lm_head`` (the target's ``compute_logits``,
    set by the proposer); else each head has its own ``lm_heads[i]``."""

    def __init__(self, config: MedusaConfig, with_lm_head_copy: bool = False) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.blocks = nn.ModuleList([ResidualBlock(h, config.num_hidden_layers) for _ in range(config.num_heads)])
        self.lm_head = Linear(h, config.vocab_size, bias=False) if with_lm_head_copy else None
        if not config.original_lm_head:
            self.lm_heads = nn.ModuleList([Linear(h, config.vocab_size, bias=False) for _ in range(config.num_heads)])
        self.target_lm_head: Any = None

    def forward(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        heads = range(self.config.num_heads if num_heads is None else num_heads)
        if self.config.original_lm_head:
            shared = self.lm_head if self.lm_head is not None else self.target_lm_head
            return torch.stack([shared(self.blocks[i](hidden)).float() for i in heads])
        return torch.stack([self.lm_heads[i](self.blocks[i](hidden)).float() for i in heads])


_FASTER_DECODING = re.compile(r"^medusa_head\.(\d+)\.(\d+)\.(?:linear\.)?(weight|bias)$")


def medusa_weight_names(
    weights: Iterator[tuple[str, torch.Tensor]], num_layers: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint names in FasterDecoding's layout mapped to ``MedusaHeads``' (others pass through)."""
    for name, tensor in weights:
        m = _FASTER_DECODING.match(name)
        if m is not None:
            head, j, kind = int(m.group(1)), int(m.group(2)), m.group(3)
            name = f"lm_heads.{head}.weight" if j == num_layers else f"blocks.{head}.layers.{j}.{kind}"
        yield name, tensor
