"""GPTQ checkpoints (AutoGPTQ / GPTQModel / optimum): 4-bit symmetric weights, ``quant_method: "gptq"``.

Layout of one quantized ``nn.Linear(in, out)`` (``G = ceil(in / group_size)``, ``group_size = -1`` -> ``in``):

- ``qweight: [in / 8, out] int32``: packs along the INPUT dim; nibble ``j`` (bits ``4j..4j+3``) of
  ``qweight[k, o]`` is ``q[8k + j, o]``, an unsigned 4-bit value.
- ``qzeros: [G, out / 8] int32``: packs along the OUTPUT dim, same nibble order: nibble ``j`` of
  ``qzeros[g, k]`` is the zero point of group ``g``, output ``8k + j``. ``checkpoint_format: "gptq"`` (v1, the
  default) stores ``zero - 1`` (AutoGPTQ's convention: a symmetric model stores 7 for zero 8); ``"gptq_v2"``
  stores the zero itself.
- ``scales: [G, out]`` (float16 as published; kept in float32 here, which holds any source dtype exactly).
- ``g_idx: [in] int32``: the group of each input channel. ``i // group_size`` without act-order; with
  ``desc_act: true`` the columns were quantized in a permuted order and ``g_idx`` is that permutation's
  group map (``qweight`` stays in the original input order). A checkpoint without ``g_idx`` means ``i //
  group_size``.
- The float weight is ``W[o, i] = (q[i, o] - zero[g_idx[i], o]) * scales[g_idx[i], o]``.

Fused layers: the checkpoint's q/k/v (gate/up) tensors stack along the output dim: ``qweight``/``scales``
along dim 1, ``qzeros`` along dim 1 in units of 8 outputs; ``g_idx`` is kept per shard (``[num_shards,
in]``) since each source layer has its own.

The PyTorch path dequantizes to float32 on every call and runs ``F.linear`` (the oracle for a W4A16 kernel).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from pagedllm.layers.linear import Linear, LinearMethod
from pagedllm.quantization.base import (
    QuantizationConfig,
    _get,
    is_ignored,
    output_sharded_parameter,
    per_shard_parameter,
    unpack_int4,
)


@dataclass
class GPTQConfig(QuantizationConfig):
    name = "gptq"
    bits: int = 4
    group_size: int = 128
    desc_act: bool = False
    checkpoint_format: str = "gptq"  # "gptq" (v1: zero stored minus one) | "gptq_v2"
    modules_to_not_convert: list[str] = field(default_factory=list)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GPTQConfig:
        bits = _get(config, "bits", "w_bit", default=4)
        if bits != 4:
            raise ValueError(f"quantization_config.bits: only 4-bit GPTQ is supported, got {bits!r}")
        group_size = _get(config, "group_size", default=128)
        if not isinstance(group_size, int) or not (group_size == -1 or group_size > 0):
            raise ValueError(f"quantization_config.group_size must be -1 or positive, got {group_size!r}")
        sym = _get(config, "sym", default=True)
        if sym is not True:
            raise ValueError("quantization_config.sym: asymmetric GPTQ (sym: false) is not supported")
        fmt = _get(config, "checkpoint_format", default="gptq")
        if config.get("is_marlin_format") or fmt not in ("gptq", "gptq_v2"):
            raise ValueError(
                f"quantization_config.checkpoint_format must be 'gptq' or 'gptq_v2', got {fmt!r}"
                + (" (is_marlin_format)" if config.get("is_marlin_format") else "")
            )
        if config.get("lm_head"):
            raise ValueError("quantization_config.lm_head: a quantized LM head is not supported")
        if config.get("dynamic"):
            raise ValueError("quantization_config.dynamic: per-module GPTQ overrides are not supported")
        return cls(
            bits=4,
            group_size=group_size,
            desc_act=bool(_get(config, "desc_act", default=False)),
            checkpoint_format=fmt,
            modules_to_not_convert=list(_get(config, "modules_to_not_convert", default=[])),
        )

    def get_linear_method(
        self, layer: Linear, prefix: str, checkpoint_names: list[str]
    ) -> LinearMethod | None:
        if is_ignored(prefix, checkpoint_names, self.modules_to_not_convert, "modules_to_not_convert"):
            return None
        return GPTQLinearMethod(self)


class GPTQLinearMethod(LinearMethod):
    def __init__(self, config: GPTQConfig) -> None:
        self.config = config

    def group_size(self, layer: Linear) -> int:
        return layer.input_size if self.config.group_size == -1 else self.config.group_size

    def create_weights(self, layer: Linear) -> None:
        in_size, out_size = layer.input_size, layer.output_size
        if in_size % 8:
            raise ValueError(f"GPTQ needs the input size to be a multiple of 8, got {in_size}")
        group_size = self.group_size(layer)
        num_groups = math.ceil(in_size / group_size)
        layer.qweight = output_sharded_parameter(layer, (in_size // 8, out_size), torch.int32, output_dim=1)
        layer.qzeros = output_sharded_parameter(
            layer, (num_groups, out_size // 8), torch.int32, output_dim=1, pack_factor=8
        )
        layer.scales = output_sharded_parameter(layer, (num_groups, out_size), torch.float32, output_dim=1)
        layer.g_idx = per_shard_parameter(layer, (in_size,), torch.int32, optional=True)  # [num_shards, in]
        default = torch.arange(in_size, dtype=torch.int32, device=layer.g_idx.device) // group_size  # [in]
        layer.g_idx.data.copy_(default.expand_as(layer.g_idx))

    def process_weights_after_loading(self, layer: Linear) -> None:
        g_idx = layer.g_idx  # [num_shards, in]
        num_groups = layer.scales.shape[0]
        if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= num_groups):
            raise ValueError(f"GPTQ g_idx holds groups outside [0, {num_groups})")
        layer.g_idx_shared = bool((g_idx == g_idx[:1]).all())  # one dequantization for all shards

    def zeros(self, layer: Linear) -> torch.Tensor:  # [G, out] int32
        zeros = unpack_int4(layer.qzeros, dim=1).to(torch.int32)
        return zeros + 1 if self.config.checkpoint_format == "gptq" else zeros

    def dequantize(self, layer: Linear) -> torch.Tensor:  # [out, in] float32
        q = unpack_int4(layer.qweight, dim=0).to(torch.float32)  # [in, out]
        zeros = self.zeros(layer).to(torch.float32)  # [G, out]
        scales = layer.scales  # [G, out]
        shared = getattr(layer, "g_idx_shared", False)
        spans = (
            [(0, layer.output_size)] if shared else zip(layer.shard_offsets, layer.output_sizes, strict=True)
        )
        pieces = []
        for shard, (start, size) in enumerate(spans):
            g = layer.g_idx[shard].long()  # [in]
            cols = slice(start, start + size)
            pieces.append((q[:, cols] - zeros[g, cols]) * scales[g, cols])  # [in, size]
        return torch.cat(pieces, dim=1).t().contiguous()  # [out, in]

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantize(layer).to(x.dtype), layer.bias)
