"""Write this step's keys and values into the paged KV cache.

Token t goes to slot ``slot_mapping[t]`` = ``block_id * block_size + offset``; a slot of -1 means "skip"
(padding tokens). One program per token copies all of its KV heads, keys and values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_dim]: keys at 0, values at stride_kv
    slot_mapping_ptr,  # [num_tokens] int64
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kv,
    stride_cb,
    stride_cs,
    stride_ch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HEAD_DIM)[None, :]
    mask = h < NUM_KV_HEADS
    src_t = t.to(tl.int64)
    k = tl.load(key_ptr + src_t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + src_t * stride_vt + h * stride_vh + d, mask=mask)
    dst = block * stride_cb + offset * stride_cs + h * stride_ch + d
    tl.store(kv_cache_ptr + dst, k, mask=mask)
    tl.store(kv_cache_ptr + stride_kv + dst, v, mask=mask)


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [>= num_tokens] int64, -1 = skip
) -> None:
    """Scatter ``key``/``value`` into ``kv_cache`` in place. One launch, grid ``(num_tokens,)``."""
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape, f"value {tuple(value.shape)} != key {tuple(key.shape)}"
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, f"bad kv_cache shape {tuple(kv_cache.shape)}"
    assert kv_cache.shape[3] == num_kv_heads and kv_cache.shape[4] == head_dim, (
        f"kv_cache {tuple(kv_cache.shape)} does not match key {tuple(key.shape)}"
    )
    assert key.dtype == value.dtype == kv_cache.dtype, (
        f"dtypes differ: key {key.dtype}, value {value.dtype}, cache {kv_cache.dtype}"
    )
    assert slot_mapping.dtype == torch.int64 and slot_mapping.shape[0] >= num_tokens
    assert key.stride(2) == 1 and value.stride(2) == 1 and kv_cache.stride(4) == 1, (
        "head_dim must be contiguous"
    )
    assert head_dim & (head_dim - 1) == 0, f"head_dim {head_dim} must be a power of two"
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        BLOCK_SIZE=kv_cache.shape[2],
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )


def reshape_and_cache_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [>= num_tokens] int64, -1 = skip
) -> None:
    """PyTorch twin of :func:`reshape_and_cache`."""
    num_tokens = key.shape[0]
    block_size = kv_cache.shape[2]
    slots = slot_mapping[:num_tokens]
    keep = slots >= 0
    slots = slots[keep]
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[0, blocks, offsets] = key[keep]
    kv_cache[1, blocks, offsets] = value[keep]
