"""Linear layers whose parameters know how to load themselves from checkpoint tensors.

Every parameter carries a ``weight_loader(param, loaded_weight[, shard_id])`` attribute that the model loader
calls. Fused layers (``MergedLinear``, ``QKVLinear``) hold several checkpoint tensors in one weight, stacked
along the output dimension; each piece is loaded by its shard index and ``param.num_shards`` says how many
pieces a complete parameter has, so the loader can check none is missing. No tensor parallelism yet:
every rank would hold the whole weight.

How a layer holds and applies its weight is its ``quant_method`` (a ``LinearMethod``): the default
``UnquantizedLinearMethod`` keeps a float ``weight: [output_size, input_size]``; the methods of
``pagedllm.quantization`` replace it with packed tensors (``qweight``, ``scales``, ...) after the model is
built (``set_linear_method``), so model files never change. Under ``deferred_linear_weights()`` (what the
loader uses for quantized models) the float weight is a meta-device placeholder until then, so a quantized
model never allocates its float weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Copy ``loaded_weight`` into ``param`` (casting dtype/device), after checking the shapes agree."""
    if param.shape != loaded_weight.shape:
        raise ValueError(
            f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded_weight.shape)}"
        )
    param.data.copy_(loaded_weight)


def new_parameter(
    *shape: int, weight_loader=default_weight_loader, num_shards: int | None = None
) -> nn.Parameter:
    """An uninitialised parameter (default dtype/device) tagged with its loader.

    Values are set later by the model loader (checkpoint or dummy weights), so nothing is initialised here.
    """
    param = nn.Parameter(torch.empty(*shape), requires_grad=False)
    param.weight_loader = weight_loader
    if num_shards is not None:
        param.num_shards = num_shards
    return param


_DEFER_WEIGHTS = False  # set by deferred_linear_weights() while a model is being built


@contextlib.contextmanager
def deferred_linear_weights() -> Iterator[None]:
    """Build ``Linear`` layers with a meta-device placeholder weight (no memory) until ``set_linear_method``
    gives each its real parameters. Construction-time only; biases are allocated as usual."""
    global _DEFER_WEIGHTS
    old, _DEFER_WEIGHTS = _DEFER_WEIGHTS, True
    try:
        yield
    finally:
        _DEFER_WEIGHTS = old


class LinearMethod:
    """How a ``Linear`` holds and applies its weight.

    ``create_weights(layer)`` registers the layer's weight parameters (each with a ``weight_loader``, and
    ``num_shards`` on fused layers) in the current default dtype and device; ``process_weights_after_loading``
    runs once the checkpoint is in; ``apply(layer, x)`` computes ``x @ W.T + layer.bias``.
    """

    def create_weights(self, layer: Linear) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: Linear) -> None:
        return None

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        raise NotImplementedError


class UnquantizedLinearMethod(LinearMethod):
    """A float ``weight: [output_size, input_size]``; fused layers load it shard by shard (rows)."""

    def create_weights(self, layer: Linear) -> None:
        if layer.fused:
            weight = new_parameter(
                layer.output_size,
                layer.input_size,
                weight_loader=layer.weight_loader,
                num_shards=len(layer.output_sizes),
            )
        else:
            weight = new_parameter(layer.output_size, layer.input_size)
        layer.weight = weight  # [output_size, input_size]

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)


class Linear(nn.Module):
    """``y = x @ W.T + b`` with ``W: [output_size, input_size]`` (held as its ``quant_method`` says)."""

    fused = False  # True for layers whose weight stacks several checkpoint tensors (MergedLinear)

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        output_sizes: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        # shard i is output rows [shard_offsets[i], shard_offsets[i] + output_sizes[i])
        self.output_sizes = list(output_sizes) if output_sizes is not None else [output_size]
        self.shard_offsets = [sum(self.output_sizes[:i]) for i in range(len(self.output_sizes))]
        self.quant_method: LinearMethod = UnquantizedLinearMethod()
        if _DEFER_WEIGHTS:
            self.weight = nn.Parameter(
                torch.empty(output_size, input_size, device="meta"), requires_grad=False
            )
        else:
            self.quant_method.create_weights(self)
        self.bias = new_parameter(output_size) if bias else None  # [output_size]

    def set_linear_method(self, method: LinearMethod) -> None:
        """Drop the current weight parameters and let ``method`` create its own (before loading)."""
        if "weight" in self._parameters:
            del self._parameters["weight"]
        self.quant_method = method
        method.create_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., input_size] -> [..., output_size]
        return self.quant_method.apply(self, x)

    def extra_repr(self) -> str:
        method = type(self.quant_method).__name__
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}, method={method}"


class MergedLinear(Linear):
    """Several linears over the same input, fused into one matmul (e.g. ``gate_up_proj = [gate; up]``).

    Shard ``i`` of the weight is rows ``[sum(output_sizes[:i]), sum(output_sizes[:i+1]))``.
    """

    fused = True

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False) -> None:
        super().__init__(input_size, sum(output_sizes), bias, output_sizes=output_sizes)
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader
            self.bias.num_shards = len(self.output_sizes)

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: int) -> None:
        """Copy one checkpoint tensor (``[output_sizes[shard_id], ...]``) into its rows of ``param``."""
        if not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard_id {shard_id} out of range for {len(self.output_sizes)} shards")
        rows = param.data.narrow(0, self.shard_offsets[shard_id], self.output_sizes[shard_id])
        default_weight_loader(rows, loaded_weight)


class QKVLinear(MergedLinear):
    """The fused query/key/value projection: shards 0, 1, 2 are q, k, v.

    Output layout: ``[q: num_heads * head_dim | k: num_kv_heads * head_dim | v: num_kv_heads * head_dim]``.
    """

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False
    ) -> None:
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        super().__init__(hidden_size, [self.q_size, self.kv_size, self.kv_size], bias)
