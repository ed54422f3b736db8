"""SiLU-and-multiply for gated MLPs: ``[T, 2I] -> [T, I]``, ``silu(x[:, :I]) * x[:, I:]``.

Rounds like the unfused PyTorch ops do (silu result to the input dtype, then the product).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [num_tokens, 2 * inter]
    out_ptr,  # [num_tokens, inter]
    stride_x,
    stride_o,
    inter,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # x [num_tokens, 2 * inter] -> [num_tokens, inter]
    assert x.dim() == 2 and x.shape[1] % 2 == 0, f"x must be [num_tokens, 2 * inter], got {tuple(x.shape)}"
    assert x.stride(1) == 1, "last dim must be contiguous"
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_tokens, inter), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, _BLOCK))](
        x, out, x.stride(0), out.stride(0), inter, BLOCK=_BLOCK, num_warps=4
    )
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """PyTorch twin of :func:`silu_and_mul`."""
    inter = x.shape[-1] // 2
    return F.silu(x[..., :inter]) * x[..., inter:]
