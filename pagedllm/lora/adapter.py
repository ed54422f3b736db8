"""Load a PEFT LoRA adapter directory into per-layer A/B tensors named after pagedllm's modules.

PEFT saves ``base_model.model.<hf module>.lora_A.weight: [r, in]`` and ``.lora_B.weight: [out, r]``; the
adapter's output is ``scaling * B @ A @ x`` with ``scaling = alpha / r`` (``alpha / sqrt(r)`` with rsLoRA;
``r`` and ``alpha`` per module through ``rank_pattern`` / ``alpha_pattern``). pagedllm fuses q/k/v into
``qkv_proj`` and gate/up into ``gate_up_proj`` (the model's ``packed_modules_mapping``), so ``...self_attn.k_proj``
becomes slice 1 of ``...self_attn.qkv_proj``. An adapter trained on an already fused module (Phi-3's
``qkv_proj``) has one A for all slices: each slice gets that A and its rows of B.

Everything that would change the forward beyond ``x @ A.T @ B.T * scaling`` on those layers is refused at
load time with a ``ValueError`` naming it.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")

# PEFT LoraConfig fields that change the forward in ways pagedllm does not implement: field -> what it is.
_UNSUPPORTED_FIELDS = {
    "use_dora": "DoRA (use_dora)",
    "lora_bias": "LoRA bias on B (lora_bias)",
    "modules_to_save": "fully trained extra modules (modules_to_save)",
    "trainable_token_indices": "trainable token embeddings (trainable_token_indices)",
    "target_parameters": "LoRA on raw parameters (target_parameters)",
    "layer_replication": "layer replication (layer_replication)",
    "fan_in_fan_out": "Conv1D-style weights (fan_in_fan_out)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QA-LoRA (use_qalora)",
    "arrow_config": "Arrow routing (arrow_config)",
}


@dataclass(frozen=True)
class LayerShape:
    """What the loader needs to know of a LoRA-capable layer: its input size and output slices."""

    input_size: int
    output_sizes: tuple[int, ...]  # one per fused shard (q, k, v / gate, up), else one


@dataclass
class LoRAModel:
    """One adapter on the host: for each pagedllm layer it touches, per output slice ``(A [r, in],
    scaling * B [out_s, r])`` or None (slice not adapted). Tensors in the dtype asked for at load."""

    lora_int_id: int
    rank: int  # the largest rank over its modules
    layers: dict[str, list[tuple[torch.Tensor, torch.Tensor] | None]]

    def num_bytes(self) -> int:
        return sum(
            a.nbytes + b.nbytes for slices in self.layers.values() for p in slices if p for a, b in [p]
        )


def _pattern_value(patterns: Mapping[str, float], module: str, default: float) -> float:
    """PEFT's ``get_pattern_key``: the first pattern key matching the end of ``module``'s dotted name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def read_adapter_config(path: str) -> dict:
    """``adapter_config.json`` of a PEFT LoRA adapter, checked for features pagedllm does not implement."""
    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter path {path!r} is not a directory")
    config_path = os.path.join(path, ADAPTER_CONFIG)
    if not os.path.isfile(config_path):
        raise ValueError(f"LoRA adapter {path!r} has no {ADAPTER_CONFIG}")
    with open(config_path) as f:
        config = json.load(f)
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise ValueError(f"LoRA adapter {path!r}: peft_type {peft_type!r} is not supported (only LORA)")
    for field, what in _UNSUPPORTED_FIELDS.items():
        if config.get(field):
            raise ValueError(f"LoRA adapter {path!r} uses {what}: not supported")
    bias = config.get("bias", "none")
    if bias != "none":
        raise ValueError(f"LoRA adapter {path!r}: bias={bias!r} is not supported (only 'none')")
    if "r" not in config or "lora_alpha" not in config:
        raise ValueError(f"LoRA adapter {path!r}: {ADAPTER_CONFIG} must set 'r' and 'lora_alpha'")
    return config


def _load_tensors(path: str) -> dict[str, torch.Tensor]:
    for name in ADAPTER_WEIGHTS:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            continue
        if name.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(file, device="cpu")
        return torch.load(file, map_location="cpu", weights_only=True)
    raise ValueError(f"LoRA adapter {path!r} has no weights file ({' or '.join(ADAPTER_WEIGHTS)})")


def _split_key(key: str) -> tuple[str, str]:
    """``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` -> (``model.layers.0.self_attn.q_proj``,
    ``lora_A``)."""
    prefix = "base_model.model."
    if key.startswith(prefix):
        key = key[len(prefix) :]
    # A vision-language checkpoint's text model: transformers 5 names it model.language_model.layers..., the
    # layout the models here keep (and transformers 4 wrote) is language_model.model.layers...
    vlm = "model.language_model."
    if key.startswith(vlm):
        key = "language_model.model." + key[len(vlm) :]
    parts = key.split(".")
    if len(parts) >= 3 and parts[-1] == "weight" and parts[-2] in ("lora_A", "lora_B"):
        return ".".join(parts[:-2]), parts[-2]
    # PEFT writes lora_A.<adapter>.weight while training; saved files drop the adapter name.
    if len(parts) >= 4 and parts[-1] == "weight" and parts[-3] in ("lora_A", "lora_B"):
        return ".".join(parts[:-3]), parts[-3]
    return key, ""


def load_peft_adapter(
    path: str,
    lora_int_id: int,
    layers: Mapping[str, LayerShape],
    packed_modules_mapping: Mapping[str, Sequence[str]],
    max_lora_rank: int,
    dtype: torch.dtype = torch.float32,
    absent: Sequence[str] = (),
) -> LoRAModel:
    """Read a PEFT adapter directory and map it onto the model's LoRA-capable ``layers`` (by pagedllm module
    name). Raises ``ValueError`` naming the problem: missing files, a rank above ``max_lora_rank``, a module
    the model has no LoRA layer for, an unsupported PEFT feature, or tensors of the wrong shape. ``absent``:
    module prefixes another pipeline stage holds (``PPMissingLayer``s); their weights are skipped unchecked."""
    config = read_adapter_config(path)
    tensors = _load_tensors(path)
    shard_of = {
        name: (packed, i) for packed, names in packed_modules_mapping.items() for i, name in enumerate(names)
    }
    supported = sorted({*shard_of, *(name.rsplit(".", 1)[-1] for name in layers)})

    target_modules = config.get("target_modules")
    if isinstance(target_modules, (list, tuple)):
        for target in target_modules:
            leaf = str(target).rsplit(".", 1)[-1]
            if "embed" in leaf:
                raise ValueError(f"LoRA adapter {path!r} targets {target!r}: embedding LoRA is not supported")
            if leaf not in shard_of and leaf not in supported:
                raise ValueError(
                    f"LoRA adapter {path!r} targets module {target!r}, which pagedllm cannot apply LoRA to "
                    f"(supported: {', '.join(supported)})"
                )

    for key in tensors:
        if "lora_embedding_A" in key or "lora_embedding_B" in key:
            raise ValueError(f"LoRA adapter {path!r} has embedding LoRA ({key}): not supported")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, kind = _split_key(key)
        if not kind:
            raise ValueError(
                f"LoRA adapter {path!r} holds {key!r}, which is not a LoRA A/B weight "
                "(modules_to_save or another unsupported feature)"
            )
        pairs.setdefault(module, {})[kind] = tensor

    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}
    use_rslora = bool(config.get("use_rslora", False))
    out: dict[str, list[tuple[torch.Tensor, torch.Tensor] | None]] = {}
    max_rank = 0
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"lora_A", "lora_B"}:
            raise ValueError(
                f"LoRA adapter {path!r}: module {module!r} lacks {'lora_B' if 'lora_A' in ab else 'lora_A'}"
            )
        parent, _, leaf = module.rpartition(".")
        if leaf in shard_of:
            packed, shard = shard_of[leaf]
            target = f"{parent}.{packed}" if parent else packed
        else:
            target, shard = module, None
        if target not in layers:
            if any(target.startswith(prefix + ".") for prefix in absent):
                continue  # another pipeline stage's layer: that stage loads and checks it
            raise ValueError(
                f"LoRA adapter {path!r} targets module {module!r}, which the model has no LoRA layer for "
                f"(supported: {', '.join(supported)})"
            )
        shape = layers[target]
        a, b = ab["lora_A"], ab["lora_B"]  # [r, in], [out, r]
        r = int(_pattern_value(rank_pattern, module, config["r"]))
        alpha = float(_pattern_value(alpha_pattern, module, config["lora_alpha"]))
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != r or b.shape[1] != r:
            raise ValueError(
                f"LoRA adapter {path!r}: module {module!r} has A {tuple(a.shape)}, B {tuple(b.shape)}, "
                f"not rank r={r} from {ADAPTER_CONFIG}"
            )
        if r > max_lora_rank:
            raise ValueError(
                f"LoRA adapter {path!r}: module {module!r} has rank {r} > max_lora_rank {max_lora_rank}"
            )
        scaling = alpha / math.sqrt(r) if use_rslora else alpha / r
        sizes = shape.output_sizes
        expected_out = sizes[shard] if shard is not None else sum(sizes)
        if a.shape[1] != shape.input_size or b.shape[0] != expected_out:
            raise ValueError(
                f"LoRA adapter {path!r}: module {module!r} has A {tuple(a.shape)}, B {tuple(b.shape)}; "
                f"the model's layer takes {shape.input_size} inputs and gives {expected_out} outputs"
            )
        a = a.to(dtype).contiguous()
        b = (b.float() * scaling).to(dtype)  # [out, r]
        slices = out.setdefault(target, [None] * len(sizes))
        if shard is not None:
            if slices[shard] is not None:
                raise ValueError(f"LoRA adapter {path!r}: module {module!r} given twice")
            slices[shard] = (a, b.contiguous())
        else:  # a whole (possibly fused) layer: every slice shares A and takes its rows of B
            if any(s is not None for s in slices):
                raise ValueError(f"LoRA adapter {path!r}: module {module!r} overlaps another one")
            offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
            for s in range(len(sizes)):
                slices[s] = (a, b[offsets[s] : offsets[s + 1]].contiguous())
        max_rank = max(max_rank, r)
    if not out:
        raise ValueError(f"LoRA adapter {path!r} holds no LoRA weights")
    return LoRAModel(lora_int_id=lora_int_id, rank=max_rank, layers=out)
