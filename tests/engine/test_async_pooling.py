"""AsyncLLM.encode with a pooling model's core in its own process: concurrent requests match the offline engine,
bad input fails before anything is queued, cancelling a call drops its request, generation is refused."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
import torch

from pagedllm import LLM, PoolingParams, SamplingParams
from pagedllm.config import make_engine_config
from pagedllm.engine.async_llm import AsyncLLM
from tests.pooling.pooling_utils import TEXTS, make_st_embedder

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module")
def embedder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_st_embedder("xlm-roberta", tmp_path_factory.mktemp("async_pool") / "xlmr", "mean")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(embedder):
    eng = AsyncLLM(make_engine_config(embedder, device="cpu", max_num_batched_tokens=80, max_num_seqs=3))
    yield eng
    eng.shutdown()


async def test_concurrent_encode_matches_offline(engine, embedder) -> None:
    params = PoolingParams(task="embed")
    outs = await asyncio.gather(*(engine.encode(t, params, f"r{i}") for i, t in enumerate(TEXTS)))
    with LLM(embedder, max_num_batched_tokens=80) as llm:
        ref = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    ours = torch.stack([o.outputs.data for o in outs])
    assert torch.allclose(ours, ref, atol=1e-6, rtol=0)
    assert [o.prompt for o in outs] == TEXTS


async def test_bad_input_and_cancel(engine) -> None:
    with pytest.raises(ValueError, match="empty"):
        await engine.encode("", PoolingParams(task="embed"), "empty")
    with pytest.raises(ValueError, match="dimensions"):
        await engine.encode("a", PoolingParams(task="embed", dimensions=8), "dims")
    with pytest.raises(ValueError, match="pooling model"):
        engine.add_request("gen", "a", SamplingParams(max_tokens=2))
    params = PoolingParams(task="embed")
    tasks = [asyncio.ensure_future(engine.encode(TEXTS[3], params, f"c{i}")) for i in range(8)]
    await asyncio.sleep(0)
    for task in tasks[2:]:
        task.cancel()
    done = await asyncio.gather(*tasks, return_exceptions=True)
    assert sum(isinstance(d, asyncio.CancelledError) for d in done) >= 1
    assert engine.num_unfinished_requests == 0  # nothing left in flight on the front-end
    for _ in range(100):
        if await engine.is_idle():
            break
        await asyncio.sleep(0.05)
    assert await engine.is_idle()
    again = await engine.encode(TEXTS[0], params, "after")
    assert again.outputs.data.shape == (64,)
