"""Tensor- and pipeline-parallel execution on one node (``distributed_executor_backend="mp"``): rank 0 is the
engine core's own ``ModelRunner``; ranks 1..W-1 (``W = pipeline_parallel_size * tensor_parallel_size``) are worker
processes, each with its ``ModelRunner`` over its shard (rank ``g`` = TP rank ``g % T`` of stage ``g // T``, see
pagedllm/distributed/parallel_state.py).

The scheduler runs once (in the engine core). Each runner call is mirrored on every rank through a gloo
"control" group: rank 0 broadcasts ``(method, args)`` with ``broadcast_object_list``, then every rank runs it, so
the model's collectives (all-reduce, all-gather of logits) meet. Only rank 0 samples; the tokens it sampled ride
along with the next ``launch`` so the workers' persistent batches stay identical to rank 0's::

    rank 0:   launch(step N) ─ sample ─ collect ──► broadcast(("launch", sched N+1, tokens of N)) ─ launch(N+1) ...
    rank r:                     recv ◄──────────────┘  append tokens of N, launch(N+1) (no sampling)

Scheduling is synchronous under TP (the workers need step N's tokens before step N+1). Pure-decode steps replay
CUDA graphs on every rank (captured with the NCCL all-reduces inside; see ``maybe_capture_cuda_graphs``). A worker that dies makes
rank 0's next collective fail, which ends the engine core (the server then answers 503).

Pipeline parallelism (P > 1 stages): every rank still gets each ``launch`` from rank 0 and runs its stage's layers;
activations go stage to stage by send/recv (pagedllm/distributed/pipeline.py). The *sampler*, TP rank 0 of the last
stage (global rank ``(P - 1) * T``), samples and reads the tokens back; a gloo "link" group of ranks {0, sampler}
carries the step's grammar bitmask there and its ``ModelRunnerOutput`` back. Every other rank, rank 0 included,
appends the sampled tokens that ride along with the next ``launch``::

    rank 0 (stage 0):  launch(N): broadcast, layers, send ──► ... ──► sampler: recv, layers, logits
                       sample(N):  bitmask ───────────── link ─────► sample, collect
                       collect(N): ModelRunnerOutput ◄── link ────── (tokens go out with launch N+1)

Synchronous scheduling, as under TP, and eager steps. Speculative decoding, LoRA and quantized models are refused
with pipeline_parallel_size > 1 (pagedllm/config.py).

Speculative decoding under TP (n-gram and draft-model proposers; EAGLE is refused in pagedllm/config.py): the
proposer runs in the engine core only (a draft model whole, unsharded, on rank 0, its KV cache keyed by the
target's block ids); the drafts ride in the broadcast ``SchedulerOutput`` (``scheduled_spec_decode_tokens``), so
every rank feeds them as extra query tokens and computes the same verification logits (the logits all-gather
meets). Only rank 0 verifies; its ``collect`` gives each request its emitted tokens (accepted drafts plus one),
which ride with the next launch like any sampled tokens: a worker appends exactly those, and the rejected drafts,
left past the row's known tokens on every rank, are overwritten later, as on rank 0. ``check_batches`` compares
every rank's batch with rank 0's (tests).

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


def _sampler_rank(config: EngineConfig) -> int:
    """The global rank that samples: TP rank 0 of the last pipeline stage (rank 0 without pipeline parallelism)."""
    pc = config.parallel_config
    return (pc.pipeline_parallel_size - 1) * pc.tensor_parallel_size


def _join(config: EngineConfig, rank: int, init_file: str) -> tuple[Any, Any, Any, Any]:
    """Join the process group; return (this rank's TPGroup, its PPGroup, the gloo control group over every rank,
    the gloo link group of ranks {0, sampler} or None without pipeline parallelism)."""
    from pagedllm.distributed.parallel_state import init_parallel_groups

    pc = config.parallel_config
    if config.device_config.device.type == "cuda":
        torch.cuda.set_device(rank)
    backend = "nccl" if config.device_config.device.type == "cuda" else "gloo"
    tp, pp = init_parallel_groups(
        pc.tensor_parallel_size,
        pc.pipeline_parallel_size,
        rank,
        f"file://{init_file}",
        backend=backend,
        timeout_s=TIMEOUT_S,
        partition=pc.pp_layer_partition,
    )
    # Creating groups is collective: every rank makes both, in this order.
    control = dist.new_group(list(range(pc.world_size)), backend="gloo")
    link = None
    if pp.size > 1:
        link = dist.new_group([0, _sampler_rank(config)], backend="gloo")
    return tp, pp, control, link


def _rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    import dataclasses

    from pagedllm.config import DeviceConfig

    if config.device_config.device.type != "cuda":
        return config
    return dataclasses.replace(config, device_config=DeviceConfig(f"cuda:{rank}"))


def _worker_main(config: EngineConfig, rank: int, init_file: str) -> None:
    from pagedllm.worker.model_runner import ModelRunner

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.parallel_config.world_size))
    tp, pp, control, link = _join(config, rank, init_file)
    runner = ModelRunner(_rank_config(config, rank), tp=tp, pp=pp)
    samples = link is not None and rank == _sampler_rank(config)  # this rank samples for rank 0
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
                if not samples:
                    runner.apply_sampled(sampled)
                step = runner.launch(sched)
                if samples:
                    _sample_for_rank0(runner, step, link, rank)
            elif method in ("add_lora", "remove_lora"):
                error = None
                try:
                    getattr(runner.lora_manager, method)(*args)
                except Exception as e:  # noqa: BLE001 - reported to rank 0, which raises it
                    error = f"{type(e).__name__}: {e}"
                dist.gather_object(error, None, dst=0, group=control)
            elif method == "batch_tokens":
                pending = None if samples else args[0]  # the sampler already holds its own tokens
                dist.gather_object(_batch_tokens(runner, pending), None, dst=0, group=control)
            elif method == "determine_num_blocks":
                n = torch.tensor([runner.determine_num_blocks(*args)])
                dist.all_reduce(n, op=dist.ReduceOp.MIN, group=control)
            else:
                getattr(runner, method)(*args)
    finally:
        dist.destroy_process_group()


def _sample_for_rank0(runner: Any, step: Any, link: Any, rank: int) -> None:
    """The sampler's half of ``MultiprocRunner.sample`` / ``collect``: wait for the step's grammar bitmask (or None)
    from rank 0, sample, send the step's ``ModelRunnerOutput`` back."""
    msg: list[Any] = [None]
    dist.broadcast_object_list(msg, src=0, group=link)
    runner.sample(step, msg[0])
    dist.broadcast_object_list([runner.collect(step)], src=rank, group=link)


def _batch_tokens(runner: Any, pending: dict[str, list[int]] | None) -> dict[str, list[int]]:
    """Each request's known tokens in ``runner``'s persistent batch, plus ``pending`` (tokens sampled elsewhere
    that this rank appends at the next launch). Drafts past a row's known tokens are not part of it."""
    batch = runner.input_batch
    out = {}
    for req_id, row in batch.req_id_to_row.items():
        tokens = batch.token_ids_np[row, : int(batch.num_tokens_np[row])].tolist()
        out[req_id] = tokens + list((pending or {}).get(req_id, ()))
    return out


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


class MultiprocRunner:
    """``ModelRunner``'s interface over ``P * T`` ranks (attributes not defined here are rank 0's runner's)."""

    def __init__(self, config: EngineConfig) -> None:
        from pagedllm.worker.model_runner import ModelRunner

        pc = config.parallel_config
        size = pc.world_size
        if dist.is_initialized():
            raise RuntimeError(
                "this process already belongs to a torch.distributed group (another tensor/pipeline-parallel "
                "engine): shut that engine down before starting another"
            )
        if config.device_config.device.type == "cuda" and size > torch.cuda.device_count():
            raise ValueError(
                f"tensor_parallel_size={pc.tensor_parallel_size} x pipeline_parallel_size="
                f"{pc.pipeline_parallel_size} needs {size} GPUs; {torch.cuda.device_count()} visible"
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
        tp, pp, self._control, self._link = _join(config, 0, init_file)
        self.runner = ModelRunner(_rank_config(config, 0), tp=tp, pp=pp)
        self._sampled: dict[str, list[int]] = {}  # rank 0's last collected tokens, for the workers
        self._stopped = False
        self._size = size
        # Pipeline parallelism: the sampler's rank, and the launched step still owed its bitmask / output exchange.
        self._sampler = _sampler_rank(config)
        self._unsampled: Any = None
        self._uncollected: Any = None
        if self._link is not None:
            logger.info(
                "pipeline parallel: %d stages of %d tensor-parallel ranks, decoder layers per stage %s",
                pp.size,
                tp.size,
                list(pc.pp_layer_partition or ()),
            )
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

    def check_batches(self) -> None:
        """``RuntimeError`` naming the rank and request when a rank's persistent batch differs from rank 0's
        (each request's known tokens, counting the sampled tokens a rank appends at the next launch). A
        consistency check for tests and debugging: after speculative steps, every rank must hold the emitted
        tokens (accepted drafts plus one) and none of the rejected drafts."""
        if self._uncollected is not None:
            self.collect(self._uncollected)
        self._broadcast("batch_tokens", self._sampled)
        states: list[Any] = [None] * self._size
        mine = _batch_tokens(self.runner, self._sampled if self._link is not None else None)
        dist.gather_object(mine, states, dst=0, group=self._control)
        for rank, state in enumerate(states[1:], start=1):
            if state != mine:
                bad = sorted(r for r in set(state) | set(mine) if state.get(r) != mine.get(r))
                raise RuntimeError(
                    f"rank {rank}: persistent batch differs from rank 0's for request(s) {bad[:5]} "
                    f"(rank 0: {[mine.get(r) for r in bad[:1]]}, rank {rank}: {[state.get(r) for r in bad[:1]]})"
                )

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
        """Under TP alone, every rank captures the same decode graphs, in the same order, with the model's NCCL
        all-reduces inside them; a step then replays the graph of the same padded size on every rank (each rank's
        runner picks it from the same ``SchedulerOutput``). Pipeline stages stay eager (their send/recv is not
        captured)."""
        if self._link is not None:
            logger.info("pipeline parallel: CUDA graphs are not captured yet (eager steps)")
            return
        if os.environ.get("PAGEDLLM_TP_CUDA_GRAPHS", "1") == "0":
            logger.info("tensor parallel: CUDA graphs off (PAGEDLLM_TP_CUDA_GRAPHS=0)")
            return
        self._broadcast("maybe_capture_cuda_graphs")
        self.runner.maybe_capture_cuda_graphs()

    def launch(self, sched: Any) -> Any:
        if self._uncollected is not None:  # the engine always collects; never leave the sampler waiting
            self.collect(self._uncollected)
        lora = self.runner.lora_manager
        self._broadcast("launch", sched, self._sampled, None if lora is None else lora.slot_table())
        if self._link is not None:  # the sampler is another rank: append its tokens here too
            self.runner.apply_sampled(self._sampled)
        self._sampled = {}
        step = self.runner.launch(sched)
        if self._link is not None:
            self._unsampled = self._uncollected = step
        return step

    def sample(self, step: Any, grammar_bitmask: Any = None) -> None:
        """Sample ``step``; under pipeline parallelism the sampler does, once it has the bitmask sent here."""
        if self._link is None:
            self.runner.sample(step, grammar_bitmask)
        elif step is self._unsampled:
            self._unsampled = None
            dist.broadcast_object_list([grammar_bitmask], src=0, group=self._link)

    def collect(self, step: Any) -> Any:
        if self._link is None:
            out = self.runner.collect(step)
        elif step is self._uncollected:
            self.sample(step)  # no-op unless the engine skipped sample()
            msg: list[Any] = [None]
            dist.broadcast_object_list(msg, src=self._sampler, group=self._link)
            out = step.output = msg[0]  # rank 0's own runner reads it from there (collect is idempotent)
            self._uncollected = None
        else:
            return self.runner.collect(step)  # collected before: the same output
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


TensorParallelRunner = MultiprocRunner  # the name before pipeline parallelism
