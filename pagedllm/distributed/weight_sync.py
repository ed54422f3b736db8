"""A process group between a trainer and an engine's workers, apart from the engine's own groups, for sending
new weights by broadcast (vLLM's RLHF example: ``init_weight_update_group`` / ``update_weight``).

    ranks:  0 = the trainer (it hosts the TCP store at master_address:master_port and broadcasts)
            rank_offset + r = engine worker r (r = 0 .. tensor_parallel_size * pipeline_parallel_size - 1)

The group is built directly on a ``TCPStore`` (gloo on CPU, NCCL on CUDA) without ``init_process_group``: an
engine worker already belongs to the engine's default group, and a trainer may belong to its own training group.
Both sides call :func:`stateless_process_group`; then each update is ``broadcast(tensor, src=0)`` on every rank, in
the same order.
"""

from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist

from pagedllm.distributed.parallel_state import shutdown_backend

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0


class WeightSyncGroup:
    """A standalone gloo or NCCL group (see the module docstring) with the one collective weight updates use."""

    def __init__(
        self, store: dist.Store, backend: dist.ProcessGroup, rank: int, world_size: int, backend_name: str
    ) -> None:
        self.store = store  # kept alive as long as the group
        self.backend = backend
        self.backend_name = backend_name  # "gloo": CPU tensors; "nccl": CUDA tensors
        self.rank = rank
        self.world_size = world_size

    def destroy(self) -> None:
        """Release the communicator (NCCL's is shut down rather than left to process exit) and the store."""
        backend, self.backend, self.store = self.backend, None, None
        shutdown_backend(backend, "weight-update group")

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Broadcast ``tensor`` in place from rank ``src`` (blocking until this rank's part is done)."""
        self.backend.broadcast(tensor, src).wait()


def stateless_process_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    backend: str = "gloo",
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> WeightSyncGroup:
    """Join the group of ``world_size`` ranks whose store rank 0 hosts at ``master_address:master_port``;
    blocks until every rank has joined. ``backend``: "gloo" (CPU tensors) or "nccl" (CUDA tensors on the
    current device)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: {rank} is not in [0, {world_size})")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend: {backend!r} is not 'gloo' or 'nccl'")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, int(master_port), world_size, is_master=rank == 0, timeout=timeout)
    prefixed = dist.PrefixStore("pagedllm-weight-sync", store)
    if backend == "nccl":
        pg = dist.ProcessGroupNCCL(prefixed, rank, world_size)
    else:
        pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    return WeightSyncGroup(store, pg, rank, world_size, backend)
