"""Pure-PyTorch paged attention: the CPU path and the oracle that faster kernels are tested against.

Written for clarity first: one loop over requests (driven by host-side lengths), each request's context
gathered through its block table, then a masked SDPA in float32. See ``base.py`` for the cache layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.attention.base import AttentionMetadata


def write_kv_cache_ref(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], contiguous
    slot_mapping: torch.Tensor,  # [>= T] int64; slot = block_id * block_size + offset, -1 = skip
) -> None:
    """Write token ``t``'s key/value into flat slot ``slot_mapping[t]``; entries equal to -1 are skipped.

    (The boolean mask makes this sync with the host on CUDA; fine for a reference.)
    """
    num_tokens = key.shape[0]
    slots = slot_mapping[:num_tokens]  # [T]
    valid = slots >= 0  # [T]
    key_cache = kv_cache[0].view(
        -1, *kv_cache.shape[-2:]
    )  # [num_blocks * block_size, num_kv_heads, head_dim]
    value_cache = kv_cache[1].view(
        -1, *kv_cache.shape[-2:]
    )  # [num_blocks * block_size, num_kv_heads, head_dim]
    valid_slots = slots[valid]  # [num_valid]
    key_cache[valid_slots] = key[valid].to(key_cache.dtype)
    value_cache[valid_slots] = value[valid].to(value_cache.dtype)


def _paged_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_reqs, max_blocks_per_req]
    seq_lens: list[int],  # [num_reqs] context length of each request (its keys already in the cache)
    query_start_loc: list[int],  # [num_reqs + 1]
    scale: float,
) -> torch.Tensor:  # [T, num_heads, head_dim]; rows past query_start_loc[-1] (padding) are zero
    num_heads = query.shape[1]
    block_size, num_kv_heads, head_dim = key_cache.shape[1:]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    group = num_heads // num_kv_heads
    acc_dtype = torch.promote_types(query.dtype, torch.float32)  # float32, or float64 when given float64
    out = torch.zeros_like(query)  # [T, num_heads, head_dim]
    decodes = [r for r, s in enumerate(seq_lens) if query_start_loc[r + 1] - query_start_loc[r] == 1]
    if len(decodes) > 1:
        _decode_batched(
            query, key_cache, value_cache, block_table, seq_lens, query_start_loc, decodes, scale, out
        )
    decode_set = set(decodes) if len(decodes) > 1 else set()
    for r, seq_len in enumerate(seq_lens):
        q_start, q_end = query_start_loc[r], query_start_loc[r + 1]
        query_len = q_end - q_start
        if query_len == 0 or r in decode_set:
            continue
        if query_len > seq_len:
            raise ValueError(f"request {r}: query_len {query_len} > seq_len {seq_len}")
        num_blocks = (seq_len + block_size - 1) // block_size
        block_ids = block_table[r, :num_blocks].long()  # [num_blocks]
        k = key_cache[block_ids].flatten(0, 1)[:seq_len]  # [seq_len, num_kv_heads, head_dim]
        v = value_cache[block_ids].flatten(0, 1)[:seq_len]  # [seq_len, num_kv_heads, head_dim]
        # GQA: query head h reads kv head h // group.
        k = k.to(acc_dtype).repeat_interleave(group, dim=1).transpose(0, 1)  # [num_heads, seq_len, head_dim]
        v = v.to(acc_dtype).repeat_interleave(group, dim=1).transpose(0, 1)  # [num_heads, seq_len, head_dim]
        q = query[q_start:q_end].to(acc_dtype).transpose(0, 1)  # [num_heads, query_len, head_dim]
        # Query i sits at position seq_len - query_len + i and sees keys at positions <= it.
        if query_len == 1:  # a decode sees the whole context: no mask needed
            mask = None
        else:
            q_pos = torch.arange(seq_len - query_len, seq_len, device=query.device)  # [query_len]
            k_pos = torch.arange(seq_len, device=query.device)  # [seq_len]
            mask = k_pos[None, :] <= q_pos[:, None]  # [query_len, seq_len], True = attend
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale
        )  # [num_heads, query_len, head_dim]
        out[q_start:q_end] = o.transpose(0, 1).to(out.dtype)
    return out


def _decode_batched(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_reqs, max_blocks_per_req]
    seq_lens: list[int],
    query_start_loc: list[int],
    reqs: list[int],  # requests with exactly one query token
    scale: float,
    out: torch.Tensor,  # [T, num_heads, head_dim], written at those requests' rows
) -> None:
    """All one-token queries in one padded SDPA call (the CPU decode path): keys past a request's length masked."""
    block_size, num_kv_heads, head_dim = key_cache.shape[1:]
    num_heads = query.shape[1]
    acc_dtype = torch.promote_types(query.dtype, torch.float32)
    lens = torch.tensor([seq_lens[r] for r in reqs])  # [R]
    max_len = int(lens.max())
    num_blocks = (max_len + block_size - 1) // block_size
    rows = torch.tensor(reqs, device=block_table.device)
    tokens = torch.tensor([query_start_loc[r] for r in reqs], device=query.device)  # [R]
    blocks = block_table[rows, :num_blocks].long()  # [R, num_blocks]
    # Entries past a request's own blocks are not its blocks (padding, possibly invalid ids): read block 0 there
    # instead (masked out below).
    own = (
        torch.arange(num_blocks)[None, :] < ((lens + block_size - 1) // block_size)[:, None]
    )  # [R, num_blocks]
    blocks = blocks.masked_fill(~own.to(blocks.device), 0)
    k = key_cache[blocks].flatten(1, 2)[:, :max_len].to(acc_dtype)  # [R, L, num_kv_heads, head_dim]
    v = value_cache[blocks].flatten(1, 2)[:, :max_len].to(acc_dtype)  # [R, L, num_kv_heads, head_dim]
    mask = torch.arange(max_len, device=query.device)[None, :] < lens.to(query.device)[:, None]  # [R, L]
    # Slots past a request's length may hold anything (NaN in a fresh or poisoned cache); 0 * NaN would leak.
    k = k.masked_fill(~mask[:, :, None, None], 0.0).transpose(1, 2)  # [R, num_kv_heads, L, head_dim]
    v = v.masked_fill(~mask[:, :, None, None], 0.0).transpose(1, 2)  # [R, num_kv_heads, L, head_dim]
    q = query[tokens].to(acc_dtype).unsqueeze(2)  # [R, num_heads, 1, head_dim]
    # GQA without copying keys per query head: query head h reads kv head h // (num_heads // num_kv_heads).
    o = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=num_heads != num_kv_heads
    )  # [R, num_heads, 1, head_dim]
    out[tokens] = o.squeeze(2).to(out.dtype)


def paged_attention_ref(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_reqs, max_blocks_per_req] int, block ids of each request's context
    seq_lens: torch.Tensor,  # [num_reqs] int, context length per request (including this step's tokens)
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int, cumulative query lengths into ``query``
    scale: float,
) -> torch.Tensor:  # [T, num_heads, head_dim], query dtype
    """Causal attention of each request's query tokens over its paged context; does not write the cache.

    Request ``r`` owns query rows ``query_start_loc[r]:query_start_loc[r+1]`` (``query_len`` of them) and
    context positions ``0..seq_lens[r]-1``, position ``p`` stored at ``block_table[r, p // block_size]``,
    offset ``p % block_size``. Its query row ``i`` sits at position ``seq_lens[r] - query_len + i`` and
    attends to keys at positions ``<=`` that. Computed in float32 (float64 for float64 inputs).
    GQA: query head ``h`` uses kv head ``h // (num_heads // num_kv_heads)``. Rows past
    ``query_start_loc[-1]`` (padding) are zero. Host-syncs on ``seq_lens``/``query_start_loc`` (test oracle).
    """
    return _paged_attention(
        query,
        key_cache,
        value_cache,
        block_table,
        seq_lens.tolist(),
        query_start_loc.tolist(),
        scale,
    )


class TorchAttentionBackend:
    """The ``AttentionBackend`` in plain PyTorch: write this step's k/v, then ``paged_attention_ref``."""

    name = "torch"

    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        write_kv_cache_ref(key, value, kv_cache, metadata.slot_mapping)
        return _paged_attention(
            query,
            kv_cache[0],
            kv_cache[1],
            metadata.block_table,
            metadata.seq_lens_cpu.tolist(),
            metadata.query_start_loc_cpu.tolist(),
            scale,
        )
