"""The one module that asks what the machine has (CUDA, Triton). Everything else asks here."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

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


_pdl_depth = 0  # > 0 inside launch_with_pdl()


@functools.cache
def _pdl_capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


@contextlib.contextmanager
def launch_with_pdl() -> Iterator[None]:
    """Within this block, the Triton kernels launch as programmatic dependent launches (PDL) where
    :func:`use_pdl` allows. The decode CUDA graphs warm up and capture inside it (worker/cuda_graphs.py).

    Why: a batch-1 decode step is ~300 small kernels back to back; under PDL each one is launched while the
    one before it drains, and waits in ``griddepcontrol.wait`` (at the top of each kernel) until that one has
    finished and its writes are visible, so the launch gap (about 1 µs each) is hidden. Eager steps keep plain
    launches: their kernels are large, and a PDL variant is another Triton compile.
    """
    global _pdl_depth
    _pdl_depth += 1
    try:
        yield
    finally:
        _pdl_depth -= 1


def use_pdl(x: torch.Tensor) -> bool:
    """Whether a Triton kernel on ``x``'s device launches as a PDL now: inside :func:`launch_with_pdl`, on a
    CUDA device of compute capability 9.0 or later, with the fused kernels on and ``PAGEDLLM_PDL`` not ``0``."""
    if _pdl_depth == 0 or not use_fused_kernels(x) or os.environ.get("PAGEDLLM_PDL", "1") == "0":
        return False
    index = x.device.index
    return _pdl_capable(torch.cuda.current_device() if index is None else index)
