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

Tensor parallelism: column-parallel layers keep their output channels of all four tensors (``qzeros`` in
units of 8: each rank's shard sizes must divide by 8); row-parallel ones keep their input rows of ``qweight``
(in packs of 8) and ``g_idx``, and their groups of ``scales``/``qzeros`` (the input size per rank must divide by
``group_size``); with ``desc_act`` they keep ``scales``/``qzeros`` whole, ``g_idx`` naming global groups (as vLLM).

The PyTorch path (CPU, and CUDA without Triton) dequantizes to float32 on every call and runs ``F.linear``: the
oracle for the GPU path.

GPU path (CUDA with Triton, ``pagedllm/kernels/w4a16_gemm.py``), prepared once in ``process_weights_after_loading``:

- every shard has the same ``g_idx`` (always so for published checkpoints: q/k/v, gate/up read the same input, so
  GPTQ's act-order permutation, taken from that input's statistics, is the same) and it is ``i // group_size``:
  one "grouped" launch for all shards, one row of zeros/scales per K step;
- the same act-order ``g_idx`` (a permutation of ``i // group_size``): ``qweight``'s rows are sorted by group at
  load (stable ``argsort(g_idx)``, kept as ``w4a16_perm``) and ``g_idx`` becomes ``i // group_size``; each call
  permutes the input's columns to match (``x[:, w4a16_perm]``), then one grouped launch;
- otherwise (shards with different ``g_idx``): one launch per shard, gathering zeros/scales by ``g_idx``.

The kernel computes the twin's products up to rounding the float32 weight to the activation dtype (bf16/fp16);
``dequantize`` still returns the checkpoint's weight after the reordering (it undoes ``w4a16_perm``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from pagedllm.layers.linear import Linear, LinearMethod
from pagedllm.platform import use_fused_kernels
from pagedllm.quantization.base import (
    QuantizationConfig,
    _get,
    add_group_params,
    input_shard,
    int4_group_size,
    is_ignored,
    is_row_parallel,
    output_sharded_parameter,
    pack_int4,
    per_shard_parameter,
    tp_size,
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
        group_size = int4_group_size(config, "GPTQ")
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
        """Allocate this rank's part (module docstring for the layouts).

        Row-parallel layers under tensor parallelism (as vLLM): ``qweight`` keeps the rank's input rows (packs of
        8), ``g_idx`` their entries; ``scales``/``qzeros`` keep the rank's groups, except with ``desc_act`` (the
        rank's inputs may belong to any group) or ``group_size = -1`` (one group), where they stay whole and
        ``g_idx`` holds global group indices."""
        in_size, out_size = layer.input_size, layer.output_size
        tp = tp_size(layer)
        row_parallel = is_row_parallel(layer)
        where = f" (the input size per rank, with tensor_parallel_size {tp})" if row_parallel else ""
        if in_size % 8:
            raise ValueError(f"GPTQ needs the input size to be a multiple of 8, got {in_size}{where}")
        group_size = self.group_size(layer)
        if row_parallel and self.config.group_size != -1 and in_size % group_size:
            raise ValueError(
                f"GPTQ with tensor_parallel_size {tp}: the input size per rank ({in_size}) is not a multiple of "
                f"group_size ({group_size})"
            )
        whole_groups = row_parallel and (self.config.desc_act or self.config.group_size == -1)
        if whole_groups and self.config.group_size != -1:
            num_groups = math.ceil(layer.full_input_size / group_size)
        else:
            num_groups = math.ceil(in_size / group_size)
        group_input_dim = None if whole_groups else 0  # scales/qzeros rows: cut by group when row-parallel
        layer.qweight = output_sharded_parameter(
            layer, (in_size // 8, out_size), torch.int32, output_dim=1, input_dim=0
        )
        add_group_params(layer, num_groups, group_input_dim)
        layer.g_idx = per_shard_parameter(layer, (in_size,), torch.int32, optional=True)  # [num_shards, in]
        # global group index of this rank's input i when scales stay whole, else the rank's own group index
        first_input = layer.tp.rank * in_size if whole_groups and self.config.group_size != -1 else 0
        local_groups_start = layer.tp.rank * num_groups if row_parallel and not whole_groups else 0
        default = (
            torch.arange(in_size, dtype=torch.int32, device=layer.g_idx.device) + first_input
        ) // group_size
        layer.g_idx.data.copy_(default.expand_as(layer.g_idx))
        load_g_idx = layer.g_idx.weight_loader

        def g_idx_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None = None) -> None:
            loaded = input_shard(layer, loaded, 0, in_size)  # the rank's input channels
            if local_groups_start:
                loaded = loaded - local_groups_start  # global -> this rank's group index
            load_g_idx(param, loaded, shard_id)

        layer.g_idx.weight_loader = layer.g_idx.fused_weight_loader = g_idx_loader

    def process_weights_after_loading(self, layer: Linear) -> None:
        g_idx = layer.g_idx  # [num_shards, in]
        num_groups = layer.scales.shape[0]
        if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= num_groups):
            raise ValueError(f"GPTQ g_idx holds groups outside [0, {num_groups})")
        layer.g_idx_shared = bool((g_idx == g_idx[:1]).all())  # one dequantization for all shards
        if use_fused_kernels(layer.qweight):
            self.prepare_kernel(layer)

    def zero_offset(self) -> int:
        return 1 if self.config.checkpoint_format == "gptq" else 0

    def prepare_kernel(self, layer: Linear) -> None:
        """Ready ``layer`` for the W4A16 kernel (module docstring): sorts act-order rows by group when every shard
        shares ``g_idx``. Runs on any device (tests call it on CPU under Triton's interpreter)."""
        if getattr(layer, "w4a16_mode", None) is not None:
            return
        group_size = self.group_size(layer)
        default = (torch.arange(layer.input_size, device=layer.g_idx.device) // group_size).to(torch.int32)
        layer.w4a16_perm = None
        layer.w4a16_mode = "gather"
        if layer.g_idx_shared:
            g_idx = layer.g_idx[0]
            if torch.equal(g_idx, default):
                layer.w4a16_mode = "grouped"
            else:
                perm = torch.argsort(g_idx, stable=True)  # [in]: stored row j is input channel perm[j]
                if torch.equal(g_idx[perm], default):
                    q = unpack_int4(layer.qweight.data, dim=0)  # [in, out] uint8
                    layer.qweight.data = pack_int4(q[perm], dim=0)
                    del q
                    layer.g_idx.data.copy_(default.expand_as(layer.g_idx))
                    layer.w4a16_perm = perm
                    layer.w4a16_mode = "grouped"

    def apply_kernel(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        from pagedllm.kernels.w4a16_gemm import w4a16_gemm

        x2 = x.reshape(-1, layer.input_size)  # [M, in]
        if layer.w4a16_mode == "grouped":
            if layer.w4a16_perm is not None:
                x2 = x2.index_select(1, layer.w4a16_perm)
            out = w4a16_gemm(
                x2,
                layer.qweight,
                layer.qzeros,
                layer.scales,
                None,
                self.zero_offset(),
                group_size=self.group_size(layer),
            )
        elif layer.g_idx_shared:
            out = w4a16_gemm(
                x2, layer.qweight, layer.qzeros, layer.scales, layer.g_idx[0], self.zero_offset()
            )
        else:
            pieces = []
            for shard, (start, size) in enumerate(zip(layer.shard_offsets, layer.output_sizes, strict=True)):
                pieces.append(
                    w4a16_gemm(
                        x2,
                        layer.qweight[:, start : start + size],
                        layer.qzeros[:, start // 8 : (start + size) // 8],
                        layer.scales[:, start : start + size],
                        layer.g_idx[shard],
                        self.zero_offset(),
                    )
                )
            out = torch.cat(pieces, dim=1)
        if layer.bias is not None:
            out += layer.bias
        return out.reshape(*x.shape[:-1], layer.output_size)

    def zeros(self, layer: Linear) -> torch.Tensor:  # [G, out] int32
        return unpack_int4(layer.qzeros, dim=1).to(torch.int32) + self.zero_offset()

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
        weight = torch.cat(pieces, dim=1).t()  # [out, in] (input channels in stored order)
        perm = getattr(layer, "w4a16_perm", None)
        if perm is not None:  # stored column j is input channel perm[j]
            weight = weight[:, torch.argsort(perm)]
        return weight.contiguous()

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if getattr(layer, "w4a16_mode", None) is not None:
            return self.apply_kernel(layer, x)
        return F.linear(x, self.dequantize(layer).to(x.dtype), layer.bias)
