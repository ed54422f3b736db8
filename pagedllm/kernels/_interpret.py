"""Fixes for Triton's CPU interpreter (``TRITON_INTERPRET=1``), a debug and test path only.

The interpreter stores bf16 tensors as raw ``uint16`` and its ``create_dot`` multiplies those integers
(seen in triton 3.6.0 and 3.9.0): any ``tl.dot`` with a bf16 operand returns garbage. This widens bf16
operands to fp32 before the product, which is what the GPU's bf16 MMA with an fp32 accumulator computes.
"""

from __future__ import annotations

import numpy as np

_PATCHED = False


def _bf16_bits_to_fp32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def patch_interpreter() -> None:
    global _PATCHED
    if _PATCHED:
        return
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    builder_cls = getattr(interpreter, "InterpreterBuilder", None)
    if builder_cls is None or not hasattr(builder_cls, "create_dot"):
        return
    original = builder_cls.create_dot

    def create_dot(self, a, b, d, *args, **kwargs):
        if a.dtype.scalar == tl.bfloat16 or b.dtype.scalar == tl.bfloat16:
            a_data = _bf16_bits_to_fp32(a.data) if a.dtype.scalar == tl.bfloat16 else a.data
            b_data = _bf16_bits_to_fp32(b.data) if b.dtype.scalar == tl.bfloat16 else b.data
            out = np.matmul(a_data.astype(np.float32), b_data.astype(np.float32)).astype(d.data.dtype)
            return interpreter.TensorHandle(out + d.data, d.dtype.scalar)
        return original(self, a, b, d, *args, **kwargs)

    builder_cls.create_dot = create_dot
    _PATCHED = True
