"""Neox-style rotary embedding applied in place to q and k.

For each token at position ``p`` and each head, the first ``rotary_dim = 2 * cos_cache.shape[1]`` dims are
split into halves ``x1, x2`` and replaced by ``x1 * cos - x2 * sin`` and ``x2 * cos + x1 * sin`` with
``cos = cos_cache[p]``, ``sin = sin_cache[p]``; dims past ``rotary_dim`` are untouched. Math in fp32, one
rounding to the tensor dtype. One program per token handles all q and k heads. ``rotary_dim // 2`` need not be
a power of two (Phi-3's 48): the kernel pads it to one and masks the rest.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.pdl import pdl_launch_options, pdl_prologue
from pagedllm.kernels.reshape_and_cache import KVCacheWrite, cache_token
from pagedllm.platform import use_pdl


@triton.jit
def _rotate_heads(
    x_ptr,
    row,
    stride_t,
    stride_h,
    cos,
    sin,
    num_heads,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HALF_PAD)[None, :]
    mask = (h < num_heads) & (d < HALF)
    ptr1 = x_ptr + row * stride_t + h * stride_h + d
    x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr1 + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptr1, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(ptr1 + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_ptr,  # [num_tokens, num_kv_heads, head_dim]
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
    HALF: tl.constexpr,  # rotary_dim // 2
    HALF_PAD: tl.constexpr,  # next power of two >= HALF
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
    _rotate_heads(q_ptr, row, stride_qt, stride_qh, cos, sin, num_heads, Q_HEADS_PAD, HALF, HALF_PAD)
    _rotate_heads(k_ptr, row, stride_kt, stride_kh, cos, sin, num_kv_heads, K_HEADS_PAD, HALF, HALF_PAD)
    if CACHE:
        tl.debug_barrier()  # the rotated keys this program stored are visible to all its threads
        cache_token(
            row, k_ptr, stride_kt, stride_kh, value_ptr, kv_cache_ptr, slot_mapping_ptr, k_scale, v_scale, stride_vt,
            stride_vh, stride_kv, stride_cb, stride_cs, stride_ch, num_kv_heads, HEAD_DIM_POW2, K_HEADS_PAD,
            BLOCK_SIZE, FP8,
        )  # fmt: skip


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int32/int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated in place
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    cos_cache: torch.Tensor,  # [max_position, rotary_dim // 2]
    sin_cache: torch.Tensor,  # [max_position, rotary_dim // 2]
    cache: KVCacheWrite | None = None,  # also write the rotated keys and the values into the paged cache
) -> None:
    assert query.dim() == 3 and key.dim() == 3, f"q {tuple(query.shape)}, k {tuple(key.shape)}"
    num_tokens, num_heads, head_dim = query.shape
    assert key.shape[0] == num_tokens and key.shape[2] == head_dim, (
        f"k {tuple(key.shape)} vs q {tuple(query.shape)}"
    )
    assert positions.shape == (num_tokens,) and positions.dtype in (torch.int32, torch.int64)
    assert cos_cache.shape == sin_cache.shape and cos_cache.dim() == 2, f"cos {tuple(cos_cache.shape)}"
    half = cos_cache.shape[1]
    assert 0 < 2 * half <= head_dim, f"rotary_dim {2 * half} must be in (0, head_dim {head_dim}]"
    assert query.dtype == key.dtype, f"q {query.dtype} != k {key.dtype}"
    assert query.stride(2) == 1 and key.stride(2) == 1, "head_dim must be contiguous"
    assert cos_cache.stride(1) == 1 and sin_cache.stride(1) == 1
    if num_tokens == 0:
        return
    heads_pad = triton.next_power_of_2(max(num_heads, key.shape[1]))
    half_pad = triton.next_power_of_2(half)
    pdl = use_pdl(query)
    if cache is not None:
        cache.check(key)
    _rotary_kernel[(num_tokens,)](
        query, key, cos_cache, sin_cache, positions,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), cos_cache.stride(0), sin_cache.stride(0),
        num_heads, key.shape[1], *cache_launch_args(cache, query),
        HALF=half, HALF_PAD=half_pad, Q_HEADS_PAD=triton.next_power_of_2(num_heads),
        K_HEADS_PAD=triton.next_power_of_2(key.shape[1]), **cache_launch_options(cache, head_dim), PDL=pdl,
        num_warps=4 if heads_pad * half_pad >= 1024 else 1,
        **pdl_launch_options(pdl),
    )  # fmt: skip


def cache_launch_args(cache: KVCacheWrite | None, dummy: torch.Tensor) -> tuple:
    """The CACHE arguments of the RoPE kernels: the write's, or placeholders (never read) without one."""
    if cache is not None:
        return cache.launch_args()
    return (dummy, dummy, dummy, 1.0, 1.0, 0, 0, 0, 0, 0, 0)


def cache_launch_options(cache: KVCacheWrite | None, head_dim: int) -> dict:
    """The CACHE constexprs of the RoPE kernels."""
    return dict(
        HEAD_DIM_POW2=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=cache.kv_cache.shape[2] if cache is not None else 1,
        FP8=cache is not None and cache.kv_cache.dtype == torch.float8_e4m3fn,
        CACHE=cache is not None,
    )


def rotary_embedding_ref(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> None:
    """PyTorch twin of :func:`rotary_embedding` (also in place)."""
    half = cos_cache.shape[1]
    cos = cos_cache[positions].float()[:, None, :]  # [num_tokens, 1, half]
    sin = sin_cache[positions].float()[:, None, :]
    for x in (query, key):
        x1, x2 = x[..., :half].float(), x[..., half : 2 * half].float()
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        x[..., : 2 * half] = rotated.to(x.dtype)
