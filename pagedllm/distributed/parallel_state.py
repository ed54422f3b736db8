"""The tensor-parallel (TP) group of this process, as a small object handed to layers at construction.

One process per rank. ``init_tp_group`` joins torch.distributed (gloo on CPU, nccl on CUDA) and returns a
``TPGroup``; ``TPGroup.single()`` (what layers use when given none) is the one-rank group, with no process
group at all, so a single-GPU or CPU engine never touches torch.distributed. There is no process-wide
default: whoever builds the model (``model_loader.get_model(..., tp=...)``) passes the group down.

Ranks ``[k * tp_size, (k + 1) * tp_size)`` of the world form TP group ``k`` (the world is one TP group until
pipeline or data parallelism arrive).

What is split (``T = tp_size``, rank ``r``):

    attention heads     rank r: query heads [r * H / T, (r + 1) * H / T)
    KV heads (KV >= T)  rank r: KV heads [r * KV / T, (r + 1) * KV / T)
    KV heads (KV < T)   rank r: KV head r // (T / KV), replicated on T / KV ranks (T % KV == 0)
    MLP                 intermediate rows [r * I / T, (r + 1) * I / T)
    vocabulary          padded to a multiple of T; rank r: ids [r * V' / T, (r + 1) * V' / T)
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """This process's place in its tensor-parallel group.

    ``group`` is None for one rank; a ``size > 1`` group without one can build and load a rank's part of a
    model (tests do) but not run it (the collectives need the process group)."""

    rank: int  # rank within the TP group, 0 <= rank < size
    size: int
    group: Any = None  # torch.distributed ProcessGroup

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"invalid tensor-parallel rank {self.rank} of size {self.size}")

    @classmethod
    def single(cls) -> TPGroup:
        return cls(rank=0, size=1)

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0


def init_tp_group(
    tp_size: int,
    rank: int,
    init_method: str,
    backend: str | None = None,
    world_size: int | None = None,
    timeout_s: float = 600.0,
) -> TPGroup:
    """Join the default process group (``world_size`` ranks, ``tp_size`` by default) and return this rank's
    TP group. Every rank of the world must call it (creating groups is collective).

    ``init_method``: ``"tcp://host:port"`` or ``"file:///path"``; ``backend``: ``"nccl"`` when CUDA is
    available, else ``"gloo"`` (nccl ranks must have called ``torch.cuda.set_device`` already).
    """
    world_size = tp_size if world_size is None else world_size
    if tp_size < 1 or world_size % tp_size:
        raise ValueError(
            f"tensor_parallel_size ({tp_size}) must be >= 1 and divide the world size ({world_size})"
        )
    if world_size == 1:
        return TPGroup.single()
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(
            backend,
            init_method=init_method,
            world_size=world_size,
            rank=rank,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    if tp_size == 1:
        return TPGroup.single()
    if tp_size == world_size:
        return TPGroup(rank=rank, size=tp_size, group=dist.group.WORLD)
    mine = None
    for start in range(0, world_size, tp_size):
        group = dist.new_group(
            list(range(start, start + tp_size))
        )  # collective: every rank makes every group
        if start <= rank < start + tp_size:
            mine = TPGroup(rank=rank - start, size=tp_size, group=group)
    assert mine is not None
    return mine


def destroy_distributed() -> None:
    """Leave torch.distributed (no-op when it was never joined)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def divide(numerator: int, tp_size: int, field: str) -> int:
    """``numerator / tp_size``, or a ``ValueError`` naming the config ``field`` that does not split evenly."""
    if numerator % tp_size:
        raise ValueError(f"{field} ({numerator}) must be divisible by tensor_parallel_size ({tp_size})")
    return numerator // tp_size


def local_num_kv_heads(num_kv_heads: int, tp_size: int) -> int:
    """KV heads held per rank (and so the KV cache's head count per rank): ``KV / T``, or 1 (replicated)
    when there are fewer KV heads than ranks."""
    return max(1, num_kv_heads // tp_size)


def verify_tp_config(hf_config: Any, tp_size: int) -> None:
    """Start-up check that a decoder config splits over ``tp_size`` ranks; ``ValueError`` naming the field.

    ``num_attention_heads`` must be divisible by T; ``num_key_value_heads`` too when it is >= T, else T must
    be a multiple of it (each KV head is then replicated on T / KV ranks); ``intermediate_size`` must be
    divisible by T. The vocabulary is padded, so any size works.
    """
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp_size!r}")
    if tp_size == 1:
        return
    num_heads = int(hf_config.num_attention_heads)
    divide(num_heads, tp_size, "num_attention_heads")
    num_kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or num_heads)
    if num_kv_heads >= tp_size:
        divide(num_kv_heads, tp_size, "num_key_value_heads")
    elif tp_size % num_kv_heads:
        raise ValueError(
            f"num_key_value_heads ({num_kv_heads}) is smaller than tensor_parallel_size ({tp_size}) and does not "
            "divide it, so its heads cannot be replicated evenly over the ranks"
        )
    inter = getattr(hf_config, "intermediate_size", None)
    if inter is not None:
        divide(int(inter), tp_size, "intermediate_size")
