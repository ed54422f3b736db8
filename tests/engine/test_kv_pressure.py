"""KV pressure through AsyncLLM (engine core in its own process): more concurrent long requests than the cache
holds. They are preempted and recomputed, all complete, and each greedy output equals transformers' for that
prompt alone; nothing hangs and nothing leaks."""

from __future__ import annotations

import asyncio
import random

import pytest

from pagedllm.config import make_engine_config
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from tests.utils import hf_greedy

NUM_REQUESTS = 8
MAX_NEW = 36
BLOCK_SIZE = 4
MAX_MODEL_LEN = 64
# One sequence at max_model_len needs 16 blocks; 8 requests of 40-60 tokens need ~100 together.
NUM_BLOCKS = 24


@pytest.mark.usefixtures("admit_while_blocks_last")
async def test_preemption_under_kv_pressure_keeps_greedy_outputs(tiny_llama):
    config = make_engine_config(
        tiny_llama,
        dtype="float32",
        device="cpu",
        block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
        num_gpu_blocks_override=NUM_BLOCKS,
    )
    engine = AsyncLLM(config)
    try:
        rng = random.Random(0)
        vocab = engine.engine_core.vocab_size
        prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(4, 24))] for _ in range(NUM_REQUESTS)]

        async def run(i: int) -> list[int]:
            # Half stream deltas (checked to add up), half get only the final output.
            kind = RequestOutputKind.DELTA if i % 2 else RequestOutputKind.FINAL_ONLY
            params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, output_kind=kind)
            token_ids: list[int] = []
            last = None
            async for out in engine.generate({"prompt_token_ids": prompts[i]}, params, f"req-{i}"):
                token_ids += out.outputs[0].token_ids
                last = out
            assert last is not None and last.finished and last.outputs[0].finish_reason == "length"
            return token_ids

        got = await asyncio.wait_for(asyncio.gather(*(run(i) for i in range(NUM_REQUESTS))), 120)
        stats = await engine.get_stats()
        print(
            f"KV pressure: {NUM_REQUESTS} requests, {NUM_BLOCKS} blocks, {stats.num_preemptions} preemptions"
        )
        assert stats.num_preemptions > 0, stats
        assert stats.num_running_reqs == stats.num_waiting_reqs == 0 and stats.kv_cache_usage == 0.0
        assert stats.num_integrity_failures == 0
        await engine.check_integrity()
        state = await engine.debug_state()
        assert state["num_requests"] == state["num_frontend_requests"] == 0
        assert state["num_free_blocks"] == NUM_BLOCKS
    finally:
        engine.shutdown()
    assert got == hf_greedy(tiny_llama, prompts, MAX_NEW)
