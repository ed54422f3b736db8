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
in units of 8 outputs). Only ``version: "gemm"`` with ``zero_point: true`` is supported. The PyTorch path
dequantizes to float32 on every call and runs ``F.linear``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from pagedllm.layers.linear import Linear, LinearMethod
from pagedllm.quantization.base import (
    AWQ_ORDER,
    QuantizationConfig,
    _get,
    is_ignored,
    output_sharded_parameter,
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
        bits = _get(config, "bits", "w_bit", default=4)
        if bits != 4:
            raise ValueError(f"quantization_config.bits: only 4-bit AWQ is supported, got {bits!r}")
        group_size = _get(config, "group_size", "q_group_size", default=128)
        if not isinstance(group_size, int) or not (group_size == -1 or group_size > 0):
            raise ValueError(f"quantization_config.group_size must be -1 or positive, got {group_size!r}")
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
        in_size, out_size = layer.input_size, layer.output_size
        group_size = in_size if self.config.group_size == -1 else self.config.group_size
        if in_size % group_size:
            raise ValueError(
                f"AWQ needs the input size ({in_size}) to be a multiple of group_size ({group_size})"
            )
        num_groups = in_size // group_size
        layer.qweight = output_sharded_parameter(
            layer, (in_size, out_size // 8), torch.int32, output_dim=1, pack_factor=8
        )
        layer.qzeros = output_sharded_parameter(
            layer, (num_groups, out_size // 8), torch.int32, output_dim=1, pack_factor=8
        )
        layer.scales = output_sharded_parameter(layer, (num_groups, out_size), torch.float32, output_dim=1)

    def dequantize(self, layer: Linear) -> torch.Tensor:  # [out, in] float32
        q = unpack_int4(layer.qweight, dim=1, order=AWQ_ORDER).to(torch.float32)  # [in, out]
        zeros = unpack_int4(layer.qzeros, dim=1, order=AWQ_ORDER).to(torch.float32)  # [G, out]
        group_size = layer.input_size // layer.scales.shape[0]
        zeros = zeros.repeat_interleave(group_size, dim=0)  # [in, out]
        scales = layer.scales.repeat_interleave(group_size, dim=0)  # [in, out]
        return ((q - zeros) * scales).t().contiguous()  # [out, in]

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantize(layer).to(x.dtype), layer.bias)
