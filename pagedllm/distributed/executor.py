"""Tensor-parallel execution on one node (``distributed_executor_backend="mp"``): rank 0 is the engine core's
own ``ModelRunner``; ranks 1..T-1 are worker processes, each with its ``ModelRunner`` over its shard.

The scheduler runs once (in the engine core). Each runner call is mirrored on every rank through a gloo
"control" group: rank 0 broadcasts ``(method, args)`` with ``broadcast_object_list``, then every rank runs it, so
the model's collectives (all-reduce, all-gather of logits) meet. Only rank 0 samples; the tokens it sampled ride
along with the next ``launch`` so the workers' persistent batches stay identical to rank 0's::

    rank 0:   launch(step N) ─ sample ─ collect ──► broadcast(("launch", sched N+1, tokens of N)) ─ launch(N+1) ...
    rank r:                     recv ◄──────────────┘  append tokens of N, launch(N+1) (no sampling)

Scheduling is synchronous under TP (the workers need step N's tokens before step N+1). A worker that dies makes
rank 0's next collective fail, which ends the engine core (the server then answers 503).

Multi-LoRA: every rank has its own ``LoRAManager`` over its shard (pagedllm/lora/layers.py says which part of an
adapter each layer keeps). The engine core's ``add_lora`` / ``remove_lora`` reach every rank in the same order
(``TPLoRAManager``: rank 0 first, so a bad adapter is refused before any worker sees it; then the workers, whose
errors come back through a gather); each ``launch`` then gives the step's adapters slots on every rank from the
same state, so the slots and the per-token slot map agree. Each launch also carries rank 0's slot table, which a
worker checks against its own: ranks that ever diverged fail loudly instead of mixing adapters.
"""

from __future__ import annotations

import logging
import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagedllm.config import EngineConfig

logger = logging.getLogger(__name__)

TIMEOUT_S = 600.0  # a collective a peer never joins fails after this


def _join(config: EngineConfig, rank: int, init_file: str) -> tuple[Any, Any]:
    """Join the process group; return (this rank's TPGroup, the gloo control group)."""
    from pagedllm.distributed.parallel_state import init_tp_group

    size = config.parallel_config.tensor_parallel_size
    if config.device_config.device.type == "cuda":
        torch.cuda.set_device(rank)
    backend = "nccl" if config.device_config.device.type == "cuda" else "gloo"
    tp = init_tp_group(size, rank, f"file://{init_file}", backend=backend, timeout_s=TIMEOUT_S)
    control = dist.new_group(list(range(size)), backend="gloo")
    return tp, control


def _rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    import dataclasses

    from pagedllm.config import DeviceConfig

    if config.device_config.device.type != "cuda":
        return config
    return dataclasses.replace(config, device_config=DeviceConfig(f"cuda:{rank}"))


def _worker_main(config: EngineConfig, rank: int, init_file: str) -> None:
    from pagedllm.worker.model_runner import ModelRunner

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.parallel_config.tensor_parallel_size))
    tp, control = _join(config, rank, init_file)
    runner = ModelRunner(_rank_config(config, rank), tp=tp)
    try:
        while True:
            msg = [None]
            dist.broadcast_object_list(msg, src=0, group=control)
            method, args = msg[0]
            if method == "stop":
                break
            if method == "launch":
                sched, sampled, lora_slots = args
                _check_lora_slots(runner, rank, lora_slots)
                runner.apply_sampled(sampled)
                runner.launch(sched)
            elif method in ("add_lora", "remove_lora"):
                error = None
                try:
                    getattr(runner.lora_manager, method)(*args)
                except Exception as e:  # noqa: BLE001 - reported to rank 0, which raises it
                    error = f"{type(e).__name__}: {e}"
                dist.gather_object(error, None, dst=0, group=control)
            elif method == "determine_num_blocks":
                n = torch.tensor([runner.determine_num_blocks(*args)])
                dist.all_reduce(n, op=dist.ReduceOp.MIN, group=control)
            else:
                getattr(runner, method)(*args)
    finally:
        dist.destroy_process_group()


def _check_lora_slots(runner: Any, rank: int, expected: list[tuple[int, int]] | None) -> None:
    """Raise when this worker's LoRA slot table is not rank 0's (``expected``; None: LoRA is off)."""
    if expected is None:
        return
    mine = runner.lora_manager.slot_table()
    if mine != expected:
        raise RuntimeError(
            f"tensor-parallel rank {rank}: LoRA slots (lora_int_id, slot) {mine} differ from rank 0's {expected}"
        )


class TPLoRAManager:
    """Rank 0's ``LoRAManager`` as the engine core sees it under TP (``TensorParallelRunner.lora_manager``).

    ``add_lora`` / ``remove_lora`` run on rank 0, then on every worker, so all ranks' host caches and slot LRUs
    stay equal; a worker's failure is raised here as a ``ValueError`` naming its rank. Everything else
    (``list_loras``, ``slot_of``, ...) is rank 0's, which every rank mirrors.
    """

    def __init__(self, local: Any, tp_runner: TensorParallelRunner) -> None:
        self._local = local
        self._tp_runner = tp_runner

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._local, name)

    def add_lora(self, lora_request: Any) -> bool:
        """Load the adapter on every rank; rank 0 validates it first (its ``ValueError`` reaches no worker)."""
        added = self._local.add_lora(lora_request)
        self._tp_runner.call_workers("add_lora", lora_request)
        return added

    def remove_lora(self, lora_int_id: int) -> bool:
        self._tp_runner.call_workers("remove_lora", lora_int_id)
        return self._local.remove_lora(lora_int_id)


class TensorParallelRunner:
    """``ModelRunner``'s interface over T ranks (attributes not defined here are rank 0's runner's)."""

    def __init__(self, config: EngineConfig) -> None:
        from pagedllm.worker.model_runner import ModelRunner

        size = config.parallel_config.tensor_parallel_size
        if config.device_config.device.type == "cuda" and size > torch.cuda.device_count():
            raise ValueError(
                f"tensor_parallel_size={size} needs {size} GPUs; {torch.cuda.device_count()} visible"
            )
        self._dir = tempfile.mkdtemp(prefix="pagedllm-tp-")
        init_file = os.path.join(self._dir, "init")
        ctx = mp.get_context("spawn")
        self.workers = [
            ctx.Process(target=_worker_main, args=(config, r, init_file), daemon=True, name=f"pagedllm-tp{r}")
            for r in range(1, size)
        ]
        for w in self.workers:
            w.start()
        tp, self._control = _join(config, 0, init_file)
        self.runner = ModelRunner(_rank_config(config, 0), tp=tp)
        self._sampled: dict[str, list[int]] = {}  # rank 0's last collected tokens, for the workers
        self._stopped = False
        self._size = size
        local_lora = self.runner.lora_manager
        self.lora_manager = None if local_lora is None else TPLoRAManager(local_lora, self)

    def __getattr__(self, name: str) -> Any:
        if name == "runner":
            raise AttributeError(name)
        return getattr(self.runner, name)

    def _broadcast(self, method: str, *args: Any) -> None:
        dist.broadcast_object_list([(method, args)], src=0, group=self._control)

    def call_workers(self, method: str, *args: Any) -> None:
        """Run a worker-side call that reports back (``add_lora`` / ``remove_lora`` on each worker's LoRA
        manager); ``ValueError`` naming the ranks where it raised."""
        self._broadcast(method, *args)
        errors: list[str | None] = [None] * self._size
        dist.gather_object(None, errors, dst=0, group=self._control)
        failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None]
        if failed:
            raise ValueError(f"{method} failed on tensor-parallel {'; '.join(failed)}")

    def determine_num_blocks(self, extra_block_bytes: int = 0) -> int:
        """The smallest block count any rank can hold (every rank uses the same block ids)."""
        self._broadcast("determine_num_blocks", extra_block_bytes)
        n = torch.tensor([self.runner.determine_num_blocks(extra_block_bytes)])
        dist.all_reduce(n, op=dist.ReduceOp.MIN, group=self._control)
        return int(n.item())

    def init_kv_cache(self, num_blocks: int) -> None:
        self._broadcast("init_kv_cache", num_blocks)
        self.runner.init_kv_cache(num_blocks)

    def maybe_capture_cuda_graphs(self) -> None:
        logger.info("tensor parallel: CUDA graphs are not captured yet (eager steps)")

    def launch(self, sched: Any) -> Any:
        lora = self.runner.lora_manager
        self._broadcast("launch", sched, self._sampled, None if lora is None else lora.slot_table())
        self._sampled = {}
        return self.runner.launch(sched)

    def sample(self, step: Any, grammar_bitmask: Any = None) -> None:
        self.runner.sample(step, grammar_bitmask)

    def collect(self, step: Any) -> Any:
        out = self.runner.collect(step)
        for req_id, tokens in out.sampled_token_ids.items():
            if tokens:
                self._sampled[req_id] = list(tokens)
        return out

    def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        try:
            self._broadcast("stop")
        except Exception:  # noqa: BLE001 - a dead worker: nothing to tell
            pass
        for w in self.workers:
            w.join(10)
            if w.is_alive():
                w.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
