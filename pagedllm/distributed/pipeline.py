"""Pipeline parallelism inside one rank: the placeholder for modules a stage does not own, the activations that
cross between stages, and one stage's part of a step.

A model split over stages keeps every module name of the whole model (checkpoint names still map one to one):
modules this stage does not own are ``PPMissingLayer`` (no parameters; the loader skips their checkpoint tensors).
Stage ``s`` of a Llama-family model owns::

    model.embed_tokens        stage 0 (and the last stage when the LM head is tied to it)
    model.layers[start:end]   its layer range (pagedllm.distributed.parallel_state.pp_layer_partition)
    model.norm, lm_head       the last stage

Between stages travel the residual stream's two halves, ``(hidden, residual)``, each ``[num_tokens, hidden_size]``
in the model dtype, followed (EAGLE-3) by the residual stream entering each of its layers the stages so far hold:
the receiver knows the shape from the step's token count and its first layer, so only the tensor crosses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedllm.distributed.communicator import recv_from_prev_stage, send_to_next_stage
from pagedllm.distributed.parallel_state import PPGroup


class PPMissingLayer(nn.Module):
    """A module another pipeline stage owns: no parameters, and calling it is a bug."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("PPMissingLayer called: this module belongs to another pipeline stage")


def is_missing(module: Any) -> bool:
    return isinstance(module, PPMissingLayer)


@dataclass
class IntermediateTensors:
    """What a stage hands the next one (the state between two decoder layers)."""

    hidden: torch.Tensor  # [num_tokens, hidden_size] the last layer's output
    residual: torch.Tensor  # [num_tokens, hidden_size] the residual stream before it is added
    # [A, num_tokens, hidden_size] the residual stream entering each EAGLE-3 layer of the stages so far (None: none)
    aux: torch.Tensor | None = None


def run_stage(
    model: nn.Module,
    pp: PPGroup,
    input_ids: torch.Tensor,  # [T]
    positions: torch.Tensor,  # [T]
    kv_caches: list[torch.Tensor],  # this stage's layers only
    attn_metadata: Any,
    hidden_size: int,
    dtype: torch.dtype,
    communicate: bool = True,
) -> torch.Tensor | None:
    """This stage's part of a forward pass: receive ``(hidden, residual)`` from the previous stage (unless first),
    run the stage's layers, send the result on (unless last). Returns the final hidden states ``[T, hidden_size]``
    on the last stage, None on the others. ``communicate=False`` (memory profiling): zeros stand in for the
    received activations and nothing is sent."""
    intermediate = None
    if not pp.is_first:
        num_tokens = input_ids.shape[0]
        num_aux = _num_aux_before(model)
        # [2 + A, T, hidden_size]: hidden, residual, the earlier stages' EAGLE-3 states
        buf = torch.empty(2 + num_aux, num_tokens, hidden_size, dtype=dtype, device=input_ids.device)
        if communicate:
            recv_from_prev_stage(buf, pp)
        else:
            buf.zero_()
        intermediate = IntermediateTensors(buf[0], buf[1], buf[2:] if num_aux else None)
    out = model(input_ids, positions, kv_caches, attn_metadata, intermediate=intermediate)
    if pp.is_last:
        return out
    if communicate:
        parts = (out.hidden[None], out.residual[None]) + (() if out.aux is None else (out.aux,))
        send_to_next_stage(torch.cat(parts), pp)  # [2 + A', T, hidden_size]
    return None


def _num_aux_before(model: nn.Module) -> int:
    """How many of the layers whose hidden states an EAGLE-3 draft reads come before this stage's first layer (the
    states the previous stage sends along)."""
    inner = getattr(model, "model", None)
    start = getattr(inner, "start_layer", 0)
    return sum(1 for i in getattr(inner, "aux_hidden_state_layers", ()) if i < start)
