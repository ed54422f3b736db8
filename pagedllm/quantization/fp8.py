"""FP8 (float8_e4m3fn) weights: ``quant_method: "fp8"`` checkpoints and online quantization (``quantization="fp8"``
on a float checkpoint). ``compressed_tensors.py`` reuses ``Fp8LinearMethod`` for its float-quantized format.

Checkpoint layouts of one ``nn.Linear(in, out)`` (the weight is always ``weight: [out, in] float8_e4m3fn``):

- per-tensor (vLLM / AutoFP8 ``fp8``; compressed-tensors strategy ``tensor``): ``weight_scale`` is one float
  (saved as ``[]`` or ``[1]``); ``W = weight * weight_scale``. A fused layer has one scale per source tensor,
  kept exactly by expanding each to its shard's rows (no requantization).
- per-channel (compressed-tensors strategy ``channel``; online): ``weight_scale: [out, 1]`` (or ``[out]``);
  ``W[o] = weight[o] * weight_scale[o]``.
- block-wise (``weight_block_size: [bn, bk]``, DeepSeek-V3 / transformers' FineGrainedFP8; compressed-tensors
  strategy ``block``): ``weight_scale_inv: [ceil(out / bn), ceil(in / bk)]`` (``weight_scale`` in
  compressed-tensors), ``W[o, i] = weight[o, i] * scale[o // bn, i // bk]`` (multiplied, despite the name).
  Fused layers keep each shard's block rows, so shards need not be multiples of ``bn``.
- Tensor parallelism (as vLLM): column-parallel layers keep their rows of ``weight`` and of per-channel scales
  (a merged layer's per-tensor scales fill its rows of each shard); row-parallel layers keep their columns of
  ``weight`` and every output's scale. Online quantization computes each row's scale over the whole row before
  keeping the rank's columns, so every rank holds exactly what one process would. Block-wise scales under
  tensor parallelism are refused.
- ``activation_scheme: "static"`` adds ``input_scale`` (one float per source tensor), kept per shard.

Online (``quantization="fp8"``, float checkpoint): each output row is quantized at load time,
``s[o] = max(|w[o]|.max(), 1e-12) / 448``, ``weight[o] = e4m3(w[o] / s[o])`` (round to nearest), so float
weights are never held in full.

Activations: the PyTorch path (CPU, the oracle) is weight-only: it dequantizes the weight to float32 and runs
``F.linear`` in the model dtype; activations are not quantized, and ``input_scale`` is loaded but unused.

GPU path (CUDA, compute capability >= 8.9, input and output sizes multiples of 16): W8A8 (``fp8_linear``). Each call
quantizes the activations per token (``max|x_row| / 448``, dynamic) or with the checkpoint's static ``input_scale``
(the largest of a fused layer's shards, as vLLM does), then ``torch._scaled_mm`` multiplies in FP8 with row-wise
scales: ``[M, 1]`` for the activations, ``[1, N]`` for the weight (per-channel scales as they are, per-tensor ones
expanded to their shard's rows, so fused shards keep their own scales exactly); the bias is added after.
``_scaled_mm`` with row-wise scales writes bf16 (the one output dtype every torch version supports there; other
model dtypes get a cast). The activation quantization is one Triton kernel (``pagedllm/kernels/fp8_quant.py``) or,
without Triton, its PyTorch twin ``quantize_fp8_per_token``. Not covered, so they keep the weight-only path on
CUDA: block-wise weights (dequantize + matmul every call: correct, slow), GPUs below 8.9 (a one-time warning),
sizes not multiples of 16.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.linear import Linear, LinearMethod
from pagedllm.platform import use_fused_kernels
from pagedllm.quantization.base import (
    QuantizationConfig,
    _check_shape,
    _get,
    _shard_id_ok,
    _tag,
    input_shard,
    is_ignored,
    output_pieces,
    output_sharded_parameter,
    per_shard_parameter,
    tp_size,
)

logger = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
STRATEGIES = ("tensor", "channel", "block", "online")


def quantize_fp8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Online quantization of ``weight: [rows, in]``: ``(e4m3 [rows, in], scale [rows] float32)`` as documented
    in the module docstring."""
    w = weight.to(torch.float32)
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / FP8_MAX  # [rows]
    q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)  # [rows, in]
    return q, scale


def quantize_fp8_per_token(
    x: torch.Tensor, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations ``x: [M, K]`` -> ``(e4m3 [M, K], scale [M, 1] float32)``: per-row ``max(max|x|, 1e-12) / 448``, or
    the per-tensor ``static_scale`` (one float) for every row; ``q = e4m3(clamp(x / scale, -448, 448))``."""
    x32 = x.to(torch.float32)
    if static_scale is None:
        # A tensor divisor: CUDA divides by a Python scalar through its reciprocal (1 ulp off true division,
        # which the Triton kernel does).
        fp8_max = torch.full((), FP8_MAX, dtype=torch.float32, device=x.device)
        scale = x32.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / fp8_max  # [M, 1]
    else:
        scale = static_scale.to(torch.float32).reshape(1, 1).expand(x.shape[0], 1).contiguous()
    q = (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def fp8_linear(
    x: torch.Tensor,  # [M, K] bf16/fp16/fp32
    weight: torch.Tensor,  # [N, K] float8_e4m3fn, row-major (so weight.t() is column-major, as _scaled_mm needs)
    weight_scale: torch.Tensor,  # [1, N] float32
    input_scale: torch.Tensor | None = None,  # [1] float32: static activations
    bias: torch.Tensor | None = None,  # [N]
    quantize=quantize_fp8_per_token,  # or the Triton kernel pagedllm.kernels.fp8_quant.quant_fp8_per_token
) -> torch.Tensor:  # [M, N] in x.dtype
    """W8A8 ``x @ (weight * weight_scale).T + bias`` through ``torch._scaled_mm`` (CUDA, capability >= 8.9; ``K``
    and ``N`` multiples of 16)."""
    N, K = weight.shape
    assert x.dim() == 2 and x.shape[1] == K, f"x {tuple(x.shape)} vs weight {tuple(weight.shape)}"
    assert weight_scale.shape == (1, N) and weight_scale.dtype == torch.float32
    q, scale = quantize(x, input_scale)  # [M, K] e4m3, [M, 1] float32
    out = torch._scaled_mm(q, weight.t(), scale_a=scale, scale_b=weight_scale, out_dtype=torch.bfloat16)
    if out.dtype != x.dtype:
        out = out.to(x.dtype)
    if bias is not None:
        out += bias
    return out


def fp8_linear_ref(
    q: torch.Tensor,  # [M, K] e4m3: the quantized activations fp8_linear used
    scale: torch.Tensor,  # [M, 1] float32
    weight: torch.Tensor,  # [N, K] e4m3
    weight_scale: torch.Tensor,  # [1, N] float32
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # [M, N] float32
    """The twin of ``fp8_linear`` given its quantized activations, in float32."""
    out = (q.to(torch.float32) * scale) @ (weight.to(torch.float32) * weight_scale.reshape(-1, 1)).t()
    return out if bias is None else out + bias.to(torch.float32)


_WARNED: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        logger.warning(message)


def fp8_matmul_supported(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` runs on ``device`` (CUDA with compute capability >= 8.9: Ada, Hopper, later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


@dataclass
class Fp8Config(QuantizationConfig):
    name = "fp8"
    strategy: str = "tensor"  # one of STRATEGIES
    weight_block_size: tuple[int, int] | None = None
    activation_scheme: str = "dynamic"  # "dynamic" | "static" (then input_scale tensors)
    ignored_layers: list[str] = field(default_factory=list)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Fp8Config:
        """A ``quant_method: "fp8"`` checkpoint (vLLM/AutoFP8 per-tensor, or block-wise with ``weight_block_size``)."""
        fmt = _get(config, "fmt", default="e4m3")
        if fmt != "e4m3":
            raise ValueError(f"quantization_config.fmt: only 'e4m3' FP8 is supported, got {fmt!r}")
        scheme = _get(config, "activation_scheme", default="dynamic")
        if scheme not in ("dynamic", "static"):
            raise ValueError(
                f"quantization_config.activation_scheme must be 'dynamic' or 'static', got {scheme!r}"
            )
        block = _get(config, "weight_block_size")
        if block is not None:
            if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
                raise ValueError(f"quantization_config.weight_block_size must be [bn, bk], got {block!r}")
            if scheme == "static":
                raise ValueError(
                    "quantization_config.activation_scheme: 'static' with weight_block_size is not supported"
                )
        ignored = list(_get(config, "ignored_layers", default=[])) + list(
            _get(config, "modules_to_not_convert", default=[])
        )
        return cls(
            strategy="tensor" if block is None else "block",
            weight_block_size=tuple(block) if block is not None else None,
            activation_scheme=scheme,
            ignored_layers=ignored,
        )

    @classmethod
    def online(cls) -> Fp8Config:
        """``quantization="fp8"`` on a float checkpoint: per-channel scales computed at load time."""
        return cls(strategy="online")

    def get_linear_method(
        self, layer: Linear, prefix: str, checkpoint_names: list[str]
    ) -> LinearMethod | None:
        if is_ignored(prefix, checkpoint_names, self.ignored_layers, "ignored_layers"):
            return None
        scale_name = "weight_scale_inv" if self.strategy == "block" else "weight_scale"
        return Fp8LinearMethod(
            self.strategy, self.weight_block_size, self.activation_scheme == "static", scale_name
        )


class Fp8LinearMethod(LinearMethod):
    """``weight: [out, in] float8_e4m3fn`` plus its scales (see the module docstring for each strategy)."""

    def __init__(
        self,
        strategy: str,
        block_size: tuple[int, int] | None = None,
        static_input_scale: bool = False,
        scale_name: str = "weight_scale",
    ) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown FP8 strategy {strategy!r}; choose from {STRATEGIES}")
        if (strategy == "block") != (block_size is not None):
            raise ValueError("FP8 block strategy needs a block size (and only it)")
        self.strategy = strategy
        self.block_size = block_size
        self.static_input_scale = static_input_scale
        self.scale_name = scale_name

    def create_weights(self, layer: Linear) -> None:
        out_size, in_size = layer.output_size, layer.input_size
        if self.strategy == "block" and tp_size(layer) > 1:
            raise ValueError(
                f"block-wise FP8 weights do not support tensor_parallel_size > 1 yet (got {tp_size(layer)})"
            )
        if self.strategy == "online":
            layer.weight = self._online_weight(layer)
        else:
            layer.weight = output_sharded_parameter(
                layer, (out_size, in_size), FP8_DTYPE, output_dim=0, input_dim=1
            )
            layer.weight.weight_loader = layer.weight.fused_weight_loader = _fp8_only(
                layer.weight.weight_loader
            )
        if self.strategy == "block":
            scale = self._block_scale(layer)
        elif self.strategy == "online":
            scale = _tag(  # float32 whatever the model's dtype: the scale quantize_fp8_per_channel computed
                nn.Parameter(torch.empty(out_size, dtype=torch.float32), requires_grad=False),
                layer,
                _no_loader,
                True,
            )
        else:
            scale = self._row_scale(layer)
        setattr(layer, self.scale_name, scale)
        if self.static_input_scale:
            layer.input_scale = per_shard_parameter(layer, (), torch.float32)  # [num_shards]

    # -- parameters ----------------------------------------------------------------------------------------
    def _online_weight(self, layer: Linear) -> nn.Parameter:
        weight = nn.Parameter(
            torch.empty(layer.output_size, layer.input_size, dtype=FP8_DTYPE), requires_grad=False
        )

        def loader(param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None = None) -> None:
            pieces, source_len = output_pieces(layer, shard_id)
            if not loaded.is_floating_point() or loaded.dtype == FP8_DTYPE:
                raise ValueError(
                    f"online FP8 quantization needs a float checkpoint weight, got {loaded.dtype}"
                )
            full_in = getattr(layer, "full_input_size", layer.input_size)
            _check_shape(torch.empty(source_len, full_in, device="meta"), loaded, "weight")
            for dst_offset, size, src_offset in pieces:
                # whole rows first, then this rank's columns: the scales are those of one process
                q, scale = quantize_fp8_per_channel(loaded.narrow(0, src_offset, size).to(param.device))
                param.data.narrow(0, dst_offset, size).copy_(input_shard(layer, q, 1, layer.input_size))
                layer.weight_scale.data.narrow(0, dst_offset, size).copy_(scale)

        return _tag(weight, layer, loader)

    def _row_scale(self, layer: Linear) -> nn.Parameter:
        """``[out] float32``: per-tensor scales expanded to their shard's rows, or per-channel scales (this rank's
        output channels; whole on row-parallel layers, whose output is not split)."""
        scale = nn.Parameter(torch.empty(layer.output_size, dtype=torch.float32), requires_grad=False)
        per_tensor = self.strategy == "tensor"

        def loader(param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None = None) -> None:
            pieces, source_len = output_pieces(layer, shard_id)
            if per_tensor:
                if loaded.numel() != 1:
                    raise ValueError(
                        f"per-tensor weight_scale must hold one value, got shape {tuple(loaded.shape)}"
                    )
                value = loaded.reshape(()).to(torch.float32).item()
                for dst_offset, size, _ in pieces:
                    param.data.narrow(0, dst_offset, size).fill_(value)
                return
            if loaded.dim() == 2 and loaded.shape[1] == 1:
                loaded = loaded[:, 0]  # [rows, 1] -> [rows]
            _check_shape(torch.empty(source_len, device="meta"), loaded, "per-channel weight_scale")
            for dst_offset, size, src_offset in pieces:
                param.data.narrow(0, dst_offset, size).copy_(loaded.narrow(0, src_offset, size))

        return _tag(scale, layer, loader)

    def _block_scale(self, layer: Linear) -> nn.Parameter:
        """``[sum_i ceil(out_i / bn), ceil(in / bk)] float32``: each shard's block rows, stacked."""
        bn, bk = self.block_size
        rows = [math.ceil(size / bn) for size in layer.output_sizes]
        row_offsets = [sum(rows[:i]) for i in range(len(rows))]
        layer.block_row_offsets = row_offsets
        cols = math.ceil(layer.input_size / bk)
        scale = nn.Parameter(torch.empty(sum(rows), cols, dtype=torch.float32), requires_grad=False)
        aligned = all(size % bn == 0 for size in layer.output_sizes)

        def loader(param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None = None) -> None:
            _shard_id_ok(layer, shard_id)
            if shard_id is None:
                if len(rows) > 1 and not aligned:
                    raise ValueError(
                        f"a fused block-scale tensor cannot be split: shard sizes {layer.output_sizes} are not "
                        f"multiples of the block size {bn}"
                    )
                dst = param.data
            else:
                dst = param.data.narrow(0, row_offsets[shard_id], rows[shard_id])
            _check_shape(dst, loaded, "block weight scale")
            dst.copy_(loaded)

        return _tag(scale, layer, loader)

    # -- compute -------------------------------------------------------------------------------------------
    def dequantize(self, layer: Linear) -> torch.Tensor:  # [out, in] float32
        weight = layer.weight.to(torch.float32)  # [out, in]
        scale = getattr(layer, self.scale_name)
        if self.strategy != "block":
            return weight * scale[:, None]  # scale [out]
        bn, bk = self.block_size
        pieces = []
        for start, size, row0 in zip(
            layer.shard_offsets, layer.output_sizes, layer.block_row_offsets, strict=True
        ):
            block = scale[row0 : row0 + math.ceil(size / bn)]  # [ceil(size / bn), ceil(in / bk)]
            full = block.repeat_interleave(bn, dim=0)[:size].repeat_interleave(bk, dim=1)[
                :, : layer.input_size
            ]
            pieces.append(weight[start : start + size] * full)  # [size, in]
        return torch.cat(pieces, dim=0)

    def process_weights_after_loading(self, layer: Linear) -> None:
        if layer.weight.device.type != "cuda":
            return
        if self.strategy == "block":
            _warn_once(
                "block",
                "block-wise FP8 weights run as dequantize + matmul on the GPU (no FP8 block kernel yet): correct "
                "but slower than bf16",
            )
            return
        if not fp8_matmul_supported(layer.weight.device):
            _warn_once(
                "capability",
                f"this GPU (compute capability {torch.cuda.get_device_capability(layer.weight.device)}) has no FP8 "
                "matmul (needs >= 8.9): FP8 weights are dequantized for every matmul (weight-only, slow)",
            )
            return
        if layer.input_size % 16 or layer.output_size % 16:
            _warn_once(
                f"shape{layer.input_size}x{layer.output_size}",
                f"FP8 layer {layer.input_size} -> {layer.output_size}: sizes not multiples of 16, which "
                "torch._scaled_mm needs; it is dequantized for every matmul instead",
            )
            return
        self.enable_w8a8(layer)

    def enable_w8a8(self, layer: Linear) -> None:
        """Use ``torch._scaled_mm`` for this layer (module docstring)."""
        scale = getattr(layer, self.scale_name)  # [out] float32
        layer.fp8_weight_scale = (
            scale.data.to(torch.float32).reshape(1, layer.output_size).contiguous()
        )  # [1, out]
        layer.fp8_input_scale = None
        if self.static_input_scale:
            layer.fp8_input_scale = layer.input_scale.data.max().reshape(1).to(torch.float32)  # [1]
        layer.fp8_w8a8 = True

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if getattr(layer, "fp8_w8a8", False):
            x2 = x.reshape(-1, layer.input_size)
            if x2.stride(-1) != 1:
                x2 = x2.contiguous()
            quantize = quantize_fp8_per_token
            if use_fused_kernels(x2):
                from pagedllm.kernels.fp8_quant import quant_fp8_per_token as quantize
            out = fp8_linear(
                x2, layer.weight, layer.fp8_weight_scale, layer.fp8_input_scale, layer.bias, quantize
            )
            return out.reshape(*x.shape[:-1], layer.output_size)
        return F.linear(x, self.dequantize(layer).to(x.dtype), layer.bias)


def _fp8_only(loader):
    def checked(param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        if loaded.dtype != FP8_DTYPE:
            raise ValueError(f"expected a float8_e4m3fn weight, got {loaded.dtype}")
        loader(param, loaded, shard_id)

    return checked


def _no_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None = None) -> None:
    raise ValueError(
        "this scale is computed from the float weight when quantizing online; the checkpoint has one"
    )
