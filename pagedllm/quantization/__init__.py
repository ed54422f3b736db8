"""Quantized linear layers, with vLLM's method names.

``resolve_quantization(quantization, hf_config)`` turns the ``quantization=`` flag and config.json's
``quantization_config`` into a ``QuantizationConfig`` (or None), failing at start-up with a ``ValueError``
naming the field. ``quantize_model`` then gives each ``Linear`` of a freshly built model its ``LinearMethod``
(by module name, honouring the format's ignore list; embeddings and the LM head are not ``Linear`` and stay
unquantized), before the loader fills the parameters.

Methods: ``fp8`` (checkpoints, or online from a float checkpoint), ``compressed-tensors`` (FP8
float-quantized), ``gptq`` (4-bit symmetric), ``awq`` (4-bit GEMM). One file each.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection
from typing import Any

import torch
from torch import nn

from pagedllm.layers.linear import Linear
from pagedllm.layers.placement import HOST
from pagedllm.quantization.awq import AWQConfig
from pagedllm.quantization.base import QuantizationConfig
from pagedllm.quantization.compressed_tensors import CompressedTensorsConfig
from pagedllm.quantization.fp8 import Fp8Config
from pagedllm.quantization.gptq import GPTQConfig

QUANTIZATION_METHODS: dict[str, type] = {
    "fp8": Fp8Config,
    "compressed-tensors": CompressedTensorsConfig,
    "gptq": GPTQConfig,
    "awq": AWQConfig,
}
# vLLM flag names that pick a faster kernel for the same checkpoint format
_ALIASES = {"gptq_marlin": "gptq", "awq_marlin": "awq", "compressed_tensors": "compressed-tensors"}

__all__ = ["QUANTIZATION_METHODS", "QuantizationConfig", "quantize_model", "resolve_quantization"]


def _checkpoint_quant_config(hf_config: Any) -> dict[str, Any] | None:
    cfg = getattr(hf_config, "quantization_config", None)
    if cfg is None:
        return None
    if not isinstance(cfg, dict):
        cfg = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(vars(cfg))
    return cfg


def resolve_quantization(quantization: str | None, hf_config: Any) -> QuantizationConfig | None:
    """The quantization of a model: config.json's ``quantization_config`` (the checkpoint's own format), or the
    ``quantization`` flag for online quantization (``"fp8"`` only). A flag that disagrees with the checkpoint
    is a ``ValueError``, as in vLLM."""
    if quantization is not None:
        quantization = _ALIASES.get(quantization, quantization)
        if quantization not in QUANTIZATION_METHODS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} (or None), got {quantization!r}"
            )
    ckpt = _checkpoint_quant_config(hf_config)
    if ckpt is None:
        if quantization is None:
            return None
        if quantization != "fp8":
            raise ValueError(
                f"quantization={quantization!r} needs a checkpoint quantized in that format (config.json has no "
                "quantization_config); only 'fp8' quantizes a float checkpoint online"
            )
        return Fp8Config.online()
    method = ckpt.get("quant_method")
    if not isinstance(method, str):
        raise ValueError(f"quantization_config.quant_method is missing or not a string: {method!r}")
    method = _ALIASES.get(method.lower(), method.lower())
    if method not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization_config.quant_method {method!r} is not supported; supported: "
            f"{', '.join(QUANTIZATION_METHODS)}"
        )
    if quantization is not None and quantization != method:
        raise ValueError(
            f"quantization={quantization!r} does not match the checkpoint's quantization_config.quant_method "
            f"{method!r}"
        )
    return QUANTIZATION_METHODS[method].from_config(ckpt)


def _checkpoint_names(prefix: str, layer: Linear, packed: dict[str, list[str]]) -> list[str]:
    """The checkpoint module names stacked into the layer ``prefix`` (``[prefix]`` when it is not fused)."""
    head, _, last = prefix.rpartition(".")
    sources = packed.get(last)
    if layer.fused and sources and len(sources) == len(layer.output_sizes):
        return [f"{head}.{s}" if head else s for s in sources]
    return [prefix]


def quantize_model(
    model: nn.Module, quant_config: QuantizationConfig, host_modules: Collection[str] = ()
) -> None:
    """Give every ``Linear`` of ``model`` its method's parameters (current default dtype and device; in host memory
    under the modules named in ``host_modules``: the decoder layers weight offload keeps there); layers the
    config leaves out get float weights. Run right after building the model, before loading weights."""
    packed = getattr(model, "packed_modules_mapping", {})
    host_modules = set(host_modules)
    for prefix, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        method = quant_config.get_linear_method(module, prefix, _checkpoint_names(prefix, module, packed))
        if method is None:
            from pagedllm.layers.linear import UnquantizedLinearMethod

            method = UnquantizedLinearMethod()
        parts = prefix.split(".")
        on_host = any(".".join(parts[:i]) in host_modules for i in range(1, len(parts)))
        with torch.device(HOST) if on_host else contextlib.nullcontext():
            module.set_linear_method(method)
