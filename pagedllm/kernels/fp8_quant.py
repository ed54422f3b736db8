"""FP8 activation quantization for the W8A8 path (``pagedllm/quantization/fp8.py``), one row per program.

``quant_fp8_per_token(x, static_scale=None) -> (q [M, K] float8_e4m3fn, scale [M, 1] float32)``: dynamic
``scale = max(max|x_row|, 1e-12) / 448``, or the given per-tensor ``static_scale`` (``[1]``, written to every row so
that ``torch._scaled_mm`` gets the contiguous ``[M, 1]`` its row-wise scaling needs); ``q = e4m3(clamp(x / scale,
-448, 448))`` with IEEE division and round-to-nearest, so it matches its twin
(:func:`pagedllm.quantization.fp8.quantize_fp8_per_token`) bit for bit. One launch replaces the twin's six.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.quantization.fp8 import FP8_DTYPE, quantize_fp8_per_token


@triton.jit
def _quant_fp8_per_token_kernel(
    x_ptr,  # [M, K]
    q_ptr,  # [M, K] float8_e4m3fn
    scale_ptr,  # [M] float32 (out)
    static_scale_ptr,  # [1] float32 (STATIC only)
    K,
    stride_xm,
    stride_qm,
    STATIC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    if STATIC:
        s = tl.load(static_scale_ptr)
    else:
        amax = tl.max(tl.abs(x), axis=0)
        s = tl.div_rn(tl.maximum(amax, 1e-12), 448.0)
    tl.store(scale_ptr + row, s)
    q = tl.clamp(tl.div_rn(x, s), -448.0, 448.0)
    tl.store(q_ptr + row * stride_qm + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


def quant_fp8_per_token(
    x: torch.Tensor, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:  # ([M, K] e4m3, [M, 1] float32)
    assert x.dim() == 2 and x.stride(1) == 1, f"x must be [M, K] with unit column stride, got {x.stride()}"
    M, K = x.shape
    q = torch.empty((M, K), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    if static_scale is not None:
        assert static_scale.numel() == 1 and static_scale.dtype == torch.float32
    if M == 0:
        return q, scale
    block = triton.next_power_of_2(K)
    _quant_fp8_per_token_kernel[(M,)](
        x,
        q,
        scale,
        static_scale if static_scale is not None else scale,
        K,
        x.stride(0),
        q.stride(0),
        STATIC=static_scale is not None,
        BLOCK=block,
        num_warps=max(1, min(16, block // 512)),
    )
    return q, scale


def quant_fp8_per_token_ref(
    x: torch.Tensor, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_fp8_per_token(x, static_scale)
