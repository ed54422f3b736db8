"""CPU offloading: a second, larger prefix-cache tier in host memory.

Write-through: each full block whose KV a step computed (or loaded) is copied to a CPU slot after that step's
forward, unless its hash is already there. A block the device prefix cache later evicts is therefore still in the
CPU tier, as long as the tier's own LRU keeps it. A request whose prefix misses the device cache looks up the
CPU tier for the blocks right after its device hit (chained hashes, so a hit is a whole prefix); the hit blocks are
copied into fresh device blocks before the request computes anything, and then registered in the device prefix
cache like computed ones.

Sizing: ``kv_connector_extra_config`` gives ``num_cpu_blocks`` or ``cpu_bytes_to_use`` (bytes, divided by one
device block's bytes over all layers); ``--kv-offloading-size`` / ``swap_space`` (GiB) set the latter.

Ordering (why no slot is read while it is overwritten): within a step the worker does the loads before the forward
and the saves after it, and steps run in order (on CUDA every copy goes on the compute stream, asynchronous to the
host, ordered with the forwards, see ``_copy``). A slot evicted by this step's saves may be read by this step's loads only, which
come first; a device block is reused by a later step only, after this step's saves.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from pagedllm.kv_transfer.base import KVConnectorBase, KVConnectorMetadata, KVConnectorRole

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.core.kv_cache_manager import KVCacheManager
    from pagedllm.core.request import Request
    from pagedllm.core.sched_output import SchedulerOutput

logger = logging.getLogger(__name__)

STAGING_SLOTS = 64  # at most this many blocks per staged copy ...
STAGING_BYTES = 256 * 2**20  # ... and at most this many bytes of device memory for the buffer
POOL_CHUNK_BYTES = 2**30  # the CPU tier is allocated in chunks of at most this many bytes


@dataclass
class OffloadingMetadata(KVConnectorMetadata):
    """One step's copies, as (CPU slot, device block id) pairs."""

    loads: list[tuple[int, int]] = field(default_factory=list)  # CPU slot -> device block, before the forward
    load_req_ids: list[str] = field(default_factory=list)  # requests whose loads these are
    stores: list[tuple[int, int]] = field(default_factory=list)  # device block -> CPU slot, after the forward


def num_cpu_blocks_from(extra: dict[str, Any], kv_block_bytes: int) -> int:
    """The CPU tier's size in blocks (``ValueError`` naming the field when missing, not a number or too small)."""
    prefix = "kv_transfer_config.kv_connector_extra_config"
    if "num_cpu_blocks" in extra:
        n = extra["num_cpu_blocks"]
        field_name = "num_cpu_blocks"
    elif "cpu_bytes_to_use" in extra:
        size = extra["cpu_bytes_to_use"]
        if isinstance(size, bool) or not isinstance(size, (int, float)):
            raise ValueError(f"{prefix}.cpu_bytes_to_use must be a number of bytes, got {size!r}")
        n = int(size) // max(kv_block_bytes, 1)
        field_name = "cpu_bytes_to_use"
    else:
        raise ValueError(
            "kv_transfer_config.kv_connector_extra_config: OffloadingConnector needs num_cpu_blocks or "
            "cpu_bytes_to_use (or start with --kv-offloading-size GiB)"
        )
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(
            f"kv_transfer_config.kv_connector_extra_config.{field_name}: the CPU tier must hold at least one "
            f"block ({kv_block_bytes} bytes), got {extra[field_name]!r}"
        )
    return n


class OffloadingConnector(KVConnectorBase):
    supported_roles = ("kv_both",)

    @classmethod
    def check_extra_config(cls, extra: dict[str, Any]) -> None:
        unknown = sorted(set(extra) - {"num_cpu_blocks", "cpu_bytes_to_use"})
        if unknown:
            raise ValueError(
                f"kv_transfer_config.kv_connector_extra_config: OffloadingConnector does not know {unknown} "
                "(it takes num_cpu_blocks or cpu_bytes_to_use)"
            )
        num_cpu_blocks_from(extra, 1)  # the size in blocks is known once the model is: this checks the form

    def __init__(self, config: EngineConfig, role: KVConnectorRole, kv_block_bytes: int) -> None:
        super().__init__(config, role, kv_block_bytes)
        self.num_cpu_blocks = num_cpu_blocks_from(self.extra_config, kv_block_bytes)
        # Scheduler side.
        self._kv: KVCacheManager | None = None
        self._requests: dict[str, Request] = {}
        self._cpu: OrderedDict[bytes, int] = OrderedDict()  # block hash -> CPU slot, least recently used first
        self._free_slots = list(range(self.num_cpu_blocks - 1, -1, -1))
        self._num_saved: dict[str, int] = {}  # req_id -> leading blocks already offered to the CPU tier
        self._loads: list[tuple[int, int]] = []
        self._load_req_ids: list[str] = []
        self.num_lookup_tokens = 0  # tokens looked up in the CPU tier
        self.num_hit_tokens = 0  # tokens the CPU tier served (loads scheduled)
        self.num_stored_blocks = 0
        self.num_evicted_blocks = 0
        # Worker side.
        self._dev_caches: list[torch.Tensor] = []  # the distinct device cache tensors
        self._layout: list[tuple[int, int]] = []  # per device cache: (byte offset, bytes) of its block in a slot
        self._slot_bytes = 0
        self._slots_per_chunk = 1
        self._pool: list[torch.Tensor] = []  # the CPU tier: [slots, slot_bytes] uint8 chunks (pinned on CUDA)
        self._staging: torch.Tensor | None = None  # [staging slots, slot_bytes] uint8 on the device
        self._block_dim = 1
        self._finished_recving: set[str] = set()
        self._load_errors: set[int] = set()

    # ------------------------------------------------------------------ scheduler side

    def bind_scheduler(self, kv_cache_manager: KVCacheManager, requests: dict[str, Request]) -> None:
        self._kv = kv_cache_manager
        self._requests = requests

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        if request.sampling_params.prompt_logprobs is not None or self._kv is None:
            return 0, False  # cached positions would have no logits
        bs = self.block_size
        start = num_computed_tokens // bs
        end = (request.num_tokens - 1) // bs  # at least one token left to compute
        if end <= start:
            return 0, False
        self.num_lookup_tokens += (end - start) * bs
        self._kv.update_block_hashes(request, end * bs)
        hashes = request.block_hashes
        n = 0
        for i in range(start, end):
            if hashes[i] not in self._cpu:
                break
            self._cpu.move_to_end(hashes[i])
            n += 1
        return n * bs, True

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        if num_external_tokens == 0:
            return
        bs = self.block_size
        start = request.num_computed_tokens // bs
        end = start + num_external_tokens // bs
        for i in range(start, end):  # nothing evicts between the lookup and here (only build_connector_meta does)
            self._loads.append((self._cpu[request.block_hashes[i]], block_ids[i]))
        self._load_req_ids.append(request.request_id)
        self._num_saved[request.request_id] = end  # those blocks are in the CPU tier already
        self.num_hit_tokens += num_external_tokens

    def _take_slot(self, taken_now: set[int]) -> int | None:
        """A free CPU slot, evicting the least recently used block; None when every slot was filled this step."""
        if self._free_slots:
            return self._free_slots.pop()
        block_hash, slot = next(iter(self._cpu.items()))
        if slot in taken_now:
            return None
        del self._cpu[block_hash]
        self.num_evicted_blocks += 1
        return slot

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OffloadingMetadata:
        meta = OffloadingMetadata(self._loads, self._load_req_ids)
        self._loads, self._load_req_ids = [], []
        kv, requests, cpu, bs = self._kv, self._requests, self._cpu, self.block_size
        if kv is None or not self.is_producer:
            return meta
        taken_now: set[int] = set()
        for req_id in scheduler_output.num_scheduled_tokens:
            request = requests.get(req_id)
            if request is None:
                continue
            # Full blocks whose tokens the host knows and whose KV exists once this step is done.
            num_full = min(request.num_computed_tokens, request.num_tokens) // bs
            start = self._num_saved.get(req_id, 0)
            if num_full <= start:
                continue
            kv.update_block_hashes(request, num_full * bs)
            blocks = kv.req_to_blocks[req_id]
            hashes = request.block_hashes
            for i in range(start, num_full):
                block_hash = hashes[i]
                if block_hash in cpu:
                    cpu.move_to_end(block_hash)
                    continue
                slot = self._take_slot(taken_now)
                if slot is None:
                    break
                taken_now.add(slot)
                cpu[block_hash] = slot
                meta.stores.append((blocks[i].block_id, slot))
            self._num_saved[req_id] = num_full
        self.num_stored_blocks += len(meta.stores)
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._num_saved.pop(request.request_id, None)
        return False, None  # saves are ordered before any reuse of the blocks (module docstring)

    def on_load_failed(self, request: Request, num_valid_tokens: int) -> None:
        """Drop the blocks past the valid ones from the CPU tier (their slots are not trusted any more); the
        request saves them again once it has recomputed them."""
        self._num_saved[request.request_id] = num_valid_tokens // self.block_size
        for block_hash in request.block_hashes[num_valid_tokens // self.block_size :]:
            slot = self._cpu.pop(block_hash, None)
            if slot is not None:
                self._free_slots.append(slot)

    def reset_cache(self) -> bool:
        """Forget the CPU tier. Slots may be rewritten at once: a load of a step already launched comes before any
        later step's saves (module docstring)."""
        self._cpu.clear()
        self._free_slots = list(range(self.num_cpu_blocks - 1, -1, -1))
        return True

    def get_stats(self) -> dict[str, int]:
        return {
            "cpu_lookup_tokens": self.num_lookup_tokens,
            "cpu_hit_tokens": self.num_hit_tokens,
            "cpu_stored_blocks": self.num_stored_blocks,
            "cpu_evicted_blocks": self.num_evicted_blocks,
            "cpu_used_blocks": len(self._cpu),
            "cpu_num_blocks": self.num_cpu_blocks,
        }

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: list[torch.Tensor], block_dim: int) -> None:
        """Lay out the CPU tier slot-major: a slot holds one device block of every cache tensor, as bytes side by
        side, so a block moves in one contiguous copy each way (see ``_copy``)."""
        super().register_kv_caches(kv_caches, block_dim)
        self._block_dim = block_dim
        seen: set[int] = set()
        offset = 0
        for cache in kv_caches:
            if cache.data_ptr() in seen:
                continue
            seen.add(cache.data_ptr())
            nbytes = cache.select(block_dim, 0).numel() * cache.element_size()
            self._dev_caches.append(cache)
            self._layout.append((offset, nbytes))
            offset += nbytes
        self._slot_bytes = offset
        device = self._dev_caches[0].device
        pin = device.type == "cuda"
        # Pinned allocations are rounded up to a power of two: chunks of just under 1 GiB waste less than a slot.
        self._slots_per_chunk = max(1, POOL_CHUNK_BYTES // offset)
        self._pool = [
            torch.zeros((min(self._slots_per_chunk, self.num_cpu_blocks - s), offset), dtype=torch.uint8,
                        pin_memory=pin)
            for s in range(0, self.num_cpu_blocks, self._slots_per_chunk)
        ]
        staging_slots = max(1, min(STAGING_SLOTS, STAGING_BYTES // offset, self.num_cpu_blocks))
        self._staging = torch.empty((staging_slots, offset), dtype=torch.uint8, device=device)
        logger.info(
            "CPU KV offloading: %d blocks (%.2f GiB%s), %d-block device staging buffer",
            self.num_cpu_blocks, self.num_cpu_blocks * offset / 2**30, ", pinned" if pin else "", staging_slots,
        )

    def _index(self, block_ids: list[int]) -> torch.Tensor:
        """Device block ids as an index tensor on the caches' device, without a host sync on CUDA."""
        idx = torch.tensor(block_ids, dtype=torch.long)
        device = self._staging.device
        if device.type == "cuda":
            return idx.pin_memory().to(device, non_blocking=True)
        return idx

    def _slot_runs(self, slots: list[int]) -> list[tuple[int, int, int, int]]:
        """(first staging row, pool chunk, first row in it, count) for runs of consecutive slots in one chunk."""
        runs: list[tuple[int, int, int, int]] = []
        per = self._slots_per_chunk
        for j, slot in enumerate(slots):
            chunk, row = divmod(slot, per)
            if runs:
                j0, c0, r0, n0 = runs[-1]
                if c0 == chunk and r0 + n0 == row:
                    runs[-1] = (j0, c0, r0, n0 + 1)
                    continue
            runs.append((j, chunk, row, 1))
        return runs

    def _copy(self, pairs: list[tuple[int, int]], to_device: bool) -> None:
        """Copy blocks: (CPU slot, device block) pairs into the device (``to_device``), (device block, CPU slot)
        pairs out of it. Through the device staging buffer, a chunk of blocks at a time: out, one gather per
        cache tensor into the staging rows, then one copy per run of consecutive slots to the host; in, the
        reverse. On CUDA every copy is asynchronous on the current (compute) stream, so they are ordered with the
        forwards and with each other (the next chunk's gather waits for this chunk's copies out of the buffer)."""
        d = self._block_dim
        staging = self._staging
        for c in range(0, len(pairs), staging.shape[0]):
            chunk = pairs[c : c + staging.shape[0]]
            n = len(chunk)
            if to_device:
                slots, blocks = [p[0] for p in chunk], [p[1] for p in chunk]
            else:
                blocks, slots = [p[0] for p in chunk], [p[1] for p in chunk]
            idx = self._index(blocks)
            runs = self._slot_runs(slots)
            if to_device:
                for j, ci, r, k in runs:
                    staging[j : j + k].copy_(self._pool[ci][r : r + k], non_blocking=True)
                for cache, (off, nbytes) in zip(self._dev_caches, self._layout):
                    by_block = cache.movedim(d, 0)  # [num_blocks, ...]
                    rows = staging[:n, off : off + nbytes].view(cache.dtype).view(n, *by_block.shape[1:])
                    by_block.index_copy_(0, idx, rows)
            else:
                for cache, (off, nbytes) in zip(self._dev_caches, self._layout):
                    gathered = cache.movedim(d, 0).index_select(0, idx)  # [n, ...]
                    staging[:n, off : off + nbytes].copy_(gathered.reshape(n, -1).view(torch.uint8))
                for j, ci, r, k in runs:
                    self._pool[ci][r : r + k].copy_(staging[j : j + k], non_blocking=True)

    def load_blocks(self, loads: list[tuple[int, int]]) -> set[int]:
        """Copy (CPU slot, device block) pairs in; returns the device blocks that failed (none here: a connector
        over a store that can fail overrides this)."""
        self._copy(loads, to_device=True)
        return set()

    def start_load_kv(self) -> None:
        meta = self._metadata
        if not isinstance(meta, OffloadingMetadata):
            return
        if meta.loads:
            self._load_errors |= self.load_blocks(meta.loads)
        self._finished_recving.update(meta.load_req_ids)

    def wait_for_save(self) -> None:
        meta = self._metadata
        if isinstance(meta, OffloadingMetadata) and meta.stores:
            self._copy(meta.stores, to_device=False)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        done, self._finished_recving = self._finished_recving, set()
        return set(), done

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors
