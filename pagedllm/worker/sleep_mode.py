"""Sleep mode (vLLM's ``enable_sleep_mode``): give one rank's device memory back between rollouts, keep the
process, its model objects and its KV cache layout.

    level 1:  weights copied to host memory (pinned on CUDA), then freed on the device; KV cache freed
    level 2:  weights and KV cache freed; only the model's buffers (rotary tables...) are kept on the host.
              The weights must be written again (an update, or a reload from the checkpoint) before use.

Tensors are freed by shrinking their storages to zero bytes (``UntypedStorage.resize_(0)``): every tensor object
(parameters, views of a stacked tensor, the runner's per-layer cache list) stays what it is, and waking up grows
each storage back to its size and refills it, so nothing that holds a reference needs rebuilding. The new memory
is at another address, though: CUDA graphs captured over the old one are dropped at sleep, and the engine core
captures them again once every tag is awake. The CPU-side oneDNN copies of packed weights are dropped too and
made again at wake-up. On CUDA the caching allocator then hands the freed blocks back to the driver.

What stays on the device: the persistent batch's small buffers and LoRA slots. Not covered: a speculative
decoding proposer (refused with sleep mode at start-up).

Offloaded layers (``cpu_offload_gb``, worker/weight_offload.py): their weights live in host memory already and stay
there at either level (their values survive level 2 too); the device staging slots they are copied into are freed
without a backup and grown back at wake-up (every forward refills them).
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

TAGS = ("weights", "kv_cache")


@dataclass
class _SleepingStorage:
    storage: torch.UntypedStorage
    nbytes: int
    backup: torch.Tensor | None  # [nbytes] uint8 host copy; None: the contents are discarded


def _byte_view(storage: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
    """A ``[nbytes]`` uint8 tensor over the whole of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (nbytes,), (1,))


def _unique_storages(tensors: list[torch.Tensor]) -> list[torch.UntypedStorage]:
    seen: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen[storage.data_ptr()] = storage
    return list(seen.values())


def _release(storages: list[torch.UntypedStorage], keep: bool) -> list[_SleepingStorage]:
    """Free each storage; with ``keep``, copy its bytes to the host first (pinned when it is on CUDA)."""
    out = []
    for storage in storages:
        nbytes = storage.nbytes()
        backup = None
        if keep:
            pin = storage.device.type == "cuda"
            backup = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
            backup.copy_(_byte_view(storage, nbytes))
        out.append(_SleepingStorage(storage, nbytes, backup))
    for device in {s.storage.device for s in out if s.storage.device.type == "cuda"}:
        torch.cuda.synchronize(device)  # the copies are done before the memory goes
    for s in out:
        s.storage.resize_(0)
    return out


def _restore(sleeping: list[_SleepingStorage], zero: bool = False) -> None:
    """Grow each storage back; refill it from its backup (or with zeros when ``zero``)."""
    for s in sleeping:
        s.storage.resize_(s.nbytes)
        view = _byte_view(s.storage, s.nbytes)
        if s.backup is not None:
            view.copy_(s.backup, non_blocking=True)
        elif zero:
            view.zero_()


def empty_device_cache(device: torch.device) -> None:
    """CUDA: collect dropped objects and hand the caching allocator's free blocks back to the driver."""
    if device.type != "cuda":
        return
    gc.collect()
    with torch.cuda.device(device):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


class SleepState:
    """One runner's sleep bookkeeping: what is asleep and how to bring it back."""

    def __init__(self, runner: Any) -> None:
        """``runner``: the rank's ``ModelRunner``."""
        self.runner = runner
        self.asleep: set[str] = set()
        self._weights: list[_SleepingStorage] = []
        self._buffers: list[_SleepingStorage] = []
        self._kv: list[_SleepingStorage] = []
        self._staging: list[_SleepingStorage] = []  # offloaded layers' device slots (no backup)
        self._packed: list[nn.Module] = []  # modules whose oneDNN copy was dropped
        self.weights_discarded = False  # level 2: the weights must be written again

    def sleep(self, level: int) -> None:
        """Free the weights (``level`` 1: kept on the host; 2: discarded) and the KV cache. Parts already asleep
        stay as they are."""
        runner = self.runner
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
        # Graphs hold the old addresses (and memory pools of their own); the engine core captures again.
        runner.graph_runner = runner.piecewise = None
        runner._last_step = None
        if "kv_cache" not in self.asleep:
            self._kv = _release(_unique_storages(runner.kv_caches), keep=False)
            self.asleep.add("kv_cache")
        if "weights" not in self.asleep:
            model = runner.model
            self._packed = [m for m in model.modules() if getattr(m, "packed_weight", None) is not None]
            for m in self._packed:
                m.packed_weight = None
            offload = getattr(runner, "weight_offload", None)
            on_host = set() if offload is None else offload.host_storage_ptrs()  # offloaded: host memory already
            params = [s for s in _unique_storages(list(model.parameters())) if s.data_ptr() not in on_host]
            param_ptrs = {s.data_ptr() for s in params} | on_host
            buffers = [s for s in _unique_storages(list(model.buffers())) if s.data_ptr() not in param_ptrs]
            self._weights = _release(params, keep=level == 1)
            self._buffers = _release(buffers, keep=True)
            if offload is not None:
                offload.forget_prefetch()
                self._staging = _release(_unique_storages(offload.staging), keep=False)
            self.weights_discarded = level >= 2
            self.asleep.add("weights")
        empty_device_cache(runner.device)
        logger.info("sleep level %d: weights and KV cache released", level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back ``tags`` (None: all). Weights come back with their values at level 1; after level 2 they
        hold garbage until written."""
        tags = list(TAGS) if tags is None else tags
        from pagedllm.layers.cpu_gemm import pack_weight

        if "weights" in tags and "weights" in self.asleep:
            _restore(self._weights)
            _restore(self._buffers)
            _restore(self._staging)
            for m in self._packed:
                m.packed_weight = pack_weight(m.weight)
            self._weights, self._buffers, self._packed, self._staging = [], [], [], []
            self.asleep.discard("weights")
            if self.weights_discarded:
                logger.info("weights back after sleep level 2: their values are undefined until written")
        if "kv_cache" in tags and "kv_cache" in self.asleep:
            _restore(self._kv, zero=True)
            self._kv = []
            self.asleep.discard("kv_cache")
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)
