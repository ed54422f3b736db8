"""Qwen2.5-VL through the engine: Qwen2-VL's text side and processor with its own tower (RMSNorm, gated MLP, window
attention in block 0 and full attention in block 1 of the tiny model) give transformers' greedy tokens and logprobs
(float32, CPU): one image, two images of different sizes (several windows each, edge windows smaller), text only,
all in one batch, also with chunks splitting the image spans; a prefix hit on a repeated image; both checkpoint
namings."""

from __future__ import annotations

import pytest

from pagedllm import LLM
from tests.multimodal.test_llava_engine import _resave_with_names
from tests.multimodal.test_qwen2_vl_engine import (
    CASES,
    ENGINE,
    GREEDY,
    _assert_clean,
    _check,
    _prompt,
    qwen_vl_module_name,
)


@pytest.mark.parametrize("max_num_batched_tokens", [None, 8])
def test_matches_transformers(tiny_qwen2_5_vl: str, max_num_batched_tokens) -> None:
    with LLM(tiny_qwen2_5_vl, max_num_batched_tokens=max_num_batched_tokens, **ENGINE) as llm:
        outs = llm.generate([_prompt(p, imgs) for p, imgs in CASES], GREEDY, use_tqdm=False)
        _assert_clean(llm)
    for (prompt, images), out in zip(CASES, outs):
        _check(tiny_qwen2_5_vl, out, prompt, images)


def test_prefix_hit_on_a_repeated_image(tiny_qwen2_5_vl: str) -> None:
    prompt, images = CASES[1]
    with LLM(tiny_qwen2_5_vl, **ENGINE) as llm:
        runner = llm.llm_engine.engine_core.runner.encoder_runner
        first = llm.generate(_prompt(prompt, images), GREEDY, use_tqdm=False)[0]
        encoded = runner.num_encoded
        again = llm.generate(_prompt(prompt, images), GREEDY, use_tqdm=False)[0]
        assert again.num_cached_tokens == (len(first.prompt_token_ids) - 1) // 4 * 4
        assert runner.num_encoded == encoded  # the hit covered both images
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        _assert_clean(llm)
    _check(tiny_qwen2_5_vl, first, prompt, images)


def test_transformers5_checkpoint_names_load(tiny_qwen2_5_vl: str, tmp_path) -> None:
    """transformers saves Qwen's original names (visual.*, model.*, lm_head.*); its module names
    (model.visual.*, model.language_model.*) load into the same model too."""
    path = _resave_with_names(tiny_qwen2_5_vl, tmp_path / "renamed", qwen_vl_module_name)
    prompt, images = CASES[0]
    with LLM(path, **ENGINE) as other:
        out = other.generate(_prompt(prompt, images), GREEDY, use_tqdm=False)[0]
    _check(tiny_qwen2_5_vl, out, prompt, images)


def test_tied_word_embeddings(tiny_qwen2_5_vl: str, tmp_path) -> None:
    """Small Qwen2-VL / Qwen2.5-VL checkpoints tie the LM head to the embeddings (``tie_word_embeddings`` on the outer
    config, no ``lm_head.weight``): the text model ties them too."""
    import json

    from safetensors.torch import load_file, save_file

    path = _resave_with_names(tiny_qwen2_5_vl, tmp_path / "tied", lambda name: name)
    weights = load_file(f"{path}/model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, f"{path}/model.safetensors")
    with open(f"{path}/config.json", encoding="utf-8") as f:
        config = json.load(f)
    config["tie_word_embeddings"] = True
    with open(f"{path}/config.json", "w", encoding="utf-8") as f:
        json.dump(config, f)
    prompt, images = CASES[0]
    with LLM(path, **ENGINE) as llm:
        out = llm.generate(_prompt(prompt, images), GREEDY, use_tqdm=False)[0]
    _check(path, out, prompt, images)
