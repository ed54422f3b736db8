"""RMSNorm, and residual-add fused with RMSNorm. One program per row (token), whole row in registers.

Numerics follow HF Llama/Qwen: ``(x.float() * rsqrt(mean(x.float()**2) + eps)).to(dtype) * weight``; the
fused form first rounds ``x + residual`` to the input dtype (as an unfused bf16 add would) and normalizes that.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.pdl import pdl_launch_options, pdl_prologue
from pagedllm.platform import use_pdl


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [num_tokens, hidden]
    residual_ptr,  # [num_tokens, hidden] (read only when HAS_RESIDUAL)
    weight_ptr,  # [hidden]
    out_ptr,  # [num_tokens, hidden]
    residual_out_ptr,  # [num_tokens, hidden] (written only when HAS_RESIDUAL)
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    hidden,
    eps,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,  # launched as a programmatic dependent launch (pagedllm/kernels/pdl.py)
):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.math.rsqrt(tl.sum(xf * xf, 0) / hidden + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    normed = (xf * inv_rms).to(x_ptr.dtype.element_ty)
    out = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    assert x.dim() == 2, f"x must be [num_tokens, hidden], got {tuple(x.shape)}"
    assert weight.shape == (x.shape[1],), f"weight {tuple(weight.shape)} != ({x.shape[1]},)"
    assert x.stride(1) == 1 and weight.stride(0) == 1, "hidden dim must be contiguous"


def _launch_config(hidden: int) -> tuple[int, int]:
    block = triton.next_power_of_2(hidden)
    return block, min(max(block // 512, 1), 16)


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> torch.Tensor:  # [num_tokens, hidden], x.dtype
    _check(x, weight)
    out = torch.empty_like(x)
    if x.shape[0] == 0:
        return out
    block, num_warps = _launch_config(x.shape[1])
    pdl = use_pdl(x)
    _rms_norm_kernel[(x.shape[0],)](
        x, x, weight, out, out, x.stride(0), 0, out.stride(0), 0, x.shape[1], eps,
        BLOCK=block, HAS_RESIDUAL=False, PDL=pdl, num_warps=num_warps, **pdl_launch_options(pdl),
    )  # fmt: skip
    return out


def fused_add_rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    residual: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed, new_residual = x + residual), both [num_tokens, hidden]
    _check(x, weight)
    assert residual.shape == x.shape and residual.stride(1) == 1, f"residual {tuple(residual.shape)}"
    assert residual.dtype == x.dtype, f"residual {residual.dtype} != x {x.dtype}"
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x)
    if x.shape[0] == 0:
        return out, residual_out
    block, num_warps = _launch_config(x.shape[1])
    pdl = use_pdl(x)
    _rms_norm_kernel[(x.shape[0],)](
        x, residual, weight, out, residual_out, x.stride(0), residual.stride(0), out.stride(0),
        residual_out.stride(0), x.shape[1], eps, BLOCK=block, HAS_RESIDUAL=True, PDL=pdl, num_warps=num_warps,
        **pdl_launch_options(pdl),
    )  # fmt: skip
    return out, residual_out


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """PyTorch twin of :func:`rms_norm`."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (normed.float() * weight.float()).to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch twin of :func:`fused_add_rms_norm`."""
    new_residual = x + residual
    return rms_norm_ref(new_residual, weight, eps), new_residual
