"""LLaVA-1.5 through the engine: greedy tokens and logprobs equal transformers' (float32, CPU) with one image,
several images, chunks that split an image's placeholders, prefix hits on a repeated image, and batches mixing
text-only and image prompts; the encoder runs once per image and its cache empties."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.utils import hf_llava_greedy_and_logprobs, tiny_image

MAX_NEW = 6
ENGINE = dict(device="cpu", dtype="float32", block_size=4, max_model_len=128, num_gpu_blocks_override=96, enforce_eager=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=1)


def _check_against_hf(path: str, out, prompt: str, images: list) -> None:
    ids, new, logprobs = hf_llava_greedy_and_logprobs(path, prompt, images, MAX_NEW)
    assert out.prompt_token_ids == ids
    comp = out.outputs[0]
    assert comp.token_ids == new
    for j, tok in enumerate(new):
        assert abs(comp.logprobs[j][tok].logprob - logprobs[j][tok].item()) < 1e-4


def _mm(prompt: str, images: list) -> dict:
    return {"prompt": prompt, "multi_modal_data": {"image": images if len(images) != 1 else images[0]}}


def _core(llm: LLM):
    return llm.llm_engine.engine_core


def _assert_clean(llm: LLM) -> None:
    """No KV block or encoder cache entry held once everything finished."""
    core = _core(llm)
    core.scheduler.check_integrity()
    enc = core.scheduler.encoder_cache
    assert not enc.cached and enc.num_free_slots + enc.num_freeable_slots == enc.cache_size


@pytest.fixture(scope="module")
def llm(tiny_llava: str):
    with LLM(tiny_llava, **ENGINE) as engine:
        yield engine


def test_one_and_several_images_match_transformers(llm: LLM, tiny_llava: str) -> None:
    cases = [
        ("hello <image> world the", [tiny_image(1)]),
        ("<image> the cat <image> and the dog", [tiny_image(2), tiny_image(3, (20, 50))]),
    ]
    outs = llm.generate([_mm(p, imgs) for p, imgs in cases], GREEDY, use_tqdm=False)
    for (prompt, images), out in zip(cases, outs):
        _check_against_hf(tiny_llava, out, prompt, images)
    _assert_clean(llm)


def test_batch_mixes_text_only_and_image_prompts(llm: LLM, tiny_llava: str) -> None:
    cases = [
        ("the quick brown fox", []),
        ("count the <image> birds", [tiny_image(4)]),
        ("one two three four five", []),
        ("<image><image> two images side by side", [tiny_image(5), tiny_image(6)]),
    ]
    prompts = [_mm(p, imgs) if imgs else p for p, imgs in cases]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for (prompt, images), out in zip(cases, outs):
        _check_against_hf(tiny_llava, out, prompt, images)
    _assert_clean(llm)


def test_chunks_split_the_image_span(tiny_llava: str) -> None:
    """8-token steps: the 16 placeholders of each image are computed over two or three chunks, each merging its
    slice of the image's embeddings (computed once)."""
    cases = [("hello <image> world the", [tiny_image(1)]), ("a <image> b <image> c", [tiny_image(7), tiny_image(8)])]
    with LLM(tiny_llava, max_num_batched_tokens=8, **ENGINE) as llm:
        runner = _core(llm).runner
        outs = llm.generate([_mm(p, imgs) for p, imgs in cases], GREEDY, use_tqdm=False)
        assert runner.encoder_runner.num_encoded == 3
        # once their placeholders were computed the entries became freeable: the runner keeps only those the
        # scheduler still counts (evicted ones were dropped)
        assert set(runner.encoder_runner.cache) == set(_core(llm).scheduler.encoder_cache.freeable)
        _assert_clean(llm)
    for (prompt, images), out in zip(cases, outs):
        _check_against_hf(tiny_llava, out, prompt, images)


def test_prefix_cache_hits_the_same_image_and_misses_another(llm: LLM, tiny_llava: str) -> None:
    prompt = "hello <image> world and the rest of the prompt"
    first = llm.generate(_mm(prompt, [tiny_image(11)]), GREEDY, use_tqdm=False)[0]
    runner = _core(llm).runner.encoder_runner
    encoded = runner.num_encoded
    again = llm.generate(_mm(prompt, [tiny_image(11)]), GREEDY, use_tqdm=False)[0]
    other = llm.generate(_mm(prompt, [tiny_image(12)]), GREEDY, use_tqdm=False)[0]
    ids = first.prompt_token_ids
    image_start = ids.index(llm.get_tokenizer().convert_tokens_to_ids("<image>"))
    assert ids[image_start : image_start + 16] == [ids[image_start]] * 16
    assert again.num_cached_tokens == (len(ids) - 1) // 4 * 4  # every full block but the last token's
    assert again.num_cached_tokens >= image_start + 16
    assert runner.num_encoded == encoded + 1  # the hit covered the image: only the other image was encoded
    assert other.num_cached_tokens == image_start // 4 * 4  # the blocks wholly before the image only
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    _check_against_hf(tiny_llava, other, prompt, [tiny_image(12)])
    _assert_clean(llm)


def test_concurrent_requests_share_one_encoding(llm: LLM) -> None:
    runner = _core(llm).runner.encoder_runner
    encoded = runner.num_encoded
    llm.reset_prefix_cache()
    before = _core(llm).scheduler.make_stats()
    prompts = [_mm(f"{w} <image> tail", [tiny_image(21)]) for w in ("one", "two", "three")]
    llm.generate(prompts, GREEDY, use_tqdm=False)
    assert runner.num_encoded == encoded + 1
    after = _core(llm).scheduler.make_stats()  # three queries of the image, two of them hits
    assert after.encoder_cache_queries - before.encoder_cache_queries == 3
    assert after.encoder_cache_hits - before.encoder_cache_hits == 2
    llm.generate([_mm("four <image> tail", [tiny_image(22)]), _mm("five <image> tail", [tiny_image(23)])], GREEDY,
                 use_tqdm=False)  # fmt: skip
    last = _core(llm).scheduler.make_stats()  # different images: no hit
    assert last.encoder_cache_queries == after.encoder_cache_queries + 2
    assert last.encoder_cache_hits == after.encoder_cache_hits
    _assert_clean(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_and_async_scheduling(tiny_llava: str, admit_while_blocks_last, async_scheduling: bool) -> None:
    """A cache too small for every request at once: requests are preempted mid-image or after it, recomputed (their
    images encoded again), and still give transformers' tokens; with async scheduling too."""
    engine = {**ENGINE, "max_model_len": 48, "num_gpu_blocks_override": 12, "max_num_batched_tokens": 12}
    cases = [(f"{w} <image> the end of it", [tiny_image(50 + i)]) for i, w in enumerate(("one", "two"))]
    with LLM(tiny_llava, async_scheduling=async_scheduling, **engine) as llm:
        outs = llm.generate([_mm(p, imgs) for p, imgs in cases], GREEDY, use_tqdm=False)
        stats = _core(llm).scheduler.make_stats()
        _assert_clean(llm)
        held = set(_core(llm).runner.encoder_runner.cache)  # the freeable entries only
        assert held == set(_core(llm).scheduler.encoder_cache.freeable) or async_scheduling
    assert stats.num_preemptions > 0
    for (prompt, images), out in zip(cases, outs):
        _check_against_hf(tiny_llava, out, prompt, images)


def test_token_id_prompts_with_expanded_or_single_placeholders(llm: LLM, tiny_llava: str) -> None:
    """A token-id prompt may hold one image token per image (expanded here) or the expanded run HF's processor
    makes (kept)."""
    image = tiny_image(60)
    prompt = "hello <image> world the"
    ids, new, _ = hf_llava_greedy_and_logprobs(tiny_llava, prompt, [image], MAX_NEW)
    image_id = llm.get_tokenizer().convert_tokens_to_ids("<image>")
    single = [t for i, t in enumerate(ids) if t != image_id or ids[i - 1] != image_id]
    for prompt_ids in (ids, single):
        out = llm.generate({"prompt_token_ids": prompt_ids, "multi_modal_data": {"image": image}}, GREEDY,
                           use_tqdm=False)[0]  # fmt: skip
        assert out.prompt_token_ids == ids and out.outputs[0].token_ids == new


def _resave_with_names(src: str, dst, rename) -> str:
    """Copy checkpoint ``src`` to ``dst`` with every tensor renamed by ``rename``."""
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file({rename(k): v for k, v in load_file(src / "model.safetensors").items()}, dst / "model.safetensors")
    return str(dst)


@pytest.mark.parametrize(
    "renames",
    [
        # transformers 5's module names
        (("vision_tower.", "model.vision_tower."), ("multi_modal_projector.", "model.multi_modal_projector."),
         ("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head.")),
        # llava-hf checkpoints: the CLIP tower under vision_model
        (("vision_tower.", "vision_tower.vision_model."),),
    ],
)  # fmt: skip
def test_other_checkpoint_names_load(llm: LLM, tiny_llava: str, tmp_path, renames) -> None:
    """transformers saves the tiny model with names of its own; the other spellings of LLaVA checkpoints load
    into the same model."""

    def rename(name: str) -> str:
        for old, new in renames:
            if name.startswith(old):
                return new + name[len(old) :]
        return name

    path = _resave_with_names(tiny_llava, tmp_path / "renamed", rename)
    prompt = _mm("hello <image> world the", [tiny_image(1)])
    with LLM(path, **ENGINE) as other:
        assert other.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == (
            llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        )
