"""``Worker``: what ``LLM.collective_rpc`` reaches on each rank (vLLM's worker, as RL frameworks drive it).

Every rank of a tensor/pipeline-parallel engine (rank 0 in the engine core's process, the others in theirs) has
one, wrapping that rank's ``ModelRunner`` (``worker.model_runner``; ``worker.model`` is its model). A string
method names a public method of the worker (or of the ``worker_extension_cls`` mixed into it); a callable is
called as ``method(worker, *args, **kwargs)``. Results come back one per rank, in rank order.

Methods for rollout engines:

    update_weights(weights)        named full (HF checkpoint) tensors -> this rank's shards (worker/weight_update.py)
    check_weights(specs)           the refusal checks alone, on (name, dtype, shape)
    reload_weights()               the checkpoint on disk again (after sleep level 2)
    init_weight_update_group(master_address, master_port, rank_offset, world_size)
    update_weight(name, dtype, shape)   receive one tensor broadcast by the trainer (rank 0 of that group)
    destroy_weight_update_group()
    sleep(level) / wake_up(tags)   worker/sleep_mode.py (the engine core calls them; use ``LLM.sleep``)

The engine core's prefix cache is not reset by worker calls: after writing weights this way, call
``LLM.reset_prefix_cache()`` (``LLM.update_weights`` does it itself). Each rank checks only what it holds before
writing: under pipeline parallelism a name only another stage can refuse may leave the stages that accepted it
written; ``LLM.update_weights`` checks on every rank first. ``init_weight_update_group`` and ``update_weight``
block until the trainer joins or broadcasts, so the trainer runs in another process (or thread).
"""

from __future__ import annotations

import importlib
import pickle
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from pagedllm.worker.sleep_mode import SleepState
from pagedllm.worker.weight_update import WeightSpec, WeightUpdater, attach_load_weights, parse_dtype


class Worker:
    """One rank's endpoint for ``collective_rpc`` (see the module docstring)."""

    def __init__(self, model_runner: Any, rank: int) -> None:
        self.model_runner = model_runner
        self.rank = rank
        self.device: torch.device = model_runner.device
        self.sleep_state = SleepState(model_runner)
        self.weight_update_group: Any = None
        self._updater: WeightUpdater | None = None
        quantized = model_runner.config.model_config.quant_config is not None
        attach_load_weights(self.model, quantized)  # vLLM's model.load_weights, for worker extensions

    @property
    def model(self) -> torch.nn.Module:
        return self.model_runner.model

    @property
    def updater(self) -> WeightUpdater:
        if self._updater is None:
            mc = self.model_runner.config.model_config
            self._updater = WeightUpdater(self.model, quantized=mc.quant_config is not None)
        return self._updater

    def _check_weights_awake(self) -> None:
        if "weights" in self.sleep_state.asleep:
            raise RuntimeError("the weights are asleep: wake_up(tags=['weights']) before writing them")

    # ------------------------------------------------------------------ weights from named tensors

    def check_weights(self, specs: Iterable[WeightSpec]) -> None:
        """``ValueError`` naming the first tensor this rank's model cannot take; changes nothing."""
        self.updater.check(specs)

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Check every ``(checkpoint name, full tensor)`` pair, then write them all; returns how many this rank
        holds. A refused update (``ValueError``) writes nothing."""
        self._check_weights_awake()
        return len(self.updater.update(weights))

    def apply_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Write pairs ``check_weights`` accepted (on every rank, before any writes: ``LLM.update_weights``)."""
        self._check_weights_awake()
        return len(self.updater.apply(weights))

    def reload_weights(self) -> int:
        """Write the whole checkpoint the engine was started from again (vLLM's ``reload_weights``)."""
        from pagedllm.model_loader import iter_safetensors

        self._check_weights_awake()
        path = self.model_runner.config.model_config.model_path
        return len(self.updater.update(iter_safetensors(path)))

    # ------------------------------------------------------------------ weights broadcast by a trainer

    def init_weight_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int
    ) -> None:
        """Join the trainer's weight-update group as rank ``rank_offset + self.rank`` of ``world_size``
        (pagedllm/distributed/weight_sync.py); blocks until every rank, the trainer's included, has joined."""
        from pagedllm.distributed.weight_sync import stateless_process_group

        if self.weight_update_group is not None:
            raise RuntimeError("this worker already belongs to a weight-update group")
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.weight_update_group = stateless_process_group(
            master_address, master_port, rank_offset + self.rank, world_size, backend
        )

    def update_weight(self, name: str, dtype: torch.dtype | str, shape: Sequence[int]) -> None:
        """Receive checkpoint tensor ``name`` (``dtype``, full ``shape``) broadcast by the trainer (rank 0) and
        write this rank's shard. A refused tensor (``ValueError``) is still received, so the trainer's broadcast
        completes, then dropped."""
        group = self.weight_update_group
        if group is None:
            raise RuntimeError("no weight-update group: call init_weight_update_group first")
        dtype = parse_dtype(dtype)
        device = self.device if group.backend_name == "nccl" else torch.device("cpu")
        buffer = torch.empty(tuple(shape), dtype=dtype, device=device)
        refusal: Exception | None = None
        try:
            self._check_weights_awake()
            self.updater.check([(name, dtype, tuple(shape))])
        except (ValueError, RuntimeError) as e:
            refusal = e
        group.broadcast(buffer, src=0)
        if refusal is not None:
            raise refusal
        self.updater.apply([(name, buffer)])

    def destroy_weight_update_group(self) -> None:
        """Leave the trainer's group and release its communicator (the trainer destroys its side too)."""
        group, self.weight_update_group = self.weight_update_group, None
        if group is not None:
            group.destroy()

    # ------------------------------------------------------------------ sleep mode

    def sleep(self, level: int = 1) -> None:
        self.sleep_state.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.sleep_state.wake_up(tags)

    def sleeping_tags(self) -> list[str]:
        return sorted(self.sleep_state.asleep)


def make_worker(model_runner: Any, rank: int) -> Worker:
    """The rank's ``Worker``, with the config's ``worker_extension_cls`` (``"module.Class"``) mixed in."""
    path = getattr(model_runner.config, "worker_extension_cls", None)
    if not path:
        return Worker(model_runner, rank)
    cls = type("ExtendedWorker", (Worker, load_extension_class(path)), {})
    return cls(model_runner, rank)


def load_extension_class(path: str) -> type:
    """The class named by ``"package.module.Class"``; ``ValueError`` naming ``worker_extension_cls``."""
    module_name, _, attr = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"worker_extension_cls: cannot import {path!r}: {e}") from None
    if not isinstance(cls, type):
        raise ValueError(f"worker_extension_cls: {path!r} is not a class")
    return cls


def encode_method(method: str | bytes | Callable[..., Any]) -> str | bytes:
    """What crosses to the other ranks: a method name as is, a callable pickled (by value with cloudpickle when
    installed, so lambdas and closures work; else by reference); bytes are a callable pickled already."""
    if isinstance(method, (str, bytes)):
        return method
    if not callable(method):
        raise ValueError(f"method: expected a method name or a callable, got {type(method).__name__}")
    try:
        import cloudpickle

        return cloudpickle.dumps(method)
    except ImportError:
        return pickle.dumps(method)


def run_rpc(
    worker: Worker, method: str | bytes | Callable[..., Any], args: Sequence[Any], kwargs: dict
) -> Any:
    """Run one ``collective_rpc`` call on ``worker``: a public method by name, or ``method(worker, ...)``."""
    if isinstance(method, bytes):
        method = pickle.loads(method)
    if isinstance(method, str):
        fn = None if method.startswith("_") else getattr(worker, method, None)
        if not callable(fn):
            raise ValueError(f"method: the worker has no method {method!r}")
        return fn(*args, **kwargs)
    return method(worker, *args, **kwargs)
