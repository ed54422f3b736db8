"""Linear layers on CPU through oneDNN with pre-packed weights (and, on the GPU, one-row products through the
Triton GEMV of ``pagedllm.kernels.gemv``: ``one_row_gemv``).

``F.linear`` on CPU goes to MKL for float32. MKL picks its kernels by CPU vendor, and on the AMD EPYC machines
this project runs on, the demo model's decode layers ran 2.5-3x faster through oneDNN given the weight once in
its own blocked layout (docs/benchmarks.md, CPU section). vLLM's CPU backend also runs its linear layers
through oneDNN with packed weights.

The packed copy is an opaque ``torch._mkldnn`` tensor. The layer keeps its plain ``weight`` (MLA reads
``kv_b_proj.weight``; LoRA and tests read weights), at the cost of a second copy of the packed layers' weights
in CPU memory. The copy follows the weight: a weight changed in place (its version counter moves) or replaced by
another tensor is packed again at its next use. A write through ``weight.data`` bypasses the version counter
(PyTorch's rule), and an inference tensor (one made under ``inference_mode``) has no version counter: after such
a write, call the layer's ``process_weights_after_loading``.

oneDNN costs about 10 us more per call than MKL, which only pays for weights of at least ``PACK_MIN_ELEMENTS``
elements (measured crossover: about 192 x 192 at 48 rows). ``PAGEDLLM_CPU_ONEDNN=0`` turns packing off. The
results are float32 (or bfloat16) GEMMs with another summation order than MKL's: equal to ``F.linear`` within
rounding, not bit for bit in float32 (bfloat16 ``F.linear`` already runs through oneDNN).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from pagedllm.platform import use_fused_kernels, use_pdl

PACK_MIN_ELEMENTS = 1 << 16
_PACKED_DTYPES = (torch.float32, torch.bfloat16)
_GEMV_DTYPES = (torch.bfloat16, torch.float16)


def onednn_enabled() -> bool:
    """Whether CPU linear layers pack their weights for oneDNN (``PAGEDLLM_CPU_ONEDNN``, default on)."""
    if os.environ.get("PAGEDLLM_CPU_ONEDNN", "1") == "0":
        return False
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def can_pack(dtype: torch.dtype) -> bool:
    """Whether weights of ``dtype`` get packed: packing on (``onednn_enabled``) and oneDNN packs ``dtype`` on this
    CPU (bfloat16 needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT; a CPU without them raises at the first pack)."""
    return dtype in _PACKED_DTYPES and onednn_enabled() and _packs_on_this_cpu(dtype)


@functools.cache
def _packs_on_this_cpu(dtype: torch.dtype) -> bool:
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype))  # tried once, on a small weight
    except RuntimeError:
        return False
    return True


class PackedWeight:
    """oneDNN's packed copy of one weight ([out, in]), remade when the weight it was made from changes."""

    __slots__ = ("_key", "_packed", "_weight")

    def __init__(self, weight: torch.Tensor) -> None:
        self._weight = weight
        self._key: tuple[int, int] | None = None
        self._packed: torch.Tensor | None = None

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        """The packed copy of ``weight`` (the layer's current weight tensor), packed again if it changed."""
        # An inference tensor (made under inference_mode) has no version counter: its storage is the key then.
        key = (-1 if weight.is_inference() else weight._version, weight.data_ptr())
        if weight is not self._weight or key != self._key:
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())
            self._weight, self._key = weight, key
        return self._packed


def pack_weight(weight: torch.Tensor, min_elements: int | None = None) -> PackedWeight | None:
    """A ``PackedWeight`` for ``weight`` ([out, in]), or None where the layer should stay on ``F.linear``: not on
    CPU, another dtype, fewer than ``min_elements`` (default ``PACK_MIN_ELEMENTS``) elements, packing turned
    off or unavailable (for this dtype on this CPU: ``can_pack``), or a weight offloaded with ``cpu_offload_gb``
    (``worker/weight_offload.py``: it is staged for each forward; a packed copy would stay resident)."""
    if weight.device.type != "cpu" or weight.dtype not in _PACKED_DTYPES or weight.dim() != 2:
        return None
    if getattr(weight, "cpu_offloaded", False):
        return None
    least = PACK_MIN_ELEMENTS if min_elements is None else min_elements
    if weight.numel() == 0 or weight.numel() < least or not can_pack(weight.dtype):
        return None
    packed = PackedWeight(weight)
    packed.get(weight)  # pack now (start-up), not at the first step
    return packed


def one_row_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x @ weight.T`` takes ``pagedllm.kernels.gemv``: one bf16/fp16 row on a GPU with Triton (batch-1
    decode), where cuBLAS streamed the weights at 2.4-2.9 TB/s against the GEMV's 2.6-3.2 (docs/benchmarks.md)."""
    return (
        x.numel() == x.shape[-1]
        and x.stride(-1) == 1
        and x.dtype in _GEMV_DTYPES
        and weight.dtype == x.dtype
        and weight.is_contiguous()
        and use_fused_kernels(x)
    )


def linear(
    x: torch.Tensor, weight: torch.Tensor, packed: PackedWeight | None, bias: torch.Tensor | None = None
) -> torch.Tensor:  # [..., in] -> [..., out]
    """``F.linear(x, weight, bias)``, through ``packed`` (``pack_weight(weight)``) when there is one, and through
    the Triton GEMV for a single row on the GPU (``one_row_gemv``)."""
    if packed is None:
        if one_row_gemv(x, weight):
            from pagedllm.kernels.gemv import gemv

            out = gemv(x.reshape(1, -1), weight, bias, pdl=use_pdl(x))
            return out.view(*x.shape[:-1], weight.shape[0])
        return F.linear(x, weight, bias)
    if x.dtype != weight.dtype:  # oneDNN wants one dtype; F.linear raises the same mismatch
        raise RuntimeError(f"input dtype {x.dtype} does not match the weight's {weight.dtype}")
    return torch.ops.mkldnn._linear_pointwise(x, packed.get(weight), bias, "none", [], "")
