"""The transformers side of the benchmarks: the same model (or the same random-weight shape) in HF."""

from __future__ import annotations

import argparse

import torch

from pagedllm.config import DeviceConfig, ModelConfig
from pagedllm.engine.arg_utils import resolve_model_arg


def load_hf_model(args: argparse.Namespace):
    """Load ``args.model`` into transformers on the engine's device and dtype (random weights for dummy)."""
    from transformers import AutoModelForCausalLM

    device = DeviceConfig(args.device).device
    mc = ModelConfig(resolve_model_arg(args), dtype=args.dtype, load_format=args.load_format)
    dtype = mc.dtype
    if args.dtype == "auto" and device.type == "cuda" and dtype == torch.float32:
        dtype = torch.bfloat16
    if args.load_format == "dummy":
        torch.manual_seed(args.seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(mc.hf_config, dtype=dtype)
        for p in model.parameters():
            p.data.normal_(0, 0.02)
    else:
        model = AutoModelForCausalLM.from_pretrained(mc.model_path, dtype=dtype).to(device)
    return model.eval(), device
