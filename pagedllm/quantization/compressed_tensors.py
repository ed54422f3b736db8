"""compressed-tensors checkpoints (llm-compressor), ``quant_method: "compressed-tensors"``: the FP8
``float-quantized`` format only.

config.json::

    "quantization_config": {
      "quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"group_0": {"targets": ["Linear"],
          "weights": {"type": "float", "num_bits": 8, "symmetric": true, "dynamic": false,
                      "strategy": "tensor" | "channel" | "block", "block_structure": [bn, bk]},
          "input_activations": null | {"type": "float", "num_bits": 8, "dynamic": true, "strategy": "token"}
                                    | {"type": "float", "num_bits": 8, "dynamic": false, "strategy": "tensor"}}},
      "ignore": ["lm_head", "re:.*mlp.gate$"], "kv_cache_scheme": null}

Tensors per quantized linear: ``weight: [out, in] float8_e4m3fn``; ``weight_scale``: ``[1]`` (tensor), ``[out, 1]``
(channel) or ``[ceil(out / bn), ceil(in / bk)]`` (block); ``input_scale: [1]`` for static activations. The float
weight is ``weight * weight_scale`` (broadcast per row / per block); see ``fp8.py``, whose ``Fp8LinearMethod``
does the work (weight-only on the PyTorch path).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedllm.layers.linear import Linear, LinearMethod
from pagedllm.quantization.base import QuantizationConfig, is_ignored
from pagedllm.quantization.fp8 import Fp8LinearMethod


def _check(cond: bool, field_name: str, message: str) -> None:
    if not cond:
        raise ValueError(f"quantization_config.{field_name}: {message}")


@dataclass
class CompressedTensorsConfig(QuantizationConfig):
    name = "compressed-tensors"
    strategy: str = "tensor"  # "tensor" | "channel" | "block"
    block_size: tuple[int, int] | None = None
    static_input_scale: bool = False
    ignore: list[str] = field(default_factory=list)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CompressedTensorsConfig:
        fmt = config.get("format")
        groups = config.get("config_groups") or {}
        _check(len(groups) == 1, "config_groups", f"exactly one group is supported, got {len(groups)}")
        ((group_name, group),) = groups.items()
        where = f"config_groups.{group_name}"
        fmt = group.get("format") or fmt
        _check(fmt == "float-quantized", "format", f"only 'float-quantized' (FP8) is supported, got {fmt!r}")
        targets = group.get("targets") or []
        _check(targets == ["Linear"], f"{where}.targets", f"only ['Linear'] is supported, got {targets!r}")
        weights = group.get("weights") or {}
        _check(
            weights.get("type") == "float" and weights.get("num_bits") == 8,
            f"{where}.weights",
            f"only 8-bit float weights are supported, got type={weights.get('type')!r} "
            f"num_bits={weights.get('num_bits')!r}",
        )
        _check(weights.get("symmetric", True) is True, f"{where}.weights.symmetric", "must be true")
        _check(
            not weights.get("dynamic", False), f"{where}.weights.dynamic", "dynamic weights are not supported"
        )
        strategy = weights.get("strategy")
        _check(
            strategy in ("tensor", "channel", "block"),
            f"{where}.weights.strategy",
            f"must be 'tensor', 'channel' or 'block', got {strategy!r}",
        )
        block = None
        if strategy == "block":
            block = weights.get("block_structure")
            _check(
                isinstance(block, list)
                and len(block) == 2
                and all(isinstance(b, int) and b > 0 for b in block),
                f"{where}.weights.block_structure",
                f"must be [bn, bk], got {block!r}",
            )
            block = tuple(block)
        acts = group.get("input_activations")
        static = False
        if acts is not None:
            _check(
                acts.get("type") == "float" and acts.get("num_bits") == 8,
                f"{where}.input_activations",
                "only 8-bit float activations are supported",
            )
            static = not acts.get("dynamic", False)
            if static:
                _check(
                    acts.get("strategy") == "tensor",
                    f"{where}.input_activations.strategy",
                    f"static activations must be per 'tensor', got {acts.get('strategy')!r}",
                )
        _check(group.get("output_activations") is None, f"{where}.output_activations", "must be null")
        _check(
            config.get("kv_cache_scheme") is None, "kv_cache_scheme", "a quantized KV cache is not supported"
        )
        sparsity = config.get("sparsity_config") or {}
        _check(
            sparsity.get("format", "dense") == "dense",
            "sparsity_config",
            f"sparse formats are not supported, got {sparsity.get('format')!r}",
        )
        return cls(
            strategy=strategy,
            block_size=block,
            static_input_scale=static,
            ignore=list(config.get("ignore") or []),
        )

    def get_linear_method(
        self, layer: Linear, prefix: str, checkpoint_names: list[str]
    ) -> LinearMethod | None:
        if is_ignored(prefix, checkpoint_names, self.ignore, "ignore"):
            return None
        return Fp8LinearMethod(self.strategy, self.block_size, self.static_input_scale, "weight_scale")
