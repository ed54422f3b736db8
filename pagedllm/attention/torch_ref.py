"""Pure-PyTorch paged attention: the CPU path and the oracle that faster kernels are tested against.

A step is planned once from the host-side lengths (``_plan_step``: which cache rows each request reads, and the
masks), and the plan serves every layer with the same window. Each layer then gathers the visible keys of each
request with one ``index_select`` and attends in float32: one-token queries (decodes) in padded SDPA calls over
groups of similar length, each longer query (prefill or chunk) in a call of its own. See ``base.py`` for the
cache layout, and for what ``sliding_window``, ``logits_soft_cap`` and ``sinks`` mean.

Cache rows: one layer's key cache ``[num_blocks, block_size, num_kv_heads, head_dim]`` seen as
``[num_slots * num_kv_heads, head_dim]``; row ``slot * num_kv_heads + h`` is kv head ``h`` of slot ``slot``
(``slot = block_id * block_size + offset``). Gathering rows in the order ``[..., num_kv_heads, L]`` gives keys
already laid out ``[..., num_kv_heads, L, head_dim]`` for SDPA, in one copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
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


def _valid_slots(slot_mapping: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The tokens to write (those whose slot is not -1: ``[num_valid]`` indices, or None for all of them) and
    their slots (``[num_valid]``). Syncs with the host on CUDA."""
    slots = slot_mapping[:num_tokens]  # [T]
    valid = slots >= 0  # [T]
    if bool(valid.all()):
        return None, slots
    tokens = valid.nonzero().squeeze(1)  # [num_valid]
    return tokens, slots[tokens]


def _write_kv(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], contiguous
    tokens: torch.Tensor | None,  # [num_valid] which tokens to write; None = all T
    slots: torch.Tensor,  # [num_valid] int64, their flat slots
    k_scale: float,
    v_scale: float,
) -> None:
    if tokens is not None:
        key, value = key.index_select(0, tokens), value.index_select(0, tokens)  # [num_valid, kv_heads, hd]
    # [num_blocks * block_size, num_kv_heads, head_dim] each
    key_cache, value_cache = (kv_cache[i].view(-1, *kv_cache.shape[-2:]) for i in (0, 1))
    if kv_cache.dtype == FP8_KV_DTYPE:
        key, value = quantize_kv_fp8(key, k_scale), quantize_kv_fp8(value, v_scale)
    key_cache[slots] = key.to(key_cache.dtype)
    value_cache[slots] = value.to(value_cache.dtype)


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

    (Finding the -1 entries syncs with the host on CUDA; fine for a reference.)
    """
    _write_kv(key, value, kv_cache, *_valid_slots(slot_mapping, key.shape[0]), k_scale, v_scale)


@dataclass
class _Prefill:
    """A request with more than one query token: its query rows and the keys it may see."""

    q_start: int
    q_end: int
    rows: torch.Tensor  # [num_kv_heads * L] int64 cache rows, laid out [num_kv_heads, L]
    mask: torch.Tensor | None  # [query_len, L] bool, True = attend; None = plain causal (query_len == L)


@dataclass
class _Decodes:
    """One-token requests of similar length (see ``_DECODE_GROUPS``), padded to the longest: one SDPA call."""

    tokens: torch.Tensor  # [R] their query rows
    rows: torch.Tensor  # [R * num_kv_heads * L] int64 cache rows, laid out [R, num_kv_heads, L]
    mask: torch.Tensor | None  # [R, 1, 1, L] bool, False on padding keys; None when nothing is padded
    num_keys: int  # L: the most keys any of them sees


@dataclass
class _StepPlan:
    """What every request of one step reads from a layer's cache under one sliding window (see ``_plan_step``)."""

    decodes: list[_Decodes]
    prefills: list[_Prefill]


# Decodes are sorted by how many keys they see and split into this many groups (of equal count), each padded to
# its longest and attended in one call: one padded call over all of them gathers and reads up to twice the keys
# when lengths are spread (CPU decode attention is bound by those memory passes). A fixed number of groups keeps
# the per-step host work independent of the batch size.
_DECODE_GROUPS = 4


def _cache_rows(slots: np.ndarray, num_kv_heads: int) -> np.ndarray:  # [..., num_kv_heads * L] int64
    """Cache rows (see the module docstring) of every kv head of ``slots`` ([..., L] int64), head-major."""
    rows = slots[..., None, :] * num_kv_heads + np.arange(num_kv_heads)[:, None]  # [..., num_kv_heads, L]
    return rows.reshape(*slots.shape[:-1], -1)


def _plan_step(
    block_table: torch.Tensor,  # [num_reqs, max_blocks_per_req]
    seq_lens: torch.Tensor,  # [num_reqs] int: context length of each request (its keys already in the cache)
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int
    block_size: int,
    num_kv_heads: int,
    sliding_window: int | None,
    bidirectional_spans: tuple[tuple[int, int, int], ...] = (),
) -> _StepPlan:
    """Query i of request r sits at position ``p = seq_lens[r] - query_len + i`` and sees the keys at positions
    ``<= p`` (and, with a window W, ``> p - W``). Keys no query of the request sees are not gathered at all (so
    slots behind a window, which may belong to other requests by now, are never read). A query inside one of
    r's ``bidirectional_spans`` (``(r, start, end)``) also sees the span's later keys (still within the window:
    transformers' ``AND(window, OR(causal, block))``).

    Decodes go in groups of similar length (``_DECODE_GROUPS``), each padded to its longest: a padding key reads
    the request's newest key (written this step, so finite: a fresh or recycled slot may hold NaN, and
    ``0 * NaN`` would leak through the masked softmax) and is masked out. Index arithmetic in NumPy on the host
    (cheaper per op than small tensors), no Python loop over decodes; the results go to the cache's device.
    """
    device = block_table.device
    table = block_table.cpu().numpy()  # [num_reqs, max_blocks_per_req]; a view on CPU
    lens = seq_lens.cpu().numpy().astype(np.int64)  # [num_reqs]
    starts = query_start_loc.cpu().numpy().astype(np.int64)  # [num_reqs + 1]
    query_lens = np.diff(starts)  # [num_reqs]
    too_long = np.flatnonzero(query_lens > lens)
    if len(too_long):
        r = int(too_long[0])
        raise ValueError(f"request {r}: query_len {query_lens[r]} > seq_len {lens[r]}")

    def to_device(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device)

    spans: dict[int, list[tuple[int, int]]] = {}
    for r, a, b in bidirectional_spans:
        spans.setdefault(int(r), []).append((int(a), int(b)))
    prefills = []
    for r in np.flatnonzero(query_lens > 1).tolist():
        seq_len, q_start, q_end = int(lens[r]), int(starts[r]), int(starts[r + 1])
        query_len = q_end - q_start
        # Keys before k_start are outside every query's window.
        k_start = 0 if sliding_window is None else max(0, seq_len - query_len - sliding_window + 1)
        k_pos = np.arange(k_start, seq_len)  # [L]
        slots = table[r, k_pos // block_size].astype(np.int64) * block_size + k_pos % block_size  # [L]
        mask = None  # plain causal: as many keys as queries, and no window in between
        if (
            seq_len - k_start != query_len
            or (sliding_window is not None and sliding_window < query_len)
            or r in spans
        ):
            q_pos = np.arange(seq_len - query_len, seq_len)[:, None]  # [query_len, 1]
            visible = k_pos <= q_pos  # [query_len, L]
            for a, b in spans.get(r, ()):
                visible |= (q_pos >= a) & (q_pos < b) & (k_pos >= a) & (k_pos < b)
            if sliding_window is not None:
                visible &= k_pos > q_pos - sliding_window
            mask = to_device(visible)
        prefills.append(_Prefill(q_start, q_end, to_device(_cache_rows(slots, num_kv_heads)), mask))

    # A decode's query sits at position seq_len - 1 and sees its last min(seq_len, W) keys.
    decodes = np.flatnonzero(query_lens == 1)  # [num_decodes]
    num_keys = lens[decodes] if sliding_window is None else np.minimum(lens[decodes], sliding_window)
    order = np.argsort(-num_keys, kind="stable")  # most keys first
    decodes, num_keys = decodes[order], num_keys[order]
    groups = []
    for reqs, keys in zip(np.array_split(decodes, _DECODE_GROUPS), np.array_split(num_keys, _DECODE_GROUPS)):
        if not len(reqs):  # fewer decodes than groups
            continue
        j = np.arange(keys[0])  # [L]
        real = j < keys[:, None]  # [R, L]
        last = lens[reqs, None] - 1  # [R, 1]: the query's own position
        k_pos = np.where(real, last + 1 - keys[:, None] + j, last)  # [R, L]
        slots = table[reqs[:, None], k_pos // block_size].astype(np.int64) * block_size + k_pos % block_size
        groups.append(
            _Decodes(
                tokens=to_device(starts[reqs]),
                rows=to_device(_cache_rows(slots, num_kv_heads).reshape(-1)),
                mask=None if real.all() else to_device(real[:, None, None, :]),
                num_keys=int(keys[0]),
            )
        )
    return _StepPlan(groups, prefills)


def _attend(
    q: torch.Tensor,  # [B, num_heads, query_len, head_dim]
    k: torch.Tensor,  # [B, num_kv_heads, key_len, head_dim]
    v: torch.Tensor,  # [B, num_kv_heads, key_len, head_dim]
    mask: torch.Tensor | None,  # bool, broadcastable to [B, num_heads, query_len, key_len]; True = attend
    causal: bool,  # no mask: query i sees keys 0..i (query_len == key_len)
    scale: float,
    logits_soft_cap: float | None,
    sinks: torch.Tensor | None = None,  # broadcastable to [B, num_heads, query_len, 1]: one logit per head
) -> torch.Tensor:  # [B, num_heads, query_len, head_dim]
    """Softmax attention; with ``logits_soft_cap`` the scores become ``cap * tanh(scores / cap)`` before the
    mask and the softmax; with ``sinks`` each head's softmax also runs over its sink logit, whose value is zero
    (the attention weights sum to less than one). SDPA can do neither, so those cases are computed by hand.
    Every row must see a key."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    if logits_soft_cap is None and sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=num_heads != num_kv_heads
        )
    if num_heads != num_kv_heads:
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)  # [B, num_heads, key_len, head_dim]
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)  # [B, num_heads, key_len, head_dim]
    scores = q @ k.transpose(-1, -2) * scale  # [B, num_heads, query_len, key_len]
    if logits_soft_cap is not None:
        scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1) @ v
    sink = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)  # [B, num_heads, query_len, 1]
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)  # [B, num_heads, query_len, key_len + 1]
    return probs[..., :-1] @ v  # the sink takes its share of the weight and contributes no value


def _paged_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    plan: _StepPlan,
    scale: float,
    logits_soft_cap: float | None = None,
    k_scale: float = 1.0,  # FP8 cache: keys read as k_fp8 * k_scale (ignored otherwise)
    v_scale: float = 1.0,
    sinks: torch.Tensor | None = None,  # [num_heads]
) -> torch.Tensor:  # [T, num_heads, head_dim]; rows no request owns (padding) are zero
    num_heads = query.shape[1]
    num_kv_heads, head_dim = key_cache.shape[2:]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    group = num_heads // num_kv_heads
    if sinks is not None and sinks.shape != (num_heads,):
        raise ValueError(f"sinks must be [num_heads] = [{num_heads}], got {tuple(sinks.shape)}")
    acc_dtype = torch.promote_types(query.dtype, torch.float32)  # float32, or float64 when given float64
    keys = key_cache.reshape(-1, head_dim)  # [num_slots * num_kv_heads, head_dim]: the cache rows
    values = value_cache.reshape(-1, head_dim)  # [num_slots * num_kv_heads, head_dim]
    out = torch.zeros_like(query)  # [T, num_heads, head_dim]

    def gather(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [len(rows), head_dim] each
        return (
            _dequantize(keys.index_select(0, rows), acc_dtype, k_scale),
            _dequantize(values.index_select(0, rows), acc_dtype, v_scale),
        )

    head_sinks = None if sinks is None else sinks.view(1, num_kv_heads, group, 1)
    for d in plan.decodes:
        num_decodes = d.tokens.shape[0]
        k, v = (x.view(num_decodes, num_kv_heads, d.num_keys, head_dim) for x in gather(d.rows))
        # GQA: query head h reads kv head h // group, so each kv head's group of query heads sits in the
        # query-length dimension (one query token, so no causal mask between them): no GQA inside SDPA.
        q = query.index_select(0, d.tokens).to(acc_dtype).view(num_decodes, num_kv_heads, group, head_dim)
        o = _attend(q, k, v, d.mask, False, scale, logits_soft_cap, head_sinks)  # [R, kv_heads, group, hd]
        out.index_copy_(0, d.tokens, o.reshape(num_decodes, num_heads, head_dim).to(out.dtype))

    head_sinks = None if sinks is None else sinks.view(1, num_heads, 1, 1)
    for p in plan.prefills:
        k, v = (x.view(1, num_kv_heads, -1, head_dim) for x in gather(p.rows))  # [1, num_kv_heads, L, hd]
        q = query[p.q_start : p.q_end].to(acc_dtype).transpose(0, 1)[None]  # [1, num_heads, query_len, hd]
        o = _attend(
            q, k, v, p.mask, p.mask is None, scale, logits_soft_cap, head_sinks
        )  # [1, heads, q_len, hd]
        out[p.q_start : p.q_end] = o[0].transpose(0, 1).to(out.dtype)
    return out


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
    block_size, num_kv_heads = key_cache.shape[1:3]
    plan = _plan_step(block_table, seq_lens, query_start_loc, block_size, num_kv_heads, sliding_window)
    return _paged_attention(
        query, key_cache, value_cache, plan, scale, logits_soft_cap, k_scale, v_scale, sinks
    )  # fmt: skip


class TorchAttentionBackend:
    """The ``AttentionBackend`` in plain PyTorch: write this step's k/v, then ``paged_attention_ref``.

    What depends only on the step (the slots to write, the plan of which cache rows each request reads) is
    computed at the first layer and reused by the others (``AttentionMetadata.derived``: metadata is built once a
    step, once per KV cache group in a hybrid model, and not changed after).
    """

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
        out: torch.Tensor | None = None,  # [T, num_heads, head_dim]: where to write (else a new tensor)
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        num_tokens = key.shape[0]
        write = metadata.derived(
            ("write", num_tokens), lambda: _valid_slots(metadata.slot_mapping, num_tokens)
        )
        _write_kv(key, value, kv_cache, *write, k_scale, v_scale)
        block_size, num_kv_heads = kv_cache.shape[2:4]
        plan = metadata.derived(
            ("plan", block_size, num_kv_heads, sliding_window),
            lambda: _plan_step(
                metadata.block_table, metadata.seq_lens_cpu, metadata.query_start_loc_cpu,
                block_size, num_kv_heads, sliding_window, metadata.bidirectional_spans,
            ),
        )  # fmt: skip
        result = _paged_attention(
            query, kv_cache[0], kv_cache[1], plan, scale, logits_soft_cap, k_scale, v_scale, sinks
        )  # fmt: skip
        return result if out is None else out.copy_(result)
