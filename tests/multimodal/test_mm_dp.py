"""Data parallelism with a multimodal model: ``data_parallel_size=2`` engine copies (in-process cores behind ``LLM``,
one core process per rank behind ``AsyncLLM``) give the single engine's greedy tokens for image and text requests
spread over both ranks; every rank encodes the images of the requests it serves and leaks nothing."""

from __future__ import annotations

import asyncio

from pagedllm import LLM, SamplingParams
from pagedllm.config import make_engine_config
from pagedllm.engine.async_llm import AsyncLLM
from tests.utils import tiny_image

ENGINE = dict(device="cpu", dtype="float32", block_size=4, max_model_len=128, num_gpu_blocks_override=96)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _prompts() -> list:
    images = [{"prompt": "<image>\nwhat is it", "multi_modal_data": {"image": tiny_image(i)}} for i in range(5)]
    return images + ["hello there", "one two three"]


def test_data_parallel_equals_one_engine(tiny_llava: str) -> None:
    prompts = _prompts()
    with LLM(tiny_llava, enforce_eager=True, **ENGINE) as one:
        want = [o.outputs[0].token_ids for o in one.generate(prompts, GREEDY, use_tqdm=False)]
    with LLM(tiny_llava, data_parallel_size=2, enforce_eager=True, **ENGINE) as two:
        got = [o.outputs[0].token_ids for o in two.generate(prompts, GREEDY, use_tqdm=False)]
        cores = two.llm_engine.engine_core.cores
        assert all(c.get_stats().encoder_cache_queries > 0 for c in cores), "both ranks must have encoded images"
        for c in cores:
            assert not c.scheduler.requests
            c.scheduler.check_integrity()
    assert got == want

    async def run() -> list[list[int]]:
        engine = AsyncLLM(make_engine_config(tiny_llava, data_parallel_size=2, **ENGINE))
        try:

            async def final(i: int, p) -> list[int]:
                last = None
                async for out in engine.generate(p, GREEDY, f"r{i}"):
                    last = out
                return last.outputs[0].token_ids

            return list(await asyncio.gather(*(final(i, p) for i, p in enumerate(prompts))))
        finally:
            engine.shutdown()

    assert asyncio.run(run()) == want
