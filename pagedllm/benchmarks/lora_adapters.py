"""Random-weight LoRA adapters in PEFT's layout for a model directory, for benchmarks (no peft needed).

    python -m pagedllm.benchmarks.lora_adapters MODEL_DIR OUT_DIR [--rank 16] [--alpha 32] [--seed 0]

writes ``OUT_DIR/adapter_config.json`` and ``OUT_DIR/adapter_model.safetensors`` with ``lora_A [r, in]`` and
``lora_B [out, r]`` for q/k/v/o and gate/up/down of every decoder layer (Llama-family shapes from the model's
``config.json``), in bfloat16. Both A and B are nonzero, so the adapter changes the output (PEFT starts B at 0).
"""

from __future__ import annotations

import argparse
import json
import os

import torch

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def module_shapes(config: dict) -> dict[str, tuple[str, int, int]]:
    """target -> (parent module, in features, out features) for a Llama-family ``config.json``."""
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads") or heads
    inter = config["intermediate_size"]
    return {
        "q_proj": ("self_attn", hidden, heads * head_dim),
        "k_proj": ("self_attn", hidden, kv * head_dim),
        "v_proj": ("self_attn", hidden, kv * head_dim),
        "o_proj": ("self_attn", heads * head_dim, hidden),
        "gate_proj": ("mlp", hidden, inter),
        "up_proj": ("mlp", hidden, inter),
        "down_proj": ("mlp", inter, hidden),
    }


def make_dummy_lora(
    model_dir: str, out_dir: str, rank: int = 16, alpha: float = 32.0, seed: int = 0, std: float = 0.01
) -> str:
    """Write a random rank-``rank`` adapter for ``model_dir`` into ``out_dir``; returns ``out_dir``."""
    from safetensors.torch import save_file

    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for target, (parent, n_in, n_out) in module_shapes(config).items():
            key = f"base_model.model.model.layers.{layer}.{parent}.{target}"
            a = torch.randn(rank, n_in, generator=gen) * std
            b = torch.randn(n_out, rank, generator=gen) * std
            tensors[f"{key}.lora_A.weight"] = a.to(torch.bfloat16)
            tensors[f"{key}.lora_B.weight"] = b.to(torch.bfloat16)
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": os.path.abspath(model_dir),
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": list(TARGETS),
        "use_rslora": False,
    }
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(adapter_config, f, indent=2)
    return out_dir


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir")
    p.add_argument("out_dir")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    print(make_dummy_lora(args.model_dir, args.out_dir, args.rank, args.alpha, args.seed))


if __name__ == "__main__":
    main()
