"""Tensor and pipeline parallelism over torch.distributed: the groups (``parallel_state``), their collectives and
point-to-point transfers (``communicator``) and a stage's share of a step (``pipeline``). The model receives its
``TPGroup`` and ``PPGroup`` at construction; nothing here is a module-level global."""

from pagedllm.distributed.communicator import all_gather, all_reduce
from pagedllm.distributed.parallel_state import (
    PPGroup,
    TPGroup,
    destroy_distributed,
    init_parallel_groups,
    init_tp_group,
    local_num_kv_heads,
    pp_layer_partition,
    verify_pp_config,
    verify_tp_config,
)

__all__ = [
    "PPGroup",
    "TPGroup",
    "all_gather",
    "all_reduce",
    "destroy_distributed",
    "init_parallel_groups",
    "init_tp_group",
    "local_num_kv_heads",
    "pp_layer_partition",
    "verify_pp_config",
    "verify_tp_config",
]
