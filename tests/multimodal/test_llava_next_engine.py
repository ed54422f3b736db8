"""LLaVA-NeXT through the engine: any-resolution tiles (an image's placeholder count follows its size, as
transformers' processor counts it), unpadding and ``image_newline`` give transformers' greedy tokens and logprobs
(float32, CPU): one image, two images of different sizes, text only, all in one batch, also with chunks splitting
the image spans; a prefix hit on a repeated image; both checkpoint namings."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagedllm import LLM
from pagedllm.multimodal.processing import llava_next_max_image_tokens, llava_next_num_image_tokens
from tests.multimodal.test_llava_engine import (
    GREEDY,
    _assert_clean,
    _check_against_hf,
    _core,
    _mm,
    _resave_with_names,
)
from tests.utils import tiny_image

ENGINE = dict(device="cpu", dtype="float32", block_size=4, max_model_len=256, num_gpu_blocks_override=160, enforce_eager=True)
CASES = [
    ("hello <image> world the", [tiny_image(1)]),  # 40x30: 2x2 tiles, 70 tokens
    ("<image> the cat <image> and the dog", [tiny_image(2), tiny_image(3, (20, 50))]),  # 70 + 56 (1x2 tiles)
    ("the quick brown fox", []),
]


def test_placeholder_counts_match_the_processor(tiny_llava_next: str) -> None:
    """Our count of an image's tokens is transformers' processor's, for the tiny model and for LLaVA-v1.6's real
    tiling (336-pixel tiles of 14-pixel patches), over sizes and aspect ratios; the encoder cache's bound holds."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_llava_next)
    real_pinpoints = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
    sizes = [(30, 40), (50, 20), (1, 1), (28, 56), (336, 1008), (1000, 10), (10, 1000), (480, 640), (333, 777)]
    for tile, patch, pinpoints in ((28, 7, processor.image_processor.image_grid_pinpoints), (336, 14, real_pinpoints)):
        config = SimpleNamespace(
            vision_config=SimpleNamespace(image_size=tile, patch_size=patch), image_grid_pinpoints=pinpoints,
            vision_feature_select_strategy="default",
        )  # fmt: skip
        processor.patch_size = patch
        processor.image_processor.image_grid_pinpoints = pinpoints
        bound = llava_next_max_image_tokens(config)
        for h, w in sizes:
            expected = processor._get_number_of_features(h, w, tile, tile) - 1  # "default": no CLS
            assert llava_next_num_image_tokens(config, h, w) == expected, (tile, h, w)
            assert expected <= bound


@pytest.mark.parametrize("max_num_batched_tokens", [None, 8])
def test_matches_transformers(tiny_llava_next: str, max_num_batched_tokens) -> None:
    """All prompts in one batch; with 8-token steps every image's span is computed over many chunks (its
    embeddings computed once)."""
    with LLM(tiny_llava_next, max_num_batched_tokens=max_num_batched_tokens, **ENGINE) as llm:
        outs = llm.generate([_mm(p, imgs) if imgs else p for p, imgs in CASES], GREEDY, use_tqdm=False)
        assert _core(llm).runner.encoder_runner.num_encoded == 3
        _assert_clean(llm)
    image_id = llm.get_tokenizer().convert_tokens_to_ids("<image>")
    assert [o.prompt_token_ids.count(image_id) for o in outs] == [70, 126, 0]
    for (prompt, images), out in zip(CASES, outs):
        _check_against_hf(tiny_llava_next, out, prompt, images)


def test_prefix_hit_on_a_repeated_image(tiny_llava_next: str) -> None:
    """The same image hits the prefix cache; another (wide: 1x2 tiles, the third layout) misses from its first
    block."""
    prompt = "hello <image> world and the rest"
    wide = tiny_image(12, (60, 20))
    with LLM(tiny_llava_next, **ENGINE) as llm:
        runner = _core(llm).runner.encoder_runner
        first = llm.generate(_mm(prompt, [tiny_image(11)]), GREEDY, use_tqdm=False)[0]
        again = llm.generate(_mm(prompt, [tiny_image(11)]), GREEDY, use_tqdm=False)[0]
        other = llm.generate(_mm(prompt, [wide]), GREEDY, use_tqdm=False)[0]
        ids = first.prompt_token_ids
        image_start = ids.index(llm.get_tokenizer().convert_tokens_to_ids("<image>"))
        assert again.num_cached_tokens == (len(ids) - 1) // 4 * 4
        assert other.num_cached_tokens == image_start // 4 * 4  # the blocks wholly before the image only
        assert runner.num_encoded == 2  # the hit covered the image
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        _assert_clean(llm)
    _check_against_hf(tiny_llava_next, first, prompt, [tiny_image(11)])
    _check_against_hf(tiny_llava_next, other, prompt, [wide])


@pytest.mark.parametrize(
    "renames",
    [
        # transformers 5's module names
        (("vision_tower.", "model.vision_tower."), ("multi_modal_projector.", "model.multi_modal_projector."),
         ("image_newline", "model.image_newline"), ("language_model.model.", "model.language_model."),
         ("language_model.lm_head.", "lm_head.")),
        # llava-hf's v1.6 checkpoints: the CLIP tower under vision_model
        (("vision_tower.", "vision_tower.vision_model."),),
    ],
)  # fmt: skip
def test_other_checkpoint_names_load(tiny_llava_next: str, tmp_path, renames) -> None:
    """transformers saves the tiny model as vision_tower.*, multi_modal_projector.*, image_newline,
    language_model.model.*, language_model.lm_head.*; the other spellings load into the same model."""

    def rename(name: str) -> str:
        for old, new in renames:
            if name.startswith(old):
                return new + name[len(old) :]
        return name

    path = _resave_with_names(tiny_llava_next, tmp_path / "renamed", rename)
    prompt, images = CASES[0]
    with LLM(path, **ENGINE) as other:
        out = other.generate(_mm(prompt, images), GREEDY, use_tqdm=False)[0]
    _check_against_hf(tiny_llava_next, out, prompt, images)
