"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.platform import use_fused_kernels


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, computed in float32 and cast back to the input dtype (as HF does).

    ``forward(x)`` returns the normed tensor. ``forward(x, residual)`` first adds ``residual`` to ``x``
    and returns ``(normed, x + residual)``, so decoder layers carry the residual stream without an extra op.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size))  # [hidden_size]

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype == torch.float32 and x.device.type == "cpu":
            # One op instead of seven on the CPU path; ATen's CPU rms_norm is the arithmetic below, bit for bit.
            return torch.rms_norm(x, self.weight.shape, self.weight, self.eps)
        orig_dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * x32.to(orig_dtype)

    def forward(
        self,
        x: torch.Tensor,  # [..., hidden_size]
        residual: torch.Tensor | None = None,  # [..., hidden_size]
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if use_fused_kernels(x):
            return self._forward_triton(x, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _forward_triton(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        from pagedllm.kernels.rms_norm import fused_add_rms_norm, rms_norm

        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # [rows, hidden_size]
        if residual is None:
            return rms_norm(x2, self.weight, self.eps).view(shape)
        out, new_residual = fused_add_rms_norm(x2, residual.reshape(-1, shape[-1]), self.weight, self.eps)
        return out.view(shape), new_residual.view(shape)
