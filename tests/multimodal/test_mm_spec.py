"""n-gram speculative decoding on multimodal models: greedy tokens equal decoding without speculation (LLaVA's fixed
image spans, Qwen2-VL's and Qwen2.5-VL's 3-D positions, where each generated token counts on from the prompt's last
position, Gemma 3's bidirectional image spans), with
drafts proposed and verified, images mixed with text-only requests, and nothing left behind."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.utils import tiny_image

ENGINE = dict(device="cpu", dtype="float32", block_size=4, max_model_len=192, num_gpu_blocks_override=160,
              enforce_eager=True)  # fmt: skip
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize(
    "fixture, mark",
    [("tiny_llava", "<image>"), ("tiny_qwen2_vl", None), ("tiny_qwen2_5_vl", None), ("tiny_gemma3_vl", None)],
)
def test_ngram_speculation_equals_plain_decoding(request, fixture: str, mark: str | None) -> None:
    path = request.getfixturevalue(fixture)
    with LLM(path, **ENGINE) as plain, LLM(path, speculative_config=NGRAM, **ENGINE) as spec:
        ip = plain.llm_engine.input_processor
        mark = mark or ip.image_placeholder
        text = "one two one two one two"
        prompts = [
            {"prompt": f"{mark}\n{text}", "multi_modal_data": {"image": tiny_image(5)}},
            {"prompt": f"{text} {mark} {text}", "multi_modal_data": {"image": tiny_image(6, (28, 56))}},
            text + " three",  # text only, in the same batch
        ]
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
        got = [o.outputs[0].token_ids for o in spec.generate(prompts, GREEDY, use_tqdm=False)]
        assert got == want
        stats = spec.llm_engine.engine_core.get_stats()
        assert stats.spec_num_drafts > 0 and stats.spec_num_accepted_tokens > 0  # multi-token verification steps
        core = spec.llm_engine.engine_core
        assert not core.scheduler.requests
        core.scheduler.check_integrity()
