"""Tensor- and pipeline-parallel execution: rank 0 is the engine core's own ``ModelRunner``; ranks 1..W-1
(``W = pipeline_parallel_size * tensor_parallel_size``) are workers, each running ``_worker_main`` with its
``ModelRunner`` over its shard (rank ``g`` = TP rank ``g % T`` of stage ``g // T``, see
pagedllm/distributed/parallel_state.py). Two backends (``distributed_executor_backend``) start the workers; the
protocol below is the same for both, only the launcher differs:

    "mp"    worker processes on this node (``ProcessWorkers``): rank r on ``cuda:r``, a ``file://`` rendezvous.
    "ray"   Ray actors in a placement group, on any node of a Ray cluster (pagedllm/distributed/ray_executor.py):
            each on its Ray-assigned GPU, rank 0 on a GPU of this node; a ``tcp://`` rendezvous at this node.

None picks "mp", or "ray" when the ranks outnumber this node's GPUs and Ray is installed (pagedllm/config.py).

The scheduler runs once (in the engine core). Each runner call is mirrored on every rank through a gloo
"control" group: rank 0 broadcasts ``(method, args)`` with ``broadcast_object_list``, then every rank runs it, so
the model's collectives (all-reduce, all-gather of logits) meet. Only rank 0 samples; the tokens it sampled ride
along with the next ``launch`` so the workers' persistent batches stay identical to rank 0's::

    rank 0:   launch(step N) ─ sample ─ collect ──► broadcast(("launch", sched N+1, tokens of N)) ─ launch(N+1) ...
    rank r:                     recv ◄──────────────┘  append tokens of N, launch(N+1) (no sampling)

With async scheduling (TP alone; the default on CUDA) rank 0 launches step N+1 before it has read step N's tokens
on the host, so they cannot ride in the message. Rank 0 sends the message for N+1 with the number of tokens step
N sampled, then broadcasts the sampled ids tensor itself over the TP group (NCCL: on the device, queued after the
sampling, no host wait). Each worker receives them into its last step (``ModelRunner.receive_sampled``) and feeds
them to step N+1 on the device, as rank 0 does with its own. It marks the placeholders ``sample`` would
(``skip_sample``), and writes the tokens into its host batch (``collect``) once N+1 is queued::

    rank 0:   launch(N+1): msg(sched N+1, count of N) ─ bcast(sampled N) ─ forward(N+1) ─ collect(N) ─ sample(N+1)
    rank r:   recv msg ─ bcast(sampled N) into step N ─ forward(N+1), fed sampled N on the device ─ collect(N)

Pipeline parallelism keeps synchronous scheduling. Pure-decode steps replay
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

Synchronous scheduling and eager steps. n-gram and draft-model drafts ride the broadcast step to every stage; the
last stage computes the verification logits and the sampler verifies, and the other ranks append the emitted
tokens with the next launch, as under TP. An EAGLE head or Medusa heads run on rank 0 (as under TP, with whole
copies of the target's embedding and LM head), and so does an MTP layer (its own LM head, the first stage's
embedding), over the last stage's final hidden states, which the sampler sends after each step's output on the
link group ([num_tokens, H], as bytes; EAGLE-3's [num_tokens, 3H] states of layers on several stages reach the
last stage with the activations, pagedllm/distributed/pipeline.py). Quantized checkpoints
load stage by stage like any other, and each stage's LoRA manager loads the part of an adapter its layers hold
(the rest: ``LoRAManager.absent``).

Speculative decoding under TP (n-gram, draft-model and EAGLE proposers): the proposer runs in the engine core only
(a draft model or an EAGLE head whole, unsharded, on rank 0, the head with whole copies of the target's embedding
and LM head, reading rank 0's hidden states, which are whole after each all-reduce; a draft's KV cache keyed by the
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

import contextlib
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagedllm.config import EngineConfig
from pagedllm.distributed.parallel_state import destroy_distributed

logger = logging.getLogger(__name__)

TIMEOUT_S = 600.0  # a collective a peer never joins fails after this


def _sampler_rank(config: EngineConfig) -> int:
    """The global rank that samples: TP rank 0 of the last pipeline stage (rank 0 without pipeline parallelism)."""
    pc = config.parallel_config
    return (pc.pipeline_parallel_size - 1) * pc.tensor_parallel_size


def _join(
    config: EngineConfig, rank: int, init_method: str, device: torch.device
) -> tuple[Any, Any, Any, Any]:
    """Join the process group (``init_method``: ``file://`` or ``tcp://``) with this rank on ``device``; return
    (this rank's TPGroup, its PPGroup, the gloo control group over every rank, the gloo link group of ranks
    {0, sampler} or None without pipeline parallelism)."""
    from pagedllm.distributed.parallel_state import init_parallel_groups

    pc = config.parallel_config
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    tp, pp = init_parallel_groups(
        pc.tensor_parallel_size,
        pc.pipeline_parallel_size,
        rank,
        init_method,
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


def local_rank_device(config: EngineConfig, rank: int) -> torch.device:
    """Rank ``rank``'s device when every rank runs on this node ("mp"): ``cuda:rank`` on CUDA, else the
    configured device (CPU)."""
    device = config.device_config.device
    return torch.device("cuda", rank) if device.type == "cuda" else device


def _rank_config(config: EngineConfig, device: torch.device) -> EngineConfig:
    import dataclasses

    from pagedllm.config import DeviceConfig

    if device.type != "cuda":
        return config
    return dataclasses.replace(config, device_config=DeviceConfig(str(device)))


def _worker_main(
    config: EngineConfig, rank: int, init_method: str, device: str | None = None, started: Any = None
) -> None:
    """Worker rank ``rank`` (>= 1): join the ranks at ``init_method``, build this rank's ``ModelRunner`` on
    ``device`` (None: ``local_rank_device``), then run what rank 0 broadcasts until "stop"."""
    from pagedllm.worker.model_runner import ModelRunner
    from pagedllm.worker.worker import make_worker

    if started is not None:  # the "mp" launcher's Event: this process is up and about to join (wait_ready)
        started.set()
    dev = local_rank_device(config, rank) if device is None else torch.device(device)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.parallel_config.world_size))
    tp, pp, control, link = _join(config, rank, init_method, dev)
    runner = ModelRunner(_rank_config(config, dev), tp=tp, pp=pp)
    worker = make_worker(runner, rank)
    samples = link is not None and rank == _sampler_rank(config)  # this rank samples for rank 0
    last = None  # async scheduling: the last launched step, whose tokens rank 0 sends with the next message
    stopped = False
    try:
        while True:
            msg = [None]
            dist.broadcast_object_list(msg, src=0, group=control)
            method, args = msg[0]
            if method == "stop":
                stopped = True
                break
            if method == "launch":
                sched, sampled, lora_slots, num_sent = args
                _check_lora_slots(runner, rank, lora_slots)
                if num_sent:
                    _receive_sampled(runner, last, num_sent, tp)
                elif not samples:
                    runner.apply_sampled(sampled)
                step = runner.launch(sched)
                if samples:
                    _sample_for_rank0(runner, step, link, rank)
                elif _device_side_tokens(config):
                    runner.skip_sample(step)
                    if last is not None:
                        runner.collect(last)  # its tokens into the host batch (the step launched above runs on)
                    last = step
            elif method in ("add_lora", "remove_lora"):
                error = None
                try:
                    getattr(runner.lora_manager, method)(*args)
                except Exception as e:  # noqa: BLE001 - reported to rank 0, which raises it
                    error = f"{type(e).__name__}: {e}"
                dist.gather_object(error, None, dst=0, group=control)
            elif method == "collective_rpc":
                dist.gather_object(_rpc_outcome(worker, *args), None, dst=0, group=control)
            elif method == "batch_tokens":
                if args[1]:
                    _receive_sampled(runner, last, args[1], tp)
                    runner.collect(last)
                pending = None if samples else args[0]  # the sampler already holds its own tokens
                dist.gather_object(_batch_tokens(runner, pending), None, dst=0, group=control)
            elif method == "determine_num_blocks":
                n = torch.tensor([runner.determine_num_blocks(*args)])
                dist.all_reduce(n, op=dist.ReduceOp.MIN, group=control)
            else:
                getattr(runner, method)(*args)
    finally:
        if runner.device.type == "cuda" and stopped:
            # NCCL's teardown waits for every CUDA graph that holds its kernels.
            runner.graph_runner = runner.piecewise = None
            torch.cuda.synchronize(runner.device)
        if stopped:  # else rank 0 is gone or a call failed: no teardown with the others (this process ends now)
            destroy_distributed()


def _process_main(main: Any, *args: Any) -> None:
    """A "mp" worker process: ``main(*args)`` (``_worker_main``), then, once it stopped cleanly, exit at once. Its
    process group is gone and nothing is left to clean up, and tearing the interpreter down (torch's modules) would
    keep rank 0's ``shutdown`` waiting for a second or more."""
    main(*args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _rpc_outcome(worker: Any, method: Any, args: Any, kwargs: dict) -> tuple[bool, Any]:
    """``(True, result)`` of one ``collective_rpc`` call on this rank, or ``(False, (exception type name,
    message))`` when it raised (gathered to rank 0, which raises it)."""
    import pickle

    from pagedllm.worker.worker import run_rpc

    try:
        result = run_rpc(worker, method, args, kwargs)
        pickle.dumps(result)  # a result that cannot cross must not break the gather every rank is in
        return True, result
    except Exception as e:  # noqa: BLE001 - reported to rank 0
        return False, (type(e).__name__, str(e))


def _device_side_tokens(config: EngineConfig) -> bool:
    """Whether rank 0 sends each step's sampled tokens to the workers on the device, for a launch that feeds
    them there (async scheduling without speculative decoding); otherwise they ride the next launch message."""
    return config.scheduler_config.async_scheduling and config.speculative_config is None


def _count(tokens: torch.Tensor | None) -> int:
    return 0 if tokens is None else int(tokens.shape[0])


def _receive_sampled(runner: Any, step: Any, num_sampled: int, tp: Any) -> None:
    """Async scheduling under TP: receive the ``num_sampled`` tokens rank 0 sampled for ``step`` (this worker's
    last launch) by a device broadcast over the TP group, which the next launch feeds on the device."""
    if step is None or step.sample_rows is None or len(step.sample_rows) != num_sampled:
        raise RuntimeError(f"rank 0 sends {num_sampled} sampled tokens for a step this rank did not launch alike")
    tokens = torch.empty(num_sampled, dtype=torch.long, device=runner.device)
    dist.broadcast(tokens, src=0, group=tp.group)
    runner.receive_sampled(step, tokens)


def _sample_for_rank0(runner: Any, step: Any, link: Any, rank: int) -> None:
    """The sampler's half of ``MultiprocRunner.sample`` / ``collect``: wait for the step's grammar bitmask (or None)
    from rank 0, sample, send the step's ``ModelRunnerOutput`` back."""
    msg: list[Any] = [None]
    dist.broadcast_object_list(msg, src=0, group=link)
    runner.sample(step, msg[0])
    dist.broadcast_object_list([runner.collect(step)], src=rank, group=link)
    if runner.keep_hidden and step.query_start is not None:  # (None: a step of no tokens)
        # The proposer on rank 0 (an EAGLE head, Medusa heads, an MTP layer) reads the step's final hidden states.
        dist.broadcast(_as_bytes(step.draft_hidden), src=rank, group=link)


def _as_bytes(hidden: torch.Tensor) -> torch.Tensor:
    """``hidden`` [T, H] as a host tensor of its bytes [T, H * element size] (uint8: any dtype crosses gloo)."""
    return hidden.detach().contiguous().cpu().view(torch.uint8)


def _receive_hidden(link: Any, sampler: int, num_tokens: int, hidden_size: int, runner: Any) -> torch.Tensor:
    """Rank 0's half of the sampler's hidden-state send: the step's final hidden states ``[num_tokens,
    hidden_size]`` in the runner's dtype, on its device."""
    elem = torch.empty((), dtype=runner.dtype).element_size()
    buf = torch.empty(num_tokens, hidden_size * elem, dtype=torch.uint8)
    dist.broadcast(buf, src=sampler, group=link)
    return buf.view(runner.dtype).to(runner.device, non_blocking=True)


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


def start_workers(config: EngineConfig) -> Any:
    """Start ranks 1..W-1 with the configured backend; the launcher returned has ``workers``, ``init_method``
    (where every rank joins), ``rank0_device`` (this process's device) and ``stop()`` (after "stop" was broadcast:
    wait for the workers briefly, then end them)."""
    if config.parallel_config.distributed_executor_backend == "ray":
        from pagedllm.distributed.ray_executor import RayWorkers

        return RayWorkers(config)
    return ProcessWorkers(config)


class ProcessWorkers:
    """The "mp" backend: ranks 1..W-1 as spawned processes on this node, joining through a ``file://`` init
    method; rank r uses ``cuda:r`` (CPU: the configured device)."""

    def __init__(self, config: EngineConfig) -> None:
        pc = config.parallel_config
        size = pc.world_size
        if config.device_config.device.type == "cuda" and size > torch.cuda.device_count():
            raise ValueError(
                f"tensor_parallel_size={pc.tensor_parallel_size} x pipeline_parallel_size="
                f"{pc.pipeline_parallel_size} needs {size} GPUs; {torch.cuda.device_count()} visible "
                "(more GPUs than this node has: distributed_executor_backend='ray' on a Ray cluster)"
            )
        self._stopped = False
        self._dir = tempfile.mkdtemp(prefix="pagedllm-tp-")
        self.init_method = f"file://{os.path.join(self._dir, 'init')}"
        self.rank0_device = local_rank_device(config, 0)
        ctx = mp.get_context("spawn")
        self._started = [ctx.Event() for _ in range(1, size)]
        self.workers = [
            ctx.Process(
                target=_process_main,
                args=(_worker_main, config, r, self.init_method, None, started),
                daemon=True,
                name=f"pagedllm-tp{r}",
            )
            for r, started in zip(range(1, size), self._started)
        ]
        for w in self.workers:
            w.start()

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Wait until every worker process runs ``_worker_main``; ``RuntimeError`` at once when one exits first
        (it died importing or unpickling: rank 0 would otherwise wait out the rendezvous timeout)."""
        deadline = time.monotonic() + timeout_s
        for rank, (w, started) in enumerate(zip(self.workers, self._started), start=1):
            while not started.wait(0.05):
                if not w.is_alive():
                    raise RuntimeError(
                        f"tensor/pipeline-parallel worker rank {rank} exited with code {w.exitcode} while starting"
                    )
                if time.monotonic() > deadline:
                    raise RuntimeError(f"tensor/pipeline-parallel worker rank {rank} did not start in {timeout_s} s")

    def alive(self) -> bool:
        return not self._stopped and all(w.is_alive() for w in self.workers)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Wait up to ``timeout_s`` in all for the workers to exit (after "stop"), kill the ones still running,
        reap them and remove the rendezvous directory. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        deadline = time.monotonic() + timeout_s
        for w in self.workers:
            w.join(max(0.0, deadline - time.monotonic()))
            if w.exitcode is None:
                w.kill()
                w.join(5.0)
        for w in self.workers:
            if w.exitcode is not None:
                w.close()  # its sentinel and pipe
        shutil.rmtree(self._dir, ignore_errors=True)


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
        self._launcher = start_workers(config)
        self.workers = self._launcher.workers  # mp: Processes; ray: actor handles (ranks 1..W-1)
        device = self._launcher.rank0_device
        try:
            self._launcher.wait_ready()
            tp, pp, self._control, self._link = _join(config, 0, self._launcher.init_method, device)
            self.runner = ModelRunner(_rank_config(config, device), tp=tp, pp=pp)
        except BaseException:  # the workers wait on rank 0, which will never come: end them now
            self._launcher.stop(timeout_s=0)
            _leave_after_kill(device)
            raise
        self._sampled: dict[str, list[int]] = {}  # rank 0's last collected tokens, for the workers
        # Async scheduling (TP alone): the workers get each step's sampled tokens on the device instead, broadcast
        # over the TP group right after the next message; ``_to_send`` holds them until then. Not with speculative
        # decoding: the engine core collects each step before the next launch (its drafts need the tokens), so the
        # emitted tokens go with the launch message as in synchronous scheduling.
        self._tp = tp
        self._async = _device_side_tokens(config) and pp.size == 1
        self._to_send: torch.Tensor | None = None
        self._last_forwarded = -1  # the latest step whose collected tokens went into ``_sampled``
        self._stopped = False
        self._num_open = 0  # calls every rank joins that have not returned (see _collective)
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
        from pagedllm.worker.worker import make_worker

        self.worker = make_worker(self.runner, 0)  # rank 0's collective_rpc endpoint

    def __getattr__(self, name: str) -> Any:
        if name == "runner":
            raise AttributeError(name)
        return getattr(self.runner, name)

    def _broadcast(self, method: str, *args: Any) -> None:
        dist.broadcast_object_list([(method, args)], src=0, group=self._control)

    @contextlib.contextmanager
    def _collective(self) -> Iterator[None]:
        """Wrap rank 0's part of a call every rank joins. Left by an exception (Ctrl-C included), the call stays
        counted as open: the ranks may then wait in different collectives, and ``shutdown`` ends the workers
        instead of telling them to stop (which would wait out the collective timeout)."""
        self._num_open += 1
        yield
        self._num_open -= 1

    def call_workers(self, method: str, *args: Any) -> None:
        """Run a worker-side call that reports back (``add_lora`` / ``remove_lora`` on each worker's LoRA
        manager); ``ValueError`` naming the ranks where it raised."""
        errors: list[str | None] = [None] * self._size
        with self._collective():
            self._broadcast(method, *args)
            dist.gather_object(None, errors, dst=0, group=self._control)
        failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None]
        if failed:
            raise ValueError(f"{method} failed on tensor-parallel {'; '.join(failed)}")

    def collective_rpc(self, method: Any, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        """Run ``method`` on every rank's ``Worker`` (pagedllm/worker/worker.py); the results in rank order. A
        call that raised on some rank raises here once every rank is done: rank 0's own exception, else the
        first worker's, rebuilt as its builtin type (``ValueError``...) and naming its rank."""
        from pagedllm.worker.worker import encode_method, run_rpc

        kwargs = kwargs or {}
        payload = encode_method(method)
        outcomes: list[Any] = [None] * self._size
        with self._collective():
            self._broadcast("collective_rpc", payload, tuple(args), kwargs)
            local_error: BaseException | None = None
            result = None
            try:
                result = run_rpc(self.worker, method, args, kwargs)
            except Exception as e:  # noqa: BLE001 - raised once the workers' outcomes are in
                local_error = e
            dist.gather_object(None, outcomes, dst=0, group=self._control)
        if local_error is not None:
            raise local_error
        results = [result]
        for rank, (ok, value) in enumerate(outcomes[1:], start=1):
            if not ok:
                raise _rebuild_error(value[0], f"tensor/pipeline-parallel rank {rank}: {value[1]}")
            results.append(value)
        return results

    def check_batches(self) -> None:
        """``RuntimeError`` naming the rank and request when a rank's persistent batch differs from rank 0's
        (each request's known tokens, counting the sampled tokens a rank appends at the next launch). A
        consistency check for tests and debugging: after speculative steps, every rank must hold the emitted
        tokens (accepted drafts plus one) and none of the rejected drafts."""
        if self._uncollected is not None:
            self.collect(self._uncollected)
        to_send = self._take_to_send()
        states: list[Any] = [None] * self._size
        mine = _batch_tokens(self.runner, self._sampled if self._link is not None else None)
        with self._collective():
            self._broadcast("batch_tokens", self._sampled, _count(to_send))
            if to_send is not None:
                dist.broadcast(to_send, src=0, group=self._tp.group)
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
        with self._collective():
            self._broadcast("determine_num_blocks", extra_block_bytes)
            n = torch.tensor([self.runner.determine_num_blocks(extra_block_bytes)])
            dist.all_reduce(n, op=dist.ReduceOp.MIN, group=self._control)
        return int(n.item())

    def init_kv_cache(self, num_blocks: int) -> None:
        with self._collective():
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
        with self._collective():
            self._broadcast("maybe_capture_cuda_graphs")
            self.runner.maybe_capture_cuda_graphs()

    def launch(self, sched: Any) -> Any:
        if self._uncollected is not None:  # the engine always collects; never leave the sampler waiting
            self.collect(self._uncollected)
        lora = self.runner.lora_manager
        to_send = self._take_to_send()
        with self._collective():
            self._broadcast(
                "launch", sched, self._sampled, None if lora is None else lora.slot_table(), _count(to_send)
            )
            if to_send is not None:
                dist.broadcast(to_send, src=0, group=self._tp.group)
            if self._link is not None:  # the sampler is another rank: append its tokens here too
                self.runner.apply_sampled(self._sampled)
            self._sampled = {}
            step = self.runner.launch(sched)
        if self._link is not None:
            self._unsampled = self._uncollected = step
        return step

    def _take_to_send(self) -> torch.Tensor | None:
        to_send, self._to_send = self._to_send, None
        return to_send

    def sample(self, step: Any, grammar_bitmask: Any = None) -> None:
        """Sample ``step``; under pipeline parallelism the sampler does, once it has the bitmask sent here."""
        if self._link is None:
            self.runner.sample(step, grammar_bitmask)
            if self._async and step.sampled is not None and step.sampled.numel():
                self._to_send = step.sampled.contiguous()
        elif step is self._unsampled:
            with self._collective():
                dist.broadcast_object_list([grammar_bitmask], src=0, group=self._link)
            self._unsampled = None

    def collect(self, step: Any) -> Any:
        if self._link is None:
            out = self.runner.collect(step)
            if step.step_id <= self._last_forwarded:
                return out  # collected before: its tokens are already on their way to the workers
            self._last_forwarded = step.step_id
        elif step is self._uncollected:
            self.sample(step)  # no-op unless the engine skipped sample()
            msg: list[Any] = [None]
            with self._collective():
                dist.broadcast_object_list(msg, src=self._sampler, group=self._link)
                if self.runner.keep_hidden and step.query_start is not None:  # for the proposer here
                    # [T, H], or EAGLE-3's [T, A * H]
                    aux = getattr(getattr(self.runner.model, "model", None), "aux_hidden_state_layers", ())
                    hidden_size = self.runner.config.model_config.hf_config.hidden_size * max(1, len(aux))
                    num_tokens = int(step.query_start[-1])
                    step.draft_hidden = _receive_hidden(
                        self._link, self._sampler, num_tokens, hidden_size, self.runner
                    )
            out = step.output = msg[0]  # rank 0's own runner reads it from there (collect is idempotent)
            self._uncollected = None
        else:
            return self.runner.collect(step)  # collected before: the same output
        if not self._async:
            for req_id, tokens in out.sampled_token_ids.items():
                if tokens:
                    self._sampled[req_id] = list(tokens)
        return out

    def shutdown(self) -> None:
        """Stop the workers, leave torch.distributed (every group of this process) and release rank 0's runner
        (``ModelRunner.shutdown``). Idempotent.

        Normally rank 0 finishes a pipeline step still owed its exchange, broadcasts "stop" and tears the groups
        down together with the workers, which destroy theirs on "stop" (NCCL's teardown waits for every rank, so
        stopping the workers first would deadlock). When a worker died, or a call every rank joins was cut off
        (``_collective``), telling the workers could wait forever: they are killed and the groups aborted (gloo;
        see ``_leave_after_kill`` for NCCL)."""
        if self._stopped:
            return
        self._stopped = True
        runner = self.runner
        self.worker = None  # it holds the runner and the parameters
        orderly = self._num_open == 0 and self._launcher.alive()
        try:
            if orderly:
                try:
                    if self._uncollected is not None:  # the sampler waits for its bitmask
                        self.collect(self._uncollected)
                    self._broadcast("stop")
                except Exception:  # noqa: BLE001 - a worker died meanwhile: end them all below
                    orderly = False
            if orderly and runner.device.type == "cuda":
                runner.graph_runner = runner.piecewise = None  # see the worker's teardown
                torch.cuda.synchronize(runner.device)
            if orderly:
                destroy_distributed()
            else:
                logger.warning("killing the tensor/pipeline-parallel workers (a worker died or a call was cut off)")
                self._launcher.stop(timeout_s=0)
                _leave_after_kill(runner.device)
        finally:
            self._launcher.stop()
            runner.shutdown()


def _rebuild_error(type_name: str, message: str) -> Exception:
    """An exception of the builtin type a worker raised (ValueError, RuntimeError...), else RuntimeError."""
    import builtins

    exc_type = getattr(builtins, type_name, None)
    if isinstance(exc_type, type) and issubclass(exc_type, Exception):
        return exc_type(message)
    return RuntimeError(f"{type_name}: {message}")


def _leave_after_kill(device: torch.device) -> None:
    """Leave torch.distributed once the workers were killed. Gloo's groups are aborted. NCCL's are left as they
    are: aborting a communicator whose peer died inside a collective waits for that peer (seen on H200, torch
    2.11), so the process keeps them, and another tensor/pipeline-parallel engine needs a new process."""
    if device.type == "cuda":
        if dist.is_initialized():
            logger.warning(
                "a worker was lost: this process keeps its NCCL groups (tearing them down would wait for it); "
                "start another tensor/pipeline-parallel engine in a new process"
            )
        return
    destroy_distributed(abort=True)


TensorParallelRunner = MultiprocRunner  # the name before pipeline parallelism
