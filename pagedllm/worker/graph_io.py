"""What the CUDA graph runners share about their outputs: a forward's output is a tensor of hidden states, or a
tuple of them (the final hidden states and, for an EAGLE-3 draft, the target's auxiliary hidden states,
``[T, 3 * hidden_size]``); a graph's outputs live in static buffers of the padded row count, and a step reads the
first rows of each. Also a graph stand-in that replays by running the captured function again, which lets the
runners' staging and slicing be exercised where there is no GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Output = torch.Tensor | tuple[torch.Tensor, ...]


def slice_rows(output: Any, num_rows: int) -> Any:
    """The first ``num_rows`` rows of ``output`` (a tensor or a tuple of tensors, each ``[rows, ...]``); None
    stays None. Views: valid until the graph that wrote them replays again."""
    if output is None:
        return None
    if isinstance(output, tuple):
        return tuple(t[:num_rows] for t in output)
    return output[:num_rows]


def map_output(fn: Callable[[torch.Tensor], torch.Tensor], output: Any) -> Any:
    """``fn`` applied to ``output``'s tensor, or to each tensor of a tuple."""
    if isinstance(output, tuple):
        return tuple(fn(t) for t in output)
    return fn(output)


def copy_output(dst: Any, src: Any) -> None:
    """Copy ``src`` into ``dst``, tensor by tensor (the same structure and shapes)."""
    if isinstance(dst, tuple):
        assert isinstance(src, tuple) and len(src) == len(dst)
        for d, s in zip(dst, src):
            d.copy_(s)
    elif dst is not None:
        dst.copy_(src)


def unowned_view(t: torch.Tensor) -> torch.Tensor:
    """A view of ``t``'s memory that does not keep it allocated (a graph pool may hand it out again)."""
    storage = t.untyped_storage()
    unowned = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), t.device, storage.nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        unowned, t.storage_offset(), t.size(), t.stride()
    )


def final_hidden(output: Any) -> Any:
    """The final hidden states of a forward's ``output`` (its first tensor when it is a tuple)."""
    return output[0] if isinstance(output, tuple) else output


class EagerGraph:
    """Stands in for a captured CUDA graph where there is none (CPU tests): ``output`` is what ``fn()`` returned
    at capture, and ``replay`` runs ``fn`` again and copies its result into ``output``, as a graph's replay
    rewrites its static output buffers from its static inputs."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.output = fn()

    def replay(self) -> None:
        copy_output(self.output, self.fn())
