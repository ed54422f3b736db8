"""Data parallelism: ``data_parallel_size`` engine cores behind the one-core interfaces the front-ends use.

Each core is a whole engine (scheduler, KV cache, model; on CUDA its own GPU, ``cuda:<rank>``). A new request goes
to the core with the fewest unfinished requests (ties: the lowest rank), and stays there: aborts follow it, and
the core's prefix cache serves it. Stats are summed over the cores (KV cache usage: the mean).

- ``DataParallelEngineCore``: in-process cores for ``LLMEngine`` (``LLM``). ``step()`` steps every core that has
  work; with async scheduling each core's step returns while its device still computes, so the cores' devices
  overlap.
- ``DataParallelCoreClient``: one ``EngineCoreClient`` (core process) per rank for ``AsyncLLM`` (the server).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pagedllm.config import DeviceConfig, EngineConfig
from pagedllm.core.sched_output import EngineCoreOutputs, EngineCoreRequest, SchedulerStats


def rank_configs(config: EngineConfig) -> list[EngineConfig]:
    """One config per data-parallel rank: rank r runs on ``cuda:r`` (CUDA) or the same device (CPU)."""
    size = config.data_parallel_size
    device = config.device_config.device
    if device.type != "cuda" or size == 1:
        return [config] * size
    available = torch.cuda.device_count()
    if size > available:
        raise ValueError(f"data_parallel_size={size} needs {size} GPUs; {available} visible")
    return [dataclasses.replace(config, device_config=DeviceConfig(f"cuda:{r}")) for r in range(size)]


def on_device(config: EngineConfig) -> contextlib.AbstractContextManager:
    """Make ``config``'s GPU the current device (Triton launches there) for the calls inside; no-op on CPU."""
    device = config.device_config.device
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def merge_stats(stats: Sequence[SchedulerStats]) -> SchedulerStats:
    """The cores' stats as one: counts and cumulative counters summed, KV cache usage averaged."""
    merged = SchedulerStats()
    for f in dataclasses.fields(SchedulerStats):
        values = [getattr(s, f.name) for s in stats]
        if f.name == "kv_cache_usage":
            value = sum(values) / len(values)
        elif f.name == "spec_accepted_per_pos":
            value = [sum(v[i] for v in values if i < len(v)) for i in range(max(map(len, values), default=0))]
        elif values and isinstance(values[0], dict):  # named counters (a KV connector's): summed key by key
            value = {}
            for v in values:
                for key, count in v.items():
                    value[key] = value.get(key, 0) + count
        else:
            value = sum(values)
        setattr(merged, f.name, value)
    return merged


class _Router:
    """Which rank holds each request, and how many unfinished requests each rank has."""

    def __init__(self, size: int) -> None:
        self.owner: dict[str, int] = {}
        self.load = [0] * size

    def assign(self, request_id: str) -> int:
        rank = min(range(len(self.load)), key=lambda r: (self.load[r], r))
        self.owner[request_id] = rank
        self.load[rank] += 1
        return rank

    def release(self, request_id: str) -> None:
        rank = self.owner.pop(request_id, None)
        if rank is not None:
            self.load[rank] -= 1

    def by_rank(self, request_ids: Sequence[str]) -> dict[int, list[str]]:
        groups: dict[int, list[str]] = {}
        for req_id in request_ids:
            rank = self.owner.get(req_id)
            if rank is not None:
                groups.setdefault(rank, []).append(req_id)
        return groups


class DataParallelEngineCore:
    """``EngineCore``'s interface over ``data_parallel_size`` in-process cores (attributes not defined here, such
    as ``vocab_size`` or ``config``, are rank 0's)."""

    def __init__(self, config: EngineConfig, tokenizer: Any = None) -> None:
        from pagedllm.engine.engine_core import EngineCore

        self.cores = []
        try:
            for c in rank_configs(config):
                with on_device(c):
                    self.cores.append(EngineCore(c, tokenizer=tokenizer))
        except BaseException:  # the ranks started so far must not outlive the failed start
            self.shutdown()
            raise
        self._router = _Router(len(self.cores))

    def __getattr__(self, name: str) -> Any:
        if name == "cores":  # not yet set: avoid recursing during construction
            raise AttributeError(name)
        return getattr(self.cores[0], name)

    def add_request(self, request: EngineCoreRequest) -> None:
        rank = self._router.assign(request.request_id)
        try:
            self.cores[rank].add_request(request)
        except BaseException:
            self._router.release(request.request_id)
            raise

    def abort_requests(self, request_ids: list[str]) -> None:
        for rank, ids in self._router.by_rank(request_ids).items():
            self.cores[rank].abort_requests(ids)
            for req_id in ids:
                self._router.release(req_id)

    def step(self) -> EngineCoreOutputs:
        outputs = []
        for core in self.cores:
            if core.has_unfinished_requests():
                with on_device(core.config):
                    outputs.extend(core.step().outputs)
        for out in outputs:
            if out.finished:
                self._router.release(out.request_id)
        return EngineCoreOutputs(outputs=outputs, stats=self.get_stats(), timestamp=time.monotonic())

    def has_unfinished_requests(self) -> bool:
        return any(core.has_unfinished_requests() for core in self.cores)

    def get_stats(self) -> SchedulerStats:
        return merge_stats([core.get_stats() for core in self.cores])

    def check_integrity(self) -> None:
        for core in self.cores:
            core.check_integrity()

    def on_idle(self) -> bool:
        return all([core.on_idle() for core in self.cores])

    def debug_state(self) -> dict:
        return _merge_debug([core.debug_state() for core in self.cores])

    def reset_prefix_cache(self) -> bool:
        return all([core.reset_prefix_cache() for core in self.cores])

    def collective_rpc(self, method: Any, args: Sequence[Any] = (), kwargs: dict | None = None) -> list[Any]:
        """Every data-parallel rank's workers, rank by rank: the results concatenated."""
        return [r for core in self.cores for r in core.collective_rpc(method, args, kwargs)]

    def update_weights(self, weights: Any) -> int:
        from pagedllm.worker.weight_update import check_pairs

        weights = check_pairs(weights)
        specs = [(name, t.dtype, tuple(t.shape)) for name, t in weights]
        for core in self.cores:  # every rank checks before any writes
            core.collective_rpc("check_weights", (specs,))
        return [core.update_weights(weights) for core in self.cores][0]

    def sleep(self, level: int = 1) -> None:
        for core in self.cores:
            core.sleep(level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        for core in self.cores:
            core.wake_up(tags)

    def is_sleeping(self) -> bool:
        return any(core.is_sleeping() for core in self.cores)

    def check_awake(self) -> None:
        for core in self.cores:
            core.check_awake()

    def add_lora(self, lora_request: Any) -> bool:
        return all([core.add_lora(lora_request) for core in self.cores])

    def remove_lora(self, lora_int_id: int) -> bool:
        return any([core.remove_lora(lora_int_id) for core in self.cores])

    def list_loras(self) -> set[int]:
        return set().union(*(core.list_loras() for core in self.cores))

    def shutdown(self) -> None:
        """Shut every rank's core down (``EngineCore.shutdown``), each even when another's raised (the first
        error is raised at the end). Idempotent."""
        error: BaseException | None = None
        for core in self.cores:
            try:
                with on_device(core.config):
                    core.shutdown()
            except Exception as e:  # noqa: BLE001 - raised once every rank is down
                error = error or e
        if error is not None:
            raise error


def _merge_debug(states: list[dict]) -> dict:
    merged: dict[str, Any] = {}
    for state in states:
        for key, value in state.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                merged[key] = merged.get(key, 0) + value
            elif value is not None:
                merged.setdefault(key, value)
    merged["data_parallel_size"] = len(states)
    return merged


class _AllAlive:
    """``proc``-like view of several core processes: alive while all are."""

    def __init__(self, clients: Sequence[Any]) -> None:
        self._clients = clients

    def is_alive(self) -> bool:
        return all(c.proc is not None and c.proc.is_alive() for c in self._clients)


class DataParallelCoreClient:
    """``EngineCoreClient``'s interface over one core process per data-parallel rank."""

    def __init__(
        self, config: EngineConfig, *, while_starting: Callable[[], None] | None = None, **client_kwargs: Any
    ) -> None:
        from pagedllm.engine.core_process import EngineCoreClient

        self.clients: list[Any] = []
        try:
            for rank, rank_config in enumerate(rank_configs(config)):
                self.clients.append(
                    EngineCoreClient(
                        rank_config, while_starting=while_starting if rank == 0 else None, **client_kwargs
                    )
                )
        except BaseException:
            self.shutdown()
            raise
        first = self.clients[0]
        self.kv_cache_info = first.kv_cache_info
        self.vocab_size = first.vocab_size
        self.pid = first.pid
        self.proc = _AllAlive(self.clients)
        self._router = _Router(len(self.clients))
        self._stats: list[SchedulerStats] = [SchedulerStats() for _ in self.clients]
        self._merged: asyncio.Queue | None = None
        self._pumps: list[asyncio.Task] = []

    @property
    def is_dead(self) -> bool:
        return any(c.is_dead for c in self.clients)

    @property
    def dead_error(self) -> Any:
        return next((c.dead_error for c in self.clients if c.dead_error is not None), None)

    def is_alive(self) -> bool:
        return all(c.is_alive() for c in self.clients)

    def start(self) -> None:
        if self._merged is not None:
            return
        for client in self.clients:
            client.start()
        self._merged = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self._pumps = [
            loop.create_task(self._pump(r), name=f"pagedllm-dp-{r}") for r in range(len(self.clients))
        ]

    async def _pump(self, rank: int) -> None:
        assert self._merged is not None
        try:
            while True:
                outputs, errors = await self.clients[rank].get_output_async()
                for out in outputs.outputs:
                    if out.finished:
                        self._router.release(out.request_id)
                for req_id in errors:
                    self._router.release(req_id)
                if outputs.stats is not None:
                    self._stats[rank] = outputs.stats
                    outputs.stats = merge_stats(self._stats)
                self._merged.put_nowait((outputs, errors))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - a dead rank ends the whole engine
            self._merged.put_nowait(e)

    def add_request(self, request: EngineCoreRequest) -> None:
        rank = self._router.assign(request.request_id)
        try:
            self.clients[rank].add_request(request)
        except BaseException:
            self._router.release(request.request_id)
            raise

    def abort_requests(self, request_ids: list[str]) -> None:
        for rank, ids in self._router.by_rank(request_ids).items():
            self.clients[rank].abort_requests(ids)

    async def get_output_async(self) -> tuple[EngineCoreOutputs, dict[str, str]]:
        if self._merged is None:
            self.start()
        assert self._merged is not None
        item = await self._merged.get()
        if isinstance(item, BaseException):
            self._merged.put_nowait(item)
            raise item
        return item

    async def call_utility_async(self, name: str, *args: Any, timeout_s: float | None = None) -> Any:
        """Run the utility on every rank and combine the answers."""
        results = await asyncio.gather(
            *(c.call_utility_async(name, *args, timeout_s=timeout_s) for c in self.clients)
        )
        if name == "get_stats":
            return merge_stats(results)
        if name == "debug_state":
            return _merge_debug(results)
        if name == "list_loras":
            return set().union(*results)
        if name == "remove_lora":
            return any(results)
        if name in ("reset_prefix_cache", "add_lora", "is_idle"):
            return all(results)
        if name == "is_sleeping":
            return any(results)
        if name == "collective_rpc":
            return [r for rank_results in results for r in rank_results]
        return results[0]

    def shutdown(self, timeout_s: float = 5.0) -> None:
        for task in self._pumps:
            if not task.done():
                try:
                    task.cancel()
                except RuntimeError:
                    pass
        for client in self.clients:
            client.shutdown(timeout_s)
