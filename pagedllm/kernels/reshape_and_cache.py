"""Write this step's keys and values into the paged KV cache.

Token t goes to slot ``slot_mapping[t]`` = ``block_id * block_size + offset``; a slot of -1 means "skip"
(padding tokens). One program per token copies all of its KV heads, keys and values. A head_dim that is not a power
of two (Phi-3's 96) is padded to one in the program, the lanes past it masked; a power of two has no such mask.

FP8 cache (``float8_e4m3fn``, ``kv_cache_dtype="fp8"``): the program stores
``e4m3(clamp(k / k_scale, -448, 448))`` (values with ``v_scale``), computed in fp32 (IEEE division) and rounded to
nearest even, as the twin does, so the two match bit for bit. (Triton 3.9's CPU interpreter converts fp32 to fp8
wrongly: that path is tested on the GPU only.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedllm.kernels.pdl import pdl_launch_options, pdl_prologue
from pagedllm.platform import use_pdl


@dataclass(frozen=True)
class KVCacheWrite:
    """Where a kernel that produces this step's keys (RoPE, q/k norm + RoPE) also writes them, with the values,
    into the paged cache, as :func:`reshape_and_cache` would; the attention backend then skips its own write."""

    value: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor  # [>= num_tokens] int64, -1 = skip
    k_scale: float = 1.0  # FP8 cache only
    v_scale: float = 1.0

    def check(self, key: torch.Tensor) -> None:
        _check(key, self.value, self.kv_cache, self.slot_mapping)
        head_dim = key.shape[2]
        # The RoPE kernels hand cache_token next_power_of_2(head_dim) as HEAD_DIM (no HEAD_PAD): only exact for a
        # power of two; any other head would be written past its end.
        assert head_dim & (head_dim - 1) == 0, (
            f"head_dim {head_dim}: the RoPE kernels write the KV cache of power-of-two heads only"
        )

    def launch_args(self) -> tuple:
        """value, kv_cache, slot_mapping, k_scale, v_scale and the strides, in :func:`cache_token`'s order."""
        v, c = self.value, self.kv_cache
        return (
            v, c, self.slot_mapping, float(self.k_scale), float(self.v_scale), v.stride(0), v.stride(1),
            c.stride(0), c.stride(1), c.stride(2), c.stride(3),
        )  # fmt: skip


@triton.jit
def cache_token(
    t,  # the token (row of key/value)
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    stride_kt,
    stride_kh,
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_dim]: keys at 0, values at stride_kv
    slot_mapping_ptr,  # [num_tokens] int64
    k_scale,
    v_scale,
    stride_vt,
    stride_vh,
    stride_kv,
    stride_cb,
    stride_cs,
    stride_ch,
    num_kv_heads,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FP8: tl.constexpr,
    HEAD_PAD: tl.constexpr = 0,  # next power of two >= HEAD_DIM; 0 (or HEAD_DIM): HEAD_DIM is a power of two
):
    """Copy token ``t``'s keys and values (all KV heads) into its cache slot; nothing for slot -1."""
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot >= 0:
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        h = tl.arange(0, HEADS_PAD)[:, None]
        if HEAD_PAD > HEAD_DIM:  # [HEADS_PAD, HEAD_PAD] tile, the lanes past HEAD_DIM masked
            d = tl.arange(0, HEAD_PAD)[None, :]
            mask = (h < num_kv_heads) & (d < HEAD_DIM)
        else:
            d = tl.arange(0, HEAD_DIM)[None, :]
            mask = h < num_kv_heads
        src_t = t.to(tl.int64)
        k = tl.load(key_ptr + src_t * stride_kt + h * stride_kh + d, mask=mask)
        v = tl.load(value_ptr + src_t * stride_vt + h * stride_vh + d, mask=mask)
        if FP8:
            fp8 = kv_cache_ptr.dtype.element_ty
            k = tl.clamp(tl.div_rn(k.to(tl.float32), k_scale), -448.0, 448.0).to(fp8)
            v = tl.clamp(tl.div_rn(v.to(tl.float32), v_scale), -448.0, 448.0).to(fp8)
        dst = block * stride_cb + offset * stride_cs + h * stride_ch + d
        tl.store(kv_cache_ptr + dst, k, mask=mask)
        tl.store(kv_cache_ptr + stride_kv + dst, v, mask=mask)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_dim]: keys at 0, values at stride_kv
    slot_mapping_ptr,  # [num_tokens] int64
    k_scale,  # with FP8: fp32 per-tensor scale of the keys (else unused)
    v_scale,
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
    HEAD_PAD: tl.constexpr,  # next power of two >= HEAD_DIM
    HEADS_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FP8: tl.constexpr,  # the cache is float8_e4m3fn: scale, clamp and round on the way in
    PDL: tl.constexpr,  # launched as a programmatic dependent launch (pagedllm/kernels/pdl.py)
):
    pdl_prologue(PDL)
    cache_token(
        tl.program_id(0), key_ptr, stride_kt, stride_kh, value_ptr, kv_cache_ptr, slot_mapping_ptr, k_scale, v_scale,
        stride_vt, stride_vh, stride_kv, stride_cb, stride_cs, stride_ch, NUM_KV_HEADS, HEAD_DIM, HEADS_PAD,
        BLOCK_SIZE, FP8, HEAD_PAD,
    )  # fmt: skip


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [>= num_tokens] int64, -1 = skip
    k_scale: float = 1.0,  # FP8 cache only: stored key = e4m3(clamp(key / k_scale))
    v_scale: float = 1.0,
) -> None:
    """Scatter ``key``/``value`` into ``kv_cache`` in place. One launch, grid ``(num_tokens,)``."""
    _check(key, value, kv_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    head_pad = triton.next_power_of_2(head_dim)
    pdl = use_pdl(key)
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        float(k_scale),
        float(v_scale),
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
        HEAD_PAD=head_pad,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        BLOCK_SIZE=kv_cache.shape[2],
        FP8=fp8,
        PDL=pdl,
        num_warps=4 if num_kv_heads * head_pad >= 1024 else 1,
        **pdl_launch_options(pdl),
    )


def _check(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape, f"value {tuple(value.shape)} != key {tuple(key.shape)}"
    assert slot_mapping.stride(0) == 1, f"slot_mapping must be contiguous, stride {slot_mapping.stride()}"
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, f"bad kv_cache shape {tuple(kv_cache.shape)}"
    assert kv_cache.shape[3] == num_kv_heads and kv_cache.shape[4] == head_dim, (
        f"kv_cache {tuple(kv_cache.shape)} does not match key {tuple(key.shape)}"
    )
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    assert key.dtype == value.dtype and (fp8 or key.dtype == kv_cache.dtype), (
        f"dtypes differ: key {key.dtype}, value {value.dtype}, cache {kv_cache.dtype}"
    )
    assert slot_mapping.dtype == torch.int64 and slot_mapping.shape[0] >= num_tokens
    assert key.stride(2) == 1 and value.stride(2) == 1 and kv_cache.stride(4) == 1, (
        "head_dim must be contiguous"
    )


def reshape_and_cache_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [>= num_tokens] int64, -1 = skip
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """PyTorch twin of :func:`reshape_and_cache`."""
    num_tokens = key.shape[0]
    block_size = kv_cache.shape[2]
    slots = slot_mapping[:num_tokens]
    keep = slots >= 0
    slots = slots[keep]
    blocks, offsets = slots // block_size, slots % block_size
    key, value = key[keep], value[keep]  # [num_valid, num_kv_heads, head_dim]
    if kv_cache.dtype == torch.float8_e4m3fn:
        from pagedllm.attention.torch_ref import quantize_kv_fp8

        key, value = quantize_kv_fp8(key, k_scale), quantize_kv_fp8(value, v_scale)
    kv_cache[0, blocks, offsets] = key
    kv_cache[1, blocks, offsets] = value
