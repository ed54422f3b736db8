"""LoRA test helpers: PEFT adapters with random (nonzero) weights on the tiny test models, and oracles.

Adapters (per arch) differ in rank, alpha, targets and scaling rule::

    attn:    r=8,  alpha=16, q/k/v/o (Phi-3: its fused qkv_proj and o_proj)
    all:     r=16, alpha=8,  every linear module
    rs:      r=4,  alpha=8,  rsLoRA (alpha / sqrt(r)), k/v + up/down only (q and gate slices stay empty)
    pattern: r=4,  alpha=4,  rank_pattern / alpha_pattern per module (ranks 2..8), v/o + gate/down
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from pagedllm.attention.base import AttentionMetadata
from pagedllm.attention.torch_ref import TorchAttentionBackend
from pagedllm.config import ModelConfig
from pagedllm.lora.manager import LoRAManager
from pagedllm.lora.request import LoRARequest
from pagedllm.model_loader import get_model

LORA_ARCHS = ("llama", "qwen3", "phi3")
MAX_LORA_RANK = 16
ATOL = 1e-4
BLOCK_SIZE = 4
# one flattened batch: base rows and four adapters, one of them twice
MIXED = [None, "attn", "all", None, "rs", "attn", "pattern"]


def adapter_kwargs(arch: str) -> dict[str, dict]:
    fused = arch == "phi3"
    attn = ["qkv_proj", "o_proj"] if fused else ["q_proj", "k_proj", "v_proj", "o_proj"]
    kv_up_down = (
        ["qkv_proj", "gate_up_proj", "down_proj"] if fused else ["k_proj", "v_proj", "up_proj", "down_proj"]
    )
    pattern = ["qkv_proj", "o_proj", "down_proj"] if fused else ["v_proj", "o_proj", "gate_proj", "down_proj"]
    return {
        "attn": dict(r=8, lora_alpha=16, target_modules=attn),
        "all": dict(r=16, lora_alpha=8, target_modules="all-linear"),
        "rs": dict(r=4, lora_alpha=8, target_modules=kv_up_down, use_rslora=True),
        "pattern": dict(
            r=4,
            lora_alpha=4,
            target_modules=pattern,
            rank_pattern={"o_proj": 8, "down_proj": 2},
            alpha_pattern={"o_proj": 3, "layers.1.mlp.down_proj": 12},
        ),
    }


def make_peft_adapter(base_dir: str, out_dir: str | Path, seed: int, std: float = 0.1, **lora_kwargs) -> str:
    """Wrap the checkpoint at ``base_dir`` with ``peft.LoraConfig(**lora_kwargs)``, fill every LoRA tensor
    with seeded normal noise (PEFT starts B at zero, which would hide every mistake), save the adapter."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(**lora_kwargs))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    peft_model.save_pretrained(str(out_dir))
    return str(out_dir)


@functools.lru_cache(maxsize=64)
def hf_peft_logits(base_dir: str, adapter_dir: str | None, token_ids: tuple[int, ...]) -> torch.Tensor:
    """transformers (+ peft when ``adapter_dir``) float32 logits ``[len(token_ids), vocab]``: the oracle."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir).eval()
    with torch.inference_mode():
        return model(torch.tensor([list(token_ids)])).logits[0].float()


def load_model(path: str, device: str = "cpu"):
    model_config = ModelConfig(model=path, dtype="float32")
    model = get_model(model_config, torch.device(device), TorchAttentionBackend())
    return model, model_config


def random_prompt(length: int, vocab_size: int, seed: int) -> list[int]:
    return torch.randint(3, vocab_size, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def prefill(
    model, model_config: ModelConfig, prompts: list[list[int]], device: str = "cpu"
) -> list[torch.Tensor]:
    """One flattened prefill of ``prompts`` (each in its own contiguous blocks); logits per prompt
    ``[len, vocab]`` on the CPU."""
    num_blocks = sum(-(-len(p) // BLOCK_SIZE) for p in prompts)
    kv_caches = [
        torch.zeros(
            2, num_blocks, BLOCK_SIZE, model_config.num_kv_heads, model_config.head_dim, device=device
        )
        for _ in range(model_config.num_layers)
    ]  # each [2, num_blocks, block_size, num_kv_heads, head_dim]
    lens = [len(p) for p in prompts]
    max_blocks = max(-(-n // BLOCK_SIZE) for n in lens)
    block_table = torch.zeros(len(prompts), max_blocks, dtype=torch.int32)  # [num_reqs, max_blocks]
    slots, next_block = [], 0
    for i, n in enumerate(lens):
        nb = -(-n // BLOCK_SIZE)
        block_table[i, :nb] = torch.arange(next_block, next_block + nb)
        slots += [next_block * BLOCK_SIZE + j for j in range(n)]
        next_block += nb
    query_start_loc = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    metadata = AttentionMetadata(
        num_reqs=len(prompts),
        num_tokens=sum(lens),
        max_query_len=max(lens),
        max_seq_len=max(lens),
        query_start_loc=query_start_loc.to(device),
        seq_lens=seq_lens.to(device),
        block_table=block_table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
    )
    input_ids = torch.tensor([t for p in prompts for t in p], device=device)
    positions = torch.tensor([j for n in lens for j in range(n)], device=device)
    hidden = model(input_ids, positions, kv_caches, metadata)  # [num_tokens, hidden]
    logits = model.compute_logits(hidden).cpu()  # [num_tokens, vocab]
    return [logits[query_start_loc[i] : query_start_loc[i + 1]] for i in range(len(prompts))]


def run_mixed_batch(
    base_dir: str, adapters: dict[str, str], names: list[str | None], device: str = "cpu", tweak=None
) -> tuple[list[torch.Tensor], list[list[int]], list[int]]:
    """Our logits for one prompt per entry of ``names`` (an adapter name or None), all in one batch."""
    model, model_config = load_model(base_dir, device)
    manager = LoRAManager(model, max_loras=4, max_lora_rank=MAX_LORA_RANK, max_num_tokens=256)
    if tweak is not None:
        tweak(manager)
    ids = {name: i + 1 for i, name in enumerate(sorted(adapters))}
    requests = [None if n is None else LoRARequest(n, ids[n], adapters[n]) for n in names]
    slots = manager.activate(requests)
    prompts = [random_prompt(5 + 3 * i, model_config.vocab_size, seed=i) for i in range(len(names))]
    manager.set_mapping(slots, [len(p) for p in prompts])
    return prefill(model, model_config, prompts, device), prompts, slots


@functools.lru_cache(maxsize=128)
def hf_peft_greedy(
    base_dir: str, adapter_dir: str | None, token_ids: tuple[int, ...], max_new_tokens: int
) -> list[int]:
    """transformers (+ an unmerged peft adapter when ``adapter_dir``) float32 greedy decoding, EOS ignored:
    exactly ``max_new_tokens`` new token ids (the engine oracle)."""
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # else generate() merges the checkpoint's eos back in
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir).eval()
    gen_config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=model.config.pad_token_id,
    )
    input_ids = torch.tensor([list(token_ids)], dtype=torch.long)  # [1, prompt_len]
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), generation_config=gen_config
        )  # [1, prompt_len + max_new_tokens]
    new_tokens = out[0, len(token_ids) :].tolist()
    assert len(new_tokens) == max_new_tokens
    return new_tokens
