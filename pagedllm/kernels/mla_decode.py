"""Multi-head latent attention (MLA) decode over a paged latent cache, in the absorbed-weight form.

DeepSeek-V2/V3 cache one vector per token and layer: the compressed latent ``c`` (``kv_lora_rank`` = L wide,
after ``kv_a_layernorm``) followed by the rotated shared key part ``k_pe`` (``qk_rope_head_dim`` = R wide)::

    kv_cache: [num_blocks, block_size, L + R]      token at position p of request b:
                                                   kv_cache[block_table[b, p // block_size], p % block_size]

A decoding query never expands the cache into per-head keys and values. Its no-position part has been
multiplied through ``W_UK`` into latent space beforehand (``q_latent[h] = W_UK[h].T @ q_nope[h]``, [L]), so for
head h and context position s::

    score[h, s] = scale * (q_latent[h] . c[s] + q_pe[h] . k_pe[s])
    out[h]      = sum_s softmax_s(score[h, :]) * c[s]                         [L], still in latent space

and the caller maps ``out`` through ``W_UV`` to per-head values. All heads read the same cache rows (one shared
"KV head"), so a program owns ``BLOCK_H`` heads of one query and loads each cache tile once for all of them:
two ``tl.dot`` per tile for the scores (latent and rope parts) and one for the output, with an online softmax
in fp32 (base 2, the scale folded into the scores).

Grid ``(B, cdiv(num_heads, BLOCK_H), num_splits)``. Split-K (flash-decoding): with few queries and long contexts
each query's tiles are cut into ``num_splits`` runs (computed in the kernel from the real ``seq_lens``); each
split writes an unnormalised partial output with its running max and sum to fp32 scratch and a second kernel
merges them. The split count follows :func:`pagedllm.kernels.paged_attention.num_kv_splits` with one "KV head".

CUDA graphs: the launcher reads only Python ints (``max_seq_len`` sizes the split count) and never syncs; a
query with ``seq_lens == 0`` (padding) comes out zero.
"""

from __future__ import annotations

import functools
import math

import torch

try:  # CI may have no Triton: the twin (the CPU path) still imports
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where Triton is missing
    triton = None
    tl = None

_LOG2E = 1.4426950408889634


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # Triton's CPU interpreter: any small number exercises the split path


if triton is not None:

    @triton.jit
    def _mla_decode_kernel(
        q_ptr,  # [B, H, L] latent queries
        q_pe_ptr,  # [B, H, R] rotated rope queries
        kv_cache_ptr,  # [num_blocks, block_size, L + R]
        block_table_ptr,  # [>= B, max_blocks] int32
        seq_lens_ptr,  # [>= B] int32
        out_ptr,  # [B, H, L] (NUM_SPLITS == 1)
        part_acc_ptr,  # [NUM_SPLITS, B, H, BLOCK_L] fp32 (NUM_SPLITS > 1)
        part_ml_ptr,  # [NUM_SPLITS, B, H, 2] fp32: running max (log2 units), running sum
        qk_scale,  # softmax scale * log2(e)
        num_heads,
        num_queries,
        stride_qb, stride_qh, stride_pb, stride_ph, stride_cb, stride_cs, stride_bt, stride_ob, stride_oh,
        KV_LORA: tl.constexpr,
        ROPE: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_L: tl.constexpr,
        BLOCK_R: tl.constexpr,
        TILE_N: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs, else "tf32" (ignored for 16-bit inputs)
    ):  # fmt: skip
        b = tl.program_id(0)
        hb = tl.program_id(1)
        split = tl.program_id(2)
        offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        h_mask = offs_h < num_heads
        offs_l = tl.arange(0, BLOCK_L)
        l_mask = offs_l < KV_LORA
        offs_r = tl.arange(0, BLOCK_R)
        r_mask = offs_r < ROPE
        b64 = b.to(tl.int64)
        q = tl.load(
            q_ptr + b64 * stride_qb + offs_h[:, None] * stride_qh + offs_l[None, :],
            mask=h_mask[:, None] & l_mask[None, :],
            other=0.0,
        )  # [BLOCK_H, BLOCK_L]
        q_pe = tl.load(
            q_pe_ptr + b64 * stride_pb + offs_h[:, None] * stride_ph + offs_r[None, :],
            mask=h_mask[:, None] & r_mask[None, :],
            other=0.0,
        )  # [BLOCK_H, BLOCK_R]
        seq_len = tl.load(seq_lens_ptr + b)
        num_tiles = tl.cdiv(seq_len, TILE_N)
        tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
        t_lo = split * tiles_per_split
        t_hi = tl.minimum(t_lo + tiles_per_split, num_tiles)
        block_table_row = block_table_ptr + b64 * stride_bt

        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_L], dtype=tl.float32)
        for t in range(t_lo, t_hi):
            offs_n = t * TILE_N + tl.arange(0, TILE_N)
            n_valid = offs_n < seq_len
            block = tl.load(block_table_row + offs_n // BLOCK_SIZE, mask=n_valid, other=0).to(tl.int64)
            row = block * stride_cb + (offs_n % BLOCK_SIZE) * stride_cs  # [TILE_N]
            c = tl.load(
                kv_cache_ptr + row[:, None] + offs_l[None, :],
                mask=n_valid[:, None] & l_mask[None, :],
                other=0.0,
            )  # [TILE_N, BLOCK_L]
            pe = tl.load(
                kv_cache_ptr + row[:, None] + KV_LORA + offs_r[None, :],
                mask=n_valid[:, None] & r_mask[None, :],
                other=0.0,
            )  # [TILE_N, BLOCK_R]
            s = tl.dot(q, tl.trans(c), input_precision=DOT_PRECISION)
            s += tl.dot(q_pe, tl.trans(pe), input_precision=DOT_PRECISION)
            s = tl.where(n_valid[None, :], s * qk_scale, float("-inf"))  # [BLOCK_H, TILE_N], log2 units
            m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: the tile holds at least one key
            p = tl.math.exp2(s - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=DOT_PRECISION)
            m_i = m_new

        if NUM_SPLITS == 1:
            out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # seq_len 0: acc is 0, the row comes out 0
            tl.store(
                out_ptr + b64 * stride_ob + offs_h[:, None] * stride_oh + offs_l[None, :],
                out.to(out_ptr.dtype.element_ty),
                mask=h_mask[:, None] & l_mask[None, :],
            )
        else:
            row_id = (split * num_queries + b64) * num_heads + offs_h  # [BLOCK_H] rows of the scratch
            tl.store(part_acc_ptr + row_id[:, None] * BLOCK_L + offs_l[None, :], acc, mask=h_mask[:, None])
            tl.store(part_ml_ptr + row_id * 2, m_i, mask=h_mask)
            tl.store(part_ml_ptr + row_id * 2 + 1, l_i, mask=h_mask)

    @triton.jit
    def _mla_merge_kernel(
        part_acc_ptr,  # [NUM_SPLITS, B, H, BLOCK_L] fp32
        part_ml_ptr,  # [NUM_SPLITS, B, H, 2] fp32
        out_ptr,  # [B, H, L]
        num_heads,
        num_queries,
        stride_ob,
        stride_oh,
        KV_LORA: tl.constexpr,
        BLOCK_L: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
    ):
        """One program per (query, head): weight each split's partial sums by ``exp2(m_split - m_max)``."""
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        offs_l = tl.arange(0, BLOCK_L)
        split_stride = num_queries * num_heads
        base = b * num_heads + h
        m_max = tl.full([], float("-inf"), dtype=tl.float32)
        for s in range(NUM_SPLITS):
            m_max = tl.maximum(m_max, tl.load(part_ml_ptr + (s * split_stride + base) * 2))
        m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)  # all splits empty (seq_len 0): no -inf - -inf
        acc = tl.zeros([BLOCK_L], dtype=tl.float32)
        l_sum = tl.zeros([], dtype=tl.float32)
        for s in range(NUM_SPLITS):
            row = s * split_stride + base
            m_s = tl.load(part_ml_ptr + row * 2)
            l_s = tl.load(part_ml_ptr + row * 2 + 1)
            w = tl.math.exp2(m_s - m_ref)  # an empty split (m_s = -inf) weighs nothing
            acc += w * tl.load(part_acc_ptr + row * BLOCK_L + offs_l)
            l_sum += w * l_s
        out = acc / tl.where(l_sum > 0.0, l_sum, 1.0)
        tl.store(
            out_ptr + b * stride_ob + h * stride_oh + offs_l,
            out.to(out_ptr.dtype.element_ty),
            mask=offs_l < KV_LORA,
        )


def tile_config(kv_lora_rank: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """``(BLOCK_H, TILE_N, num_warps, num_stages)``. Untuned guesses: 16 heads per program (``tl.dot``'s least
    M), key tiles of 32 rows for 16-bit inputs and 16 for exact fp32 dots or wide latents."""
    block_l = triton.next_power_of_2(kv_lora_rank)
    tile_n = 16 if dtype == torch.float32 or block_l > 512 else 32
    return 16, tile_n, 4, 2


def mla_decode(
    q_latent: torch.Tensor,  # [B, H, L]
    q_pe: torch.Tensor,  # [B, H, R]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, L + R]
    block_table: torch.Tensor,  # [>= B, max_blocks] int32
    seq_lens: torch.Tensor,  # [>= B] int32, context length of each query (its own key included)
    scale: float,
    max_seq_len: int,  # an upper bound of seq_lens[:B] (sizes the split count only)
    out: torch.Tensor | None = None,  # [B, H, L]
    num_splits: int | None = None,  # force a split count (tests); None = the rule in the module docstring
) -> torch.Tensor:  # [B, H, L], q_latent's dtype
    """Latent-space attention of one query per row over its paged context; see the module docstring."""
    assert q_latent.dim() == 3 and q_pe.dim() == 3, f"q {tuple(q_latent.shape)}, q_pe {tuple(q_pe.shape)}"
    num_queries, num_heads, kv_lora_rank = q_latent.shape
    rope_dim = q_pe.shape[2]
    assert q_pe.shape[:2] == (num_queries, num_heads), (
        f"q_pe {tuple(q_pe.shape)} vs q {tuple(q_latent.shape)}"
    )
    assert kv_cache.dim() == 3 and kv_cache.shape[2] == kv_lora_rank + rope_dim, (
        f"kv_cache {tuple(kv_cache.shape)} is not [num_blocks, block_size, {kv_lora_rank} + {rope_dim}]"
    )
    assert q_latent.dtype == q_pe.dtype == kv_cache.dtype, (
        f"dtypes differ: q {q_latent.dtype}, q_pe {q_pe.dtype}, cache {kv_cache.dtype}"
    )
    assert q_latent.stride(2) == 1 and q_pe.stride(2) == 1 and kv_cache.stride(2) == 1, (
        "last dims must be contiguous"
    )
    assert block_table.dtype == torch.int32 and block_table.dim() == 2 and block_table.shape[0] >= num_queries
    assert seq_lens.dtype == torch.int32 and seq_lens.shape[0] >= num_queries
    if out is None:
        out = torch.empty_like(q_latent, memory_format=torch.contiguous_format)
    assert out.shape == q_latent.shape and out.stride(2) == 1
    if num_queries == 0:
        return out
    block_h, tile_n, num_warps, num_stages = tile_config(kv_lora_rank, q_latent.dtype)
    block_l = triton.next_power_of_2(kv_lora_rank)
    block_r = max(16, triton.next_power_of_2(rope_dim))
    head_blocks = triton.cdiv(num_heads, block_h)
    if num_splits is None:
        from pagedllm.kernels.paged_attention import num_kv_splits

        num_splits = num_kv_splits(num_queries * head_blocks, 1, max_seq_len, _num_sms(q_latent.device))
    if num_splits > 1:
        part_acc = torch.empty(
            num_splits, num_queries, num_heads, block_l, dtype=torch.float32, device=out.device
        )
        part_ml = torch.empty(num_splits, num_queries, num_heads, 2, dtype=torch.float32, device=out.device)
    else:
        part_acc = part_ml = out  # unused
    _mla_decode_kernel[(num_queries, head_blocks, num_splits)](
        q_latent, q_pe, kv_cache, block_table, seq_lens, out, part_acc, part_ml,
        float(scale) * _LOG2E, num_heads, num_queries,
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0), out.stride(0), out.stride(1),
        KV_LORA=kv_lora_rank, ROPE=rope_dim, BLOCK_H=block_h, BLOCK_L=block_l, BLOCK_R=block_r, TILE_N=tile_n,
        BLOCK_SIZE=kv_cache.shape[1], NUM_SPLITS=num_splits,
        DOT_PRECISION="ieee" if q_latent.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if num_splits > 1:
        _mla_merge_kernel[(num_queries, num_heads)](
            part_acc, part_ml, out, num_heads, num_queries, out.stride(0), out.stride(1),
            KV_LORA=kv_lora_rank, BLOCK_L=block_l, NUM_SPLITS=num_splits, num_warps=4 if block_l >= 256 else 1,
        )  # fmt: skip
    return out


def mla_decode_ref(
    q_latent: torch.Tensor,  # [B, H, L]
    q_pe: torch.Tensor,  # [B, H, R]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, L + R]
    block_table: torch.Tensor,  # [>= B, max_blocks] int
    seq_lens: torch.Tensor,  # [>= B] int, on q's device
    scale: float,
    max_seq_len: int,  # an upper bound of seq_lens[:B]
) -> torch.Tensor:  # [B, H, L], q_latent's dtype
    """PyTorch twin of :func:`mla_decode` (and the CPU decode path): every query's context gathered through its
    block table, padded to ``max_seq_len`` and masked. Computed in float32 (float64 for float64 inputs); no host
    sync, so it may run inside a CUDA graph. A query with ``seq_lens == 0`` comes out zero."""
    num_queries, _, kv_lora_rank = q_latent.shape
    block_size = kv_cache.shape[1]
    acc_dtype = torch.promote_types(q_latent.dtype, torch.float32)
    num_blocks = max(1, math.ceil(max_seq_len / block_size))
    lens = seq_lens[:num_queries].to(torch.long)  # [B]
    blocks = block_table[:num_queries, :num_blocks].long()  # [B, num_blocks]
    # Entries past a query's own blocks may hold anything (invalid ids): read block 0 there, masked below.
    own = (
        torch.arange(num_blocks, device=blocks.device)[None, :]
        < ((lens + block_size - 1) // block_size)[:, None]
    )
    blocks = blocks.masked_fill(~own, 0)
    span = num_blocks * block_size
    ctx = kv_cache[blocks].flatten(1, 2).to(acc_dtype)  # [B, span, L + R]
    visible = torch.arange(span, device=ctx.device)[None, :] < lens[:, None]  # [B, span]
    ctx = ctx.masked_fill(~visible[:, :, None], 0.0)  # unwritten slots may hold NaN; 0 * NaN would leak
    latent, k_pe = ctx[..., :kv_lora_rank], ctx[..., kv_lora_rank:]  # [B, span, L], [B, span, R]
    scores = q_latent.to(acc_dtype) @ latent.transpose(1, 2) + q_pe.to(acc_dtype) @ k_pe.transpose(1, 2)
    scores = (scores * scale).masked_fill(~visible[:, None, :], float("-inf"))  # [B, H, span]
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # an empty context: all -inf -> NaN -> 0
    return (probs @ latent).to(q_latent.dtype)  # [B, H, L]
