"""The rollout hooks on ``AsyncLLM`` (the engine core in its own process): collective_rpc with a method name or a
callable, weight updates through it, and sleep mode refusing requests until woken."""

from __future__ import annotations

import pytest
import pytest_asyncio

from pagedllm.config import make_engine_config
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.core_process import EngineSleepingError
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = {"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13]}
PARAMS = SamplingParams(
    temperature=0.0, max_tokens=8, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_llama):
    config = make_engine_config(
        tiny_llama, dtype="float32", device="cpu", kv_cache_memory_bytes=4 << 20, enable_sleep_mode=True
    )
    eng = AsyncLLM(config)
    yield eng
    eng.shutdown()


async def tokens(engine: AsyncLLM, request_id: str) -> list[int]:
    outs = [out async for out in engine.generate(PROMPT, PARAMS, request_id)]
    return list(outs[-1].outputs[0].token_ids)


async def test_collective_rpc(engine):
    assert await engine.collective_rpc(lambda worker: worker.rank) == [0]
    assert await engine.collective_rpc("sleeping_tags") == [[]]
    with pytest.raises(ValueError, match="method"):
        await engine.collective_rpc("no_such_method")


async def test_sleep_refuses_requests_until_woken(engine):
    before = await tokens(engine, "a")
    await engine.sleep(level=1)
    assert await engine.is_sleeping()
    with pytest.raises(EngineSleepingError):
        await tokens(engine, "b")
    await engine.wake_up()
    assert not await engine.is_sleeping()
    assert await tokens(engine, "c") == before


async def test_update_through_collective_rpc(engine, updated_tiny_llama, tiny_llama):
    from tests.distributed.rl_workers import checkpoint_tensors

    before = await tokens(engine, "d")
    state = updated_tiny_llama[1]
    assert await engine.collective_rpc("update_weights", (list(state.items()),)) == [len(state)]
    assert await engine.reset_prefix_cache()
    after = await tokens(engine, "e")
    assert after != before
    await engine.collective_rpc("update_weights", (checkpoint_tensors(tiny_llama),))
    assert await engine.reset_prefix_cache()
    assert await tokens(engine, "f") == before
