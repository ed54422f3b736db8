"""AWQ checkpoints (AutoAWQ / llm-awq, the GEMM version): 4-bit weights with zero points,
``quant_method: "awq"``.

Layout of one quantized ``nn.Linear(in, out)`` (``G = in / group_size``):

- ``qweight: [in, out / 8] int32``: packs along the OUTPUT dim in AWQ's interleaved order: nibble ``j`` (bits
  ``4j..4j+3``) of ``qweight[i, k]`` is ``q[i, 8k + AWQ_ORDER[j]]`` with ``AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)``
  (read back, nibbles ``(0, 4, 1, 5, 2, 6, 3, 7)`` give outputs ``8k..8k+7``).
- ``qzeros: [G, out / 8] int32``: the zero points, packed the same way (stored as is, no offset).
- ``scales: [G, out]`` (float16 as published; float32 here, exact for any source dtype).
- The float weight is ``W[o, i] = (q[i, o] - zero[i // group_size, o]) * scales[i // group_size, o]``.

Fused layers stack the checkpoint's tensors along the output dim (dim 1 of all three; ``qweight``/``qzeros``
in units of 8 outputs). Under tensor parallelism column-parallel layers keep their output channels,
row-parallel ones their input rows of ``qweight`` and groups of ``scales``/``qzeros`` (as vLLM). Only ``version: "gemm"`` with ``zero_point: true`` is supported. The PyTorch path (CPU, and
CUDA without Triton) dequantizes to float32 on every call and runs ``F.linear``.

GPU path (CUDA with Triton): ``process_weights_after_loading`` repacks ``qweight`` to GPTQ's layout (``[in / 8, out]``,
nibble ``j`` of row ``k`` is input ``8k + j``) and ``qzeros`` to GPTQ's nibble order (same shape; zeros stored as
is, so ``zero_offset`` 0), so the one W4A16 kernel (``pagedllm/kernels/w4a16_gemm.py``, grouped mode, all shards in
one launch) serves both formats; ``dequantize`` reads either layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.linear import Linear, LinearMethod
from pagedllm.platform import use_fused_kernels
from pagedllm.quantization.base import (
    AWQ_ORDER,
    QuantizationConfig,
    _get,
    add_group_params,
    int4_group_size,
    is_ignored,
    is_row_parallel,
    output_sharded_parameter,
    pack_int4,
    tp_size,
    unpack_int4,
)


@dataclass
class AWQConfig(QuantizationConfig):
    name = "awq"
    bits: int = 4
    group_size: int = 128
    modules_to_not_convert: list[str] = field(default_factory=list)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AWQConfig:
        group_size = int4_group_size(config, "AWQ")
        version = str(_get(config, "version", default="gemm")).lower()
        if version != "gemm":
            raise ValueError(f"quantization_config.version: only AWQ 'gemm' is supported, got {version!r}")
        if _get(config, "zero_point", default=True) is not True:
            raise ValueError("quantization_config.zero_point: AWQ without zero points is not supported")
        return cls(
            bits=4,
            group_size=group_size,
            modules_to_not_convert=list(_get(config, "modules_to_not_convert", default=[])),
        )

    def get_linear_method(
        self, layer: Linear, prefix: str, checkpoint_names: list[str]
    ) -> LinearMethod | None:
        if is_ignored(prefix, checkpoint_names, self.modules_to_not_convert, "modules_to_not_convert"):
            return None
        return AWQLinearMethod(self)


class AWQLinearMethod(LinearMethod):
    def __init__(self, config: AWQConfig) -> None:
        self.config = config

    def create_weights(self, layer: Linear) -> None:
        """Allocate this rank's part: its output channels (column-parallel: packed by 8, so each rank's shard
        sizes must divide by 8), or its input rows of ``qweight`` and groups of ``scales``/``qzeros``
        (row-parallel: the input size per rank must divide by ``group_size``; ``-1`` keeps the one group whole)."""
        in_size, out_size = layer.input_size, layer.output_size
        group_size = in_size if self.config.group_size == -1 else self.config.group_size
        if in_size % group_size:
            where = f" per rank with tensor_parallel_size {tp_size(layer)}" if is_row_parallel(layer) else ""
            raise ValueError(
                f"AWQ needs the input size{where} ({in_size}) to be a multiple of group_size ({group_size})"
            )
        num_groups = in_size // group_size
        group_input_dim = None if self.config.group_size == -1 else 0
        layer.qweight = output_sharded_parameter(
            layer, (in_size, out_size // 8), torch.int32, output_dim=1, pack_factor=8, input_dim=0
        )
        add_group_params(layer, num_groups, group_input_dim)

    def process_weights_after_loading(self, layer: Linear) -> None:
        if use_fused_kernels(layer.qweight):
            self.prepare_kernel(layer)

    def prepare_kernel(self, layer: Linear) -> None:
        """Repack to the W4A16 kernel's (GPTQ's) layout (module docstring); any device (tests use CPU)."""
        if getattr(layer, "w4a16_mode", None) is not None:
            return
        q = unpack_int4(layer.qweight.data, dim=1, order=AWQ_ORDER)  # [in, out] uint8
        layer.qweight = nn.Parameter(pack_int4(q, dim=0), requires_grad=False)  # [in / 8, out]
        del q
        zeros = unpack_int4(layer.qzeros.data, dim=1, order=AWQ_ORDER)  # [G, out]
        layer.qzeros.data.copy_(pack_int4(zeros, dim=1))
        layer.w4a16_mode = "grouped"

    def group_size(self, layer: Linear) -> int:
        return layer.input_size // layer.scales.shape[0]

    def dequantize(self, layer: Linear) -> torch.Tensor:  # [out, in] float32
        if getattr(layer, "w4a16_mode", None) is not None:  # repacked to GPTQ's layout
            q = unpack_int4(layer.qweight, dim=0).to(torch.float32)  # [in, out]
            zeros = unpack_int4(layer.qzeros, dim=1).to(torch.float32)  # [G, out]
        else:
            q = unpack_int4(layer.qweight, dim=1, order=AWQ_ORDER).to(torch.float32)  # [in, out]
            zeros = unpack_int4(layer.qzeros, dim=1, order=AWQ_ORDER).to(torch.float32)  # [G, out]
        group_size = self.group_size(layer)
        zeros = zeros.repeat_interleave(group_size, dim=0)  # [in, out]
        scales = layer.scales.repeat_interleave(group_size, dim=0)  # [in, out]
        return ((q - zeros) * scales).t().contiguous()  # [out, in]

    def apply_kernel(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        from pagedllm.kernels.w4a16_gemm import w4a16_gemm

        x2 = x.reshape(-1, layer.input_size)  # [M, in]
        out = w4a16_gemm(
            x2, layer.qweight, layer.qzeros, layer.scales, None, 0, group_size=self.group_size(layer)
        )
        if layer.bias is not None:
            out += layer.bias
        return out.reshape(*x.shape[:-1], layer.output_size)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if getattr(layer, "w4a16_mode", None) is not None:
            return self.apply_kernel(layer, x)
        return F.linear(x, self.dequantize(layer).to(x.dtype), layer.bias)
