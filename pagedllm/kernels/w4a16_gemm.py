"""W4A16 GEMM for the GPTQ layout: ``out[M, N] = x[M, K] @ W[K, N]`` with 4-bit ``W`` dequantized in registers.

Operands (one shard of a GPTQ layer; see ``pagedllm/quantization/gptq.py`` for the layout):

- ``qweight: [K / 8, N] int32``: nibble ``j`` of ``qweight[k, n]`` is ``q[8k + j, n]``;
- ``qzeros: [G, N / 8] int32``: nibble ``j`` of ``qzeros[g, c]`` is the stored zero of group ``g``, output ``8c + j``;
  the zero is that plus ``zero_offset`` (1 for GPTQ v1 checkpoints, 0 for v2);
- ``scales: [G, N]`` (any float dtype), ``g_idx: [K] int32`` (group of each input channel; act-order allowed);
- ``W[k, n] = (q[k, n] - zero[g_idx[k], n]) * scales[g_idx[k], n]``.

Each program computes a ``[BLOCK_M, BLOCK_N]`` tile, walking K in ``BLOCK_K`` steps: it loads the packed rows
``k // 8``, shifts out nibble ``k % 8``, gathers zeros and scales by ``g_idx[k]``, and accumulates
``x_tile @ W_tile`` in float32 (``x``'s dtype for the product on half types; IEEE fp32 for float32 inputs).
``w4a16_gemm_ref`` is the PyTorch twin (dequantize to float32, then matmul).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _w4a16_gemm_kernel(
    x_ptr,  # [M, K]
    qweight_ptr,  # [K / 8, N] int32
    qzeros_ptr,  # [G, N / 8] int32
    scales_ptr,  # [G, N]
    g_idx_ptr,  # [K] int32
    out_ptr,  # [M, N]
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_qk,
    stride_qn,
    stride_zg,
    stride_zn,
    stride_sg,
    stride_sn,
    stride_om,
    stride_on,
    zero_offset,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    mask_m = offs_m < M
    mask_n = offs_n < N
    zero_shift = ((offs_n % 8) * 4)[None, :]  # [1, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        mask_k = offs_k < K
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
        g = tl.load(g_idx_ptr + offs_k, mask=mask_k, other=0)  # [BLOCK_K]
        packed_z = tl.load(
            qzeros_ptr + g[:, None] * stride_zg + (offs_n // 8)[None, :] * stride_zn, mask=mask_kn, other=0
        )  # [BLOCK_K, BLOCK_N] int32
        z = ((packed_z >> zero_shift) & 0xF) + zero_offset
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
        out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
        out,
        mask=mask_m[:, None] & mask_n[None, :],
    )


def w4a16_gemm(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [K / 8, N] int32
    qzeros: torch.Tensor,  # [G, N / 8] int32
    scales: torch.Tensor,  # [G, N]
    g_idx: torch.Tensor,  # [K] int32
    zero_offset: int = 1,
    block_m: int = 16,
    block_n: int = 64,
    block_k: int = 32,
) -> torch.Tensor:  # [M, N] in x.dtype
    """``x @ W`` for one GPTQ shard (layout in the module docstring); shapes are checked here."""
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
    assert g_idx.shape == (K,) and g_idx.dtype == torch.int32, f"g_idx must be [K] int32, got {g_idx.shape}"
    assert block_k % 8 == 0
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _w4a16_gemm_kernel[grid](
        x,
        qweight,
        qzeros,
        scales,
        g_idx,
        out,
        M,
        N,
        K,
        x.stride(0),
        x.stride(1),
        qweight.stride(0),
        qweight.stride(1),
        qzeros.stride(0),
        qzeros.stride(1),
        scales.stride(0),
        scales.stride(1),
        out.stride(0),
        out.stride(1),
        zero_offset,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        FP32_DOT=x.dtype == torch.float32,
    )
    return out


def w4a16_gemm_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    zero_offset: int = 1,
) -> torch.Tensor:  # [M, N] in x.dtype
    """PyTorch twin of :func:`w4a16_gemm`: dequantize ``W: [K, N]`` to float32, then ``x @ W`` in float32."""
    from pagedllm.quantization.base import unpack_int4

    q = unpack_int4(qweight, dim=0).to(torch.float32)  # [K, N]
    zeros = unpack_int4(qzeros, dim=1).to(torch.float32) + zero_offset  # [G, N]
    g = g_idx.long()
    w = (q - zeros[g]) * scales.to(torch.float32)[g]  # [K, N]
    return (x.to(torch.float32) @ w).to(x.dtype)
