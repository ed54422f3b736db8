"""GPT-OSS and Qwen2-MoE vs transformers on tiny random checkpoints (float32, CPU, torch attention backend).

Both go through the same checks as the other tiny architectures (logits of ragged / chunked steps, then the engine
under pressure: prompts longer than the sliding window, chunked prefill, prefix hits, preemption, greedy tokens
and logprobs), plus checks that the features the comparison relies on really are exercised: attention sinks, the
clamped SwiGLU (limit low enough to bite), the interleaved gate/up layout, YaRN, the window, the shared expert.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm.layers.attention import Attention
from pagedllm.layers.fused_moe import FusedMoE
from tests.models import test_arch_matrix as arch_matrix
from tests.models.test_models import (
    PagedRunner,
    assert_ragged_and_chunked_logits,
    hf_logits,
    load_ours,
    random_prompt,
)
from tests.utils import _default_weight, save_random_model, train_tiny_tokenizer

ATOL = 1e-5
WINDOW = 8  # far shorter than the test prompts

# variant -> (model_type, config overrides)
VARIANTS = {
    # layer 0 slides (transformers' default layer_types), layer 1 is global; YaRN; swiglu_limit 1 clamps often
    "gpt_oss": ("gpt_oss", {}),
    # explicit layer_types (not the default pattern), top-1 routing (softmax over one logit: weight 1)
    "gpt_oss-layer-types": (
        "gpt_oss",
        {
            "num_hidden_layers": 3,
            "layer_types": ["full_attention", "sliding_attention", "sliding_attention"],
            "num_experts_per_tok": 1,
        },
    ),
    "qwen2_moe": ("qwen2_moe", {}),  # every layer sparse; norm_topk_prob false
    # layer 0 dense (decoder_sparse_step 2) and sliding (max_window_layers 1); layer 1 sparse, renormalised, global
    "qwen2_moe-window-dense": (
        "qwen2_moe",
        {
            "norm_topk_prob": True,
            "decoder_sparse_step": 2,
            "use_sliding_window": True,
            "sliding_window": WINDOW,
            "max_window_layers": 1,
        },
    ),
}


def _config(model_type: str, tokenizer, **overrides):
    from transformers import GptOssConfig, Qwen2MoeConfig

    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        num_experts_per_tok=2,
    )
    if model_type == "gpt_oss":
        cls = GptOssConfig
        common.update(
            head_dim=32,  # != hidden_size / num_heads
            intermediate_size=48,
            num_local_experts=4,
            sliding_window=WINDOW,
            swiglu_limit=1.0,
            # as the released models (factor 32, original 4096, truncate false), scaled to the tiny context
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 8.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
            },
        )
    elif model_type == "qwen2_moe":
        cls = Qwen2MoeConfig
        common.update(
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=40,
            num_experts=6,
            norm_topk_prob=False,
            hidden_act="silu",
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    else:
        raise ValueError(model_type)
    common.update(overrides)
    return cls(**common)


def make_tiny(model_type: str, path: Path, seed: int, **overrides) -> str:
    """A tiny random checkpoint saved by transformers' ``save_pretrained`` (+ the tiny tokenizer). Weights are
    larger than transformers' init (std 0.15, random biases, sinks around 0.5 +- 1) so every part matters."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = train_tiny_tokenizer()
    config = _config(model_type, tokenizer, **overrides)
    return save_random_model(config, tokenizer, path, seed, weight=_weight)


def _weight(name: str) -> tuple[float, float]:
    """(offset, std): sinks around 0.5 +- 1; expert biases (``gate_up_proj_bias``, ...) small like the others."""
    if name.endswith("sinks"):
        return 0.5, 1.0
    if name.endswith("bias"):
        return 0.0, 0.1
    return _default_weight(name)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("gpt_oss_qwen2moe")
    return {
        name: make_tiny(model_type, root / name, seed=31 + i, **overrides)
        for i, (name, (model_type, overrides)) in enumerate(VARIANTS.items())
    }


def _logits(model, model_config, prompt: list[int]) -> torch.Tensor:  # [len, vocab]
    return PagedRunner(model, model_config).step({0: prompt})[0]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(model_dirs, variant: str) -> None:
    """Ragged prefill of three prompts (two longer than the window) in one forward, then chunked prefill + decode
    steps with padding tokens: transformers' logits at every position."""
    path = model_dirs[variant]
    model, model_config = load_ours(path)
    assert_ragged_and_chunked_logits(path, model, model_config, (5, 21, 13), ATOL)


@pytest.mark.parametrize("variant", ["gpt_oss", "qwen2_moe-window-dense"])
def test_engine_long_prompts_chunked_prefix_hits_preemption(model_dirs, variant: str) -> None:
    """The tiny-architecture matrix's engine check (tests/models/test_arch_matrix.py) on these models: prompts of
    41-44 tokens against a window of 8, chunks of 8 tokens, prefix-cache hits and preemption; greedy tokens equal
    transformers' and logprobs agree within 1e-4."""
    vocab = len(train_tiny_tokenizer())
    assert all(len(p) > 2 * WINDOW for p in arch_matrix._prompts(vocab))
    arch_matrix.test_long_prompts_chunked_prefix_hits_preemption({variant: model_dirs[variant]}, variant)


def _far(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a - b).abs().max().item() > 100 * ATOL


def test_gpt_oss_features_are_exercised(model_dirs) -> None:
    """The comparison above would catch each GPT-OSS detail done wrong: ignoring the sinks, the clamp, the window
    or YaRN, or reading gate and up the other way round, moves the logits far beyond the tolerance."""
    path = model_dirs["gpt_oss"]
    model, model_config = load_ours(path)
    prompt = random_prompt(30, model_config.vocab_size, seed=8)
    expected = hf_logits(path, prompt)
    torch.testing.assert_close(_logits(model, model_config, prompt), expected, atol=ATOL, rtol=0)
    attns = [m for m in model.modules() if isinstance(m, Attention)]
    moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert [a.sliding_window for a in attns] == [WINDOW, None]
    assert all(a.sinks is not None for a in attns) and len(moes) == 2

    with torch.no_grad():
        saved = [a.sinks.clone() for a in attns]
        for a in attns:
            a.sinks.fill_(-1e4)  # exp(-1e4) = 0: no sink
        assert _far(_logits(model, model_config, prompt), expected)
        for a, s in zip(attns, saved):
            a.sinks.copy_(s)

        for m in moes:
            m.swiglu_limit = 1e9
        assert _far(_logits(model, model_config, prompt), expected)
        for m in moes:
            m.swiglu_limit = 1.0

        for m in moes:  # gate and up swapped
            m.w13.copy_(m.w13.roll(m.w13.shape[1] // 2, dims=1))
            m.w13_bias.copy_(m.w13_bias.roll(m.w13_bias.shape[1] // 2, dims=1))
        assert _far(_logits(model, model_config, prompt), expected)
        for m in moes:
            m.w13.copy_(m.w13.roll(m.w13.shape[1] // 2, dims=1))
            m.w13_bias.copy_(m.w13_bias.roll(m.w13_bias.shape[1] // 2, dims=1))

    attns[0].sliding_window = None
    assert _far(_logits(model, model_config, prompt), expected)
    attns[0].sliding_window = WINDOW

    rotary = model.model.layers[0].self_attn.rotary_emb
    yarn_table = rotary.cos_sin_cache.clone()
    from pagedllm.layers.rotary import RotaryEmbedding

    rotary.cos_sin_cache = RotaryEmbedding(32, 512, 150000.0).cos_sin_cache  # plain RoPE, same theta
    assert _far(_logits(model, model_config, prompt), expected)
    rotary.cos_sin_cache = yarn_table
    torch.testing.assert_close(_logits(model, model_config, prompt), expected, atol=ATOL, rtol=0)


def test_qwen2_moe_shared_expert_and_routing_are_exercised(model_dirs) -> None:
    path = model_dirs["qwen2_moe"]
    model, model_config = load_ours(path)
    prompt = random_prompt(20, model_config.vocab_size, seed=9)
    expected = hf_logits(path, prompt)
    moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert len(moes) == 2
    with torch.no_grad():
        gates = [m.shared_expert_gate.weight.clone() for m in moes]
        for m in moes:
            m.shared_expert_gate.weight.zero_()  # sigmoid(0) = 0.5 instead of the learned per-token gate
        assert _far(_logits(model, model_config, prompt), expected)
        for m, g in zip(moes, gates):
            m.shared_expert_gate.weight.copy_(g)
    for m in moes:
        m.renormalize = True
    assert _far(_logits(model, model_config, prompt), expected)
    for m in moes:
        m.renormalize = False
    torch.testing.assert_close(_logits(model, model_config, prompt), expected, atol=ATOL, rtol=0)
    dense = load_ours(model_dirs["qwen2_moe-window-dense"])[0]
    assert [type(layer.mlp).__name__ for layer in dense.model.layers] == ["LlamaMLP", "Qwen2MoeSparseMoe"]
    assert [layer.self_attn.attn.sliding_window for layer in dense.model.layers] == [WINDOW, None]


def test_gpt_oss_stacked_experts_load_strictly(model_dirs, tmp_path: Path) -> None:
    """transformers' 3-D expert tensors land transposed and de-interleaved in the stacked [gate | up] tensors (the
    checkpoint parameters are views of them); a missing bias is reported by name."""
    src = Path(model_dirs["gpt_oss"])
    tensors = load_file(src / "model.safetensors")
    prefix = "model.layers.1.mlp.experts."
    assert tensors[prefix + "gate_up_proj"].shape == (4, 64, 96)  # [E, hidden, 2 * inter], interleaved
    assert tensors[prefix + "down_proj"].shape == (4, 48, 64)  # [E, inter, hidden]
    model, _ = load_ours(str(src))
    layer = model.model.layers[1].mlp
    gate_up, gate_up_bias = tensors[prefix + "gate_up_proj"], tensors[prefix + "gate_up_proj_bias"]
    for e in range(4):
        assert torch.equal(layer.w13[e, :48], gate_up[e, :, 0::2].T)
        assert torch.equal(layer.w13[e, 48:], gate_up[e, :, 1::2].T)
        assert torch.equal(layer.w13_bias[e], torch.cat([gate_up_bias[e, 0::2], gate_up_bias[e, 1::2]]))
        assert torch.equal(layer.w2[e], tensors[prefix + "down_proj"][e].T)
    assert torch.equal(layer.w2_bias, tensors[prefix + "down_proj_bias"])
    assert layer.experts.gate_up_proj.data_ptr() == layer.w13.data_ptr()
    assert layer.experts.down_proj_bias.data_ptr() == layer.w2_bias.data_ptr()
    assert torch.equal(model.model.layers[1].self_attn.sinks, tensors["model.layers.1.self_attn.sinks"])

    dst = tmp_path / "broken"
    shutil.copytree(src, dst)
    dropped = {k: v for k, v in tensors.items() if k != prefix + "down_proj_bias"}
    save_file(dropped, dst / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.experts\.down_proj_bias"):
        load_ours(str(dst))
