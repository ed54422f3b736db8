"""Data parallelism on CPU: ``data_parallel_size=2`` engine copies behind ``LLM`` (in-process cores) and behind
``AsyncLLM`` (one core process per rank). Output equals transformers' and the single engine's, requests spread
over the ranks, aborts reach the right rank, stats add up, nothing leaks."""

from __future__ import annotations

import asyncio
import random

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import make_engine_config
from pagedllm.engine.async_llm import AsyncLLM
from tests.utils import TINY_ARCHS, hf_greedy

MAX_NEW = 10


def _prompts(n: int = 6) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, 300) for _ in range(rng.randrange(2, 30))] for _ in range(n)]


def test_llm_data_parallel_matches_transformers(tiny_llama):
    llm = LLM(tiny_llama, device="cpu", dtype="float32", block_size=4, data_parallel_size=2)
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(tiny_llama, prompts, MAX_NEW)
    core = llm.llm_engine.engine_core
    per_rank = [c.get_stats().num_prompt_tokens for c in core.cores]
    assert all(n > 0 for n in per_rank), "both ranks must have served requests"
    assert core.get_stats().num_prompt_tokens == sum(per_rank) == sum(map(len, prompts))
    # Aborts reach the rank that holds the request; nothing leaks anywhere.
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(f"a{i}", {"prompt_token_ids": p}, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.abort_request([f"a{i}" for i in range(len(prompts))])
    assert not engine.has_unfinished_requests()
    core.check_integrity()
    for c in core.cores:
        assert c.kv_cache_manager.num_free_blocks == c.kv_cache_manager.pool.num_blocks


def test_data_parallel_size_is_checked(tiny_llama):
    with pytest.raises(ValueError, match="data_parallel_size"):
        LLM(tiny_llama, device="cpu", data_parallel_size=0)


def test_async_llm_data_parallel(tiny_llama):
    prompts = _prompts(5)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    want = hf_greedy(tiny_llama, prompts, MAX_NEW)

    async def run() -> None:
        config = make_engine_config(
            tiny_llama, device="cpu", dtype="float32", kv_cache_memory_bytes=4 << 20, data_parallel_size=2
        )
        engine = AsyncLLM(config)
        try:

            async def final(i: int, p: list[int]):
                last = None
                async for out in engine.generate({"prompt_token_ids": p}, params, f"r{i}"):
                    last = out
                return last.outputs[0].token_ids

            got = await asyncio.gather(*(final(i, p) for i, p in enumerate(prompts)))
            assert list(got) == want
            stats = await engine.get_stats()
            assert stats.num_prompt_tokens == sum(map(len, prompts))
            state = await engine.debug_state()
            assert state["data_parallel_size"] == 2
            # A long request aborted mid-stream frees its rank's blocks.
            stream = engine.generate(
                {"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=200, ignore_eos=True), "long"
            )
            async for _ in stream:
                break
            await engine.abort("long")
            for _ in range(200):
                stats = await engine.get_stats()
                if stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0:
                    break
                await asyncio.sleep(0.05)
            assert stats.kv_cache_usage == 0.0
            await engine.check_integrity()
        finally:
            engine.shutdown()

    asyncio.run(run())


def test_a_dead_rank_fails_requests_and_health(tiny_llama):
    """Killing one rank's core process mid-run ends every request with EngineDeadError within seconds, and the
    engine reports itself dead (the server's /health then answers 503), as with one core."""
    import os
    import signal
    import time

    from pagedllm.engine.core_process import EngineDeadError

    async def run() -> None:
        config = make_engine_config(
            tiny_llama, device="cpu", dtype="float32", kv_cache_memory_bytes=4 << 20, data_parallel_size=2
        )
        engine = AsyncLLM(config)
        try:
            params = SamplingParams(max_tokens=450, ignore_eos=True)
            got = asyncio.Event()

            async def consume(request_id: str) -> None:
                async for _ in engine.generate("w", params, request_id):
                    got.set()

            tasks = [asyncio.create_task(consume(f"doomed-{i}")) for i in range(4)]  # two per rank
            await asyncio.wait_for(got.wait(), 30)
            os.kill(engine.engine_core.clients[1].pid, signal.SIGKILL)
            start = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
            assert time.monotonic() - start < 5
            assert all(isinstance(r, EngineDeadError) for r in results), results
            assert engine.errored
            with pytest.raises(EngineDeadError):
                await engine.check_health()
        finally:
            engine.shutdown()

    asyncio.run(run())


def _family_dirs(root) -> dict[str, str]:
    """One tiny checkpoint of each family beyond the dense ``TINY_ARCHS`` (their own tests' builders)."""
    from tests.models.test_deepseek import VARIANTS as DEEPSEEK
    from tests.models.test_deepseek import make_tiny_deepseek
    from tests.models.test_gpt_oss_qwen2moe import make_tiny
    from tests.models.test_moe import make_tiny_moe

    return {
        "mixtral": make_tiny_moe("mixtral", root / "mixtral", seed=5),
        "qwen3_moe": make_tiny_moe("qwen3_moe", root / "qwen3_moe", seed=6),
        "qwen2_moe": make_tiny("qwen2_moe", root / "qwen2_moe", seed=7),
        "gpt_oss": make_tiny("gpt_oss", root / "gpt_oss", seed=8),
        "deepseek_v2": make_tiny_deepseek(DEEPSEEK["v2-lite"][0], root / "deepseek_v2", 9, **DEEPSEEK["v2-lite"][1]),
        "deepseek_v3": make_tiny_deepseek(DEEPSEEK["v3"][0], root / "deepseek_v3", 10, **DEEPSEEK["v3"][1]),
    }


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, str]:
    return _family_dirs(tmp_path_factory.mktemp("dp_families"))


FAMILIES = ["mixtral", "qwen3_moe", "qwen2_moe", "gpt_oss", "deepseek_v2", "deepseek_v3"]


@pytest.mark.parametrize("arch", list(TINY_ARCHS) + FAMILIES)
def test_data_parallel_every_architecture(tiny_model_dirs, family_dirs, arch):
    """D=2 gives transformers' greedy tokens for every architecture (prompts longer than the tiny windows); both
    ranks serve."""
    path = tiny_model_dirs[arch] if arch in tiny_model_dirs else family_dirs[arch]
    llm = LLM(path, device="cpu", dtype="float32", block_size=4, max_model_len=128, data_parallel_size=2)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (40, 3, 25, 33)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, prompts, 6)
    core = llm.llm_engine.engine_core
    assert all(c.get_stats().num_prompt_tokens > 0 for c in core.cores)
    core.check_integrity()
