"""Triton attention backend: write this step's keys/values into the paged cache, then paged attention.

Two launches per layer (one when the RoPE kernel already wrote the cache: ``kv_written``, Attention.kv_write; split-K
merges inside the attention kernel), no host syncs: everything the launchers size their grids from is a Python int
already in :class:`AttentionMetadata`. See
``pagedllm/kernels/paged_attention.py`` for what the grid depends on (CUDA-graph capture).

Mixed steps (prefill chunks and decodes together) whose batch starts with decodes, as the scheduler's order
(running requests first) gives, attend in two launches: the leading decodes with the decode tiles (16 rows, one
token's query heads; split-K when it pays), the rest with the prefill tiles. One launch for all would give each
decode a prefill-sized tile (64 rows, of which only its ``group`` heads are real): the same keys read, but
several times the tensor-core and softmax work, which makes the decodes of a mixed step compute-bound.
"""

from __future__ import annotations

import torch

from pagedllm.attention.base import AttentionMetadata, split_leading_decodes
from pagedllm.kernels.paged_attention import paged_attention
from pagedllm.kernels.reshape_and_cache import reshape_and_cache


class TritonAttentionBackend:
    name = "triton"
    # The RoPE kernels may write this step's keys and values into the cache themselves (Attention.kv_write):
    # forward(kv_written=True) then skips its own write, one launch per layer fewer.
    accepts_written_kv = True

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        sinks: torch.Tensor | None = None,  # [num_heads]
        kv_written: bool = False,  # this step's keys and values are already in kv_cache
        out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]: write here (else a new tensor)
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]; padding rows (past metadata.num_tokens) zero
        full_out = None
        n = metadata.num_tokens
        if query.shape[0] > n:
            # Padded rows (piecewise graphs): attend over the real rows only, with the grid an eager step of these
            # requests gets (same tiles, same split-K choice, same results); the padding rows come out zero.
            full_out = torch.empty_like(query) if out is None else out
            query, key, value, out = query[:n], key[:n], value[:n], full_out[:n]
        if not kv_written:
            reshape_and_cache(key, value, kv_cache, metadata.slot_mapping, k_scale, v_scale)
        options = dict(
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
            k_scale=k_scale,
            v_scale=v_scale,
            sinks=sinks,
        )
        split = (
            None
            if metadata.is_pure_decode
            else metadata.derived("leading_decodes", lambda: split_leading_decodes(metadata))
        )
        if split is None:
            out = paged_attention(
                query,
                kv_cache,
                metadata.block_table,
                metadata.seq_lens,
                metadata.query_start_loc,
                scale,
                metadata.num_reqs,
                metadata.max_query_len,
                metadata.max_seq_len,
                out=out,
                **options,
            )
        else:
            d = split.d
            out = torch.empty_like(query) if out is None else out
            paged_attention(
                query[:d],
                kv_cache,
                metadata.block_table[:d],
                metadata.seq_lens[:d],
                metadata.query_start_loc[: d + 1],
                scale,
                d,
                1,
                split.decode_max_seq_len,
                out=out[:d],
                **options,
            )
            paged_attention(
                query[d:],
                kv_cache,
                split.rest_block_table,
                split.rest_seq_lens,
                split.rest_query_start_loc,
                scale,
                metadata.num_reqs - d,
                metadata.max_query_len,
                split.rest_max_seq_len,
                out=out[d:],
                **options,
            )
        if full_out is not None:
            full_out[n:].zero_()
            return full_out
        return out
