"""``LoRAManager``: adapters cached on the host (LRU of ``max_cpu_loras``) and ``max_loras`` device slots.

A step's requests name their adapters; ``activate`` returns one slot per request (``-1``: none), loading an
adapter from disk into the host cache on first use and copying it into a free slot, or into the least
recently used slot no request of this step uses. Slots and host cache are independent: an adapter evicted
from the host cache stays valid in its slot until the slot is reused.

    host cache (max_cpu_loras, LRU)      device slots (max_loras, LRU)        per layer (LoRALinearMethod)
    {id 7: LoRAModel, id 3: ...}   -->   slot 0: id 7, slot 1: id 3, ...  ->  lora_a[slot], lora_b[slot]

The caller (scheduler) keeps the number of distinct adapters in one step <= ``max_loras``; asking for more
is an error here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import nn

from pagedllm.distributed.pipeline import PPMissingLayer
from pagedllm.lora.adapter import LayerShape, LoRAModel, load_peft_adapter
from pagedllm.lora.layers import LoRALinearMethod, LoRAMapping, install_lora_layers
from pagedllm.lora.request import LoRARequest


class LoRAManager:
    """Installs the LoRA layers on ``model`` and owns their slots and the host adapter cache.

    ``max_cpu_loras`` defaults to ``max_loras`` and may not be smaller (vLLM's rule). ``mapping`` is the
    per-step token->slot map every LoRA layer reads; the runner fills it (``LoRAMapping.update``) after
    ``activate``.
    """

    def __init__(
        self,
        model: nn.Module,
        max_loras: int,
        max_lora_rank: int,
        max_num_tokens: int,
        max_cpu_loras: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        if max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {max_lora_rank}")
        if max_cpu_loras is None:
            max_cpu_loras = max_loras
        if max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({max_loras})")
        if device is None:
            device = next(p.device for p in model.parameters() if p.device.type != "meta")
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.mapping = LoRAMapping(max_num_tokens, max_loras, device)
        self.layers: dict[str, LoRALinearMethod] = install_lora_layers(
            model, self.mapping, max_loras, max_lora_rank, dtype
        )
        self.dtype = next(iter(self.layers.values())).lora_a.dtype
        self.packed_modules_mapping = dict(getattr(model, "packed_modules_mapping", {}) or {})
        # Pipeline parallelism: the layers other stages hold, whose adapter weights this stage skips.
        self.absent = [name for name, m in model.named_modules() if isinstance(m, PPMissingLayer)]
        # adapters are checked against the whole model's sizes; each LoRA layer keeps its TP rank's part
        self.layer_shapes = {
            name: LayerShape(m.full_input_size, tuple(m.full_output_sizes)) for name, m in self.layers.items()
        }
        self._cpu_cache: OrderedDict[int, LoRAModel] = OrderedDict()  # lora_int_id -> adapter, LRU first
        self._requests: dict[int, LoRARequest] = {}  # lora_int_id -> request it was loaded from
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, LRU first
        self._free_slots = list(range(max_loras))

    # -- host cache -----------------------------------------------------------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load the adapter into the host cache (validating it); False when it was there already."""
        lora_id = lora_request.lora_int_id
        known = self._requests.get(lora_id)
        if known is not None and known.lora_path != lora_request.lora_path:
            raise ValueError(
                f"lora_int_id {lora_id} is already used by adapter {known.lora_name!r} at {known.lora_path!r}"
            )
        if lora_id in self._cpu_cache:
            self._cpu_cache.move_to_end(lora_id)
            return False
        adapter = load_peft_adapter(
            lora_request.lora_path,
            lora_id,
            self.layer_shapes,
            self.packed_modules_mapping,
            self.max_lora_rank,
            self.dtype,
            self.absent,
        )
        while len(self._cpu_cache) >= self.max_cpu_loras:
            evicted, _ = self._cpu_cache.popitem(last=False)
            if evicted not in self._slot_of:
                self._requests.pop(evicted, None)
        self._cpu_cache[lora_id] = adapter
        self._requests[lora_id] = lora_request
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter: drop it from the host cache and free its slot. False when it was unknown."""
        found = self._cpu_cache.pop(lora_int_id, None) is not None
        slot = self._slot_of.pop(lora_int_id, None)
        if slot is not None:
            for layer in self.layers.values():
                layer.clear_slot(slot)
            self._free_slots.append(slot)
            found = True
        self._requests.pop(lora_int_id, None)
        return found

    def list_loras(self) -> set[int]:
        """Ids of the adapters the manager holds (host cache or a slot)."""
        return set(self._cpu_cache) | set(self._slot_of)

    def slot_of(self, lora_int_id: int) -> int | None:
        """The slot an adapter occupies now, or None (no side effects)."""
        return self._slot_of.get(lora_int_id)

    def slot_table(self) -> list[tuple[int, int]]:
        """``(lora_int_id, slot)`` of every adapter in a slot, least recently used first (no side effects).
        Tensor-parallel ranks compare theirs with rank 0's: equal tables mean equal slot choices to come."""
        return list(self._slot_of.items())

    # -- slots ----------------------------------------------------------------------------------------------

    def activate(self, lora_requests: Sequence[LoRARequest | None]) -> list[int]:
        """Give every request's adapter a slot for this step; return the slot per request (-1 for None).

        Adapters already in a slot keep it; the others go to free slots, then to the least recently used
        slots whose adapters this step does not use. More distinct adapters than ``max_loras`` is an error.
        """
        wanted: dict[int, LoRARequest] = {}
        for req in lora_requests:
            if req is not None:
                wanted.setdefault(req.lora_int_id, req)
        if len(wanted) > self.max_loras:
            raise ValueError(
                f"{len(wanted)} distinct LoRA adapters in one step > max_loras {self.max_loras}; "
                "the scheduler must cap them"
            )
        for lora_id in wanted:  # in use this step: most recently used
            if lora_id in self._slot_of:
                self._slot_of.move_to_end(lora_id)
        for lora_id, req in wanted.items():
            if lora_id in self._slot_of:
                continue
            self.add_lora(req)
            adapter = self._cpu_cache[lora_id]
            self._cpu_cache.move_to_end(lora_id)
            slot = self._take_slot(wanted)
            self._load_slot(slot, adapter)
            self._slot_of[lora_id] = slot
        return [-1 if req is None else self._slot_of[req.lora_int_id] for req in lora_requests]

    def _take_slot(self, in_use: dict[int, LoRARequest]) -> int:
        if self._free_slots:
            return self._free_slots.pop(0)
        for lora_id, slot in self._slot_of.items():  # LRU first
            if lora_id not in in_use:
                del self._slot_of[lora_id]
                if lora_id not in self._cpu_cache:
                    self._requests.pop(lora_id, None)
                return slot
        raise AssertionError("no slot to evict although distinct adapters <= max_loras")

    def _load_slot(self, slot: int, adapter: LoRAModel) -> None:
        for name, layer in self.layers.items():
            slices = adapter.layers.get(name)
            if slices is None:
                layer.clear_slot(slot)
            else:
                layer.set_slot(slot, slices)

    def set_mapping(
        self,
        request_slots: Sequence[int],
        num_scheduled_tokens: Sequence[int],
        force_apply: bool = False,
    ) -> None:
        """Convenience for the runner: per-request slots (from ``activate``) repeated over each request's
        tokens of this step, written into ``self.mapping``."""
        self.mapping.update(LoRAMapping.token_slots_of(request_slots, num_scheduled_tokens), force_apply)
