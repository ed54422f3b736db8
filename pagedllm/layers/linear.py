"""Linear layers whose parameters know how to load themselves from checkpoint tensors.

Every parameter carries a ``weight_loader(param, loaded_weight[, shard_id])`` attribute that the model loader
calls. Fused layers (``MergedLinear``, ``QKVLinear``) hold several checkpoint tensors in one weight, stacked
along the output dimension; each piece is loaded by its shard index and ``param.num_shards`` says how many
pieces a complete parameter has, so the loader can check none is missing. No tensor parallelism yet:
every rank would hold the whole weight.
"""

from __future__ import annotations

from collections.abc import Sequence

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


class Linear(nn.Module):
    """``y = x @ W.T + b`` with ``W: [output_size, input_size]``."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = new_parameter(output_size, input_size)  # [output_size, input_size]
        self.bias = new_parameter(output_size) if bias else None  # [output_size]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., input_size] -> [..., output_size]
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"


class MergedLinear(Linear):
    """Several linears over the same input, fused into one matmul (e.g. ``gate_up_proj = [gate; up]``).

    Shard ``i`` of the weight is rows ``[sum(output_sizes[:i]), sum(output_sizes[:i+1]))``.
    """

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False) -> None:
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = list(output_sizes)
        self.shard_offsets = [sum(self.output_sizes[:i]) for i in range(len(self.output_sizes))]
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_loader = self.weight_loader
                param.num_shards = len(self.output_sizes)

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
