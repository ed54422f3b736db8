"""Model directories with a real model's shape and no weights, for `--load-format dummy` benchmarks.

``python -m pagedllm.benchmarks.shapes OUT_DIR`` writes ``OUT_DIR/<name>`` for every entry of ``SHAPES``
(llama-3.1-8b, llama-3.3-70b, qwen3-0.6b, qwen3-30b-a3b, qwen3-235b-a22b, gemma-3-12b, deepseek-v2-lite): the
architecture's config.json and a stand-in word-level tokenizer of 32,000 ids (benchmarks send token ids and skip
detokenizing).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SHAPES: dict[str, dict] = {
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "torch_dtype": "bfloat16",
    },
    # Llama-3.3-70B: 80 layers of hidden 8192, 64 query / 8 KV heads, MLP 28672 (tensor-parallel runs).
    "llama-3.3-70b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "bos_token_id": 128000,
        "eos_token_id": 128009,
        "torch_dtype": "bfloat16",
    },
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "attention_bias": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
    },
    # MoE: 128 experts of 768, 8 per token, on every layer; Qwen3 attention (32 / 4 heads of 128).
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_bias": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
    },
    # Gemma 3 12B, text only (Gemma3ForCausalLM): 48 layers, five local (sliding window 1024, RoPE base 10k) then
    # one global (RoPE base 1M, linear x8), 16 query / 8 KV heads of 256, tied embeddings of a 262k vocabulary.
    "gemma-3-12b": {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": 3840,
        "intermediate_size": 15360,
        "num_hidden_layers": 48,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
        "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(48)],
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "vocab_size": 262208,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "pad_token_id": 0,
        "torch_dtype": "bfloat16",
    },
    # MLA (cache row: 512 latent + 64 rope values per token and layer), 64 routed experts of 1408, 6 per token, plus
    # 2 shared; layer 0 dense (10944); YaRN x40 over a 4096-token original context.
    "deepseek-v2-lite": {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "hidden_size": 2048,
        "intermediate_size": 10944,
        "moe_intermediate_size": 1408,
        "num_hidden_layers": 27,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "q_lora_rank": None,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 64,
        "num_experts_per_tok": 6,
        "n_shared_experts": 2,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "greedy",
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.0,
        "scoring_func": "softmax",
        "vocab_size": 102400,
        "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 40,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
            "original_max_position_embeddings": 4096,
        },
        "attention_bias": False,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "bos_token_id": 100000,
        "eos_token_id": 100001,
        "torch_dtype": "bfloat16",
    },
}
# Qwen3-235B-A22B (the 8-GPU runs): Qwen3-30B-A3B's family at 94 layers, hidden 4096, 128 experts of 1536, 8 per
# token, 64 query / 4 KV heads of 128.
SHAPES["qwen3-235b-a22b"] = {
    **SHAPES["qwen3-30b-a3b"],
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1536,
    "num_hidden_layers": 94,
    "num_attention_heads": 64,
}


STAND_IN_VOCAB = 32000  # below every shape's vocab_size


def _write_tokenizer(path: Path) -> None:
    """A word-level tokenizer of ``STAND_IN_VOCAB`` ids. Random-prompt datasets draw their ids from it (vLLM's
    ``(offset + i + j) % vocab``): with a vocabulary of a few dozen ids, prompts would repeat one another and prefix
    caching would skip most prefills."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, **{f"w{i}": 3 + i for i in range(STAND_IN_VOCAB - 3)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(str(path))


def write_shape_dir(name: str, path: str | Path) -> str:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(SHAPES[name], indent=2))
    _write_tokenizer(path)
    return str(path)


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "bench_models")
    for name in SHAPES:
        print(write_shape_dir(name, out / name))
