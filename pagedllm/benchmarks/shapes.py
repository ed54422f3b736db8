"""Model directories with a real model's shape and no weights, for `--load-format dummy` benchmarks.

``python -m pagedllm.benchmarks.shapes OUT_DIR`` writes ``OUT_DIR/<name>`` for every entry of ``SHAPES``
(llama-3.1-8b, llama-3.3-70b, qwen3-0.6b, qwen3-30b-a3b, qwen3-235b-a22b, gemma-3-12b, deepseek-v2-lite,
qwen2.5-vl-7b): the architecture's config.json and a stand-in word-level tokenizer of 32,000 ids (benchmarks send
token ids and skip detokenizing).

qwen2.5-vl-7b also takes chat requests with images: its stand-in tokenizer has Qwen's special tokens at their real
ids (a word-level vocabulary of filler words below them, so that every id of the 152064-row embedding decodes), a
Qwen-style chat template that turns image parts into ``<|vision_start|><|image_pad|><|vision_end|>``, and
Qwen2-VL's image processor settings (``preprocessor_config.json``; transformers picks its PIL or torchvision
backend, whichever is installed).
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


# Qwen2.5-VL-7B-Instruct: a Qwen2.5-7B text model (M-RoPE sections 16/24/24 of the 64 rotary pairs) under a
# 32-block ViT of width 1280 over 14x14 patches (2x2 merged into one token; window attention in 112-pixel windows,
# full attention in blocks 7, 15, 23, 31). Nested text_config / vision_config as transformers 5 saves them (no
# legacy rope_scaling beside rope_parameters: vLLM refuses a "type" that differs from "rope_type").
_QWEN25_VL_MROPE = [16, 24, 24]
SHAPES["qwen2.5-vl-7b"] = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "model_type": "qwen2_5_vl",
    "text_config": {
        "model_type": "qwen2_5_vl_text",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "max_position_embeddings": 128000,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": _QWEN25_VL_MROPE},
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "use_sliding_window": False,
        "max_window_layers": 28,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "dtype": "bfloat16",
    },
    "vision_config": {
        "model_type": "qwen2_5_vl_vision",
        "depth": 32,
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "out_hidden_size": 3584,
        "in_channels": 3,
        "hidden_act": "silu",
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
        "tokens_per_second": 2,
    },
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
}
# Qwen2's special tokens from id 151643 on, in id order (the first 14 special; the rest plain added tokens).
QWEN_SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>",
]  # fmt: skip
QWEN_ADDED_TOKENS = [
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>",
]  # fmt: skip
QWEN_FIRST_SPECIAL_ID = 151643
# Qwen2-VL's chat template, image and video parts included (a string content is written as it is).
QWEN_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] in ('video', 'video_url') %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen2-VL's image processor (CLIP normalization; 4 to 16384 merged 28x28 units per image).
QWEN_VL_PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2_5_VLProcessor",
    "do_resize": True,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "do_convert_rgb": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "size": {"shortest_edge": 3136, "longest_edge": 12845056},
    "patch_size": 14,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "resample": 3,
}


def _write_qwen_vl_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer over filler words ``w0 w1 ...`` (ids below 151643), Qwen's special tokens at their
    ids, and plain added tokens up to ``vocab_size`` (every id the model can emit decodes), with the chat
    template; ``tokenizer_class`` PreTrainedTokenizerFast, which transformers 4 and 5 both load."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "system", "user", "assistant", "You", "are", "a", "helpful", "."]
    vocab = {w: i for i, w in enumerate(words)}
    vocab.update({f"w{i}": i for i in range(len(words), QWEN_FIRST_SPECIAL_ID)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL_TOKENS])
    num_filler = vocab_size - QWEN_FIRST_SPECIAL_ID - len(QWEN_SPECIAL_TOKENS) - len(QWEN_ADDED_TOKENS)
    added = QWEN_ADDED_TOKENS + [f"<|reserved_{i}|>" for i in range(num_filler)]
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    for i, t in enumerate(QWEN_SPECIAL_TOKENS + added):
        assert tok.token_to_id(t) == QWEN_FIRST_SPECIAL_ID + i, t
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=QWEN_SPECIAL_TOKENS[1:],
    )  # fmt: skip
    fast.chat_template = QWEN_VL_CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["chat_template"] = QWEN_VL_CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2))
    (path / "chat_template.json").write_text(json.dumps({"chat_template": QWEN_VL_CHAT_TEMPLATE}, indent=2))

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
    """Write shape ``name``'s directory at ``path``; returns the path."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = SHAPES[name]
    (path / "config.json").write_text(json.dumps(config, indent=2))
    if config["architectures"][0] == "Qwen2_5_VLForConditionalGeneration":
        _write_qwen_vl_tokenizer(path, config["text_config"]["vocab_size"])
        (path / "preprocessor_config.json").write_text(json.dumps(QWEN_VL_PREPROCESSOR, indent=2))
    else:
        _write_tokenizer(path)
    return str(path)


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "bench_models")
    for name in SHAPES:
        print(write_shape_dir(name, out / name))
