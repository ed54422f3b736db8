"""The tensor-parallel (TP) group and pipeline stage (PP) of this process, as small objects handed to the model
at construction.

One process per rank. ``init_tp_group`` joins torch.distributed (gloo on CPU, nccl on CUDA) and returns a
``TPGroup``; ``TPGroup.single()`` (what layers use when given none) is the one-rank group, with no process
group at all, so a single-GPU or CPU engine never touches torch.distributed. There is no process-wide
default: whoever builds the model (``model_loader.get_model(..., tp=...)``) passes the group down.

A world of ``P * T`` ranks (``P = pipeline_parallel_size``, ``T = tensor_parallel_size``) is ordered as vLLM
orders it: global rank ``g = s * T + t`` is TP rank ``t`` of pipeline stage ``s``, so ranks ``[s * T, (s + 1) * T)``
form the TP group of stage ``s``. A rank sends its stage's activations to the rank with the same ``t`` in stage
``s + 1``::

    P = 2, T = 2:    stage 0: ranks 0 1   --send/recv-->   stage 1: ranks 2 3
                              (TP group)                            (TP group)

Stage ``s`` owns decoder layers ``[start_s, end_s)`` (``pp_layer_partition``); the first stage also the embedding,
the last one the final norm and the LM head (see pagedllm/distributed/pipeline.py).

What is split (``T = tp_size``, rank ``r``):

    attention heads     rank r: query heads [r * H / T, (r + 1) * H / T)
    KV heads (KV >= T)  rank r: KV heads [r * KV / T, (r + 1) * KV / T)
    KV heads (KV < T)   rank r: KV head r // (T / KV), replicated on T / KV ranks (T % KV == 0)
    MLP                 intermediate rows [r * I / T, (r + 1) * I / T)
    MoE experts         every expert's intermediate rows as the MLP's, or (expert parallel) experts
                        [r * E / T, (r + 1) * E / T) whole; the router replicated (pagedllm/layers/fused_moe.py)
    MLA (DeepSeek)      query heads and kv_b_proj's heads as attention heads; the latent cache replicated
    vocabulary          padded to a multiple of T; rank r: ids [r * V' / T, (r + 1) * V' / T)
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class PPGroup:
    """This process's pipeline stage (``rank`` of ``size``) and where its activations come from and go to.

    ``partition``: decoder layers per stage (``pp_layer_partition``); None: the even split of whatever
    ``num_hidden_layers`` the model has. ``tp_rank`` / ``tp_size`` place the process in the world
    (``global rank = rank * tp_size + tp_rank``); ``PPGroup(rank, size)`` without a process group can build a
    stage's part of a model (tests do) but not exchange activations."""

    rank: int  # pipeline stage, 0 <= rank < size
    size: int
    partition: tuple[int, ...] | None = None  # [size] decoder layers per stage
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"invalid pipeline-parallel rank {self.rank} of size {self.size}")
        if self.partition is not None and len(self.partition) != self.size:
            raise ValueError(
                f"a partition of {len(self.partition)} stages for pipeline_parallel_size {self.size}"
            )

    @classmethod
    def single(cls) -> PPGroup:
        return cls(rank=0, size=1)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    @property
    def prev_rank(self) -> int:
        """Global rank this stage receives activations from (not for the first stage)."""
        assert not self.is_first
        return (self.rank - 1) * self.tp_size + self.tp_rank

    @property
    def next_rank(self) -> int:
        """Global rank this stage sends activations to (not for the last stage)."""
        assert not self.is_last
        return (self.rank + 1) * self.tp_size + self.tp_rank

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        """``(start, end)``: this stage's decoder layers are ``[start, end)`` of ``num_layers``."""
        partition = (
            self.partition if self.partition is not None else pp_layer_partition(num_layers, self.size)
        )
        if sum(partition) != num_layers:
            raise ValueError(f"the pipeline partition {list(partition)} does not cover {num_layers} layers")
        start = sum(partition[: self.rank])
        return start, start + partition[self.rank]


PP_LAYER_PARTITION_ENV = "VLLM_PP_LAYER_PARTITION"  # vLLM's override: "4,6,6,4" layers per stage


def pp_layer_partition(num_layers: int, pp_size: int, override: str | None = None) -> tuple[int, ...]:
    """Decoder layers per pipeline stage, as vLLM splits them: ``num_layers // pp_size`` each, and the remainder one
    more each to the stages before the last, from the second-to-last backwards (the last stage also runs the LM
    head): 5 layers over 3 stages -> (2, 2, 1). ``override`` (``VLLM_PP_LAYER_PARTITION``, "2,3") fixes the split.

    ``ValueError`` naming ``pipeline_parallel_size`` when a stage would get no layer or the override does not add
    up."""
    if pp_size > num_layers:
        raise ValueError(
            f"pipeline_parallel_size ({pp_size}) must not exceed the model's num_hidden_layers ({num_layers}): "
            "every stage needs at least one layer"
        )
    if override is not None and override.strip():
        try:
            parts = tuple(int(x) for x in override.split(","))
        except ValueError:
            raise ValueError(
                f"{PP_LAYER_PARTITION_ENV}={override!r}: expected comma-separated layer counts such as '4,6,6,4'"
            ) from None
        if len(parts) != pp_size or sum(parts) != num_layers or min(parts) < 1:
            raise ValueError(
                f"{PP_LAYER_PARTITION_ENV}={override!r} must give {pp_size} positive layer counts "
                f"(pipeline_parallel_size) adding up to num_hidden_layers ({num_layers})"
            )
        return parts
    base, extra = divmod(num_layers, pp_size)
    parts = [base] * pp_size
    for stage in range(pp_size - 1 - extra, pp_size - 1):  # extra <= pp_size - 1 stages before the last
        parts[stage] += 1
    return tuple(parts)


# Architectures whose model body builds only its stage's layers (``LlamaModel.build_stage`` in
# pagedllm/models/llama.py: Llama's, Gemma's and the MoE families' bodies): every supported one.
PP_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
    "GemmaForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "GptOssForCausalLM",
)


def verify_pp_config(hf_config: Any, pp_size: int, partition: Sequence[int] | None = None) -> None:
    """Start-up check that the model can be split over ``pp_size`` pipeline stages; ``ValueError`` naming
    ``pipeline_parallel_size`` (an architecture without pipeline support, more stages than layers)."""
    if isinstance(pp_size, bool) or not isinstance(pp_size, int) or pp_size < 1:
        raise ValueError(f"pipeline_parallel_size must be a positive integer, got {pp_size!r}")
    if pp_size == 1:
        return
    archs = getattr(hf_config, "architectures", None) or []
    arch = archs[0] if archs else None
    if arch not in PP_ARCHITECTURES:
        raise ValueError(
            f"pipeline_parallel_size > 1 is not supported for {arch} yet (supported: {', '.join(PP_ARCHITECTURES)})"
        )
    num_layers = int(hf_config.num_hidden_layers)
    if partition is None:
        pp_layer_partition(num_layers, pp_size)
    elif len(partition) != pp_size or sum(partition) != num_layers or min(partition) < 1:
        raise ValueError(
            f"pipeline partition {list(partition)} must give {pp_size} stages (pipeline_parallel_size) at least one "
            f"layer each, adding up to num_hidden_layers ({num_layers})"
        )


def init_parallel_groups(
    tp_size: int,
    pp_size: int,
    rank: int,
    init_method: str,
    backend: str | None = None,
    timeout_s: float = 600.0,
    partition: tuple[int, ...] | None = None,
) -> tuple[TPGroup, PPGroup]:
    """Join a world of ``pp_size * tp_size`` ranks; return global ``rank``'s TP group and pipeline stage
    (collective: every rank of the world calls it). See ``init_tp_group`` for ``init_method`` and ``backend``."""
    tp = init_tp_group(tp_size, rank, init_method, backend, world_size=tp_size * pp_size, timeout_s=timeout_s)
    pp = PPGroup(
        rank=rank // tp_size, size=pp_size, partition=partition, tp_rank=rank % tp_size, tp_size=tp_size
    )
    return tp, pp


def destroy_distributed(abort: bool = False) -> None:
    """Leave torch.distributed: destroy every process group of this process, the default one included, so that
    ``dist.is_initialized()`` is False and a new world can be joined (no-op when none was joined).

    ``abort``: for peers that died or were left inside a collective: the groups are aborted (NCCL: the
    communicators without the collective teardown that would wait for those peers), falling back to destroying
    them when the backend cannot abort."""
    if not dist.is_initialized():
        return
    if abort:
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception:  # noqa: BLE001 - an older torch or a backend without abort: destroy instead
            logger.warning("aborting the process groups failed; destroying them", exc_info=True)
        else:
            return
    dist.destroy_process_group()


def shutdown_backend(backend: Any, what: str) -> None:
    """Release a process group built outside the default one (``ProcessGroupNCCL(store, ...)``): NCCL's
    communicator is shut down now rather than left to process exit, where its heartbeat would fail against a
    peer's closed store; gloo's frees on collection. A peer already gone is logged as ``what``'s, not raised."""
    shutdown = getattr(backend, "shutdown", None)
    if shutdown is not None:
        try:
            shutdown()
        except RuntimeError as e:
            logger.warning("%s shutdown: %s", what, e)


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
