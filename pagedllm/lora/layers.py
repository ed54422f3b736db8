"""LoRA on linear layers: a ``LinearMethod`` that wraps the layer's own and adds each token's adapter delta.

``install_lora_layers(model, mapping, ...)`` replaces ``layer.quant_method`` of every LoRA-capable ``Linear``
(``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``) with ``LoRALinearMethod(base=old_method)``;
model files and the base method (unquantized or quantized) are untouched. Every LoRA layer reads the
per-token adapter slots from one ``LoRAMapping`` the runner refreshes in place once per step (it is handed to
each layer at install time; no module-level state).

Per layer, ``R = max_lora_rank`` and ``S`` output slices (q/k/v: 3, gate/up: 2, else 1)::

    lora_a: [max_loras, S * R, in]    slot l, slice s: rows [s*R, s*R + r) hold A (zero-padded to R)
    lora_b: [max_loras, out, R]       slot l: rows of slice s (layer.shard_offsets) hold scaling * B

    y = base(x);  y[t, slice s] += (x[t] @ lora_a[slot[t], s*R:(s+1)*R].T) @ lora_b[slot[t], slice s].T

Tokens with slot -1 get the base output only.

Under tensor parallelism (vLLM's layout) each rank holds the part of every adapter that its shard of the base
weight needs; adapters arrive whole (``set_slot``) and are cut here::

    column-parallel (qkv, gate_up):  x replicated   lora_a: whole A          lora_b: per slice, this rank's rows
    row-parallel (o, down):          x split        lora_a: this rank's cols  lora_b: whole B

A row-parallel rank adds ``x_r @ A_r.T @ B.T`` to its partial output before the layer's all-reduce, so the sum
over ranks is ``x @ A.T @ B.T``; ``in`` / ``out`` above are this rank's sizes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from pagedllm.layers.linear import ColumnParallelLinear, Linear, LinearMethod, RowParallelLinear
from pagedllm.platform import use_fused_kernels

# pagedllm layer names LoRA can be applied to (the fused ones take per-shard adapters).
LORA_LAYER_NAMES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class LoRAMapping:
    """Which adapter slot each token of the step's flattened batch uses; fixed-size buffers updated in place.

    ``token_slots[t]`` is token ``t``'s slot (``-1``: base model); the kernels use the same assignment grouped
    by slot::

        token_slots:       [ -1, 2, 2, 0, -1, 0, 2 ]        (num_tokens = 7)
        sorted_token_ids:  [ 3, 5, 1, 2, 6, ... ]          slot 0's tokens, then slot 1's (none), slot 2's
        slot_num_tokens:   [ 2, 0, 3, 0 ]                  (max_loras = 4)
        slot_start:        [ 0, 2, 2, 5 ]

    Device tensors keep their addresses for the life of the mapping (a CUDA graph captured over them replays
    with whatever ``update`` wrote), with host twins (``*_cpu``, pinned on CUDA) they are copied from.
    ``apply_lora`` (host) says whether the LoRA layers run their kernels at all this step: true when any token
    has a slot, or when the caller forces it (for capturing a graph that must serve LoRA steps).
    """

    def __init__(self, max_num_tokens: int, max_loras: int, device: torch.device | str = "cpu") -> None:
        self.max_num_tokens = max_num_tokens
        self.max_loras = max_loras
        self.device = torch.device(device)
        pin = self.device.type == "cuda"
        self.token_slots_cpu = torch.full((max_num_tokens,), -1, dtype=torch.int64, pin_memory=pin)
        self.sorted_token_ids_cpu = torch.zeros(max_num_tokens, dtype=torch.int32, pin_memory=pin)
        self.slot_num_tokens_cpu = torch.zeros(max_loras, dtype=torch.int32, pin_memory=pin)
        self.slot_start_cpu = torch.zeros(max_loras, dtype=torch.int32, pin_memory=pin)
        self.token_slots = self.token_slots_cpu.to(self.device)  # [max_num_tokens] int64
        self.sorted_token_ids = self.sorted_token_ids_cpu.to(self.device)  # [max_num_tokens] int32
        self.slot_num_tokens = self.slot_num_tokens_cpu.to(self.device)  # [max_loras] int32
        self.slot_start = self.slot_start_cpu.to(self.device)  # [max_loras] int32
        self.num_tokens = 0
        self.apply_lora = False
        # the host buffers are rewritten by the next update only after this step's copies have left them
        self._copied = torch.cuda.Event() if pin else None

    def update(
        self, token_slots: Sequence[int] | np.ndarray | torch.Tensor, force_apply: bool = False
    ) -> None:
        """Set this step's slots (``[num_tokens]``, values in ``[-1, max_loras)``); every later token of the
        buffers (padding) gets -1. One host->device copy per buffer."""
        slots = np.asarray(token_slots, dtype=np.int64).reshape(-1)  # [num_tokens]
        num_tokens = slots.shape[0]
        if num_tokens > self.max_num_tokens:
            raise ValueError(f"{num_tokens} tokens > max_num_tokens {self.max_num_tokens}")
        if num_tokens and (slots.min() < -1 or slots.max() >= self.max_loras):
            raise ValueError(
                f"token slots must be in [-1, {self.max_loras}), got {slots.min()}..{slots.max()}"
            )
        if self._copied is not None:
            self._copied.synchronize()
        valid = slots >= 0
        order = np.argsort(slots, kind="stable")[int((~valid).sum()) :]  # token ids with a slot, by slot
        counts = np.bincount(slots[valid], minlength=self.max_loras)  # [max_loras]
        starts = np.concatenate(([0], np.cumsum(counts)[:-1]))  # [max_loras]
        self.token_slots_cpu.numpy()[:num_tokens] = slots
        self.token_slots_cpu.numpy()[num_tokens:] = -1
        self.sorted_token_ids_cpu.numpy()[: order.shape[0]] = order
        self.slot_num_tokens_cpu.numpy()[:] = counts
        self.slot_start_cpu.numpy()[:] = starts
        non_blocking = self.device.type == "cuda"
        self.token_slots.copy_(self.token_slots_cpu, non_blocking=non_blocking)
        self.sorted_token_ids.copy_(self.sorted_token_ids_cpu, non_blocking=non_blocking)
        self.slot_num_tokens.copy_(self.slot_num_tokens_cpu, non_blocking=non_blocking)
        self.slot_start.copy_(self.slot_start_cpu, non_blocking=non_blocking)
        if self._copied is not None:
            self._copied.record()
        self.num_tokens = num_tokens
        self.apply_lora = bool(valid.any()) or force_apply

    @staticmethod
    def token_slots_of(request_slots: Sequence[int], num_scheduled_tokens: Sequence[int]) -> np.ndarray:
        """Per-request slots (``[num_reqs]``) repeated over each request's tokens this step: ``[num_tokens]``."""
        return np.repeat(
            np.asarray(request_slots, dtype=np.int64), np.asarray(num_scheduled_tokens, dtype=np.int64)
        )


class LoRALinearMethod(LinearMethod):
    """``base`` (the layer's own method) plus, per token, the delta of the adapter in that token's slot.

    Owns the stacked slot weights of its layer (plain tensors, not parameters: the model loader and
    ``state_dict`` never see them); ``LoRAManager`` writes them with ``set_slot`` / ``clear_slot``.
    """

    def __init__(
        self,
        base: LinearMethod,
        layer: Linear,
        mapping: LoRAMapping,
        max_loras: int,
        max_lora_rank: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.base = base
        self.mapping = mapping
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.input_size = layer.input_size
        self.output_sizes = list(layer.output_sizes)  # [S]
        # Where this rank's part sits in the whole layer (what an adapter file describes): input columns
        # [input_start, input_start + input_size) of full_input_size; per slice s, output rows
        # [output_starts[s], output_starts[s] + output_sizes[s]) of full_output_sizes[s].
        self.full_input_size = layer.input_size
        self.input_start = 0
        if isinstance(layer, RowParallelLinear):
            self.full_input_size = layer.full_input_size
            self.input_start = layer.tp.rank * layer.input_size
        self.full_output_sizes = list(self.output_sizes)  # [S]
        self.output_starts = [0] * len(self.output_sizes)  # [S]
        if isinstance(layer, ColumnParallelLinear):
            self.full_output_sizes = list(layer.full_output_sizes)
            self.output_starts = list(layer.shard_slice_starts)
        self.slice_offsets = [*layer.shard_offsets, layer.output_size]  # [S + 1]
        num_slices = len(self.output_sizes)
        self.lora_a = torch.zeros(
            max_loras, num_slices * max_lora_rank, layer.input_size, dtype=dtype, device=device
        )  # [max_loras, S * R, in]
        self.lora_b = torch.zeros(
            max_loras, layer.output_size, max_lora_rank, dtype=dtype, device=device
        )  # [max_loras, out, R]
        self.slice_offsets_dev = torch.tensor(self.slice_offsets, dtype=torch.int32, device=device)  # [S + 1]

    # -- LinearMethod: the base method owns the weights -----------------------------------------------------

    def create_weights(self, layer: Linear) -> None:
        self.base.create_weights(layer)

    def process_weights_after_loading(self, layer: Linear) -> None:
        self.base.process_weights_after_loading(layer)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        y = self.base.apply(layer, x)
        if not self.mapping.apply_lora:
            return y
        x2 = x.reshape(-1, x.shape[-1])  # [T, in]
        y2 = y.reshape(-1, y.shape[-1])  # [T, out]
        if y2.data_ptr() != y.data_ptr() or not y2.is_contiguous():
            y2 = y2.contiguous()
        num_tokens = x2.shape[0]
        m = self.mapping
        if num_tokens < m.num_tokens:
            raise ValueError(f"LoRA layer got {num_tokens} tokens, the step's LoRAMapping has {m.num_tokens}")
        if use_fused_kernels(x2):
            from pagedllm.kernels.lora_shrink_expand import lora_expand, lora_shrink

            x2 = x2.to(self.lora_a.dtype).contiguous()
            h = lora_shrink(x2, self.lora_a, m.sorted_token_ids, m.slot_num_tokens, m.slot_start)
            lora_expand(
                h,
                self.lora_b,
                y2,
                m.sorted_token_ids,
                m.slot_num_tokens,
                m.slot_start,
                self.slice_offsets_dev,
            )
        else:
            from pagedllm.lora.ops_ref import lora_expand_ref, lora_shrink_ref

            slots = m.token_slots[:num_tokens]  # [T]
            h = lora_shrink_ref(x2.to(self.lora_a.dtype), self.lora_a, slots)
            lora_expand_ref(h, self.lora_b, y2, slots, self.slice_offsets)
        return y2.view(y.shape)

    # -- slot weights ---------------------------------------------------------------------------------------

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()

    def set_slot(self, slot: int, slices: Sequence[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Write one adapter into ``slot``: per output slice, the whole layer's ``(A [r, full_input_size],
        scaling * B [full_output_sizes[s], r])`` or None (that slice untouched by the adapter); this rank keeps
        its columns of A and its rows of B. Ranks up to ``max_lora_rank``; the rest is zero."""
        if len(slices) != len(self.output_sizes):
            raise ValueError(f"{len(slices)} slices for a layer with {len(self.output_sizes)}")
        self.clear_slot(slot)
        r_max = self.max_lora_rank
        for s, pair in enumerate(slices):
            if pair is None:
                continue
            a, b = pair
            r = a.shape[0]
            full_out = self.full_output_sizes[s]
            if r > r_max or a.shape != (r, self.full_input_size) or b.shape != (full_out, r):
                raise ValueError(
                    f"slice {s}: A {tuple(a.shape)}, B {tuple(b.shape)} do not fit rank <= {r_max}, "
                    f"in {self.full_input_size}, out {full_out}"
                )
            lo, hi = self.slice_offsets[s], self.slice_offsets[s + 1]
            a_local = a.narrow(1, self.input_start, self.input_size)  # [r, in]
            b_local = b.narrow(0, self.output_starts[s], hi - lo)  # [out_s, r]
            self.lora_a[slot, s * r_max : s * r_max + r].copy_(a_local)
            self.lora_b[slot, lo:hi, :r].copy_(b_local)


def lora_layers(model: nn.Module) -> dict[str, Linear]:
    """The model's LoRA-capable linear layers, by module name (``model.layers.0.self_attn.qkv_proj``, ...)."""
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, Linear) and name.rsplit(".", 1)[-1] in LORA_LAYER_NAMES
    }


def install_lora_layers(
    model: nn.Module,
    mapping: LoRAMapping,
    max_loras: int,
    max_lora_rank: int,
    dtype: torch.dtype | None = None,
) -> dict[str, LoRALinearMethod]:
    """Wrap the ``quant_method`` of every LoRA-capable layer (once); return the wrappers by module name.

    Slot weights are allocated on ``mapping.device`` (the model's device, also for layers whose weights weight
    offload keeps in host memory) in ``dtype`` (default: the model's float dtype).
    """
    if dtype is None:
        dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    methods = {}
    for name, layer in lora_layers(model).items():
        if isinstance(layer.quant_method, LoRALinearMethod):
            raise ValueError(f"LoRA layers are already installed on {name}")
        method = LoRALinearMethod(
            layer.quant_method, layer, mapping, max_loras, max_lora_rank, dtype, mapping.device
        )
        layer.quant_method = method
        methods[name] = method
    if not methods:
        raise ValueError(f"the model has no layers LoRA can be applied to ({', '.join(LORA_LAYER_NAMES)})")
    return methods
