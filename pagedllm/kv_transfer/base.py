"""The KV connector interface (vLLM v1's shape): a scheduler side and a worker side of one connector class.

The engine core builds two instances of the configured connector, one per ``KVConnectorRole``. They talk only
through plain data: the scheduler side returns a ``KVConnectorMetadata`` from ``build_connector_meta`` each step,
which rides in ``SchedulerOutput.kv_connector_metadata`` to the worker side; the worker side reports back in
``ModelRunnerOutput.kv_connector_output`` (loads and saves that finished, blocks whose load failed).

One step, with a connector::

    scheduler: admit request R
        device prefix hit of H tokens          (KVCacheManager.get_computed_blocks)
        E, is_async = get_num_new_matched_tokens(R, H)   the store holds E more tokens' KV
        allocate blocks for H + E tokens; update_state_after_alloc(R, block_ids, E)
        R waits (WAITING_FOR_REMOTE_KVS) computing nothing until its load is reported done
    scheduler: meta = build_connector_meta(scheduler_output)
    worker:    bind_connector_metadata(meta); start_load_kv(); wait_for_layer_load(i) for every layer
               forward
               save_kv_layer(i, ...) for every layer; wait_for_save()
               get_finished() -> finished loads / saves; get_block_ids_with_load_errors()
               (begin_step / end_step; the forward has no per-layer hook yet, so the per-layer calls come all
               before or all after it)
    scheduler: a finished load makes R computed up to H + (the tokens before its first failed block) and puts it
               back in the waiting queue; the rest of its prompt is recomputed, so a failed load costs time, never
               correctness.
    scheduler: request_finished(R, block_ids) -> (delay_free_blocks, params) when R ends

Loads always complete before the request computes anything (``load_is_async`` or not): the worker side loads at
the start of a step, and the request is scheduled at a later step, after the scheduler has read the load's result.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from pagedllm.config import EngineConfig, KVTransferConfig
    from pagedllm.core.kv_cache_manager import KVCacheManager
    from pagedllm.core.request import Request
    from pagedllm.core.sched_output import SchedulerOutput


class KVConnectorRole(enum.Enum):
    SCHEDULER = "scheduler"  # lives beside the scheduler: lookups, block bookkeeping, per-step metadata
    WORKER = "worker"  # lives beside the model runner: the copies


class KVConnectorMetadata:
    """What the scheduler side tells the worker side for one step; each connector defines its own (plain,
    picklable data)."""


@dataclass
class KVConnectorOutput:
    """What the worker side reports after a step."""

    finished_sending: set[str] = field(default_factory=set)  # requests whose delayed saves are done
    finished_recving: set[str] = field(default_factory=set)  # requests whose loads are done (failed ones too)
    invalid_block_ids: set[int] = field(default_factory=set)  # device blocks whose load failed

    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.invalid_block_ids)


class KVConnectorBase:
    """Base class of every connector. ``__init__(config, role, kv_block_bytes)``: ``kv_block_bytes`` is what one
    device block takes over every layer (to size a store in blocks).

    A connector states which ``kv_role`` values it accepts in ``supported_roles``; "kv_producer" saves only,
    "kv_consumer" loads only, "kv_both" does both (``is_producer`` / ``is_consumer``).
    """

    supported_roles: tuple[str, ...] = ("kv_producer", "kv_consumer", "kv_both")

    def __init__(self, config: EngineConfig, role: KVConnectorRole, kv_block_bytes: int) -> None:
        self.config = config
        self.role = role
        self.kv_block_bytes = kv_block_bytes
        transfer = config.kv_transfer_config
        assert transfer is not None
        self.transfer_config = transfer
        self.extra_config: dict[str, Any] = dict(transfer.kv_connector_extra_config)
        self.block_size = config.cache_config.block_size
        self._metadata: KVConnectorMetadata | None = None
        self.kv_caches: list[torch.Tensor] = []  # worker side: the runner's, per layer (register_kv_caches)

    @classmethod
    def check_extra_config(cls, extra: dict[str, Any]) -> None:
        """``ValueError`` naming the key when ``kv_connector_extra_config`` cannot work (called before the model
        loads)."""

    @classmethod
    def check_config(cls, transfer: KVTransferConfig) -> None:
        """The start-up check of the whole ``kv_transfer_config`` (before the model loads); by default
        ``check_extra_config``."""
        cls.check_extra_config(transfer.kv_connector_extra_config)

    @property
    def is_producer(self) -> bool:
        return self.transfer_config.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.transfer_config.kv_role in ("kv_consumer", "kv_both")

    # ------------------------------------------------------------------ scheduler side

    def bind_scheduler(self, kv_cache_manager: KVCacheManager, requests: dict[str, Request]) -> None:
        """Called once by the scheduler: its KV cache manager and its live requests (req_id -> Request), for
        connectors that look at block lists or token ids while building a step's metadata."""

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """How many tokens past ``num_computed_tokens`` (the device prefix hit, whole blocks) the store can supply,
        and whether the load runs asynchronously. The count must be whole blocks and leave at least one prompt
        token to compute. No side effects beyond LRU bookkeeping: the scheduler may not admit the request."""
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """The request got its blocks: ``block_ids`` are all of them (group 0); ``request.num_computed_tokens`` is
        its device prefix hit, and the ``num_external_tokens`` to load fill the blocks right after it."""

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """The step's metadata for the worker side; resets the per-step state. Called once per step, after
        scheduling (``scheduler_output`` counts the computed tokens after the step in the requests)."""
        return KVConnectorMetadata()

    def on_load_failed(self, request: Request, num_valid_tokens: int) -> None:
        """The load for ``request`` failed past its first ``num_valid_tokens`` tokens (which it keeps); the rest
        is recomputed. A connector may stop offering what failed."""

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """The request ended. Returns (delay_free_blocks, kv_transfer_params): True keeps its blocks until the
        worker reports it in ``finished_sending``."""
        return False, None

    def reset_cache(self) -> bool:
        """Forget what the store holds (the engine's ``reset_prefix_cache``, called when no block is in use);
        False when it cannot."""
        return True

    def get_stats(self) -> dict[str, int]:
        """Cumulative counters for logs and tests (connector-defined names)."""
        return {}

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: list[torch.Tensor], block_dim: int) -> None:
        """The runner's cache tensors, one per layer (layers may share one); ``block_dim`` is the dimension that
        indexes blocks (1 for ``[2, num_blocks, block_size, num_kv_heads, head_dim]``)."""
        self.kv_caches = kv_caches

    def begin_step(self, metadata: KVConnectorMetadata | None, num_layers: int) -> None:
        """What the runner calls before a step's forward: bind the metadata, start the loads. The runner's
        forward has no per-layer hook yet, so every layer's load is waited for here (a connector whose loads go on
        the compute stream, as CPU offloading's, waits for nothing)."""
        self.bind_connector_metadata(metadata)
        self.start_load_kv()
        for layer in range(num_layers):
            self.wait_for_layer_load(layer)

    def end_step(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        """What the runner calls after a step's forward (or instead of it, for a step with no tokens): each layer's
        ``save_kv_layer`` (all after the forward: the runner has no per-layer hook yet), ``wait_for_save``, then the
        report for the scheduler."""
        for layer, kv_layer in enumerate(self.kv_caches):
            self.save_kv_layer(layer, kv_layer, None)
        self.wait_for_save()
        sending, recving = self.get_finished(finished_req_ids)
        output = KVConnectorOutput(sending, recving, self.get_block_ids_with_load_errors())
        self.clear_connector_metadata()
        return output

    def bind_connector_metadata(self, metadata: KVConnectorMetadata | None) -> None:
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    def start_load_kv(self) -> None:
        """Start (or do) the step's loads, before the forward."""

    def wait_for_layer_load(self, layer: int) -> None:
        """Block until layer ``layer``'s loads are done (before its attention reads the cache)."""

    def save_kv_layer(self, layer: int, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        """Layer ``layer``'s cache tensor was written by this step's forward: a connector may start saving it now
        (``attn_metadata`` is None until the runner calls this from within the forward)."""

    def wait_for_save(self) -> None:
        """After the forward: start (or finish) the step's saves; blocks may be reused once this returns."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(finished_sending, finished_recving) request ids since the last call."""
        return set(), set()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Device blocks whose load failed since the last call: the scheduler recomputes them."""
        return set()

    def shutdown(self) -> None:
        """Release threads, sockets and ports (the runner's shutdown; idempotent)."""
