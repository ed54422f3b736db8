"""CPU offloading with a multimodal model: a device cache of few blocks and a second pass over image prompts served
from the CPU tier. Blocks over an image are keyed by its content, so the greedy tokens equal a roomy engine's, the
CPU tier serves hits, an image whose tokens all load is not encoded again, and nothing leaks."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.utils import tiny_image

ENGINE = dict(device="cpu", dtype="float32", block_size=4, max_model_len=64, enforce_eager=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _second_pass_stats(path: str, num_blocks: int, prompts: list, want: list) -> tuple:
    """Two passes over ``prompts`` with CPU offloading and ``num_blocks`` device blocks, each giving ``want`` and
    leaving no block behind; the core's stats before and after the second pass."""
    with LLM(path, num_gpu_blocks_override=num_blocks, kv_offloading_size=0.01, **ENGINE) as llm:
        core = llm.llm_engine.engine_core
        for _ in range(2):
            before = core.get_stats()
            assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == want
            core.check_integrity()
            kv = core.kv_cache_manager
            assert kv.num_free_blocks == kv.pool.num_blocks and not llm.llm_engine.has_unfinished_requests()
        return before, core.get_stats()


def test_offloaded_image_prefixes_give_the_same_tokens(tiny_llava: str) -> None:
    prompts = [
        {"prompt": f"<image>\nwhat is in picture {i} please", "multi_modal_data": {"image": tiny_image(i % 3)}}
        for i in range(6)
    ]
    with LLM(tiny_llava, num_gpu_blocks_override=200, **ENGINE) as roomy:
        want = [o.outputs[0].token_ids for o in roomy.generate(prompts, GREEDY, use_tqdm=False)]
    before, after = _second_pass_stats(tiny_llava, 24, prompts, want)
    assert after.external_prefix_cache_hits > before.external_prefix_cache_hits  # the second pass loaded blocks
    assert after.encoder_cache_queries == before.encoder_cache_queries  # ...over its images: none re-encoded


@pytest.mark.parametrize("fixture", ["tiny_llava", "tiny_qwen2_vl"])
def test_loads_that_end_inside_an_image(request, fixture: str) -> None:
    """Prompts that end with their image: the CPU tier's whole blocks end inside the image's tokens, the image is
    encoded again for the rest of them (Qwen2-VL: at its 3-D positions), and the tokens stay the same."""
    path = request.getfixturevalue(fixture)
    with LLM(path, num_gpu_blocks_override=200, **ENGINE) as roomy:
        mark = roomy.llm_engine.input_processor.image_placeholder
        prompts = [{"prompt": f"hi {'a ' * j}{mark}", "multi_modal_data": {"image": tiny_image(j)}} for j in range(6)]
        want = [o.outputs[0].token_ids for o in roomy.generate(prompts, GREEDY, use_tqdm=False)]
    before, after = _second_pass_stats(path, 16, prompts, want)
    assert after.external_prefix_cache_hits > before.external_prefix_cache_hits
    assert after.encoder_cache_queries > before.encoder_cache_queries  # partly loaded images, encoded again
