"""The one module that asks what the machine has (CUDA, Triton). Everything else asks here."""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def triton_available() -> bool:
    """Triton imports and can compile for the current CUDA device (never true without CUDA)."""
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _fast_ops_disabled() -> bool:
    # Debug switch: run the PyTorch twins of the fused kernels on CUDA too.
    return os.environ.get("PAGEDLLM_DISABLE_FUSED_KERNELS", "") == "1"


def use_fused_kernels(x: torch.Tensor) -> bool:
    """Whether ops on ``x`` should take the Triton kernels (CUDA tensor, Triton present, not disabled)."""
    return x.is_cuda and triton_available() and not _fast_ops_disabled()
