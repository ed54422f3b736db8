"""Tensor parallelism over torch.distributed: the TP group (``parallel_state``) and its collectives
(``communicator``). Layers receive a ``TPGroup`` at construction; nothing here is a module-level global."""

from pagedllm.distributed.communicator import all_gather, all_reduce
from pagedllm.distributed.parallel_state import (
    TPGroup,
    destroy_distributed,
    init_tp_group,
    local_num_kv_heads,
    verify_tp_config,
)

__all__ = [
    "TPGroup",
    "all_gather",
    "all_reduce",
    "destroy_distributed",
    "init_tp_group",
    "local_num_kv_heads",
    "verify_tp_config",
]
