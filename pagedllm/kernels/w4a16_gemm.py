"""W4A16 GEMM for the GPTQ layout: ``out[M, N] = x[M, K] @ W[K, N]`` with 4-bit ``W`` dequantized in registers.

Operands (a GPTQ layer, all its fused shards side by side along N; see ``pagedllm/quantization/gptq.py``; AWQ
weights are repacked to this layout at load, ``pagedllm/quantization/awq.py``):

- ``qweight: [K / 8, N] int32``: nibble ``j`` of ``qweight[k, n]`` is ``q[8k + j, n]``;
- ``qzeros: [G, N / 8] int32``: nibble ``j`` of ``qzeros[g, c]`` is the stored zero of group ``g``, output ``8c + j``;
  the zero is that plus ``zero_offset`` (1 for GPTQ v1 checkpoints, 0 for v2 and AWQ);
- ``scales: [G, N]`` (any float dtype);
- the group of input channel ``k``: ``g_idx[k]`` (``g_idx: [K] int32``, any map, e.g. act-order), or, with
  ``g_idx=None``, ``k // group_size`` ("grouped": what a checkpoint without act-order has, and what an act-order
  one becomes once its rows are sorted by group at load, the input's columns permuted to match);
- ``W[k, n] = (q[k, n] - zero[group(k), n]) * scales[group(k), n]``.

Each program computes a ``[BLOCK_M, BLOCK_N]`` tile, walking its K range in ``BLOCK_K`` steps: it loads the packed
rows ``k // 8`` (each int32 is read by the 8 rows it holds, from L1), shifts out nibble ``k % 8``, subtracts the
zero and multiplies by the scale in float32 (one rounding to ``x``'s dtype before the product on half types; IEEE
fp32 products for float32 inputs), and accumulates ``x_tile @ W_tile`` in float32. Grouped mode loads one row of
zeros and scales per ``BLOCK_K`` step (``BLOCK_K`` divides ``group_size``); ``g_idx`` mode gathers them per element.

Split-K (decode-sized M): with ``split_k > 1`` the grid gets a third axis; program ``s`` covers K range
``[s * k_split, (s + 1) * k_split)`` and writes its float32 partial tile to ``partials[s]``; the launcher sums the
partials (deterministic, no atomics). The default ``split_k`` (``_config``) fills the GPU when ``M <= 64`` and the N
tiles are too few (``PAGEDLLM_W4A16_SPLIT_K=1`` turns it off, ``=n`` forces ``n``; for A/B runs).

``w4a16_gemm_ref`` is the PyTorch twin (dequantize to float32, then matmul in float32).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@triton.jit
def _w4a16_gemm_kernel(
    x_ptr,  # [M, K]
    qweight_ptr,  # [K / 8, N] int32
    qzeros_ptr,  # [G, N / 8] int32
    scales_ptr,  # [G, N]
    g_idx_ptr,  # [K] int32 (unused when GROUPED)
    out_ptr,  # [M, N] (SPLIT_K == 1) or float32 partials [SPLIT_K, M, N]
    M,
    N,
    K,
    k_split,  # K range of one split (a multiple of BLOCK_K)
    stride_xm,
    stride_xk,
    stride_qk,
    stride_qn,
    stride_zg,
    stride_zn,
    stride_sg,
    stride_sn,
    stride_os,
    stride_om,
    stride_on,
    zero_offset,
    GROUP_SIZE: tl.constexpr,  # GROUPED: the group of k is k // GROUP_SIZE (GROUP_SIZE % BLOCK_K == 0 or >= K)
    GROUPED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    mask_m = offs_m < M
    mask_n = offs_n < N
    zero_shift = (offs_n % 8) * 4  # [BLOCK_N]
    k_start = pid_k * k_split
    k_end = tl.minimum(K, k_start + k_split)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        mask_k = offs_k < k_end
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        mask_kn = mask_k[:, None] & mask_n[None, :]
        packed = tl.load(
            qweight_ptr + (offs_k // 8)[:, None] * stride_qk + offs_n[None, :] * stride_qn,
            mask=mask_kn,
            other=0,
        )  # [BLOCK_K, BLOCK_N] int32
        q = (packed >> ((offs_k % 8) * 4)[:, None]) & 0xF
        if GROUPED:
            g = k0 // GROUP_SIZE  # the whole step lies in one group
            packed_z = tl.load(qzeros_ptr + g * stride_zg + (offs_n // 8) * stride_zn, mask=mask_n, other=0)
            z = ((packed_z >> zero_shift) & 0xF) + zero_offset  # [BLOCK_N]
            s = tl.load(scales_ptr + g * stride_sg + offs_n * stride_sn, mask=mask_n, other=0.0)  # [BLOCK_N]
            w = (q - z[None, :]).to(tl.float32) * s.to(tl.float32)[None, :]  # [BLOCK_K, BLOCK_N]
        else:
            g = tl.load(g_idx_ptr + offs_k, mask=mask_k, other=0)  # [BLOCK_K]
            packed_z = tl.load(
                qzeros_ptr + g[:, None] * stride_zg + (offs_n // 8)[None, :] * stride_zn,
                mask=mask_kn,
                other=0,
            )  # [BLOCK_K, BLOCK_N] int32
            z = ((packed_z >> zero_shift[None, :]) & 0xF) + zero_offset
            s = tl.load(
                scales_ptr + g[:, None] * stride_sg + offs_n[None, :] * stride_sn, mask=mask_kn, other=0.0
            )
            w = (q - z).to(tl.float32) * s.to(tl.float32)  # [BLOCK_K, BLOCK_N]
        if FP32_DOT:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    out = acc.to(out_ptr.dtype.element_ty)
    tl.store(
        out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
        out,
        mask=mask_m[:, None] & mask_n[None, :],
    )


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _split_k_override() -> int | None:
    value = os.environ.get("PAGEDLLM_W4A16_SPLIT_K", "")
    return int(value) if value else None


def _block_k_for(group_size: int, K: int, preferred: int) -> int:
    """The largest power of two <= ``preferred`` (and >= 16) that keeps each step inside one group; 0 if none."""
    if group_size >= K:
        return preferred
    bk = preferred
    while bk > 16 and group_size % bk:
        bk //= 2
    return bk if group_size % bk == 0 else 0


def _config(M: int, N: int, K: int, device: torch.device, dtype: torch.dtype) -> dict[str, int]:
    """Tile sizes by M: decode-sized M gets narrow tiles (and split-K, below), prefill-sized M wide ones."""
    if M <= 16:
        cfg = dict(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3)
    elif M <= 128:
        cfg = dict(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3)
    elif M <= 256:  # narrow N tiles keep >= 128 programs on N = 4096
        cfg = dict(block_m=128, block_n=64, block_k=64, num_warps=4, num_stages=3)
    else:
        cfg = dict(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)
    if dtype == torch.float32:  # fp32 tiles take twice the shared memory per stage
        cfg.update(block_k=min(cfg["block_k"], 32), num_stages=2)
    split = 1
    if M <= 64 and device.type == "cuda":
        tiles = triton.cdiv(M, cfg["block_m"]) * triton.cdiv(N, cfg["block_n"])
        target = 2 * _num_sms(device.index if device.index is not None else torch.cuda.current_device())
        # Split while the grid is short of two waves, each split keeps >= 512 input channels, and the float32
        # partials (M * N * 4 bytes per split, written and read back) stay within a quarter of the weight's bytes.
        while tiles * split * 2 <= target and K // (split * 2) >= 512 and M * split * 2 <= K // 32:
            split *= 2
    cfg["split_k"] = split
    return cfg


def w4a16_gemm(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [K / 8, N] int32
    qzeros: torch.Tensor,  # [G, N / 8] int32
    scales: torch.Tensor,  # [G, N]
    g_idx: torch.Tensor | None = None,  # [K] int32, or None: group k // group_size
    zero_offset: int = 1,
    group_size: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    split_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:  # [M, N] in x.dtype
    """``x @ W`` for a GPTQ-layout weight (module docstring); shapes are checked here. Tile sizes and ``split_k``
    default by M (``_config``); pass them to override (tests, A/B runs)."""
    assert x.dim() == 2, f"x must be [M, K], got {tuple(x.shape)}"
    M, K = x.shape
    N = qweight.shape[1]
    assert qweight.dtype == torch.int32 and qweight.shape == (K // 8, N) and K % 8 == 0, (
        f"qweight must be [K / 8, N] int32 with K={K}, got {tuple(qweight.shape)} {qweight.dtype}"
    )
    assert qzeros.dtype == torch.int32 and qzeros.shape[1] * 8 == N, (
        f"qzeros must be [G, N / 8], got {qzeros.shape}"
    )
    assert scales.shape == (qzeros.shape[0], N), f"scales must be [G, N], got {tuple(scales.shape)}"
    if g_idx is None:
        assert group_size is not None and group_size > 0, "g_idx=None needs group_size"
        assert scales.shape[0] == triton.cdiv(K, group_size), (
            f"{scales.shape[0]} groups for K={K}, group_size={group_size}"
        )
    else:
        assert g_idx.shape == (K,) and g_idx.dtype == torch.int32, (
            f"g_idx must be [K] int32, got {g_idx.shape}"
        )
    cfg = _config(M, N, K, x.device, x.dtype)
    given = dict(
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        split_k=split_k,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    cfg.update({k: v for k, v in given.items() if v is not None})
    if split_k is None and _split_k_override() is not None:
        cfg["split_k"] = _split_k_override()
    bk = cfg["block_k"]
    assert bk % 8 == 0 and bk >= 16
    grouped = g_idx is None
    if grouped:
        fitted = _block_k_for(group_size, K, bk)
        if fitted == 0:  # groups narrower than a dot step: gather per channel
            g_idx = (torch.arange(K, device=x.device) // group_size).to(torch.int32)
            grouped = False
        else:
            bk = fitted
    split = max(1, min(cfg["split_k"], triton.cdiv(K, bk)))
    k_split = triton.cdiv(triton.cdiv(K, split), bk) * bk  # a multiple of BLOCK_K
    split = triton.cdiv(K, k_split)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    target = out if split == 1 else torch.empty((split, M, N), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(M, cfg["block_m"]), triton.cdiv(N, cfg["block_n"]), split)
    kernel_args = (
        x,
        qweight,
        qzeros,
        scales,
        qweight if g_idx is None else g_idx,
        target,
        M,
        N,
        K,
        k_split,
        x.stride(0),
        x.stride(1),
        qweight.stride(0),
        qweight.stride(1),
        qzeros.stride(0),
        qzeros.stride(1),
        scales.stride(0),
        scales.stride(1),
        0 if split == 1 else target.stride(0),
        target.stride(-2),
        target.stride(-1),
        zero_offset,
    )
    meta = dict(
        GROUP_SIZE=group_size if grouped else 1,
        GROUPED=grouped,
        BLOCK_M=cfg["block_m"],
        BLOCK_N=cfg["block_n"],
        BLOCK_K=bk,
        FP32_DOT=x.dtype == torch.float32,
        num_warps=cfg["num_warps"],
    )
    try:
        _w4a16_gemm_kernel[grid](*kernel_args, **meta, num_stages=cfg["num_stages"])
    except (
        triton.runtime.errors.OutOfResources
    ):  # a config too large for this GPU's shared memory: fewer stages
        _w4a16_gemm_kernel[grid](*kernel_args, **meta, num_stages=1)
    if split > 1:
        out.copy_(target.sum(dim=0))
    return out


def w4a16_gemm_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None = None,
    zero_offset: int = 1,
    group_size: int | None = None,
) -> torch.Tensor:  # [M, N] in x.dtype
    """PyTorch twin of :func:`w4a16_gemm`: dequantize ``W: [K, N]`` to float32, then ``x @ W`` in float32."""
    from pagedllm.quantization.base import unpack_int4

    q = unpack_int4(qweight, dim=0).to(torch.float32)  # [K, N]
    zeros = unpack_int4(qzeros, dim=1).to(torch.float32) + zero_offset  # [G, N]
    if g_idx is None:
        g = torch.arange(q.shape[0], device=q.device) // group_size
    else:
        g = g_idx.long()
    w = (q - zeros[g]) * scales.to(torch.float32)[g]  # [K, N]
    return (x.to(torch.float32) @ w).to(x.dtype)
