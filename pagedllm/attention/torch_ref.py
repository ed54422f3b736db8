"""Pure-PyTorch paged attention: the CPU path and the oracle that faster kernels are tested against.

Written for clarity first: one loop over requests (driven by host-side lengths), each request's context
gathered through its block table, then a masked SDPA in float32. See ``base.py`` for the cache layout, and for
what ``sliding_window``, ``logits_soft_cap`` and ``sinks`` mean.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.attention.base import FP8_KV_DTYPE, FP8_KV_MAX, AttentionMetadata


def quantize_kv_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:  # same shape, float8_e4m3fn
    """``e4m3(clamp(x / scale, -448, 448))`` computed in float32 (round to nearest even)."""
    return (x.float() / scale).clamp(-FP8_KV_MAX, FP8_KV_MAX).to(FP8_KV_DTYPE)


def _dequantize(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Gathered cache entries in ``dtype``: ``x * scale`` for an FP8 cache (in float32), else just ``x``."""
    if x.dtype == FP8_KV_DTYPE:
        return (x.float() * scale).to(dtype)
    return x.to(dtype)


def write_kv_cache_ref(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], contiguous
    slot_mapping: torch.Tensor,  # [>= T] int64; slot = block_id * block_size + offset, -1 = skip
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write token ``t``'s key/value into flat slot ``slot_mapping[t]``; entries equal to -1 are skipped.

    An FP8 cache stores ``quantize_kv_fp8(key, k_scale)`` and ``quantize_kv_fp8(value, v_scale)``.

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
    if kv_cache.dtype == FP8_KV_DTYPE:
        key_cache[valid_slots] = quantize_kv_fp8(key[valid], k_scale)
        value_cache[valid_slots] = quantize_kv_fp8(value[valid], v_scale)
        return
    key_cache[valid_slots] = key[valid].to(key_cache.dtype)
    value_cache[valid_slots] = value[valid].to(value_cache.dtype)


def _attend(
    q: torch.Tensor,  # [B, num_heads, query_len, head_dim]
    k: torch.Tensor,  # [B, num_kv_heads, key_len, head_dim]
    v: torch.Tensor,  # [B, num_kv_heads, key_len, head_dim]
    mask: torch.Tensor | None,  # bool, broadcastable to [B, num_heads, query_len, key_len]; True = attend
    scale: float,
    logits_soft_cap: float | None,
    sinks: torch.Tensor | None = None,  # [num_heads]: one extra logit per head in the softmax denominator
) -> torch.Tensor:  # [B, num_heads, query_len, head_dim]
    """Softmax attention; with ``logits_soft_cap`` the scores become ``cap * tanh(scores / cap)`` before the
    mask and the softmax; with ``sinks`` each head's softmax also runs over its sink logit, whose value is zero
    (the attention weights sum to less than one). SDPA can do neither, so those cases are computed by hand.
    Every row must see a key."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    if logits_soft_cap is None and sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=num_heads != num_kv_heads
        )
    if num_heads != num_kv_heads:
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)  # [B, num_heads, key_len, head_dim]
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)  # [B, num_heads, key_len, head_dim]
    scores = q @ k.transpose(-1, -2) * scale  # [B, num_heads, query_len, key_len]
    if logits_soft_cap is not None:
        scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1) @ v
    batch, _, query_len, _ = scores.shape
    sink = sinks.to(scores.dtype).view(1, num_heads, 1, 1).expand(batch, num_heads, query_len, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)  # [B, num_heads, query_len, key_len + 1]
    return probs[..., :-1] @ v  # the sink takes its share of the weight and contributes no value


def _paged_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_reqs, max_blocks_per_req]
    seq_lens: list[int],  # [num_reqs] context length of each request (its keys already in the cache)
    query_start_loc: list[int],  # [num_reqs + 1]
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scale: float = 1.0,  # FP8 cache: keys read as k_fp8 * k_scale (ignored otherwise)
    v_scale: float = 1.0,
    sinks: torch.Tensor | None = None,  # [num_heads]
) -> torch.Tensor:  # [T, num_heads, head_dim]; rows past query_start_loc[-1] (padding) are zero
    num_heads = query.shape[1]
    block_size, num_kv_heads, head_dim = key_cache.shape[1:]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    group = num_heads // num_kv_heads
    acc_dtype = torch.promote_types(query.dtype, torch.float32)  # float32, or float64 when given float64
    if sinks is not None and sinks.shape != (num_heads,):
        raise ValueError(f"sinks must be [num_heads] = [{num_heads}], got {tuple(sinks.shape)}")
    out = torch.zeros_like(query)  # [T, num_heads, head_dim]
    decodes = [r for r, s in enumerate(seq_lens) if query_start_loc[r + 1] - query_start_loc[r] == 1]
    if len(decodes) > 1:
        _decode_batched(
            query, key_cache, value_cache, block_table, seq_lens, query_start_loc, decodes, scale, out,
            sliding_window, logits_soft_cap, k_scale, v_scale, sinks,
        )  # fmt: skip
    decode_set = set(decodes) if len(decodes) > 1 else set()
    for r, seq_len in enumerate(seq_lens):
        q_start, q_end = query_start_loc[r], query_start_loc[r + 1]
        query_len = q_end - q_start
        if query_len == 0 or r in decode_set:
            continue
        if query_len > seq_len:
            raise ValueError(f"request {r}: query_len {query_len} > seq_len {seq_len}")
        # Keys before k_start are outside every query's window: not even gathered.
        k_start = 0 if sliding_window is None else max(0, seq_len - query_len - sliding_window + 1)
        first_block = k_start // block_size
        num_blocks = (seq_len + block_size - 1) // block_size
        block_ids = block_table[r, first_block:num_blocks].long()  # [num_blocks - first_block]
        base = first_block * block_size  # position of the first gathered slot
        keep = slice(k_start - base, seq_len - base)  # L = seq_len - k_start keys
        k = key_cache[block_ids].flatten(0, 1)[keep]  # [L, num_kv_heads, head_dim]
        v = value_cache[block_ids].flatten(0, 1)[keep]  # [L, num_kv_heads, head_dim]
        # GQA: query head h reads kv head h // group.
        k = _dequantize(k, acc_dtype, k_scale)  # [L, num_kv_heads, head_dim]
        v = _dequantize(v, acc_dtype, v_scale)  # [L, num_kv_heads, head_dim]
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [num_heads, L, head_dim]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)  # [num_heads, L, head_dim]
        q = query[q_start:q_end].to(acc_dtype).transpose(0, 1)  # [num_heads, query_len, head_dim]
        # Query i sits at position seq_len - query_len + i and sees keys at positions <= it (and, with a
        # window W, at positions > it - W).
        if query_len == 1 and sliding_window is None:  # a decode sees the whole context: no mask needed
            mask = None
        else:
            q_pos = torch.arange(seq_len - query_len, seq_len, device=query.device)  # [query_len]
            k_pos = torch.arange(k_start, seq_len, device=query.device)  # [L]
            mask = k_pos[None, :] <= q_pos[:, None]  # [query_len, L], True = attend
            if sliding_window is not None:
                mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
        o = _attend(q[None], k[None], v[None], mask, scale, logits_soft_cap, sinks)[0]  # [heads, q_len, hd]
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
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sinks: torch.Tensor | None = None,  # [num_heads]
) -> None:
    """All one-token queries in one padded SDPA call (the CPU decode path): keys past a request's length masked
    (and, with a window W, keys at positions <= len - 1 - W)."""
    block_size, num_kv_heads, head_dim = key_cache.shape[1:]
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
    k = _dequantize(key_cache[blocks].flatten(1, 2)[:, :max_len], acc_dtype, k_scale)  # [R, L, kv_heads, hd]
    v = _dequantize(
        value_cache[blocks].flatten(1, 2)[:, :max_len], acc_dtype, v_scale
    )  # [R, L, kv_heads, hd]
    k_pos = torch.arange(max_len, device=query.device)[None, :]  # [1, L]
    mask = k_pos < lens.to(query.device)[:, None]  # [R, L]
    if sliding_window is not None:  # the query sits at position len - 1
        mask &= k_pos > lens.to(query.device)[:, None] - 1 - sliding_window
    # Slots past a request's length may hold anything (NaN in a fresh or poisoned cache); 0 * NaN would leak.
    # (Slots behind a window are zeroed too: they are never read, as in the Triton kernel.)
    k = k.masked_fill(~mask[:, :, None, None], 0.0).transpose(1, 2)  # [R, num_kv_heads, L, head_dim]
    v = v.masked_fill(~mask[:, :, None, None], 0.0).transpose(1, 2)  # [R, num_kv_heads, L, head_dim]
    q = query[tokens].to(acc_dtype).unsqueeze(2)  # [R, num_heads, 1, head_dim]
    # GQA without copying keys per query head: query head h reads kv head h // (num_heads // num_kv_heads).
    o = _attend(q, k, v, mask[:, None, None, :], scale, logits_soft_cap, sinks)  # [R, num_heads, 1, head_dim]
    out[tokens] = o.squeeze(2).to(out.dtype)


def paged_attention_ref(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_reqs, max_blocks_per_req] int, block ids of each request's context
    seq_lens: torch.Tensor,  # [num_reqs] int, context length per request (including this step's tokens)
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int, cumulative query lengths into ``query``
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sinks: torch.Tensor | None = None,  # [num_heads]
) -> torch.Tensor:  # [T, num_heads, head_dim], query dtype
    """Causal attention of each request's query tokens over its paged context; does not write the cache.

    Request ``r`` owns query rows ``query_start_loc[r]:query_start_loc[r+1]`` (``query_len`` of them) and
    context positions ``0..seq_lens[r]-1``, position ``p`` stored at ``block_table[r, p // block_size]``,
    offset ``p % block_size``. Its query row ``i`` sits at position ``seq_lens[r] - query_len + i`` and
    attends to keys at positions ``<=`` that and, given ``sliding_window`` W, ``> position - W`` (W keys,
    itself included: transformers' convention). Given ``logits_soft_cap`` c, the scaled scores become
    ``c * tanh(scores / c)`` before masking and softmax. Given ``sinks`` (``[num_heads]``), head h's softmax
    denominator also holds ``exp(sinks[h])`` (a logit with no value). Computed in float32 (float64 for float64
    inputs).
    GQA: query head ``h`` uses kv head ``h // (num_heads // num_kv_heads)``. Rows past
    ``query_start_loc[-1]`` (padding) are zero. Host-syncs on ``seq_lens``/``query_start_loc`` (test oracle).
    An FP8 (``float8_e4m3fn``) cache is read as ``k_fp8 * k_scale`` / ``v_fp8 * v_scale`` in float32: exactly
    the attention over a float32 cache holding those products.
    """
    return _paged_attention(
        query,
        key_cache,
        value_cache,
        block_table,
        seq_lens.tolist(),
        query_start_loc.tolist(),
        scale,
        sliding_window,
        logits_soft_cap,
        k_scale,
        v_scale,
        sinks,
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
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        write_kv_cache_ref(key, value, kv_cache, metadata.slot_mapping, k_scale, v_scale)
        return _paged_attention(
            query,
            kv_cache[0],
            kv_cache[1],
            metadata.block_table,
            metadata.seq_lens_cpu.tolist(),
            metadata.query_start_loc_cpu.tolist(),
            scale,
            sliding_window,
            logits_soft_cap,
            k_scale,
            v_scale,
            sinks,
        )
