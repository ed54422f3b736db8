"""Multi-LoRA shrink and expand: each token of a flattened batch goes through its own adapter's A and B.

Layout of one LoRA layer (``pagedllm.lora.layers``), ``R = max_lora_rank``, ``S`` output slices (3 for q/k/v,
2 for gate/up, else 1)::

    lora_a: [max_loras, S * R, in]      slice s of slot l: rows [s*R, (s+1)*R) of lora_a[l]
    lora_b: [max_loras, out, R]         slice s: rows [slice_offsets[s], slice_offsets[s+1]) (scaling folded in)

    shrink:  h[t, :]          = x[t] @ lora_a[slot[t]].T                       h: [num_tokens, S * R] float32
    expand:  y[t, off_s:off_s+1] += h[t, s*R:(s+1)*R] @ lora_b[slot[t], off_s:off_s+1].T   for every slice s

Tokens with slot -1 are skipped (their ``h`` rows are never written, their ``y`` rows never touched).

The kernels work on tokens grouped by slot (``sorted_token_ids``: token indices ordered by slot, slot ``l``'s
at ``[slot_start[l], slot_start[l] + slot_num_tokens[l])``), so each program multiplies a tile of tokens that
share one adapter with ``tl.dot``. The grid is ``(max_loras [* S], cdiv(num_tokens, BLOCK_M), n-blocks)``:
it depends on the batch only through ``num_tokens``; the grouping is read from device memory, so a CUDA graph
captured at a padded size replays for any slot assignment written into the same buffers. Programs past their
slot's token count return at once.

The PyTorch twins (in ``pagedllm.lora.ops_ref``, importable without Triton) take the per-token slots directly (``token_slots: [num_tokens] int64``) and are the oracle.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _lora_shrink_kernel(
    x_ptr,  # [num_tokens, K]
    a_ptr,  # [max_loras, N, K]
    h_ptr,  # [num_tokens, N] float32
    sorted_ids_ptr,  # [>= num_tokens] int32: token indices grouped by slot
    slot_num_tokens_ptr,  # [max_loras] int32
    slot_start_ptr,  # [max_loras] int32
    N,
    K,
    stride_xm,
    stride_as,
    stride_an,
    stride_hm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    slot = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(2)
    count = tl.load(slot_num_tokens_ptr + slot)
    if pid_m * BLOCK_M >= count:
        return
    start = tl.load(slot_start_ptr + slot)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < count
    tok = tl.load(sorted_ids_ptr + start + offs_m, mask=mask_m, other=0).to(tl.int64)  # [BLOCK_M]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    a_base = a_ptr + slot.to(tl.int64) * stride_as
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(
            x_ptr + tok[:, None] * stride_xm + offs_k[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        a = tl.load(
            a_base + offs_n[None, :] * stride_an + offs_k[:, None],
            mask=mask_n[None, :] & mask_k[:, None],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(x, a, acc, input_precision=PRECISION)
    tl.store(h_ptr + tok[:, None] * stride_hm + offs_n[None, :], acc, mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _lora_expand_kernel(
    h_ptr,  # [num_tokens, S * R] float32
    b_ptr,  # [max_loras, out, R]
    y_ptr,  # [num_tokens, out], updated in place
    sorted_ids_ptr,  # [>= num_tokens] int32
    slot_num_tokens_ptr,  # [max_loras] int32
    slot_start_ptr,  # [max_loras] int32
    slice_offsets_ptr,  # [S + 1] int32
    R,
    stride_hm,
    stride_bs,
    stride_bn,
    stride_ym,
    NUM_SLICES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid0 = tl.program_id(0)
    slot = pid0 // NUM_SLICES
    s = pid0 % NUM_SLICES
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(2)
    count = tl.load(slot_num_tokens_ptr + slot)
    if pid_m * BLOCK_M >= count:
        return
    n_lo = tl.load(slice_offsets_ptr + s)
    n_hi = tl.load(slice_offsets_ptr + s + 1)
    if n_lo + pid_n * BLOCK_N >= n_hi:
        return
    start = tl.load(slot_start_ptr + slot)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < count
    tok = tl.load(sorted_ids_ptr + start + offs_m, mask=mask_m, other=0).to(tl.int64)  # [BLOCK_M]
    offs_n = n_lo + pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n_hi
    b_base = b_ptr + slot.to(tl.int64) * stride_bs
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, R, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < R
        h = tl.load(
            h_ptr + tok[:, None] * stride_hm + s * R + offs_k[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        ).to(b_ptr.dtype.element_ty)  # [BLOCK_M, BLOCK_K]
        b = tl.load(
            b_base + offs_n[None, :] * stride_bn + offs_k[:, None],
            mask=mask_n[None, :] & mask_k[:, None],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(h, b, acc, input_precision=PRECISION)
    y_ptrs = y_ptr + tok[:, None] * stride_ym + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + acc).to(y_ptr.dtype.element_ty), mask=mask)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32 stays exact; ignored for 16-bit inputs


def _block(n: int, lo: int = 16, hi: int = 64) -> int:
    return max(lo, min(hi, triton.next_power_of_2(max(n, 1))))


def _check_grouping(num_tokens: int, sorted_token_ids, slot_num_tokens, slot_start, max_loras: int) -> None:
    assert sorted_token_ids.dim() == 1 and sorted_token_ids.shape[0] >= num_tokens, (
        "sorted_token_ids too short"
    )
    assert slot_num_tokens.shape == (max_loras,) and slot_start.shape == (max_loras,), (
        f"slot_num_tokens / slot_start must be [max_loras={max_loras}]"
    )
    for t in (sorted_token_ids, slot_num_tokens, slot_start):
        assert t.dtype == torch.int32, "grouping tensors must be int32"


def lora_shrink(
    x: torch.Tensor,  # [num_tokens, in]
    lora_a: torch.Tensor,  # [max_loras, N, in]
    sorted_token_ids: torch.Tensor,  # [>= num_tokens] int32
    slot_num_tokens: torch.Tensor,  # [max_loras] int32
    slot_start: torch.Tensor,  # [max_loras] int32
) -> torch.Tensor:  # [num_tokens, N] float32; rows of tokens without a slot are left unset
    assert x.dim() == 2 and lora_a.dim() == 3 and x.shape[1] == lora_a.shape[2], (
        f"x {tuple(x.shape)} vs lora_a {tuple(lora_a.shape)}"
    )
    assert x.dtype == lora_a.dtype, f"x is {x.dtype}, lora_a is {lora_a.dtype}"
    assert x.stride(1) == 1 and lora_a.stride(2) == 1, "last dims must be contiguous"
    num_tokens, k = x.shape
    max_loras, n, _ = lora_a.shape
    _check_grouping(num_tokens, sorted_token_ids, slot_num_tokens, slot_start, max_loras)
    h = torch.empty((num_tokens, n), dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return h
    block_m, block_n, block_k = 16, _block(n, hi=64), _block(k, hi=128)
    grid = (max_loras, triton.cdiv(num_tokens, block_m), triton.cdiv(n, block_n))
    _lora_shrink_kernel[grid](
        x,
        lora_a,
        h,
        sorted_token_ids,
        slot_num_tokens,
        slot_start,
        n,
        k,
        x.stride(0),
        lora_a.stride(0),
        lora_a.stride(1),
        h.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PRECISION=_precision(x.dtype),
        num_warps=4,
    )
    return h


def lora_expand(
    h: torch.Tensor,  # [num_tokens, S * R] float32
    lora_b: torch.Tensor,  # [max_loras, out, R]
    y: torch.Tensor,  # [num_tokens, out], updated in place
    sorted_token_ids: torch.Tensor,  # [>= num_tokens] int32
    slot_num_tokens: torch.Tensor,  # [max_loras] int32
    slot_start: torch.Tensor,  # [max_loras] int32
    slice_offsets: torch.Tensor,  # [S + 1] int32 on the device: slice s is rows [offsets[s], offsets[s+1])
) -> None:
    assert h.dim() == 2 and lora_b.dim() == 3 and y.dim() == 2, "h, y: 2-D; lora_b: 3-D"
    num_slices = slice_offsets.shape[0] - 1
    max_loras, out, r = lora_b.shape
    assert h.dtype == torch.float32 and h.shape == (y.shape[0], num_slices * r), (
        f"h {tuple(h.shape)} {h.dtype} vs {num_slices} slices of rank {r}"
    )
    assert y.shape[1] == out, f"y {tuple(y.shape)} vs lora_b {tuple(lora_b.shape)}"
    assert slice_offsets.dtype == torch.int32, "slice_offsets must be int32"
    assert h.stride(1) == 1 and lora_b.stride(2) == 1 and y.stride(1) == 1, "last dims must be contiguous"
    num_tokens = y.shape[0]
    _check_grouping(num_tokens, sorted_token_ids, slot_num_tokens, slot_start, max_loras)
    if num_tokens == 0:
        return
    block_m, block_n, block_k = 16, 64, _block(r, hi=64)
    grid = (max_loras * num_slices, triton.cdiv(num_tokens, block_m), triton.cdiv(out, block_n))
    _lora_expand_kernel[grid](
        h,
        lora_b,
        y,
        sorted_token_ids,
        slot_num_tokens,
        slot_start,
        slice_offsets,
        r,
        h.stride(0),
        lora_b.stride(0),
        lora_b.stride(1),
        y.stride(0),
        NUM_SLICES=num_slices,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PRECISION=_precision(lora_b.dtype),
        num_warps=4,
    )


def lora_shrink_ref(x, lora_a, token_slots):  # -> [num_tokens, N] float32
    """PyTorch twin of :func:`lora_shrink`: the reference in ``pagedllm.lora.ops_ref`` (CPU path and oracle)."""
    from pagedllm.lora.ops_ref import lora_shrink_ref as ref

    return ref(x, lora_a, token_slots)


def lora_expand_ref(h, lora_b, y, token_slots, slice_offsets) -> None:
    """PyTorch twin of :func:`lora_expand`: the reference in ``pagedllm.lora.ops_ref``."""
    from pagedllm.lora.ops_ref import lora_expand_ref as ref

    ref(h, lora_b, y, token_slots, slice_offsets)
