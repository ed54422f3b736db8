"""The Attention layer: hands q/k/v, this layer's KV cache and the step's metadata to the backend."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention.base import AttentionBackend, AttentionMetadata


class Attention(nn.Module):
    """Paged causal self-attention over already-projected, already-rotated q/k/v.

    Holds no weights. The backend writes k/v into ``kv_cache`` at ``metadata.slot_mapping`` and attends.
    ``sliding_window`` (this layer's window W, or None) and ``logits_soft_cap`` (or None) are fixed per layer and
    handed to the backend each call; see ``pagedllm/attention/base.py`` for their exact meaning.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int,
        attn_backend: AttentionBackend,
        layer_idx: int,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window!r}")
        if logits_soft_cap is not None and logits_soft_cap <= 0:
            raise ValueError(f"logits_soft_cap must be > 0 or None, got {logits_soft_cap!r}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.layer_idx = layer_idx
        self.attn_backend = attn_backend
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap

    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        return self.attn_backend.forward(
            query,
            key,
            value,
            kv_cache,
            attn_metadata,
            self.scale,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap,
        )

    def extra_repr(self) -> str:
        return (
            f"layer={self.layer_idx}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, backend={self.attn_backend.name}"
            + (f", sliding_window={self.sliding_window}" if self.sliding_window else "")
            + (f", logits_soft_cap={self.logits_soft_cap}" if self.logits_soft_cap else "")
        )
