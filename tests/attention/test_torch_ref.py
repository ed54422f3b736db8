"""The paged reference attention vs plain dense causal attention on random q/k/v."""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention.base import AttentionMetadata
from pagedllm.attention.torch_ref import TorchAttentionBackend, paged_attention_ref, write_kv_cache_ref

HEAD_DIM = 8
# (seq_len, query_len): query_len < seq_len means the first seq_len - query_len keys are already cached
REQUESTS = [(1, 1), (7, 7), (20, 3), (33, 1), (16, 16), (5, 2), (18, 17)]


def dense_causal_attention(
    q: torch.Tensor,  # [query_len, num_heads, head_dim], the last query_len positions of the sequence
    k: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    v: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:  # [query_len, num_heads, head_dim]
    """Textbook attention in float64, no SDPA: scores, soft-cap, causal (and window) mask, softmax, weighted sum.
    The window as transformers' masking_utils has it: the query at p sees keys k with p - W < k <= p."""
    query_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    out = torch.empty(query_len, num_heads, q.shape[-1], dtype=torch.float64)
    for h in range(num_heads):
        kh, vh = k[:, h // group].double(), v[:, h // group].double()  # [seq_len, head_dim]
        scores = q[:, h].double() @ kh.T * scale  # [query_len, seq_len]
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        q_pos = torch.arange(seq_len - query_len, seq_len)[:, None]  # [query_len, 1]
        k_pos = torch.arange(seq_len)[None, :]  # [1, seq_len]
        hidden = k_pos > q_pos
        if sliding_window is not None:
            hidden |= k_pos <= q_pos - sliding_window
        scores = scores.masked_fill(hidden, float("-inf"))
        out[:, h] = torch.softmax(scores, dim=-1) @ vh
    return out


def build_step(
    requests: list[tuple[int, int]],
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    num_pad: int = 0,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """Random full-sequence q/k/v per request; the already-computed prefix written into scattered cache
    blocks; this step's tokens flattened with their slot mapping (plus ``num_pad`` padding tokens)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [(s + block_size - 1) // block_size for s, _ in requests]
    num_blocks = sum(blocks_needed) + 3
    free = torch.randperm(num_blocks, generator=gen).tolist()
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
    max_blocks = max(blocks_needed)
    block_table = torch.zeros(len(requests), max_blocks, dtype=torch.int32)  # [num_reqs, max_blocks]
    seqs, qs, ks, vs, slots, query_start_loc = [], [], [], [], [], [0]
    for r, (seq_len, query_len) in enumerate(requests):
        blocks = [free.pop() for _ in range(blocks_needed[r])]
        block_table[r, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        q = torch.randn(seq_len, num_heads, HEAD_DIM, generator=gen).to(dtype)
        k = torch.randn(seq_len, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
        seq_slots = [blocks[p // block_size] * block_size + p % block_size for p in range(seq_len)]
        num_cached = seq_len - query_len
        flat = kv_cache.view(2, -1, num_kv_heads, HEAD_DIM)  # [2, num_slots, num_kv_heads, head_dim]
        flat[0, seq_slots[:num_cached]] = k[:num_cached]
        flat[1, seq_slots[:num_cached]] = v[:num_cached]
        seqs.append((q, k, v, seq_slots))
        qs.append(q[num_cached:])
        ks.append(k[num_cached:])
        vs.append(v[num_cached:])
        slots += seq_slots[num_cached:]
        query_start_loc.append(query_start_loc[-1] + query_len)
    pad = [
        torch.randn(num_pad, h, HEAD_DIM, generator=gen).to(dtype)
        for h in (num_heads, num_kv_heads, num_kv_heads)
    ]
    query = torch.cat(qs + [pad[0]])  # [T + num_pad, num_heads, head_dim]
    key = torch.cat(ks + [pad[1]])  # [T + num_pad, num_kv_heads, head_dim]
    value = torch.cat(vs + [pad[2]])  # [T + num_pad, num_kv_heads, head_dim]
    seq_lens = [s for s, _ in requests]
    metadata = AttentionMetadata(
        num_reqs=len(requests),
        num_tokens=query_start_loc[-1],
        max_query_len=max(n for _, n in requests),
        max_seq_len=max(seq_lens),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table,
        slot_mapping=torch.tensor(slots + [-1] * num_pad, dtype=torch.int64),
        query_start_loc_cpu=torch.tensor(query_start_loc, dtype=torch.int32),
        seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int32),
    )
    return query, key, value, kv_cache, metadata, seqs


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_backend_matches_dense(block_size: int, num_heads: int, num_kv_heads: int) -> None:
    query, key, value, kv_cache, metadata, seqs = build_step(REQUESTS, block_size, num_heads, num_kv_heads)
    scale = HEAD_DIM**-0.5
    out = TorchAttentionBackend().forward(query, key, value, kv_cache, metadata, scale)
    assert out.shape == query.shape and out.dtype == query.dtype
    flat = kv_cache.view(2, -1, num_kv_heads, HEAD_DIM)  # [2, num_slots, num_kv_heads, head_dim]
    qsl = metadata.query_start_loc_cpu.tolist()
    for r, (q, k, v, seq_slots) in enumerate(seqs):
        # the whole sequence (cached prefix + this step's tokens) now sits in r's slots
        torch.testing.assert_close(flat[0, seq_slots], k, atol=0, rtol=0)
        torch.testing.assert_close(flat[1, seq_slots], v, atol=0, rtol=0)
        query_len = qsl[r + 1] - qsl[r]
        expected = dense_causal_attention(q[len(q) - query_len :], k, v, scale).float()
        torch.testing.assert_close(out[qsl[r] : qsl[r + 1]], expected, atol=1e-5, rtol=1e-5)


def test_padding_slots_are_not_written() -> None:
    num_pad = 3
    query, key, value, kv_cache, metadata, seqs = build_step(REQUESTS, 4, 4, 2, num_pad=num_pad, seed=1)
    before = kv_cache.clone()
    out = TorchAttentionBackend().forward(query, key, value, kv_cache, metadata, 0.3)
    written = torch.zeros(kv_cache.shape[1] * kv_cache.shape[2], dtype=torch.bool)  # [num_slots]
    written[metadata.slot_mapping[: metadata.num_tokens]] = True
    flat_before = before.view(2, -1, *before.shape[-2:])  # [2, num_slots, num_kv_heads, head_dim]
    flat_after = kv_cache.view(2, -1, *kv_cache.shape[-2:])
    assert torch.equal(flat_after[:, ~written], flat_before[:, ~written])
    assert torch.equal(
        flat_after[0, metadata.slot_mapping[: metadata.num_tokens]], key[: metadata.num_tokens]
    )
    assert torch.all(out[metadata.num_tokens :] == 0)
    qsl = metadata.query_start_loc_cpu.tolist()
    for r, (q, k, v, _) in enumerate(seqs):
        query_len = qsl[r + 1] - qsl[r]
        expected = dense_causal_attention(q[len(q) - query_len :], k, v, 0.3).float()
        torch.testing.assert_close(out[qsl[r] : qsl[r + 1]], expected, atol=1e-5, rtol=1e-5)


def test_slot_minus_one_inside_batch_is_skipped() -> None:
    kv_cache = torch.zeros(2, 4, 2, 1, HEAD_DIM)  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    key = torch.ones(3, 1, HEAD_DIM)
    value = torch.full((3, 1, HEAD_DIM), 2.0)
    write_kv_cache_ref(key, value, kv_cache, torch.tensor([5, -1, 0]))
    flat = kv_cache.view(2, -1, HEAD_DIM)  # [2, num_slots, head_dim]
    assert flat[0, [0, 5]].eq(1).all() and flat[1, [0, 5]].eq(2).all()
    assert flat[:, [1, 2, 3, 4, 6, 7]].eq(0).all()


def test_pure_function_does_not_write() -> None:
    query, _, _, kv_cache, metadata, seqs = build_step([(9, 9), (12, 1), (3, 2)], 4, 4, 2, seed=2)
    # fill the new tokens' slots by hand, then call the pure function
    flat = kv_cache.view(2, -1, 2, HEAD_DIM)  # [2, num_slots, num_kv_heads, head_dim]
    for _, k, v, seq_slots in seqs:
        flat[0, seq_slots], flat[1, seq_slots] = k, v
    before = kv_cache.clone()
    out = paged_attention_ref(
        query,
        kv_cache[0],
        kv_cache[1],
        metadata.block_table,
        metadata.seq_lens,
        metadata.query_start_loc,
        0.5,
    )
    assert torch.equal(kv_cache, before)
    qsl = metadata.query_start_loc_cpu.tolist()
    for r, (q, k, v, _) in enumerate(seqs):
        query_len = qsl[r + 1] - qsl[r]
        expected = dense_causal_attention(q[len(q) - query_len :], k, v, 0.5).float()
        torch.testing.assert_close(out[qsl[r] : qsl[r + 1]], expected, atol=1e-5, rtol=1e-5)


def test_bfloat16_inputs() -> None:
    query, key, value, kv_cache, metadata, seqs = build_step(REQUESTS, 4, 4, 2, dtype=torch.bfloat16, seed=3)
    out = TorchAttentionBackend().forward(query, key, value, kv_cache, metadata, HEAD_DIM**-0.5)
    assert out.dtype == torch.bfloat16
    qsl = metadata.query_start_loc_cpu.tolist()
    for r, (q, k, v, _) in enumerate(seqs):
        query_len = qsl[r + 1] - qsl[r]
        expected = dense_causal_attention(q[len(q) - query_len :], k, v, HEAD_DIM**-0.5).float()
        torch.testing.assert_close(out[qsl[r] : qsl[r + 1]].float(), expected, atol=2e-2, rtol=2e-2)


def test_float64_inputs_stay_float64() -> None:
    query, _, _, kv_cache, metadata, seqs = build_step(
        [(9, 9), (12, 1)], 4, 4, 2, dtype=torch.float64, seed=4
    )
    flat = kv_cache.view(2, -1, 2, HEAD_DIM)  # [2, num_slots, num_kv_heads, head_dim]
    for _, k, v, seq_slots in seqs:
        flat[0, seq_slots], flat[1, seq_slots] = k, v
    out = paged_attention_ref(
        query,
        kv_cache[0],
        kv_cache[1],
        metadata.block_table,
        metadata.seq_lens,
        metadata.query_start_loc,
        0.5,
    )
    assert out.dtype == torch.float64
    qsl = metadata.query_start_loc_cpu.tolist()
    for r, (q, k, v, _) in enumerate(seqs):
        expected = dense_causal_attention(q[len(q) - (qsl[r + 1] - qsl[r]) :], k, v, 0.5)
        torch.testing.assert_close(out[qsl[r] : qsl[r + 1]], expected, atol=1e-12, rtol=1e-12)


def test_batched_decodes_ignore_padding_entries_and_poisoned_slots():
    """Several one-token queries go through one padded call: block-table entries past a request's own blocks
    (here out-of-range ids) and cache slots past its length (here NaN) must not reach its output."""
    gen = torch.Generator().manual_seed(3)
    block_size, num_heads, num_kv_heads = 4, 4, 2
    seq_lens = [3, 9, 1, 14]
    num_blocks = 12
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, HEAD_DIM), float("nan"))
    block_table = torch.randint(10**6, 10**7, (len(seq_lens), 5), generator=gen, dtype=torch.int32)  # poison
    free = torch.randperm(num_blocks, generator=gen).tolist()
    dense_kv = []
    for r, s in enumerate(seq_lens):
        ids = [free.pop() for _ in range((s + block_size - 1) // block_size)]
        block_table[r, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        k, v = torch.randn(2, s, num_kv_heads, HEAD_DIM, generator=gen)
        flat = kv_cache[:, ids].flatten(1, 2)
        flat[0, :s], flat[1, :s] = k, v
        kv_cache[:, ids] = flat.view(2, len(ids), block_size, num_kv_heads, HEAD_DIM)
        dense_kv.append((k, v))
    query = torch.randn(len(seq_lens), num_heads, HEAD_DIM, generator=gen)
    out = paged_attention_ref(
        query, kv_cache[0], kv_cache[1], block_table, torch.tensor(seq_lens),
        torch.arange(len(seq_lens) + 1), scale=0.5,
    )  # fmt: skip
    assert torch.isfinite(out).all()
    for r, (k, v) in enumerate(dense_kv):
        want = dense_causal_attention(query[r : r + 1], k, v, 0.5)
        torch.testing.assert_close(out[r : r + 1].double(), want, atol=1e-5, rtol=1e-5)


# --- sliding window and soft-cap -------------------------------------------------------------------------

# Ragged requests around a window of 5: decodes far past it and just inside it, prefill chunks over a cached
# prefix longer than the window, a prefill shorter than the window, a chunk much longer than the window.
WINDOW_REQUESTS = [(1, 1), (30, 1), (4, 1), (20, 3), (33, 9), (16, 16), (5, 2), (18, 17), (6, 1)]


def test_hf_window_convention() -> None:
    """Our window reading (p - W < k <= p: W keys, the query's own included) is transformers'."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    fn = sliding_window_causal_mask_function(3)
    for p in range(8):
        seen = [k for k in range(8) if fn(0, 0, torch.tensor(p), torch.tensor(k))]
        assert seen == [k for k in range(8) if p - 3 < k <= p]


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("sliding_window,soft_cap", [(5, None), (None, 2.0), (5, 2.0), (1, None), (64, 3.0)])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2)])
def test_window_and_soft_cap_match_dense(
    block_size: int, sliding_window: int | None, soft_cap: float | None, num_heads: int, num_kv_heads: int
) -> None:
    """The backend step (cache write, then attention) vs the dense masked reference; the padded batched-decode
    path and the per-request path both see windows and caps. Window 1 is "attend to yourself only", 64 is
    longer than every sequence (same as none)."""
    query, key, value, kv_cache, metadata, seqs = build_step(
        WINDOW_REQUESTS, block_size, num_heads, num_kv_heads, num_pad=2, seed=5
    )
    scale = 0.9  # large enough that the cap bends the scores
    out = TorchAttentionBackend().forward(
        query, key, value, kv_cache, metadata, scale, sliding_window=sliding_window, logits_soft_cap=soft_cap
    )
    assert torch.all(out[metadata.num_tokens :] == 0)
    qsl = metadata.query_start_loc_cpu.tolist()
    for r, (q, k, v, _) in enumerate(seqs):
        query_len = qsl[r + 1] - qsl[r]
        expected = dense_causal_attention(q[len(q) - query_len :], k, v, scale, sliding_window, soft_cap)
        torch.testing.assert_close(out[qsl[r] : qsl[r + 1]].double(), expected, atol=1e-5, rtol=1e-5)


def test_window_and_soft_cap_change_the_output() -> None:
    """Guards the tests above: with these shapes the window and the cap each change the result."""
    query, _, _, kv_cache, metadata, seqs = build_step(WINDOW_REQUESTS, 4, 4, 2, seed=6)
    flat = kv_cache.view(2, -1, 2, HEAD_DIM)  # [2, num_slots, num_kv_heads, head_dim]
    for _, k, v, seq_slots in seqs:
        flat[0, seq_slots], flat[1, seq_slots] = k, v
    args = (
        query,
        kv_cache[0],
        kv_cache[1],
        metadata.block_table,
        metadata.seq_lens,
        metadata.query_start_loc,
    )
    plain = paged_attention_ref(*args, 0.9)
    assert (paged_attention_ref(*args, 0.9, sliding_window=5) - plain).abs().max() > 0.1
    assert (paged_attention_ref(*args, 0.9, logits_soft_cap=2.0) - plain).abs().max() > 0.1
    assert torch.equal(paged_attention_ref(*args, 0.9, sliding_window=64), plain)


def test_window_over_decode_steps() -> None:
    """A sequence decoded token by token through the backend (block size 4, window 6): each step equals the
    dense windowed attention at that position; keys behind the window stay in the cache, unread."""
    gen = torch.Generator().manual_seed(8)
    num_heads, num_kv_heads, block_size, window, total = 4, 2, 4, 6, 23
    q = torch.randn(total, num_heads, HEAD_DIM, generator=gen)
    k = torch.randn(total, num_kv_heads, HEAD_DIM, generator=gen)
    v = torch.randn(total, num_kv_heads, HEAD_DIM, generator=gen)
    blocks = [7, 2, 5, 0, 3, 6]  # scattered
    kv_cache = torch.zeros(2, 8, block_size, num_kv_heads, HEAD_DIM)
    backend = TorchAttentionBackend()
    for pos in range(total):
        slot = blocks[pos // block_size] * block_size + pos % block_size
        one = torch.tensor([0, 1], dtype=torch.int32)
        seq_lens = torch.tensor([pos + 1], dtype=torch.int32)
        metadata = AttentionMetadata(
            num_reqs=1, num_tokens=1, max_query_len=1, max_seq_len=pos + 1, query_start_loc=one,
            seq_lens=seq_lens, block_table=torch.tensor([blocks], dtype=torch.int32),
            slot_mapping=torch.tensor([slot]), query_start_loc_cpu=one, seq_lens_cpu=seq_lens,
            is_pure_decode=True,
        )  # fmt: skip
        out = backend.forward(
            q[pos : pos + 1], k[pos : pos + 1], v[pos : pos + 1], kv_cache, metadata, 0.5, window
        )
        expected = dense_causal_attention(q[pos : pos + 1], k[: pos + 1], v[: pos + 1], 0.5, window)
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
