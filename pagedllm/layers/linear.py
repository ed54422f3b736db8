"""Linear layers whose parameters know how to load themselves from checkpoint tensors.

Every parameter carries a ``weight_loader(param, loaded_weight[, shard_id])`` attribute that the model loader
calls. Fused layers (``MergedLinear``, ``QKVLinear``) hold several checkpoint tensors in one weight, stacked
along the output dimension; each piece is loaded by its shard index and ``param.num_shards`` says how many
pieces a complete parameter has, so the loader can check none is missing.

Tensor parallelism (a ``TPGroup`` of ``T`` ranks, given at construction; one rank when omitted):
``ColumnParallelLinear`` (and the fused ``MergedLinear`` / ``QKVLinear``) splits the output rows, so rank ``r``
holds its slice of each shard (of q, of k and of v; of gate and of up); ``RowParallelLinear`` splits the input
columns and all-reduces its output. Their loaders take whole checkpoint tensors and copy only this rank's
slice. A layer's ``input_size`` / ``output_size`` / ``output_sizes`` / ``shard_offsets`` describe this rank's
part (what a ``LinearMethod`` allocates); with one rank they are the whole layer, as before. Quantized methods'
parameters shard the same way through their own loaders (``pagedllm.quantization.base``).

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
from torch import nn

from pagedllm.distributed.communicator import all_reduce
from pagedllm.distributed.parallel_state import TPGroup, divide
from pagedllm.layers.cpu_gemm import linear, one_row_gemv, pack_weight
from pagedllm.platform import use_pdl


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Copy ``loaded_weight`` into ``param`` (casting dtype/device), after checking the shapes agree."""
    if param.shape != loaded_weight.shape:
        raise ValueError(
            f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded_weight.shape)}"
        )
    with torch.no_grad():
        param.copy_(loaded_weight)  # not through .data: the version counter moves (cpu_gemm.PackedWeight reads it)


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
    """A float ``weight: [output_size, input_size]`` loaded by the layer's ``weight_loader`` (fused layers:
    shard by shard (rows), or whole through ``fused_weight_loader``)."""

    def create_weights(self, layer: Linear) -> None:
        if layer.fused:
            weight = new_parameter(
                layer.output_size,
                layer.input_size,
                weight_loader=layer.weight_loader,
                num_shards=len(layer.output_sizes),
            )
            weight.fused_weight_loader = layer.fused_weight_loader
        else:
            weight = new_parameter(layer.output_size, layer.input_size, weight_loader=layer.weight_loader)
        layer.weight = weight  # [output_size, input_size]
        layer.packed_weight = None

    def process_weights_after_loading(self, layer: Linear) -> None:
        # On CPU, a oneDNN-packed copy of the weight (cpu_gemm.py); None elsewhere.
        layer.packed_weight = pack_weight(layer.weight)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return linear(x, layer.weight, getattr(layer, "packed_weight", None), layer.bias)


class Linear(nn.Module):
    """``y = x @ W.T + b`` with ``W: [output_size, input_size]`` (held as its ``quant_method`` says).

    Replicated: every tensor-parallel rank holds the whole weight."""

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

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: int | None = None
    ) -> None:
        """Copy a whole checkpoint tensor into ``param`` (an unfused, unsharded layer)."""
        if shard_id is not None:
            raise ValueError(f"shard_id {shard_id} given for a layer with no shards")
        default_weight_loader(param, loaded_weight)

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


class ColumnParallelLinear(Linear):
    """Output rows split over the ranks of ``tp``; the output stays split (a ``RowParallelLinear`` takes it).

    The weight stacks one or more checkpoint tensors (shards, ``full_output_sizes``). Of shard ``i`` this rank
    holds the ``output_sizes[i]`` rows starting at row ``shard_slice_starts[i]`` of the checkpoint tensor: slice
    ``rank`` of ``T`` equal ones, unless ``slice_sizes`` / ``slice_indices`` say otherwise (``QKVLinear``'s
    replicated KV heads). Biases are split the same way. With one rank this is a plain ``Linear``.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp: TPGroup | None = None,
        *,
        output_sizes: Sequence[int] | None = None,
        slice_sizes: Sequence[int] | None = None,
        slice_indices: Sequence[int] | None = None,
    ) -> None:
        self.tp = tp if tp is not None else TPGroup.single()
        self.full_output_sizes = list(output_sizes) if output_sizes is not None else [output_size]
        if slice_sizes is None:
            slice_sizes = [divide(size, self.tp.size, "output size") for size in self.full_output_sizes]
        if slice_indices is None:
            slice_indices = [self.tp.rank] * len(self.full_output_sizes)
        # shard i: rows [shard_slice_starts[i], + output_sizes[i]) of its checkpoint tensor
        self.shard_slice_starts = [index * size for index, size in zip(slice_indices, slice_sizes)]
        super().__init__(input_size, sum(slice_sizes), bias, output_sizes=slice_sizes)
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader
            if self.fused:
                self.bias.num_shards = len(self.output_sizes)
                self.bias.fused_weight_loader = self.fused_weight_loader

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: int | None = None
    ) -> None:
        """Copy this rank's rows of checkpoint tensor ``shard_id`` (``[full_output_sizes[shard_id], ...]``) into
        its rows of ``param``; ``shard_id`` None is the only shard of an unfused layer."""
        if shard_id is None:
            if self.fused:
                raise ValueError(
                    "a fused layer loads shard by shard (shard_id) or through fused_weight_loader"
                )
            shard_id = 0
        if not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard_id {shard_id} out of range for {len(self.output_sizes)} shards")
        expected = (self.full_output_sizes[shard_id], *param.shape[1:])
        if tuple(loaded_weight.shape) != expected:
            raise ValueError(
                f"shape mismatch: parameter {expected} vs checkpoint {tuple(loaded_weight.shape)}"
            )
        size = self.output_sizes[shard_id]
        rows = param.data.narrow(0, self.shard_offsets[shard_id], size)
        default_weight_loader(rows, loaded_weight.narrow(0, self.shard_slice_starts[shard_id], size))

    def fused_weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
        """A checkpoint that already holds the fused tensor (Phi-3's ``qkv_proj``): each shard's rows in turn."""
        expected = (sum(self.full_output_sizes), *param.shape[1:])
        if tuple(loaded_weight.shape) != expected:
            raise ValueError(
                f"shape mismatch: parameter {expected} vs checkpoint {tuple(loaded_weight.shape)}"
            )
        start = 0
        for shard_id, size in enumerate(self.full_output_sizes):
            self.weight_loader(param, loaded_weight.narrow(0, start, size), shard_id)
            start += size


class MergedLinear(ColumnParallelLinear):
    """Several linears over the same input, fused into one matmul (e.g. ``gate_up_proj = [gate; up]``).

    Shard ``i`` of the weight is rows ``[sum(output_sizes[:i]), sum(output_sizes[:i+1]))``; under tensor
    parallelism each rank holds its slice of every shard, so ``[gate_r; up_r]``.
    """

    fused = True

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool = False,
        tp: TPGroup | None = None,
        *,
        slice_sizes: Sequence[int] | None = None,
        slice_indices: Sequence[int] | None = None,
    ) -> None:
        super().__init__(
            input_size,
            sum(output_sizes),
            bias,
            tp,
            output_sizes=output_sizes,
            slice_sizes=slice_sizes,
            slice_indices=slice_indices,
        )


class QKVLinear(MergedLinear):
    """The fused query/key/value projection: shards 0, 1, 2 are q, k, v.

    Output layout (this rank's heads): ``[q: num_heads * head_dim | k: num_kv_heads * head_dim | v: same]``.
    With ``T`` ranks, rank ``r`` holds query heads ``[r * H / T, (r + 1) * H / T)`` and KV heads
    ``[r * KV / T, (r + 1) * KV / T)``; when ``KV < T`` (``T % KV == 0``) it holds the one KV head its query
    heads read, ``r // (T / KV)``, replicated on ``T / KV`` ranks. ``num_heads`` / ``num_kv_heads`` are this
    rank's counts; ``total_num_heads`` / ``total_num_kv_heads`` the model's.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        tp: TPGroup | None = None,
    ) -> None:
        tp = tp if tp is not None else TPGroup.single()
        self.total_num_heads = num_heads
        self.total_num_kv_heads = num_kv_heads
        self.num_heads = divide(num_heads, tp.size, "num_attention_heads")
        if num_kv_heads >= tp.size:
            self.num_kv_heads = divide(num_kv_heads, tp.size, "num_key_value_heads")
            kv_index = tp.rank
        else:
            if tp.size % num_kv_heads:
                raise ValueError(
                    f"num_key_value_heads ({num_kv_heads}) is smaller than tensor_parallel_size ({tp.size}) "
                    "and does not divide it"
                )
            self.num_kv_heads = 1
            kv_index = tp.rank // (tp.size // num_kv_heads)  # replicated on T / KV consecutive ranks
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        super().__init__(
            hidden_size,
            [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
            bias,
            tp,
            slice_sizes=[self.q_size, self.kv_size, self.kv_size],
            slice_indices=[tp.rank, kv_index, kv_index],
        )


class RowParallelLinear(Linear):
    """Input columns split over the ranks of ``tp``; partial outputs summed over the ranks (all-reduce).

    Rank ``r`` holds columns ``[r * in / T, (r + 1) * in / T)`` of the checkpoint weight and takes the matching
    slice of the input (the split output of a column-parallel layer); ``input_size`` is that slice's size. The
    bias is added once: rank 0 holds it and the other ranks hold zeros, so every ``LinearMethod`` can keep
    adding ``layer.bias`` (adding zeros is exact). ``reduce_results=False`` leaves the partial sums.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp: TPGroup | None = None,
        reduce_results: bool = True,
    ) -> None:
        self.tp = tp if tp is not None else TPGroup.single()
        self.full_input_size = input_size
        self.reduce_results = reduce_results
        super().__init__(divide(input_size, self.tp.size, "input size"), output_size, bias)
        if self.bias is not None:
            self.bias.weight_loader = self.bias_loader

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: int | None = None
    ) -> None:
        """Copy this rank's columns of the checkpoint weight ``[output_size, full_input_size]``."""
        if shard_id is not None:
            raise ValueError(f"shard_id {shard_id} given for a layer with no shards")
        expected = (*param.shape[:-1], self.full_input_size)
        if tuple(loaded_weight.shape) != expected:
            raise ValueError(
                f"shape mismatch: parameter {expected} vs checkpoint {tuple(loaded_weight.shape)}"
            )
        cols = loaded_weight.narrow(-1, self.tp.rank * self.input_size, self.input_size)
        default_weight_loader(param, cols)

    def bias_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: int | None = None
    ) -> None:
        """Rank 0 copies the bias; the others hold zeros (the all-reduce adds it once)."""
        if shard_id is not None:
            raise ValueError(f"shard_id {shard_id} given for a layer with no shards")
        if self.tp.rank == 0:
            default_weight_loader(param, loaded_weight)
        elif param.shape != loaded_weight.shape:
            raise ValueError(
                f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded_weight.shape)}"
            )
        else:
            param.data.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., input_size] (this rank's slice) -> [..., out]
        out = self.quant_method.apply(self, x)  # this rank's partial sum
        return all_reduce(out, self.tp) if self.reduce_results else out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, tp={self.tp.rank}/{self.tp.size}"


def act_then_linear(layer: Linear, x: torch.Tensor, act: str) -> torch.Tensor | None:
    """``layer(act(x))`` in one launch, where the Triton GEMV takes it: a single row on the GPU through an
    unquantized layer (no LoRA). ``act``: "silu_and_mul" (``x`` is ``[1, 2 * layer.input_size]``). None where it
    does not apply; the caller then runs the activation and the layer itself."""
    if type(layer.quant_method) is not UnquantizedLinearMethod or not one_row_gemv(x, layer.weight):
        return None
    from pagedllm.kernels.gemv import gemv

    out = gemv(x.reshape(1, -1), layer.weight, layer.bias, act=act, pdl=use_pdl(x))
    out = out.view(*x.shape[:-1], layer.output_size)
    if isinstance(layer, RowParallelLinear) and layer.reduce_results:
        out = all_reduce(out, layer.tp)
    return out
