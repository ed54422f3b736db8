"""Shared test fixtures: a tiny in-process tokenizer, tiny HF checkpoints, and HF-transformers oracles.

Everything here is deterministic and CPU-only so any test can build and compare against it in seconds.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast

# ~4 KB of English and code: enough for byte-level BPE to learn a few hundred merges.
_TRAINING_TEXT = '''
The quick brown fox jumps over the lazy dog. A paged key-value cache splits each sequence into fixed-size
blocks, so memory is allocated on demand and shared between requests that start with the same prompt.
Continuous batching lets new requests join the running batch at every step instead of waiting for the
slowest sequence to finish. The scheduler decides which requests run, how many tokens each one computes,
and which ones must be preempted when the cache runs out of free blocks.
Once upon a time there was a little robot who loved to count. Every morning it counted the birds on the
roof, the clouds in the sky, and the steps from the door to the garden. One day it met a cat who could not
count at all, so the robot taught the cat the numbers one, two, three, four, five, six, seven, eight, nine
and ten. The cat was happy, and the two of them counted the stars together every night.
Hello, how are you today? I am fine, thank you. What is the capital of France? The capital of France is
Paris. What is two plus two? Two plus two is four. Please write a short poem about the sea. The sea is wide
and the sea is blue, it sings all day and all night too.
You are a helpful assistant. Answer the question in one sentence. The user asked about the weather, and
the assistant said that it would be sunny in the morning and rainy in the afternoon.

def fibonacci(n: int) -> int:
    """Return the n-th Fibonacci number."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.free_blocks = list(range(num_blocks))
        self.ref_counts = [0] * num_blocks

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_blocks):
            raise ValueError("out of blocks")
        blocks, self.free_blocks = self.free_blocks[:n], self.free_blocks[n:]
        for block_id in blocks:
            self.ref_counts[block_id] += 1
        return blocks

    def free(self, blocks: list[int]) -> None:
        for block_id in blocks:
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_blocks.append(block_id)


import torch

def attention(q, k, v, scale):
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    mask = torch.ones_like(scores, dtype=torch.bool).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


for i in range(10):
    if i % 2 == 0:
        print(f"{i} is even")
    else:
        print(f"{i} is odd")

numbers = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
print(sorted(numbers), sum(numbers), max(numbers), min(numbers))
result = {"name": "pagedllm", "version": "0.1.0", "tokens": [1, 2, 3], "ok": True}
'''

_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
TINY_ARCHS = ("llama", "llama3", "mistral", "qwen2", "qwen3", "gemma", "phi3", "gemma2", "gemma3")
# Sliding windows of the tiny models that have one: far shorter than test prompts + generations (60+ tokens), so
# the window changes the outputs. (qwen2 and qwen3 take one with use_sliding_window=True, sliding_window=W.)
TINY_WINDOWS = {"mistral": 16, "phi3": 32, "gemma2": 16, "gemma3": 16}


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error of a kernel's output against its reference (in float64); fails on a non-finite output
    (a row left unwritten, or a NaN)."""
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "non-finite output (unwritten or NaN)"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@functools.lru_cache(maxsize=1)
def _tiny_tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        min_frequency=2,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_TRAINING_TEXT], trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # Like Llama: plain encode() prepends <s>; the chat template writes it itself.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok.to_str()


def train_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE (~400 tokens) with ``<s>``/``</s>``/``<pad>`` and a chat template.

    Training runs once per process; each call returns a fresh wrapper, so callers may modify it.
    Encoding adds ``<s>`` in front (``add_special_tokens=False`` to skip it).
    """
    from tokenizers import Tokenizer

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tiny_tokenizer_json()),
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
    )
    tokenizer.chat_template = _CHAT_TEMPLATE
    return tokenizer


def _tiny_config(arch: str, vocab_size: int, bos_id: int, eos_id: int, pad_id: int, **overrides):
    import transformers
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        GemmaConfig,
        LlamaConfig,
        MistralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
    )

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=512,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        tie_word_embeddings=False,
    )
    theta = 10000.0
    rope_scaling = None
    if arch in ("llama", "mistral", "qwen2"):
        cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}[arch]
        if arch == "mistral":
            common["sliding_window"] = TINY_WINDOWS[arch]  # every layer
    elif arch == "llama3":
        cls = LlamaConfig
        theta = 500000.0
        # original context 64 with head_dim 16: some frequencies kept, some blended, most divided by 8
        rope_scaling = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    elif arch == "qwen3":
        cls = Qwen3Config
        common["head_dim"] = 32  # != hidden_size / num_heads, as in real Qwen3 models
    elif arch == "gemma":
        cls = GemmaConfig
        common["head_dim"] = 32  # Gemma's head_dim is its own (256 in the real models)
        common["hidden_act"] = common["hidden_activation"] = "gelu_pytorch_tanh"
        common["tie_word_embeddings"] = True  # as every Gemma checkpoint
    elif arch == "phi3":
        cls = Phi3Config  # checkpoints hold fused qkv_proj and gate_up_proj
        common["sliding_window"] = TINY_WINDOWS[arch]  # every layer
    elif arch == "gemma2":
        cls = Gemma2Config
        common["head_dim"] = 32
        common["hidden_act"] = common["hidden_activation"] = "gelu_pytorch_tanh"
        common["tie_word_embeddings"] = True
        common["sliding_window"] = TINY_WINDOWS[arch]  # layer_types default: layer 0 sliding, layer 1 global
        common["query_pre_attn_scalar"] = 24  # != head_dim: the scale must come from it
        # Caps low enough that tanh bends the tiny model's scores and logits (real: 50 and 30).
        common["attn_logit_softcapping"] = 4.0
        common["final_logit_softcapping"] = 6.0
    elif arch == "gemma3":
        cls = Gemma3TextConfig  # text-only Gemma3ForCausalLM
        common["head_dim"] = 32
        common["hidden_act"] = common["hidden_activation"] = "gelu_pytorch_tanh"
        common["tie_word_embeddings"] = True
        common["sliding_window"] = TINY_WINDOWS[arch]
        common["layer_types"] = ["sliding_attention", "full_attention"]  # real models: 5 local, 1 global
        common["query_pre_attn_scalar"] = 24
    else:
        raise ValueError(f"unknown tiny arch {arch!r}; choose from {TINY_ARCHS}")
    if arch == "gemma3":  # local layers: their own theta, no scaling; global: linear scaling, as Gemma 3 4B+
        if int(transformers.__version__.split(".")[0]) >= 5:
            common["rope_parameters"] = {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
            }
        else:
            common.update(rope_theta=1000000.0, rope_local_base_freq=10000.0)
            common["rope_scaling"] = {"rope_type": "linear", "factor": 4.0}
    elif int(transformers.__version__.split(".")[0]) >= 5:
        common["rope_parameters"] = {"rope_type": "default", **(rope_scaling or {}), "rope_theta": theta}
    else:
        common["rope_theta"] = theta
        common["rope_scaling"] = rope_scaling
    common.update(overrides)
    return cls(**common)


def _default_weight(name: str) -> tuple[float, float]:
    """(offset, std) of a random weight: norm weights around 1, biases small, the rest std 0.15."""
    if name.endswith("norm.weight"):
        return 1.0, 0.1
    if name.endswith(".bias"):
        return 0.0, 0.1
    return 0.0, 0.15


def randomize_weights(model: torch.nn.Module, seed: int, weight=_default_weight) -> None:
    """Overwrite every parameter with seeded noise: ``weight(name)`` -> (offset, std)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            offset, std = weight(name)
            param.copy_(offset + std * torch.randn(param.shape, generator=gen))


def save_random_model(
    config, tokenizer, path: str | Path, seed: int, weight=_default_weight, **save_kw
) -> str:
    """Build ``config``'s transformers model with seeded random weights (``weight(name)`` -> (offset, std); larger
    than transformers' init, so greedy generation moves around and every part matters), save it with
    ``tokenizer`` to ``path``; return the directory."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_weights(model, seed, weight)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, **save_kw)
    tokenizer.save_pretrained(path)
    return str(path)


def make_tiny_model(
    arch: str,
    path: str | Path,
    *,
    tie_word_embeddings: bool | None = None,
    shard: bool = False,
    **config_overrides,
) -> str:
    """Save a tiny random HF checkpoint (+ tokenizer) of ``arch`` to ``path``; return the directory.

    ``arch``: llama, llama3 (llama3 rope scaling), mistral (sliding window 16), qwen2 (qkv bias), qwen3 (q/k norm,
    head_dim 32), gemma, phi3 (fused checkpoint, window 32), gemma2 (window 16 on layer 0, soft-caps), gemma3
    (text only; window 16 on layer 0, q/k norms, local rope theta, linear rope scaling on the global layer).
    hidden 64, 2 layers, 4 heads, 2 kv heads, intermediate 128, 512 positions, vocab = tokenizer size.
    Weights are seeded (same arch + options -> same weights) and larger than HF's init (std 0.15, norm
    weights around 1, random biases) so greedy generation moves around instead of repeating one token.
    ``shard=True`` saves several safetensors files plus ``model.safetensors.index.json``.
    """
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = train_tiny_tokenizer()
    if tie_word_embeddings is not None:
        config_overrides["tie_word_embeddings"] = tie_word_embeddings
    config = _tiny_config(
        arch,
        len(tokenizer),
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        **config_overrides,
    )
    seed = sum(arch.encode())  # a different (fixed) set of weights per arch
    return save_random_model(config, tokenizer, path, seed, max_shard_size="100KB" if shard else "50GB")


def _load_hf(path: str | Path):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@torch.inference_mode()
def hf_greedy(path: str | Path, prompts_token_ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers greedy decoding (float32, one prompt at a time, EOS ignored): exactly
    ``max_new_tokens`` new token ids per prompt."""
    from transformers import GenerationConfig

    model = _load_hf(path)
    model.generation_config.eos_token_id = None  # else generate() merges the checkpoint's eos back in
    gen_config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=model.config.pad_token_id,
    )
    outputs = []
    for token_ids in prompts_token_ids:
        input_ids = torch.tensor([token_ids], dtype=torch.long)  # [1, prompt_len]
        out = model.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), generation_config=gen_config
        )  # [1, prompt_len + max_new_tokens]
        new_tokens = out[0, len(token_ids) :].tolist()
        assert len(new_tokens) == max_new_tokens, (len(new_tokens), max_new_tokens)
        outputs.append(new_tokens)
    return outputs


@torch.inference_mode()
def hf_logprobs(path: str | Path, token_ids: list[int]) -> torch.Tensor:
    """``log_softmax`` of transformers' float32 logits for ``token_ids``: ``[len(token_ids), vocab_size]``."""
    model = _load_hf(path)
    logits = model(torch.tensor([token_ids], dtype=torch.long)).logits[0]  # [len, vocab_size]
    return torch.log_softmax(logits.float(), dim=-1)


def assert_greedy_and_logprobs_match_hf(outs, path: str, prompts: list[list[int]], max_new: int) -> None:
    """``outs`` (``LLM.generate`` of ``prompts``, greedy with logprobs) holds transformers' greedy tokens, and each
    token's logprob within 1e-4 of transformers' (teacher-forced over the prompt and the tokens before it)."""
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, prompts, max_new)
    for prompt, out in zip(prompts, outs):
        comp = out.outputs[0]
        ref = hf_logprobs(path, prompt + comp.token_ids[:-1])
        for j, (tok, lps) in enumerate(zip(comp.token_ids, comp.logprobs)):
            assert abs(lps[tok].logprob - ref[len(prompt) - 1 + j][tok].item()) < 1e-4


def perturbed_checkpoint(src: str | Path, dst: str | Path, seed: int = 1, scale: float = 0.3) -> dict[str, torch.Tensor]:
    """Copy the checkpoint directory ``src`` to ``dst`` with every weight changed (``w + scale * |w|.mean() *
    noise``, seeded): a trainer's "new weights" that move greedy outputs. Returns the new state dict (HF names)."""
    import shutil

    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for path in sorted(src.glob("*.safetensors")):
        for name, w in load_file(path).items():
            noise = torch.randn(w.shape, generator=gen, dtype=torch.float32).to(w.dtype)
            state[name] = (w + scale * w.abs().mean() * noise).contiguous()
    save_file(state, dst / "model.safetensors")
    return state


# The rollout-hook tests' small CPU engine and prompts (tests/engine/test_weight_update.py and its neighbours).
ROLLOUT_PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [40, 41, 42], [7, 300, 12, 99]]
ROLLOUT_ENGINE = dict(
    device="cpu", dtype="float32", block_size=4, max_model_len=64, num_gpu_blocks_override=64, enforce_eager=True
)


def greedy_ids(llm, prompts: list[list[int]] = ROLLOUT_PROMPTS, max_tokens: int = 8) -> list[list[int]]:
    """Each prompt's greedy continuation (``max_tokens`` ids, EOS ignored) from an ``LLM``."""
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


# ---------------------------------------------------------------- images in, text out (LLaVA)

TINY_IMAGE_TOKEN = "<image>"


# LLaVA-NeXT's tiny tiling: (height, width) resolutions of 2x1, 1x2 and 2x2 crops of 28x28
TINY_LLAVA_NEXT_PINPOINTS = [[28, 56], [56, 28], [56, 56]]


def make_tiny_llava(
    path: str | Path, *, feature_layer: int | list[int] = -2, strategy: str = "default", llava_next: bool = False
) -> str:
    """Save a tiny random LLaVA-1.5 checkpoint (CLIP tower: 28x28 images, 7x7 patches, 2 layers of width 32; the
    tiny Llama text model) with its tokenizer (``<image>`` added) and processor (``CLIPImageProcessorPil``), to
    ``path``; return the directory. An image takes 16 placeholder tokens ("default" strategy) or 17 ("full").

    ``llava_next``: LLaVA-NeXT instead (``TINY_LLAVA_NEXT_PINPOINTS``, ``LlavaNextImageProcessorPil``): a 40x30 image
    takes 70 tokens (base 16, a 2x2 tile grid of 8x8 patches unpadded to 6 rows, 6 newlines), a 20x50 one 56."""
    import transformers
    from transformers import CLIPVisionConfig
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    family = "LlavaNext" if llava_next else "Llava"
    config_cls, model_cls, processor_cls = (
        getattr(transformers, family + suffix) for suffix in ("Config", "ForConditionalGeneration", "Processor")
    )
    tokenizer = train_tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [TINY_IMAGE_TOKEN]})
    image_token_id = tokenizer.convert_tokens_to_ids(TINY_IMAGE_TOKEN)
    text_config = _tiny_config(
        "llama", len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
    )
    vision_config = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=28,
        patch_size=7, projection_dim=32,
    )  # fmt: skip
    config = config_cls(
        vision_config=vision_config,
        text_config=text_config,
        image_token_index=image_token_id,
        vision_feature_layer=feature_layer,
        vision_feature_select_strategy=strategy,
        projector_hidden_act="gelu",
        **({"image_grid_pinpoints": TINY_LLAVA_NEXT_PINPOINTS} if llava_next else {}),
    )
    torch.manual_seed(7)
    model = model_cls(config)
    randomize_weights(model, 7)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    sizes = dict(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    if llava_next:
        image_processor = LlavaNextImageProcessorPil(image_grid_pinpoints=TINY_LLAVA_NEXT_PINPOINTS, **sizes)
    else:
        image_processor = CLIPImageProcessorPil(**sizes)
    processor = processor_cls(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=7,
        vision_feature_select_strategy=strategy, num_additional_image_tokens=1,
    )  # fmt: skip
    processor.save_pretrained(path)
    return str(path)


def _hf_vlm_class(path: str | Path):
    """transformers' class for the checkpoint's architecture (``config.json``)."""
    import json

    import transformers

    with open(Path(path) / "config.json", encoding="utf-8") as f:
        return getattr(transformers, json.load(f)["architectures"][0])


@functools.lru_cache(maxsize=4)
def _load_hf_vlm(cls, path: str):
    """A transformers vision-language model in float32, loaded once per checkpoint (the oracles only read it)."""
    model = cls.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def tiny_image(seed: int, size: tuple[int, int] = (40, 30)):
    """A seeded random RGB PIL image (``size`` = width, height)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")


def _hf_vlm_generate(model, max_new_tokens: int, **inputs) -> tuple[list[int], torch.Tensor]:
    """Greedy ``generate`` of a transformers VLM on one prompt (``inputs``: input_ids [1, L], pixels...; EOS
    ignored): (new token ids, log_softmax rows [max_new_tokens, vocab] of the logits that chose them)."""
    from transformers import GenerationConfig

    inputs.setdefault("attention_mask", torch.ones_like(inputs["input_ids"]))
    gen_config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
        output_scores=True, return_dict_in_generate=True,
    )  # fmt: skip
    out = model.generate(**inputs, generation_config=gen_config)
    new_ids = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    return new_ids, torch.stack([torch.log_softmax(s[0].float(), -1) for s in out.scores])


@torch.inference_mode()
def hf_llava_greedy_and_logprobs(path: str | Path, prompt: str, images: list, max_new_tokens: int):
    """transformers' LLaVA (or LLaVA-NeXT: the checkpoint's architecture), float32: (prompt token ids with
    placeholders expanded, greedy new token ids (EOS ignored), log_softmax rows [max_new_tokens, vocab] of the
    logits that chose each of them)."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(str(path))
    model = _load_hf_vlm(_hf_vlm_class(path), str(path))
    inputs = processor(text=prompt, images=images or None, return_tensors="pt")
    new_ids, logprobs = _hf_vlm_generate(model, max_new_tokens, **inputs)
    return inputs["input_ids"][0].tolist(), new_ids, logprobs


QWEN2_VL_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def make_tiny_qwen2_vl(path: str | Path, *, v2_5: bool = False) -> str:
    """Save a tiny random Qwen2-VL checkpoint (ViT of width 32 over 4x4 patches, 2x2 merge; the tiny Qwen2-style
    text model with mrope_section [2, 3, 3]), its tokenizer (Qwen2-VL's vision tokens added) and image processor
    (``Qwen2VLImageProcessorPil``, 256..4096 pixels: a 40x30 image takes 20 tokens) to ``path``.

    ``v2_5``: Qwen2.5-VL instead (its tower: RMSNorm, gated SiLU MLP, windows of 16 pixels = 2x2 merged units in
    block 0 and full attention in block 1; a 40x30 image's 4x5 units make 6 windows, two of them 2x1)."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    family = "Qwen2_5_VL" if v2_5 else "Qwen2VL"
    config_cls, model_cls = (getattr(transformers, family + suffix) for suffix in ("Config", "ForConditionalGeneration"))
    tokenizer = train_tiny_tokenizer()
    specials = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    start, pad, end, video = tokenizer.convert_tokens_to_ids(specials)
    text_config = dict(
        vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, max_position_embeddings=512, rms_norm_eps=1e-6, hidden_act="silu",
        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    )  # fmt: skip
    common = dict(depth=2, num_heads=4, patch_size=4, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    if v2_5:
        vision_config = dict(
            common, hidden_size=32, intermediate_size=48, out_hidden_size=64, hidden_act="silu", window_size=16,
            fullatt_block_indexes=[1],
        )  # fmt: skip
    else:
        vision_config = dict(common, embed_dim=32, hidden_size=64, mlp_ratio=2)
    config = config_cls(
        text_config=text_config, vision_config=vision_config, image_token_id=pad, video_token_id=video,
        vision_start_token_id=start, vision_end_token_id=end, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(9)
    model = model_cls(config)
    randomize_weights(model, 9)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    Qwen2VLImageProcessorPil(
        min_pixels=256, max_pixels=4096, patch_size=4, merge_size=2, temporal_patch_size=2
    ).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@torch.inference_mode()
def hf_qwen2_vl_greedy_and_logprobs(path: str | Path, prompt: str, images: list, max_new_tokens: int):
    """transformers' Qwen2-VL (or Qwen2.5-VL: the checkpoint's architecture), float32, as
    ``hf_llava_greedy_and_logprobs`` (its processor needs torchvision for videos, so the prompt's image pads are
    expanded here: t * h * w / 4 each)."""
    from transformers import AutoImageProcessor, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = _load_hf_vlm(_hf_vlm_class(path), str(path))
    pad = model.config.image_token_id
    ids = tokenizer(prompt)["input_ids"]
    kwargs = {}
    if images:
        pixels = AutoImageProcessor.from_pretrained(str(path))(images=images, return_tensors="pt")
        counts = iter((pixels["image_grid_thw"].prod(-1) // 4).tolist())
        ids = [t for tok in ids for t in ([pad] * next(counts) if tok == pad else [tok])]
        kwargs = dict(pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"])
    input_ids = torch.tensor([ids])
    kwargs["mm_token_type_ids"] = (input_ids == pad).int()
    new_ids, logprobs = _hf_vlm_generate(model, max_new_tokens, input_ids=input_ids, **kwargs)
    return ids, new_ids, logprobs


GEMMA3_IMAGE = "<start_of_image>"
GEMMA3_MM_TOKENS = 16  # image tokens an image takes in the tiny Gemma 3


def make_tiny_gemma3_vl(path: str | Path) -> str:
    """Save a tiny random ``Gemma3ForConditionalGeneration`` checkpoint (SigLIP tower: 56x56 images, 7x7 patches,
    2 layers of width 32; the 8x8 patch grid pooled to 16 image tokens; the tiny Gemma 3 text model with a sliding
    window of 8 on layer 0, shorter than an image's 16 tokens), its tokenizer (``<start_of_image>``,
    ``<end_of_image>``, ``<image_soft_token>`` added) and image processor (``Gemma3ImageProcessorPil``) to
    ``path``."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = train_tiny_tokenizer()
    specials = [GEMMA3_IMAGE, "<end_of_image>", "<image_soft_token>"]
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    boi, eoi, image = tokenizer.convert_tokens_to_ids(specials)
    text_config = _tiny_config(
        "gemma3", len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id,
        sliding_window=8,
    )  # fmt: skip
    vision_config = SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=56,
        patch_size=7, vision_use_head=False,
    )  # fmt: skip
    config = Gemma3Config(
        text_config=text_config.to_dict(), vision_config=vision_config.to_dict(), mm_tokens_per_image=GEMMA3_MM_TOKENS,
        boi_token_index=boi, eoi_token_index=eoi, image_token_index=image,
    )  # fmt: skip
    torch.manual_seed(11)
    model = Gemma3ForConditionalGeneration(config)
    randomize_weights(model, 11)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    Gemma3ImageProcessorPil(size={"height": 56, "width": 56}).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@torch.inference_mode()
def hf_gemma3_vl_greedy_and_logprobs(path: str | Path, prompt: str, images: list, max_new_tokens: int):
    """transformers' Gemma 3 with images, float32, as ``hf_llava_greedy_and_logprobs``: each ``<start_of_image>``
    of the prompt becomes, as ``Gemma3Processor`` lays it out, a blank line, ``<start_of_image>`` + 16 image tokens
    + ``<end_of_image>``, another blank line (with no image, the text is kept), and ``token_type_ids`` marks
    the image tokens (their bidirectional block mask)."""
    from transformers import AutoImageProcessor, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = _load_hf_vlm(_hf_vlm_class(path), str(path))
    cfg = model.config
    if images:  # Gemma3Processor's layout: a blank line before and after each <start_of_image>
        boi = tokenizer.convert_ids_to_tokens(model.config.boi_token_id)
        prompt = prompt.replace(boi, f"\n\n{boi}\n\n")
    ids = []
    for tok in tokenizer(prompt)["input_ids"]:
        ids += [tok, *[cfg.image_token_id] * cfg.mm_tokens_per_image, cfg.eoi_token_id] if tok == cfg.boi_token_id else [tok]
    input_ids = torch.tensor([ids])
    kwargs = {"token_type_ids": (input_ids == cfg.image_token_id).long()}
    if images:
        kwargs["pixel_values"] = AutoImageProcessor.from_pretrained(str(path))(images=images, return_tensors="pt")[
            "pixel_values"
        ]
    new_ids, logprobs = _hf_vlm_generate(model, max_new_tokens, input_ids=input_ids, **kwargs)
    return ids, new_ids, logprobs
