"""Updating a loaded model's weights in place from tensors named as in its HF checkpoint (the rollout engine of an
RL loop takes the trainer's new weights this way, without a restart).

A name maps to a parameter, or to one shard of a fused one, exactly as at load time (``model_loader``: the model's
``packed_modules_mapping``, tied aliases), and each parameter's own loader copies this rank's slice of the full
checkpoint-shaped tensor, so a tensor-parallel rank takes the same ``(name, full tensor)`` pairs as any other.

An update is checked whole before anything is written: every name must be one the checkpoint could hold, every
dtype floating point (values are cast to the model's dtype, as at load time) and every shape what that name has
in the checkpoint. The shape check runs the parameter's own loader on meta-device stand-ins, so it is the very
check the real copy would make, without touching memory. A refused update raises ``ValueError`` naming the
tensor and leaves the model as it was.

After a write, the layers that own the written parameters redo their post-load step (on CPU: oneDNN's packed copy
of the weight, ``layers/cpu_gemm.py``). Quantized models are refused: their post-load step rewrites the loaded
tensors and cannot run twice.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from pagedllm.distributed.pipeline import PPMissingLayer
from pagedllm.layers.embedding import LMHead
from pagedllm.layers.linear import Linear
from pagedllm.model_loader import _IGNORED_SUFFIXES, _map_name, _owned_by, _param_aliases, load_tensor

WeightSpec = tuple[str, torch.dtype, Sequence[int]]  # (checkpoint name, dtype, full checkpoint shape)


_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp64": "float64"}


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """``torch.bfloat16`` from itself, ``"bfloat16"``, ``"torch.bfloat16"`` or ``"bf16"``; ``ValueError`` naming
    ``dtype``."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).removeprefix("torch.")
    found = getattr(torch, _DTYPE_ALIASES.get(name, name), None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"dtype: {dtype!r} is not a torch dtype")
    return found


class WeightUpdater:
    """Checks and applies named-tensor updates to one rank's ``model`` (see the module docstring)."""

    def __init__(self, model: nn.Module, quantized: bool = False) -> None:
        # Holds the parameters and the modules below ``model``, not ``model`` itself: kept in the model's own
        # ``load_weights`` (attach_load_weights), a reference back would make a cycle.
        self.quantized = quantized
        self.params, self.aliases = _param_aliases(model)
        self.packed = getattr(model, "packed_modules_mapping", {})
        # Modules another pipeline stage (or expert-parallel rank) holds: their tensors are skipped here.
        self.absent = {name for name, m in model.named_modules() if isinstance(m, PPMissingLayer)}
        modules = dict(model.named_modules())
        self.owners: dict[str, list[nn.Module]] = {}  # canonical name -> modules holding it (tied: several)
        for name, _ in model.named_parameters(remove_duplicate=False):
            owner_name = name.rpartition(".")[0]
            owners = self.owners.setdefault(self.aliases[name], [])
            if owner_name:  # (a parameter of the root itself has no post-load step)
                owners.append(modules[owner_name])

    def _resolve(self, ckpt_name: str) -> tuple[str, int | None] | None:
        """(canonical parameter, shard or None) for checkpoint name ``ckpt_name``; None when this rank does not
        hold it (another stage's module) or the loader ignores it; ``ValueError`` naming it when no parameter
        takes it."""
        if ckpt_name.endswith(_IGNORED_SUFFIXES) or (self.absent and _owned_by(ckpt_name, self.absent)):
            return None
        name, shard_id = _map_name(ckpt_name, self.packed)
        canonical = self.aliases.get(name)
        if canonical is None:
            raise ValueError(f"{ckpt_name!r}: no parameter of the model takes this checkpoint name")
        return canonical, shard_id

    def check(self, specs: Iterable[WeightSpec]) -> None:
        """Refuse (``ValueError`` naming the tensor) an update the model cannot take; writes nothing."""
        if self.quantized:
            raise ValueError("quantization: weight updates of quantized models are not supported")
        for ckpt_name, dtype, shape in specs:
            dtype = parse_dtype(dtype)
            if not dtype.is_floating_point:
                raise ValueError(f"{ckpt_name!r}: dtype {dtype} is not a floating-point type")
            target = self._resolve(ckpt_name)
            if target is None:
                continue
            canonical, shard_id = target
            param = self.params[canonical]
            stand_in = torch.empty_like(param, device="meta")
            try:
                load_tensor(param, stand_in, torch.empty(tuple(shape), dtype=dtype, device="meta"), shard_id)
            except (ValueError, RuntimeError) as e:
                raise ValueError(f"{ckpt_name!r} (parameter {canonical!r}): {e}") from None

    @torch.no_grad()
    def apply(self, weights: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Write checked tensors into the model, then redo the post-load step of the layers written; returns the
        parameter each tensor this rank took went to (one entry per tensor)."""
        touched: dict[int, nn.Module] = {}
        written: list[str] = []
        for ckpt_name, tensor in weights:
            target = self._resolve(ckpt_name)
            if target is None:
                continue
            canonical, shard_id = target
            param = self.params[canonical]
            load_tensor(param, param, tensor, shard_id)
            written.append(canonical)
            for owner in self.owners[canonical]:
                touched[id(owner)] = owner
        for module in touched.values():
            redo_post_load(module)
        return written

    def update(self, weights: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """``check`` every tensor, then ``apply`` them all: a refused update changes nothing. Returns ``apply``'s
        list."""
        weights = check_pairs(weights)
        self.check((name, t.dtype, tuple(t.shape)) for name, t in weights)
        return self.apply(weights)


def attach_load_weights(model: nn.Module, quantized: bool = False) -> None:
    """Give ``model`` vLLM's ``model.load_weights(weights) -> set[str]`` (what RL frameworks' worker extensions
    call as ``self.model_runner.model.load_weights(weights=[(name, tensor)])``): a checked in-place update
    (``WeightUpdater.update``) returning the parameter names written. The model is held weakly (no cycle)."""
    if "load_weights" in vars(model):
        return
    model_ref = weakref.ref(model)
    updaters: list[WeightUpdater] = []  # made at the first call, then reused (extensions call it per tensor)

    def load_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        if not updaters:
            target = model_ref()
            if target is None:
                raise RuntimeError("the model was released")
            updaters.append(WeightUpdater(target, quantized))
        return set(updaters[0].update(weights))

    model.load_weights = load_weights


def check_pairs(weights: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """``weights`` as a list of ``(name, tensor)`` pairs; ``ValueError`` naming ``weights`` for anything else."""
    if isinstance(weights, dict):
        weights = weights.items()
    pairs = []
    for item in weights:
        if not (
            isinstance(item, (tuple, list))
            and len(item) == 2
            and isinstance(item[0], str)
            and isinstance(item[1], torch.Tensor)
        ):
            raise ValueError(f"weights: expected (name, tensor) pairs, got {type(item).__name__}")
        pairs.append((item[0], item[1]))
    return pairs


def redo_post_load(module: nn.Module) -> None:
    """The post-load step of one layer whose weight was written (CPU: its oneDNN-packed copy made again)."""
    if isinstance(module, Linear):
        module.quant_method.process_weights_after_loading(module)
    elif isinstance(module, LMHead):
        module.process_weights_after_loading()
