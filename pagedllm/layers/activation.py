"""Activations used by gated MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.platform import use_fused_kernels


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` where the input holds ``[gate | up]`` along its last dimension."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., 2 * d] -> [..., d]
        if x.dim() == 2 and use_fused_kernels(x):
            from pagedllm.kernels.activation import silu_and_mul

            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)  # [..., d] each
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """``gelu_tanh(gate) * up`` (GeGLU with the tanh approximation, Gemma's MLP)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., 2 * d] -> [..., d]
        gate, up = x.chunk(2, dim=-1)  # [..., d] each
        return F.gelu(gate, approximate="tanh") * up


def get_act_and_mul(hidden_act: str) -> nn.Module:
    """The gated activation for an HF ``hidden_act`` name."""
    if hidden_act in ("silu", "swish"):
        return SiluAndMul()
    if hidden_act in ("gelu_pytorch_tanh", "gelu_tanh"):
        return GeluTanhAndMul()
    raise ValueError(f"unsupported hidden_act {hidden_act!r}; supported: 'silu', 'gelu_pytorch_tanh'")
