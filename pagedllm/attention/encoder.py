"""Bidirectional attention for encoder (pooling) models: every token of a request sees every token of it.

No KV cache: a pooling request runs its whole prompt in one step, so keys and values live only for that step.
On CUDA the step's ragged requests go to PyTorch's variable-length fused kernels (FlashAttention for 16-bit types,
the memory-efficient kernel for float32), over the real tokens only. On the CPU they are padded into one
``[num_reqs, max_len]`` batch with a key mask for the padding, then flattened back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)
_VARLEN_OK: dict[int | None, bool] = {}  # per CUDA device: False once the fused kernels failed there


@dataclass
class PoolingBatch:
    """The layout of one pooling step's flattened tokens (built once a step by the pooling runner), and what a
    pooling model's forward reads besides token ids and positions."""

    cu: np.ndarray  # [num_reqs + 1] int64, host: cumulative prompt lengths
    max_len: int  # longest prompt this step
    min_len: int  # shortest prompt this step
    cu_device: torch.Tensor  # [num_reqs + 1] int32, device: ``cu``
    token_index: torch.Tensor  # [num_tokens] int64, device: flat row of each token in [num_reqs * max_len]
    key_mask: torch.Tensor  # [num_reqs, 1, 1, max_len] bool, device: True where a key is a real token
    token_type_ids: torch.Tensor | None = None  # [num_tokens] int64 (BERT's segment ids; None: all 0)
    # Decoder models: their paged attention writes the step's keys into scratch caches (one per layer) and reads
    # them back through this metadata; nothing is kept after the step.
    kv_caches: list[torch.Tensor] | None = None
    attn_metadata: Any = None  # AttentionMetadata

    owner: torch.Tensor | None = None  # [num_tokens] int64, device: the request each token belongs to

    @classmethod
    def build(
        cls,
        cu: np.ndarray,
        device: torch.device,
        upload: Callable[[np.ndarray], torch.Tensor] | None = None,
        positions: np.ndarray | None = None,
    ) -> PoolingBatch:
        """``upload``: how a host array reaches ``device`` (default: a plain copy); ``positions``: each token's
        position in its request, when the caller has them already."""
        if upload is None:
            upload = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
        lens = np.diff(cu)  # [num_reqs]
        max_len = int(lens.max())
        num_reqs = len(lens)
        owner = np.repeat(np.arange(num_reqs), lens)  # [num_tokens]
        if positions is None:
            positions = np.arange(int(cu[-1])) - np.repeat(
                cu[:-1], lens
            )  # [num_tokens] position in its request
        key_mask = upload(np.arange(max_len)[None, :] < lens[:, None])  # [num_reqs, max_len]
        return cls(
            cu,
            max_len,
            int(lens.min()),
            upload(cu.astype(np.int32)),
            upload(owner * max_len + positions),
            key_mask[:, None, None, :],
            owner=upload(owner),
        )


def encoder_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    batch: PoolingBatch,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    num_tokens, num_heads, head_dim = query.shape
    num_reqs = len(batch.cu) - 1
    if query.is_cuda and _VARLEN_OK.get(query.device.index, True):
        try:
            return varlen_attention(query, key, value, batch, scale)
        except RuntimeError as e:  # a build or GPU without the fused kernels: pad from now on
            logger.warning("variable-length attention unavailable (%s); padding the batch instead", e)
            _VARLEN_OK[query.device.index] = False

    def padded(x: torch.Tensor) -> torch.Tensor:  # [num_tokens, H, D] -> [num_reqs, H, max_len, D]
        out = x.new_zeros(num_reqs * batch.max_len, num_heads, head_dim)
        out[batch.token_index] = x
        return out.view(num_reqs, batch.max_len, num_heads, head_dim).transpose(1, 2)

    out = F.scaled_dot_product_attention(
        padded(query), padded(key), padded(value), attn_mask=batch.key_mask, scale=scale
    )  # [num_reqs, H, max_len, D]
    out = out.transpose(1, 2).reshape(num_reqs * batch.max_len, num_heads, head_dim)
    return out[batch.token_index]


def varlen_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], CUDA
    key: torch.Tensor,
    value: torch.Tensor,
    batch: PoolingBatch,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """``encoder_attention`` without padding: each request's tokens attend to its own, through PyTorch's
    variable-length kernels (the ones its nested-tensor attention calls), given the step's cumulative lengths."""
    cu, n = batch.cu_device, batch.max_len
    if query.dtype in (torch.float16, torch.bfloat16):
        out = torch.ops.aten._flash_attention_forward(
            query, key, value, cu, cu, n, n, 0.0, False, False, scale=scale
        )[0]
        return out
    out = torch.ops.aten._efficient_attention_forward(
        query[None], key[None], value[None], None, cu, cu, n, n, 0.0, 0, scale=scale
    )[0]
    return out[0]
