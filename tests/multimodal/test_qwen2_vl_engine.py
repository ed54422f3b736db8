"""Qwen2-VL through the engine: dynamic resolution (an image's tokens follow its size) and M-RoPE (3-D prompt
positions, shifted positions after them) give transformers' greedy tokens and logprobs (float32, CPU): one image,
two images of different sizes, text only, chunks splitting image spans, a prefix hit, and chat image parts."""

from __future__ import annotations

import base64
import io

import pytest

from pagedllm import LLM, SamplingParams
from tests.utils import QWEN2_VL_IMAGE, hf_qwen2_vl_greedy_and_logprobs, tiny_image

MAX_NEW = 6
ENGINE = dict(device="cpu", dtype="float32", block_size=4, max_model_len=192, num_gpu_blocks_override=160, enforce_eager=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=1)
CASES = [
    (f"hello {QWEN2_VL_IMAGE} world the", [tiny_image(1)]),  # 40x30: 20 tokens
    (f"a {QWEN2_VL_IMAGE} b {QWEN2_VL_IMAGE} c", [tiny_image(2), tiny_image(3, (20, 50))]),  # 20 + 12 tokens
    ("just text here", []),
]


def _prompt(prompt: str, images: list):
    return {"prompt": prompt, "multi_modal_data": {"image": images}} if images else prompt


def _check(path: str, out, prompt: str, images: list) -> None:
    ids, new, logprobs = hf_qwen2_vl_greedy_and_logprobs(path, prompt, images, MAX_NEW)
    assert out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == new
    for j, tok in enumerate(new):
        assert abs(out.outputs[0].logprobs[j][tok].logprob - logprobs[j][tok].item()) < 1e-4


def _assert_clean(llm: LLM) -> None:
    core = llm.llm_engine.engine_core
    core.scheduler.check_integrity()
    assert not core.scheduler.encoder_cache.cached


@pytest.mark.parametrize("max_num_batched_tokens", [None, 8])
def test_matches_transformers(tiny_qwen2_vl: str, max_num_batched_tokens) -> None:
    """All prompts in one batch; with 8-token steps every image span is split over several chunks (some chunks
    hold image tokens, some only the text after an image, which still needs the 3-D table)."""
    with LLM(tiny_qwen2_vl, max_num_batched_tokens=max_num_batched_tokens, **ENGINE) as llm:
        outs = llm.generate([_prompt(p, imgs) for p, imgs in CASES], GREEDY, use_tqdm=False)
        _assert_clean(llm)
    for (prompt, images), out in zip(CASES, outs):
        _check(tiny_qwen2_vl, out, prompt, images)


def test_prefix_hit_and_chat(tiny_qwen2_vl: str) -> None:
    prompt, images = CASES[0]
    image = images[0]
    with LLM(tiny_qwen2_vl, **ENGINE) as llm:
        first = llm.generate(_prompt(prompt, images), GREEDY, use_tqdm=False)[0]
        again = llm.generate(_prompt(prompt, images), GREEDY, use_tqdm=False)[0]
        assert again.num_cached_tokens == (len(first.prompt_token_ids) - 1) // 4 * 4
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                 {"type": "text", "text": "describe"}]}]  # fmt: skip
        chat = llm.chat(messages, GREEDY, use_tqdm=False)[0]
        tok = llm.get_tokenizer()
        text = tok.apply_chat_template(
            [{"role": "user", "content": f"{QWEN2_VL_IMAGE}\ndescribe"}], tokenize=False, add_generation_prompt=True
        )
        assert chat.prompt == text
        ids = tok(text, add_special_tokens=False)["input_ids"]
        direct = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": image}}, GREEDY,
                              use_tqdm=False)[0]  # fmt: skip
        assert chat.outputs[0].token_ids == direct.outputs[0].token_ids
        _assert_clean(llm)
    _check(tiny_qwen2_vl, first, prompt, images)


def qwen_vl_module_name(name: str) -> str:
    """A Qwen2(.5)-VL checkpoint name as transformers 5's module names spell it (visual.* -> model.visual.*,
    model.* -> model.language_model.*)."""
    if name.startswith("visual."):
        return "model." + name
    if name.startswith("model."):
        return "model.language_model." + name[len("model.") :]
    return name


def test_transformers5_checkpoint_names_load(tiny_qwen2_vl: str, tmp_path) -> None:
    """transformers saves Qwen's original names (visual.*, model.*, lm_head.*); its module names
    (model.visual.*, model.language_model.*) load into the same model too."""
    from tests.multimodal.test_llava_engine import _resave_with_names

    path = _resave_with_names(tiny_qwen2_vl, tmp_path / "renamed", qwen_vl_module_name)
    prompt, images = CASES[0]
    with LLM(path, **ENGINE) as other:
        out = other.generate(_prompt(prompt, images), GREEDY, use_tqdm=False)[0]
    _check(tiny_qwen2_vl, out, prompt, images)
