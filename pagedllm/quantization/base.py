"""What every quantization method shares: the config interface, module-name matching, int4 packing, and
parameters whose ``weight_loader`` knows where each fused shard lies in a packed tensor.

A method is one file (``fp8.py``, ``gptq.py``, ...) holding its ``QuantizationConfig`` (parsed from
config.json's ``quantization_config`` or from the ``quantization=`` flag, checked at start-up with a
``ValueError`` naming the field) and its ``LinearMethod`` (``pagedllm.layers.linear``).

Shards. A fused layer (``qkv_proj``, ``gate_up_proj``) stacks its checkpoint tensors along the output
dimension: shard ``i`` owns output channels ``[layer.shard_offsets[i], + layer.output_sizes[i])``. A packed
parameter declares which of its dims runs over output channels (``output_dim``) and how many channels one
element holds along it (``pack_factor``, e.g. 8 for int4 packed in int32), so a shard lands at
``narrow(output_dim, offset // pack_factor, size // pack_factor)``. Per-shard values that do not run over
output channels (GPTQ's ``g_idx``, a static ``input_scale``) get a leading ``[num_shards]`` dim instead.

Tensor parallelism (as vLLM shards these formats). Loaders always receive whole checkpoint tensors and keep
this rank's part. Column-parallel layers (``ColumnParallelLinear``, ``MergedLinear``, ``QKVLinear``): every
output-channel dim is cut to the rank's rows of each shard (``output_pieces``), in packed units, so each
rank's packed sizes must divide by ``pack_factor`` (``ValueError`` naming ``tensor_parallel_size``).
Row-parallel layers (``RowParallelLinear``): a parameter that declares an ``input_dim`` is cut to the rank's
``1 / T`` of that dim (``input_shard``: packed input rows, or groups of ``group_size`` inputs); one without
keeps the whole tensor (per-output-channel scales, act-order GPTQ's scales/zeros).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from pagedllm.layers.linear import ColumnParallelLinear, Linear, LinearMethod, RowParallelLinear

WeightLoader = Callable[..., None]


class QuantizationConfig:
    """A parsed quantization scheme: which layers it quantizes and with which ``LinearMethod``."""

    name: str = ""

    def get_linear_method(
        self, layer: Linear, prefix: str, checkpoint_names: Sequence[str]
    ) -> LinearMethod | None:
        """The method for the linear layer ``prefix`` (our module name), or None to keep it unquantized.

        ``checkpoint_names`` are the checkpoint's module names stacked in it (``[q_proj, k_proj, v_proj]`` for
        ``qkv_proj``; ``[prefix]`` for an unfused layer), which is what ignore lists name.
        """
        raise NotImplementedError


def _get(config: dict[str, Any], *keys: str, default: Any = None) -> Any:
    """The first of ``keys`` present in ``config`` (formats spell some fields two ways)."""
    for key in keys:
        if key in config and config[key] is not None:
            return config[key]
    return default


def matches_module(name: str, pattern: str) -> bool:
    """Whether checkpoint module ``name`` is named by an ignore-list ``pattern``.

    ``re:<regex>`` patterns (compressed-tensors) match with ``re.match``; plain ones match a whole dotted
    component run of the name (``lm_head``, ``mlp.down_proj``, ``model.layers.0.self_attn.q_proj``), as
    transformers' ``modules_to_not_convert`` does.
    """
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return f".{pattern}." in f".{name}."


def is_ignored(prefix: str, checkpoint_names: Sequence[str], patterns: Sequence[str], field: str) -> bool:
    """True when every checkpoint module of the layer is ignored; ``ValueError`` when only some are (the
    fused layer would need two formats)."""
    if not patterns:
        return False
    if any(matches_module(prefix, p) for p in patterns):
        return True
    hits = [any(matches_module(n, p) for p in patterns) for n in checkpoint_names]
    if all(hits):
        return True
    if any(hits):
        raise ValueError(
            f"quantization_config.{field} ignores only some of {list(checkpoint_names)}, which pagedllm fuses "
            f"into {prefix}: a fused layer must be quantized as a whole"
        )
    return False


# ----------------------------------------------------------------------------------------------- int4 packing
# 8 unsigned 4-bit values per int32; nibble j occupies bits [4j, 4j + 4).
GPTQ_ORDER = (0, 1, 2, 3, 4, 5, 6, 7)  # nibble j holds element 8k + j
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j holds element 8k + AWQ_ORDER[j]
_SHIFTS = tuple(range(0, 32, 4))


def unpack_int4(packed: torch.Tensor, dim: int, order: Sequence[int] = GPTQ_ORDER) -> torch.Tensor:
    """int32 ``packed`` -> uint8 values in [0, 16), 8x longer along ``dim``.

    Element ``8k + order[j]`` along ``dim`` is nibble ``j`` (bits ``4j..4j+3``) of packed element ``k``.
    """
    dim = dim % packed.dim()
    shifts = torch.tensor(_SHIFTS, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # [..., 8]: nibble j at index j
    position_of = [0] * 8
    for j, element in enumerate(order):
        position_of[element] = j
    nibbles = nibbles[..., position_of]  # [..., 8]: element e at index e
    nibbles = nibbles.movedim(-1, dim + 1)  # the 8 elements right after the packed dim
    shape = list(packed.shape)
    shape[dim] *= 8
    return nibbles.reshape(shape).to(torch.uint8)


def pack_int4(values: torch.Tensor, dim: int, order: Sequence[int] = GPTQ_ORDER) -> torch.Tensor:
    """Inverse of ``unpack_int4``: integers in [0, 16) -> int32, 8x shorter along ``dim``."""
    dim = dim % values.dim()
    if values.shape[dim] % 8:
        raise ValueError(f"cannot pack {values.shape[dim]} int4 values along dim {dim}: not a multiple of 8")
    if values.numel() and (int(values.min()) < 0 or int(values.max()) > 15):
        raise ValueError("int4 values must lie in [0, 16)")
    shape = list(values.shape)
    shape[dim : dim + 1] = [shape[dim] // 8, 8]
    grouped = values.to(torch.int64).reshape(shape).movedim(dim + 1, -1)  # [..., 8]: element e at index e
    packed = torch.zeros(grouped.shape[:-1], dtype=torch.int64, device=values.device)
    for j, element in enumerate(order):
        packed |= grouped[..., element] << (4 * j)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)  # as two's-complement int32
    return packed.to(torch.int32)


# ------------------------------------------------------------------------------------------ sharded parameters
def _check_shape(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(
            f"{what}: shape mismatch: parameter {tuple(dst.shape)} vs checkpoint {tuple(src.shape)}"
        )


def _shard_id_ok(layer: Linear, shard_id: int | None) -> None:
    if shard_id is not None and not 0 <= shard_id < len(layer.output_sizes):
        raise ValueError(f"shard_id {shard_id} out of range for {len(layer.output_sizes)} shards")


def _tag(param: nn.Parameter, layer: Linear, loader: WeightLoader, optional: bool = False) -> nn.Parameter:
    param.weight_loader = loader
    param.fused_weight_loader = loader  # a checkpoint holding the fused tensor: shard_id None
    if layer.fused:
        param.num_shards = len(layer.output_sizes)
    if optional:
        param.optional = True  # the loader's strict check allows it to stay at its initial value
    return param


def tp_size(layer: Linear) -> int:
    """How many tensor-parallel ranks share ``layer`` (1 for a replicated ``Linear``)."""
    tp = getattr(layer, "tp", None)
    return 1 if tp is None else tp.size


def is_row_parallel(layer: Linear) -> bool:
    """Whether ``layer``'s input dim is split over more than one rank."""
    return isinstance(layer, RowParallelLinear) and layer.tp.size > 1


def output_pieces(layer: Linear, shard_id: int | None) -> tuple[list[tuple[int, int, int]], int]:
    """Where a checkpoint tensor's output channels land in ``layer``'s parameter.

    Returns ``(pieces, source_len)``: each piece ``(dst_offset, size, src_offset)`` copies output channels
    ``[src_offset, + size)`` of the loaded tensor to ``[dst_offset, + size)`` of the parameter, and the loaded
    tensor must hold ``source_len`` output channels. ``shard_id`` None is the whole parameter (an unfused
    layer, or a checkpoint holding the fused tensor, split into its shards here).
    """
    _shard_id_ok(layer, shard_id)
    if isinstance(layer, ColumnParallelLinear):
        full = layer.full_output_sizes
        if shard_id is None and layer.fused:  # the fused checkpoint tensor: every shard in turn
            pieces = [
                (layer.shard_offsets[i], layer.output_sizes[i], sum(full[:i]) + layer.shard_slice_starts[i])
                for i in range(len(full))
            ]
            return pieces, sum(full)
        i = 0 if shard_id is None else shard_id
        return [(layer.shard_offsets[i], layer.output_sizes[i], layer.shard_slice_starts[i])], full[i]
    if shard_id is None:
        return [(0, layer.output_size, 0)], layer.output_size
    return [(layer.shard_offsets[shard_id], layer.output_sizes[shard_id], 0)], layer.output_sizes[shard_id]


def input_shard(layer: Linear, loaded: torch.Tensor, dim: int, local_len: int) -> torch.Tensor:
    """This rank's ``local_len`` entries of ``loaded`` along its input dim ``dim`` (row-parallel layers; any
    other layer gets ``loaded`` back). The checkpoint must hold ``tensor_parallel_size * local_len`` there."""
    if not is_row_parallel(layer):
        return loaded
    size = layer.tp.size
    if loaded.shape[dim] != local_len * size:
        raise ValueError(
            f"shape mismatch: checkpoint {tuple(loaded.shape)} has {loaded.shape[dim]} entries along its input "
            f"dim {dim}, expected {local_len} per rank x tensor_parallel_size {size}"
        )
    return loaded.narrow(dim, layer.tp.rank * local_len, local_len)


def output_sharded_parameter(
    layer: Linear,
    shape: Sequence[int],
    dtype: torch.dtype,
    output_dim: int,
    pack_factor: int = 1,
    input_dim: int | None = None,
) -> nn.Parameter:
    """A parameter with output channels along ``output_dim`` (``pack_factor`` channels per element).

    ``weight_loader(param, loaded, shard_id=None)``: shard ``i`` goes to its slice along ``output_dim``;
    ``None`` (an unfused layer, or a checkpoint holding the fused tensor) fills the whole parameter. Under
    tensor parallelism only this rank's output channels are kept (``output_pieces``), and, on a row-parallel
    layer, its slice along ``input_dim`` when given (None: the input dim is not split, e.g. per-output scales).
    """
    size = tp_size(layer)
    for out in layer.output_sizes:
        if out % pack_factor:
            raise ValueError(
                f"output size {out} of a shard of {layer.output_sizes} is not a multiple of {pack_factor}, "
                "as this packed format needs"
                + (f" (sizes per rank with tensor_parallel_size {size})" if size > 1 else "")
            )
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

    def loader(param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        pieces, source_len = output_pieces(layer, shard_id)
        if input_dim is not None:
            loaded = input_shard(layer, loaded, input_dim, param.shape[input_dim])
        if loaded.dim() != param.dim() or loaded.shape[output_dim] * pack_factor != source_len:
            raise ValueError(
                f"output-sharded parameter: checkpoint {tuple(loaded.shape)} does not hold {source_len} output "
                f"channels along dim {output_dim} (parameter {tuple(param.shape)})"
            )
        for dst_offset, out, src_offset in pieces:
            if src_offset % pack_factor:
                raise ValueError(
                    f"this rank's output channels start at {src_offset}, not a multiple of {pack_factor}: the "
                    f"packed checkpoint cannot be split over tensor_parallel_size {size}"
                )
            dst = param.data.narrow(output_dim, dst_offset // pack_factor, out // pack_factor)
            src = loaded.narrow(output_dim, src_offset // pack_factor, out // pack_factor)
            _check_shape(dst, src, "output-sharded parameter")
            dst.copy_(src)

    return _tag(param, layer, loader)


def per_shard_parameter(
    layer: Linear, inner_shape: Sequence[int], dtype: torch.dtype, optional: bool = False
) -> nn.Parameter:
    """A parameter ``[num_shards, *inner_shape]``: one value per checkpoint tensor (``num_shards`` is 1 for an
    unfused layer). A fused checkpoint tensor (shard_id None) of ``inner_shape`` is copied to every shard."""
    num_shards = len(layer.output_sizes)
    param = nn.Parameter(torch.empty(num_shards, *inner_shape, dtype=dtype), requires_grad=False)

    def loader(param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        _shard_id_ok(layer, shard_id)
        if loaded.numel() == 1 and len(inner_shape) == 0:
            loaded = loaded.reshape(())  # scalars are saved as [] or [1]
        _check_shape(param.data[0], loaded, "per-shard parameter")
        if shard_id is None:
            param.data.copy_(loaded.unsqueeze(0).expand_as(param.data))
        else:
            param.data[shard_id].copy_(loaded)

    return _tag(param, layer, loader, optional)


def int4_group_size(config: dict[str, Any], method: str) -> int:
    """``quantization_config``'s 4-bit check and group size (-1 or positive) for GPTQ / AWQ; ``ValueError``
    naming the field otherwise."""
    bits = _get(config, "bits", "w_bit", default=4)
    if bits != 4:
        raise ValueError(f"quantization_config.bits: only 4-bit {method} is supported, got {bits!r}")
    group_size = _get(config, "group_size", "q_group_size", default=128)
    if not isinstance(group_size, int) or not (group_size == -1 or group_size > 0):
        raise ValueError(f"quantization_config.group_size must be -1 or positive, got {group_size!r}")
    return group_size


def add_group_params(layer: Linear, num_groups: int, group_input_dim: int | None) -> None:
    """``layer.qzeros`` (``[num_groups, out / 8]`` int32, packed along the output dim) and ``layer.scales``
    (``[num_groups, out]`` float32), both output-sharded; ``group_input_dim`` 0 cuts their groups on
    row-parallel layers, None keeps them whole."""
    out_size = layer.output_size
    layer.qzeros = output_sharded_parameter(
        layer, (num_groups, out_size // 8), torch.int32, output_dim=1, pack_factor=8, input_dim=group_input_dim
    )
    layer.scales = output_sharded_parameter(
        layer, (num_groups, out_size), torch.float32, output_dim=1, input_dim=group_input_dim
    )

