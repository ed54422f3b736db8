"""Weight offload (vLLM's ``cpu_offload_gb``): keep some decoder layers' weights in host memory and stream them to
the device for every forward pass, so that a model larger than the device's memory runs.

Which layers: from the first decoder layer on, every whole layer while the bytes offloaded so far fit the budget
(``plan_offload``; per rank: each tensor-parallel rank offloads its own shard, each pipeline stage its own layers).
A layer's offloaded tensors are its parameters (float or quantized) and any buffer that shares their storage (an
MoE layer's stacked experts); a storage also used outside the layer (a rotary table every layer shares) stays on
the device. Adapter slots of LoRA layers are not parameters of the layer: they stay too.

Loading (``model_loader.get_model``), so that a model larger than the device starts:

1. ``plan``: the model is built once on the meta device (no memory) and the layers are chosen from the sizes of
   their storages as built (before post-load processing; for the formats here that does not change a size).
2. The real model is built with those layers in host memory (``layers/placement.py``: ``LlamaModel.build_stage``
   builds them there, ``quantize_model`` gives their linear layers host parameters); the rest on the device.
3. ``adopt``: each chosen layer's storages move into its host buffer (pinned on CUDA; the layout below) and the
   layer's tensors become views of it; anything else the layer built on the host (a buffer of its own) goes to
   the device. The checkpoint (or dummy values) is then written straight into the host buffers.
4. ``process``: post-load processing (quantized layouts, ...) runs one layer at a time: the layer's storages are
   copied to the device, processed there, and copied back into its host buffer. The device thus holds at most one
   offloaded layer beyond the resident part while loading; then ``start`` allocates the staging slots.

Host memory while loading: the chosen layers are built as ordinary host tensors, then moved into the pinned
buffers one pinned allocation at a time, so the host briefly holds the offloaded bytes plus one pinned allocation.

Layout. Each offloaded layer's storages are copied, byte for byte, into one host buffer (pinned on CUDA, where
consecutive layers' buffers share allocations: ``host_buffers``), each storage at a 512-byte aligned offset; the
device keeps ``num_slots`` staging buffers of the largest layer's size, with the same layout. Layer ``k`` (in
offload order) uses slot ``k % num_slots``::

    host:     layer 0 [qkv | o | gate_up | down | norms]   layer 1 [...]   layer 2 [...]   ...
    device:   slot 0 [layer 0, 2, 4, ...]   slot 1 [layer 1, 3, 5, ...]

Between forwards every offloaded tensor is a view of its host buffer: weight updates, sleep mode and anything else
that reads or writes the parameters see the host copy. A forward pre-hook on the layer copies the host buffer into
its slot (one copy a layer) and points the tensors at the slot (``tensor.data``); the forward hook points them back.
Kernels queued during the layer keep the slot's addresses, so nothing waits for them on the host.

Overlap (CUDA): copies run on a side stream. When layer ``k`` starts, the compute stream waits for ``k``'s copy,
then the copy of layer ``k + 1`` is queued into the other slot; it waits for the compute stream's work so far,
which ends with layer ``k - 1``, the last reader of that slot. So layer ``k + 1`` arrives while layer ``k``
computes. On CPU the "device" is the CPU and the copy is a plain synchronous one (one slot): the same path, tested
without a GPU.

CUDA graphs are not captured when layers are offloaded (``ModelRunner._graphs_wanted``): each step is then bound by
the host-to-device copies (a Llama-3.1-8B layer is 0.4 GiB), so a graph would save launch time the GPU spends
waiting for copies anyway.

On CPU, offloaded linear layers multiply with ``F.linear`` on the staged weight rather than through a oneDNN-packed
copy (``layers/cpu_gemm.py``: a packed copy would be a second resident copy of the weight). Layers of at least
65,536 weights are thus rounded as ``F.linear`` rounds, not as the packed GEMM.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

_ALIGN = 512  # bytes: every storage starts this aligned in the host buffer and in the staging slot
OFFLOADED_ATTR = "cpu_offloaded"  # set True on every offloaded tensor (cpu_gemm.pack_weight skips them)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _byte_view(storage: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
    """A ``[nbytes]`` uint8 tensor over the start of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (nbytes,), (1,))


def _view_like(t: torch.Tensor, buffer: torch.Tensor, byte_offset: int) -> torch.Tensor:
    """A tensor with ``t``'s dtype, size, stride and storage offset over ``buffer`` (uint8, itself possibly a view)
    from ``byte_offset``."""
    elem = t.element_size()
    start = (buffer.storage_offset() + byte_offset) // elem + t.storage_offset()
    return torch.empty(0, dtype=t.dtype, device=buffer.device).set_(
        buffer.untyped_storage(), start, t.size(), t.stride()
    )


def _rebased(t: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, byte_shift: int = 0) -> torch.Tensor:
    """``t`` (a view into the uint8 buffer ``src``) at the same byte position, less ``byte_shift``, of ``dst``."""
    elem = t.element_size()
    position = t.storage_offset() * elem - src.storage_offset() - byte_shift  # bytes into ``src``
    return torch.empty(0, dtype=t.dtype, device=dst.device).set_(
        dst.untyped_storage(), (dst.storage_offset() + position) // elem, t.size(), t.stride()
    )


def _storage_key(storage: torch.UntypedStorage) -> int:
    """Identity of a storage: its address, or (meta device, where every address is 0) the storage itself."""
    return storage._cdata if storage.device.type == "meta" else storage.data_ptr()


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """``(name, module list)`` of the model's decoder layers (``model.layers`` of every generating family);
    ``ValueError`` naming ``cpu_offload_gb`` when the model has none."""
    body = getattr(model, "model", None)
    layers = getattr(body, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"cpu_offload_gb: {type(model).__name__} has no decoder layers (model.layers) to offload")
    name = next(n for n, m in model.named_modules() if m is layers)
    return name, layers


def _layer_storages(model: nn.Module, prefix: str, num_layers: int) -> list[list[torch.UntypedStorage]]:
    """Per layer, the storages it may offload (first use order): those holding a parameter of the layer and no
    tensor outside it. Works on a model built on the meta device too (sizes only)."""
    owners: dict[int, set[int | None]] = {}  # storage key -> layer indices (None: outside every layer)
    storages: dict[int, torch.UntypedStorage] = {}
    holds_param: set[int] = set()
    lead = prefix + "."
    named = [(n, t, True) for n, t in model.named_parameters(remove_duplicate=False)]
    named += [(n, t, False) for n, t in model.named_buffers(remove_duplicate=False)]
    for name, t, is_param in named:
        storage = t.untyped_storage()
        if storage.nbytes() == 0:
            continue
        key = _storage_key(storage)
        layer: int | None = None
        if name.startswith(lead):
            head = name[len(lead) :].split(".", 1)[0]
            layer = int(head) if head.isdigit() else None
        owners.setdefault(key, set()).add(layer)
        storages.setdefault(key, storage)
        if is_param and layer is not None:
            holds_param.add(key)
    per_layer: list[list[torch.UntypedStorage]] = [[] for _ in range(num_layers)]
    for key, who in owners.items():
        if key in holds_param and len(who) == 1:
            (layer,) = who
            if layer is not None and layer < num_layers:
                per_layer[layer].append(storages[key])
    return per_layer


def _tensors_by_storage(model: nn.Module, prefix: str) -> dict[int, list[torch.Tensor]]:
    """storage key (``_storage_key``) -> the distinct parameter and buffer objects of the decoder layers over it."""
    out: dict[int, list[torch.Tensor]] = {}
    seen: set[int] = set()
    lead = prefix + "."
    items = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    for name, t in items:
        if not name.startswith(lead) or id(t) in seen:
            continue
        seen.add(id(t))
        out.setdefault(_storage_key(t.untyped_storage()), []).append(t)
    return out


def layer_offload_bytes(storages: Sequence[torch.UntypedStorage]) -> int:
    """Bytes one layer's host buffer (and staging slot) takes: its storages, each 512-byte aligned."""
    return sum(_aligned(s.nbytes()) for s in storages)


def plan_offload(layer_bytes: Sequence[int], budget_bytes: int) -> list[int]:
    """The layers to offload: from the first, each whole layer while the total stays within ``budget_bytes``
    (a layer with nothing to offload is skipped). Stops at the first layer that does not fit, as the budget is
    filled from the first layers."""
    chosen, total = [], 0
    for i, nbytes in enumerate(layer_bytes):
        if nbytes == 0:
            continue
        if total + nbytes > budget_bytes:
            break
        chosen.append(i)
        total += nbytes
    return chosen


def _pow2_ceil(n: int) -> int:
    return 1 << (n - 1).bit_length()


def pinned_group_size(sizes: Sequence[int]) -> int:
    """How many consecutive layers share one pinned allocation: the count whose allocations, each rounded up to a
    power of two, pin the least in total (the smallest such count)."""

    def pinned_total(g: int) -> int:
        return sum(_pow2_ceil(sum(sizes[i : i + g])) for i in range(0, len(sizes), g))

    return min(range(1, len(sizes) + 1), key=lambda g: (pinned_total(g), g))


def host_buffers(sizes: Sequence[int], pin: bool) -> list[torch.Tensor]:
    """One ``[size]`` uint8 host buffer per layer. Pinned ones are views of a few larger allocations: torch's pinned
    allocator rounds every allocation up to a power of two (a 0.41 GiB Llama-3.1-8B layer would pin 0.5 GiB), so
    consecutive layers share allocations, as many per allocation as wastes the least in total."""
    return [buffer for group in _host_buffer_groups(sizes, pin) for buffer in group()]


def _host_buffer_groups(sizes: Sequence[int], pin: bool) -> list[Callable[[], list[torch.Tensor]]]:
    """``host_buffers`` one allocation at a time: per allocation, a function that makes it and returns its
    layers' buffers (so a loader can allocate each when it gets there)."""
    group = pinned_group_size(sizes) if pin and sizes else 1

    def allocate(chunk: Sequence[int]) -> list[torch.Tensor]:
        arena = torch.empty(sum(chunk), dtype=torch.uint8, pin_memory=pin)
        offsets = [sum(chunk[:j]) for j in range(len(chunk))]
        return [arena[o : o + n] for o, n in zip(offsets, chunk)]

    if not pin:
        return [lambda n=n: [torch.empty(n, dtype=torch.uint8)] for n in sizes]
    return [lambda c=sizes[i : i + group]: allocate(c) for i in range(0, len(sizes), group)]


@dataclass
class _Layer:
    index: int  # decoder layer index
    module: nn.Module
    nbytes: int  # bytes of the layout (the first ``nbytes`` of ``host`` and of its staging slot)
    host: torch.Tensor  # [>= nbytes] uint8 (pinned on CUDA: a view of an allocation other layers share)
    slot: int = 0
    tensors: list[torch.Tensor] = field(default_factory=list)  # the layer's params / buffers over offloaded storages
    host_views: list[torch.Tensor] = field(default_factory=list)  # each one's view of ``host``
    segments: list[tuple[int, int]] = field(default_factory=list)  # (byte offset, nbytes) of each storage
    staged_views: list[torch.Tensor] = field(default_factory=list)  # each one's view of its staging slot
    ready: Any = None  # torch.cuda.Event: this layer's copy into its slot is done


class WeightOffloader:
    """Offloads one rank's decoder layers (see the module docstring) and streams them back at forward time.

    Used by the loader in four steps: ``plan`` (on a meta build), ``adopt`` (after the real build), ``process``
    (post-load processing, one layer at a time on the device), ``start`` (staging slots and hooks)."""

    def __init__(self, budget_bytes: int, device: torch.device) -> None:
        self.budget_bytes = budget_bytes
        self.device = device
        self.cuda = device.type == "cuda"
        self.planned: list[int] = []  # decoder layer indices chosen by ``plan``
        self.layer_prefix = ""  # the decoder layer list's module name (``model.layers``)
        self.layers: list[_Layer] = []
        self.staging: list[torch.Tensor] = []  # [num_slots] each [slot_bytes] uint8 on the device
        self.num_slots = 0
        self.copy_stream: Any = None
        self._pending: int | None = None  # offload position of the layer whose copy was queued ahead
        self._handles: list[Any] = []

    # ------------------------------------------------------------------ loading

    def plan(self, model: nn.Module) -> list[int]:
        """Choose the layers to offload from ``model``'s storage sizes (a build on the meta device is enough)."""
        self.layer_prefix, module_list = decoder_layers(model)
        per_layer = _layer_storages(model, self.layer_prefix, len(module_list))
        self.planned = plan_offload([layer_offload_bytes(s) for s in per_layer], self.budget_bytes)
        return self.planned

    @property
    def planned_modules(self) -> list[str]:
        """Module names of the planned layers (``model.layers.0``, ...)."""
        return [f"{self.layer_prefix}.{i}" for i in self.planned]

    @torch.no_grad()
    def adopt(self, model: nn.Module) -> None:
        """Move each planned layer's offloaded storages into its host buffer (its tensors become views of it) and
        the rest of the layer to the device. Right after the real build, before weights are written."""
        prefix, module_list = decoder_layers(model)
        per_layer = _layer_storages(model, prefix, len(module_list))
        chosen = [i for i in self.planned if per_layer[i]]
        sizes = [layer_offload_bytes(per_layer[i]) for i in chosen]
        tensors_of = _tensors_by_storage(model, prefix)
        k = 0
        for allocate in _host_buffer_groups(sizes, pin=self.cuda):  # one pinned allocation at a time
            for host in allocate():
                index = chosen[k]
                layer = _Layer(index, module_list[index], sizes[k], host)
                self._pack(layer, per_layer[index], tensors_of)
                per_layer[index] = []  # the storages it was built in go now
                self._keep_rest_on_device(layer)
                self.layers.append(layer)
                k += 1

    @torch.no_grad()
    def process(self, model: nn.Module, process_fn: Callable[[nn.Module], None]) -> None:
        """Run ``process_fn`` (post-load processing) on each offloaded layer in turn, on the device: its storages
        are copied there, processed, and copied back into its host buffer (a larger one when processing grew
        them), so the device holds one offloaded layer at a time."""
        for layer in self.layers:
            self._process_layer(model, layer, process_fn)  # its device copies are gone when this returns
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _process_layer(self, model: nn.Module, layer: _Layer, process_fn: Callable[[nn.Module], None]) -> None:
        prefix, module_list = decoder_layers(model)
        self._to_device(layer)
        process_fn(layer.module)
        storages = _layer_storages(model, prefix, len(module_list))[layer.index]
        nbytes = layer_offload_bytes(storages)
        if nbytes > layer.host.numel():
            logger.info("cpu_offload_gb: layer %d grew in processing; a host buffer of its own", layer.index)
            (layer.host,) = host_buffers([nbytes], pin=self.cuda)
        layer.nbytes = nbytes
        self._pack(layer, storages, _tensors_by_storage(model, prefix))

    def start(self) -> None:
        """Allocate the staging slots and hook the offloaded layers (after ``process``)."""
        if not self.layers:
            return
        self.num_slots = 2 if self.cuda and len(self.layers) > 1 else 1
        slot_bytes = max(layer.nbytes for layer in self.layers)
        self.staging = [torch.empty(slot_bytes, dtype=torch.uint8, device=self.device) for _ in range(self.num_slots)]
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(self.device)
        for k, layer in enumerate(self.layers):
            layer.slot = k % self.num_slots
            layer.staged_views = [_rebased(v, layer.host, self.staging[layer.slot]) for v in layer.host_views]
            if self.cuda:
                layer.ready = torch.cuda.Event()
            self._handles.append(layer.module.register_forward_pre_hook(self._pre_hook(k)))
            self._handles.append(layer.module.register_forward_hook(self._post_hook(k), always_call=True))

    def _pack(
        self, layer: _Layer, storages: list[torch.UntypedStorage], tensors_of: dict[int, list[torch.Tensor]]
    ) -> None:
        """Copy ``storages`` into ``layer.host`` (the layout) and point their tensors at it."""
        host = layer.host
        layer.tensors, layer.host_views, layer.segments = [], [], []
        offset = 0
        for storage in storages:
            n = storage.nbytes()
            host[offset : offset + n].copy_(_byte_view(storage, n))
            for t in tensors_of[_storage_key(storage)]:
                layer.tensors.append(t)
                layer.host_views.append(_view_like(t, host, offset))
            layer.segments.append((offset, n))
            offset += _aligned(n)
        for t, host_view in zip(layer.tensors, layer.host_views):
            t.data = host_view  # the old storage goes once nothing else holds it
            setattr(t, OFFLOADED_ATTR, True)
        for m in layer.module.modules():  # a packed CPU copy would be a second resident copy of the weight
            if getattr(m, "packed_weight", None) is not None:
                m.packed_weight = None

    def _to_device(self, layer: _Layer) -> None:
        """Point the layer's offloaded tensors at device copies, one per storage (as they were built)."""
        copies = []
        for offset, n in layer.segments:
            copy = torch.empty(n, dtype=torch.uint8, device=self.device)
            copy.copy_(layer.host[offset : offset + n])
            copies.append(copy)
        ends = [offset + n for offset, n in layer.segments]
        for t, host_view in zip(layer.tensors, layer.host_views):
            position = host_view.storage_offset() * host_view.element_size() - layer.host.storage_offset()
            s = next(j for j, end in enumerate(ends) if position < end)
            t.data = _rebased(host_view, layer.host, copies[s], byte_shift=layer.segments[s][0])

    def _keep_rest_on_device(self, layer: _Layer) -> None:
        """What the layer built in host memory and is not offloaded (a buffer of its own) goes to the device."""
        if self.device.type == "cpu":
            return
        offloaded = {id(t) for t in layer.tensors}
        moved: dict[int, torch.Tensor] = {}  # host storage address -> its device copy
        items = [t for _, t in layer.module.named_parameters(remove_duplicate=False)]
        items += list(layer.module.buffers())
        for t in items:
            if id(t) in offloaded or t.device.type != "cpu" or t.untyped_storage().nbytes() == 0:
                continue
            storage = t.untyped_storage()
            copy = moved.get(storage.data_ptr())
            if copy is None:
                copy = moved[storage.data_ptr()] = _byte_view(storage, storage.nbytes()).to(self.device)
            t.data = _view_like(t, copy, 0)

    # ------------------------------------------------------------------ forward

    def _queue_copy(self, k: int, compute: Any) -> None:
        """Queue layer ``k``'s copy into its slot on the copy stream, after the compute stream's work so far (which
        ends with the slot's previous reader)."""
        layer = self.layers[k]
        self.copy_stream.wait_stream(compute)
        with torch.cuda.stream(self.copy_stream):
            self.staging[layer.slot][: layer.nbytes].copy_(layer.host[: layer.nbytes], non_blocking=True)
            layer.ready.record(self.copy_stream)

    def _stage(self, k: int) -> None:
        layer = self.layers[k]
        if self.cuda:
            compute = torch.cuda.current_stream(self.device)
            if self._pending != k:
                self._queue_copy(k, compute)
            compute.wait_event(layer.ready)
            self._pending = None
            if k + 1 < len(self.layers):  # the next one arrives while this one computes
                self._queue_copy(k + 1, compute)
                self._pending = k + 1
        else:
            self.staging[layer.slot][: layer.nbytes].copy_(layer.host[: layer.nbytes])
        for t, staged in zip(layer.tensors, layer.staged_views):
            t.data = staged

    def _unstage(self, k: int) -> None:
        layer = self.layers[k]
        for t, host_view in zip(layer.tensors, layer.host_views):
            t.data = host_view

    def _pre_hook(self, k: int):
        def hook(module: nn.Module, args: Any) -> None:
            self._stage(k)

        return hook

    def _post_hook(self, k: int):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self._unstage(k)

        return hook

    # ------------------------------------------------------------------ bookkeeping

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def layer_indices(self) -> list[int]:
        return [layer.index for layer in self.layers]

    @property
    def offloaded_bytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    @property
    def staging_bytes(self) -> int:
        return sum(t.numel() for t in self.staging)

    def host_storage_ptrs(self) -> set[int]:
        """The host buffers' storages (the pinned allocations; sleep mode leaves them: they are host memory)."""
        return {layer.host.untyped_storage().data_ptr() for layer in self.layers}

    def forget_prefetch(self) -> None:
        """Drop the note of a copy queued ahead (its slot is about to lose its memory: sleep mode)."""
        self._pending = None

    def close(self) -> None:
        """Remove the hooks (the model stops staging; its offloaded tensors stay views of the host copies)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def summary(self) -> str:
        return (
            f"{self.num_layers} decoder layers ({', '.join(map(str, self.layer_indices))}) offloaded: "
            f"{self.offloaded_bytes / 2**30:.2f} GiB in host memory, {self.staging_bytes / 2**30:.2f} GiB of device "
            f"staging ({len(self.staging)} slot{'s' if len(self.staging) > 1 else ''})"
        )


def new_offloader(cpu_offload_gb: float, device: torch.device) -> WeightOffloader | None:
    """The offloader for a budget of ``cpu_offload_gb`` GiB, for the loader to use (None when the budget is 0)."""
    if not cpu_offload_gb:
        return None
    return WeightOffloader(int(cpu_offload_gb * 2**30), device)


def loaded_offloader(offloader: WeightOffloader | None, cpu_offload_gb: float) -> WeightOffloader | None:
    """After loading: ``offloader`` when it offloaded a layer (logged), else None (a budget below one layer is
    logged as a warning)."""
    if offloader is None:
        return None
    if offloader.num_layers == 0:
        logger.warning("cpu_offload_gb=%g: no whole decoder layer fits that budget; nothing offloaded", cpu_offload_gb)
        return None
    logger.info("cpu_offload_gb=%g: %s", cpu_offload_gb, offloader.summary())
    if offloader.cuda:
        logger.info("cpu_offload_gb: CUDA graphs are not captured (the steps wait for the weight copies, not launches)")
    return offloader
