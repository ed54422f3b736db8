"""Per-head RMSNorm of q and k fused with neox-style rotary embedding, in place, in one launch.

Qwen3-style attention norms every q head with one ``[head_dim]`` weight and every k head with another, then
rotates both; unfused that is three launches (two :func:`~pagedllm.kernels.rms_norm.rms_norm`, one
:func:`~pagedllm.kernels.rotary.rotary_embedding`) and three round trips of q and k through memory.

Numerics are the unfused sequence's, rounding for rounding. Per head, with ``x`` in the tensor dtype:
``normed = (x.float() * rsqrt(mean(x.float()**2) + eps)).to(dtype)``, ``y = (normed.float() * w.float()).to(dtype)``
(as ``_rms_norm_kernel``); then the first ``rotary_dim = 2 * cos_cache.shape[1]`` dims of ``y`` split into halves
``y1, y2`` become ``y1 * cos - y2 * sin`` and ``y2 * cos + y1 * sin`` in fp32 with one rounding to the dtype, and
dims past ``rotary_dim`` keep ``y``. One program per token handles all q and k heads: it loads each head's two
rotary halves (and the tail past ``rotary_dim``) as separate tiles, so the norm's sum of squares and the rotation
both come from registers with no store/reload in between.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.pdl import pdl_launch_options, pdl_prologue
from pagedllm.kernels.reshape_and_cache import KVCacheWrite, cache_token
from pagedllm.kernels.rms_norm import rms_norm_ref
from pagedllm.kernels.rotary import cache_launch_args, cache_launch_options, rotary_embedding_ref
from pagedllm.platform import use_pdl


@triton.jit
def _norm_rope_heads(
    x_ptr, w_ptr, row, stride_t, stride_h, num_heads, eps, cos, sin,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr, TAIL_PAD: tl.constexpr,
    HEADS_PAD: tl.constexpr,
):  # fmt: skip
    dtype = x_ptr.dtype.element_ty
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HALF_PAD)[None, :]
    head_mask = h < num_heads
    dim_mask = d < HALF
    mask = head_mask & dim_mask
    ptr1 = x_ptr + row * stride_t + h * stride_h + d  # [HEADS_PAD, HALF_PAD]: dims [0, HALF)
    x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr1 + HALF, mask=mask, other=0.0).to(tl.float32)  # dims [HALF, 2 * HALF)
    sum_sq = tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)  # [HEADS_PAD]
    if TAIL_PAD > 0:  # partial rotary: dims [2 * HALF, HEAD_DIM) are normed, not rotated
        t = 2 * HALF + tl.arange(0, TAIL_PAD)[None, :]
        tail_mask = head_mask & (t < HEAD_DIM)
        ptr3 = x_ptr + row * stride_t + h * stride_h + t
        x3 = tl.load(ptr3, mask=tail_mask, other=0.0).to(tl.float32)
        sum_sq += tl.sum(x3 * x3, 1)
    inv_rms = tl.math.rsqrt(sum_sq / HEAD_DIM + eps)[:, None]  # [HEADS_PAD, 1]
    w1 = tl.load(w_ptr + d, mask=dim_mask, other=0.0).to(tl.float32)  # [1, HALF_PAD]
    w2 = tl.load(w_ptr + HALF + d, mask=dim_mask, other=0.0).to(tl.float32)
    y1 = ((x1 * inv_rms).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
    y2 = ((x2 * inv_rms).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    tl.store(ptr1, (y1 * cos - y2 * sin).to(dtype), mask=mask)
    tl.store(ptr1 + HALF, (y2 * cos + y1 * sin).to(dtype), mask=mask)
    if TAIL_PAD > 0:
        w3 = tl.load(w_ptr + t, mask=t < HEAD_DIM, other=0.0).to(tl.float32)
        tl.store(ptr3, ((x3 * inv_rms).to(dtype).to(tl.float32) * w3).to(dtype), mask=tail_mask)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_ptr,  # [num_tokens, num_kv_heads, head_dim]
    q_weight_ptr,  # [head_dim]
    k_weight_ptr,  # [head_dim]
    cos_ptr,  # [max_position, rotary_dim // 2]
    sin_ptr,  # [max_position, rotary_dim // 2]
    positions_ptr,  # [num_tokens]
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    stride_sin,
    num_heads,
    num_kv_heads,
    eps,
    # With CACHE (a KVCacheWrite, kernels/reshape_and_cache.py): also write the rotated keys and the values into
    # the paged cache, as reshape_and_cache would (else these are unused).
    value_ptr,
    kv_cache_ptr,
    slot_mapping_ptr,
    k_scale,
    v_scale,
    stride_vt,
    stride_vh,
    stride_kv,
    stride_cb,
    stride_cs,
    stride_ch,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,  # rotary_dim // 2
    HALF_PAD: tl.constexpr,  # next power of two >= HALF
    TAIL_PAD: tl.constexpr,  # next power of two >= HEAD_DIM - 2 * HALF (0: full rotary)
    Q_HEADS_PAD: tl.constexpr,
    K_HEADS_PAD: tl.constexpr,
    HEAD_DIM_POW2: tl.constexpr,  # head_dim (a power of two with CACHE)
    BLOCK_SIZE: tl.constexpr,
    FP8: tl.constexpr,
    CACHE: tl.constexpr,
    PDL: tl.constexpr,  # launched as a programmatic dependent launch (pagedllm/kernels/pdl.py)
):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + row).to(tl.int64)
    d = tl.arange(0, HALF_PAD)[None, :]
    cos = tl.load(cos_ptr + pos * stride_cos + d, mask=d < HALF, other=0.0).to(tl.float32)  # [1, HALF_PAD]
    sin = tl.load(sin_ptr + pos * stride_sin + d, mask=d < HALF, other=0.0).to(tl.float32)
    _norm_rope_heads(
        q_ptr, q_weight_ptr, row, stride_qt, stride_qh, num_heads, eps, cos, sin,
        HEAD_DIM, HALF, HALF_PAD, TAIL_PAD, Q_HEADS_PAD,
    )  # fmt: skip
    _norm_rope_heads(
        k_ptr, k_weight_ptr, row, stride_kt, stride_kh, num_kv_heads, eps, cos, sin,
        HEAD_DIM, HALF, HALF_PAD, TAIL_PAD, K_HEADS_PAD,
    )  # fmt: skip
    if CACHE:
        tl.debug_barrier()  # the rotated keys this program stored are visible to all its threads
        cache_token(
            row, k_ptr, stride_kt, stride_kh, value_ptr, kv_cache_ptr, slot_mapping_ptr, k_scale, v_scale, stride_vt,
            stride_vh, stride_kv, stride_cb, stride_cs, stride_ch, num_kv_heads, HEAD_DIM_POW2, K_HEADS_PAD,
            BLOCK_SIZE, FP8,
        )  # fmt: skip


def qk_norm_rope(
    positions: torch.Tensor,  # [num_tokens] int32/int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], normed and rotated in place
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], normed and rotated in place
    q_weight: torch.Tensor,  # [head_dim]
    k_weight: torch.Tensor,  # [head_dim]
    eps: float,
    cos_cache: torch.Tensor,  # [max_position, rotary_dim // 2]
    sin_cache: torch.Tensor,  # [max_position, rotary_dim // 2]
    cache: KVCacheWrite | None = None,  # also write the keys (normed, rotated) and values into the paged cache
) -> None:
    assert query.dim() == 3 and key.dim() == 3, f"q {tuple(query.shape)}, k {tuple(key.shape)}"
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    assert key.shape[0] == num_tokens and key.shape[2] == head_dim, (
        f"k {tuple(key.shape)} vs q {tuple(query.shape)}"
    )
    assert q_weight.shape == (head_dim,) and k_weight.shape == (head_dim,), (
        f"q_weight {tuple(q_weight.shape)}, k_weight {tuple(k_weight.shape)}: want ({head_dim},)"
    )
    assert positions.shape == (num_tokens,) and positions.dtype in (torch.int32, torch.int64), (
        f"positions {tuple(positions.shape)} {positions.dtype}: want ({num_tokens},) int32/int64"
    )
    assert cos_cache.shape == sin_cache.shape and cos_cache.dim() == 2, (
        f"cos {tuple(cos_cache.shape)}, sin {tuple(sin_cache.shape)}"
    )
    half = cos_cache.shape[1]
    assert 0 < 2 * half <= head_dim, f"rotary_dim {2 * half} must be in (0, head_dim {head_dim}]"
    assert query.dtype == key.dtype, f"q {query.dtype} != k {key.dtype}"
    assert query.stride(2) == 1 and key.stride(2) == 1, "head_dim must be contiguous"
    assert q_weight.stride(0) == 1 and k_weight.stride(0) == 1, "weights must be contiguous"
    assert cos_cache.stride(1) == 1 and sin_cache.stride(1) == 1, "cos/sin rows must be contiguous"
    if num_tokens == 0:
        return
    tail = head_dim - 2 * half
    q_heads_pad, k_heads_pad = triton.next_power_of_2(num_heads), triton.next_power_of_2(num_kv_heads)
    tile = max(q_heads_pad, k_heads_pad) * triton.next_power_of_2(head_dim)
    pdl = use_pdl(query)
    if cache is not None:
        cache.check(key)
    _qk_norm_rope_kernel[(num_tokens,)](
        query, key, q_weight, k_weight, cos_cache, sin_cache, positions,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), cos_cache.stride(0), sin_cache.stride(0),
        num_heads, num_kv_heads, eps, *cache_launch_args(cache, query),
        HEAD_DIM=head_dim, HALF=half, HALF_PAD=triton.next_power_of_2(half),
        TAIL_PAD=triton.next_power_of_2(tail) if tail else 0, Q_HEADS_PAD=q_heads_pad, K_HEADS_PAD=k_heads_pad,
        **cache_launch_options(cache, head_dim), PDL=pdl, num_warps=min(max(tile // 512, 1), 8),
        **pdl_launch_options(pdl),
    )  # fmt: skip


def qk_norm_rope_ref(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> None:
    """PyTorch twin of :func:`qk_norm_rope` (also in place): per-head ``rms_norm_ref``, then
    ``rotary_embedding_ref``."""
    query.copy_(rms_norm_ref(query, q_weight, eps))
    key.copy_(rms_norm_ref(key, k_weight, eps))
    rotary_embedding_ref(positions, query, key, cos_cache, sin_cache)
