"""Collectives over a ``TPGroup``, and the point-to-point transfers between pipeline stages (``PPGroup``). With one
rank (one stage) the collectives return their input untouched (no torch.distributed)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from pagedllm.distributed.parallel_state import PPGroup, TPGroup


def all_reduce(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Sum ``x`` over the ranks of ``tp``; every rank gets the sum. May reduce in place (``x`` is then the
    result): pass a tensor nobody else reads."""
    if tp.size == 1:
        return x
    if not x.is_contiguous():
        x = x.contiguous()
    dist.all_reduce(x, group=tp.group)
    return x


def all_gather(x: torch.Tensor, tp: TPGroup, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` (same shape on all ranks) along ``dim``, in rank order; every rank gets
    the result: ``[..., n, ...]`` -> ``[..., tp.size * n, ...]``."""
    if tp.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(parts, x, group=tp.group)
    return torch.cat(parts, dim=dim)


def send_to_next_stage(x: torch.Tensor, pp: PPGroup) -> None:
    """Send ``x`` to the same TP rank of the next pipeline stage, which must ``recv_from_prev_stage`` a tensor of
    the same shape, dtype and device type (over the default process group: nccl on GPUs, gloo on CPU)."""
    dist.send(x.contiguous(), dst=pp.next_rank)


def recv_from_prev_stage(buf: torch.Tensor, pp: PPGroup) -> torch.Tensor:
    """Fill ``buf`` (contiguous, the sender's shape and dtype) with what the previous stage sent; returns it."""
    dist.recv(buf, src=pp.prev_rank)
    return buf
