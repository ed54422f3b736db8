"""A trainer process for tests/distributed/test_weight_sync.py (spawned processes import it by name): rank 0 of
the weight-update group, broadcasting a checkpoint's tensors to an engine's workers."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from pagedllm.distributed.weight_sync import stateless_process_group

# Broadcast first, and refused by the engine (a shape q_proj never has): the refusal must not stall the group.
BAD_TENSOR = ("model.layers.0.self_attn.q_proj.weight", (3, 3))


def checkpoint_tensors(path: str) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors in the order both sides go through them."""
    state: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        state.update(load_file(f))
    return sorted(state.items())


def trainer_broadcast(master_port: int, world_size: int, checkpoint: str, device: str = "cpu") -> None:
    """Host the group's store, then broadcast the bad tensor and every tensor of ``checkpoint`` (gloo from the
    host; NCCL from ``device`` when it is a GPU)."""
    if device != "cpu":
        torch.cuda.set_device(device)
    backend = "gloo" if device == "cpu" else "nccl"
    group = stateless_process_group("127.0.0.1", master_port, 0, world_size, backend=backend, timeout_s=120)
    group.broadcast(torch.zeros(BAD_TENSOR[1], device=device), src=0)
    for _, tensor in checkpoint_tensors(checkpoint):
        group.broadcast(tensor.to(device).contiguous(), src=0)
    if device != "cpu":
        torch.cuda.synchronize()
    group.destroy()


class RankProbe:
    """A ``worker_extension_cls``: its methods join the Worker's."""

    def probe(self, offset: int = 0) -> tuple[int, int]:
        """(this rank, its TP shard of q/k/v rows + offset)."""
        qkv = dict(self.model.named_parameters())["model.layers.0.self_attn.qkv_proj.weight"]
        return self.rank, qkv.shape[0] + offset

    def load_named(self, name: str, tensor: torch.Tensor) -> list[str]:
        """What RL frameworks' extensions do: ``self.model_runner.model.load_weights(weights=[(name, tensor)])``."""
        return sorted(self.model_runner.model.load_weights(weights=[(name, tensor)]))
