"""Which decoder layers are built in host memory (construction time only).

Weight offload (``cpu_offload_gb``, pagedllm/worker/weight_offload.py) keeps some decoder layers' weights in host
memory. So that a model larger than the device can start, those layers are built there to begin with: the loader
names them (``layers_on_host``) around the model's construction, and the model body builds each of its decoder
layers under ``decoder_layer_device(index)`` (``LlamaModel.build_stage``, which every generating family uses).
Everything else is built on the loader's device as usual.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator

import torch

HOST = torch.device("cpu")

_HOST_LAYERS: frozenset[int] = frozenset()  # set by layers_on_host() while a model is being built


@contextlib.contextmanager
def layers_on_host(indices: Collection[int]) -> Iterator[None]:
    """Build the decoder layers ``indices`` (global layer indices) in host memory while this is active."""
    global _HOST_LAYERS
    old, _HOST_LAYERS = _HOST_LAYERS, frozenset(indices)
    try:
        yield
    finally:
        _HOST_LAYERS = old


def decoder_layer_device(index: int) -> contextlib.AbstractContextManager:
    """The context to build decoder layer ``index`` in: the host device when it is offloaded, else nothing (the
    caller's device stays current)."""
    return torch.device(HOST) if index in _HOST_LAYERS else contextlib.nullcontext()
