"""CPU offloading (a second prefix-cache tier in host memory) against plain runs: a device cache of few blocks,
prompts sharing long prefixes, and a second pass over them served from the CPU tier. Greedy tokens equal, logprobs
equal to float32 rounding (reused KV was computed in another batch shape, as with device prefix hits), the CPU
tier really served hits, failed loads fall back to recompute, and no block leaks."""

from __future__ import annotations

import random

import pytest

from pagedllm import LLM, SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 20  # 80 tokens: about two of the requests at once
MAX_NEW = 8
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2)
FAILING = {
    "kv_connector": "FailingLoadConnector",
    "kv_connector_module_path": "tests.kv_transfer.connectors",
    "kv_connector_extra_config": {"num_cpu_blocks": 64},
}


def make_prompts(seed: int = 0) -> list[list[int]]:
    """Three 24-token prefixes, each with two short tails."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 200) for _ in range(24)] for _ in range(3)]
    return [p + [rng.randrange(3, 200) for _ in range(rng.randint(1, 6))] for p in prefixes for _ in range(2)]


def make_llm(path: str, **kw) -> LLM:
    kw.setdefault("num_gpu_blocks_override", NUM_BLOCKS)
    return LLM(path, dtype="float32", device="cpu", block_size=BLOCK_SIZE, max_model_len=64, **kw)


def two_passes(
    llm: LLM, prompts: list[list[int]], params: SamplingParams = PARAMS
) -> list[list[tuple[list[int], list[dict]]]]:
    """(token ids, logprob dicts) per prompt, for two passes over the same prompts; integrity checked after each."""
    passes = []
    for _ in range(2):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        passes.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
        assert_no_leaks(llm)
    return passes


def assert_no_leaks(llm: LLM) -> None:
    core = llm.llm_engine.engine_core
    core.check_integrity()
    kv = core.kv_cache_manager
    assert kv.num_free_blocks == kv.pool.num_blocks
    assert not core.scheduler.loading and not core.scheduler.delayed_free
    assert not llm.llm_engine.has_unfinished_requests()


def assert_same(got, want) -> None:
    for got_pass, want_pass in zip(got, want):
        for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got_pass, want_pass):
            assert tokens == want_tokens
            for row, want_row in zip(logprobs, want_logprobs):
                assert row.keys() == want_row.keys()
                for tok, lp in row.items():
                    assert lp.logprob == pytest.approx(want_row[tok].logprob, abs=1e-5)


@pytest.fixture(scope="module")
def plain(tiny_llama):
    """The outputs without a connector, for each async_scheduling setting."""
    cache = {}

    def get(async_scheduling: bool, **kw):
        key = (async_scheduling, tuple(sorted(kw.items())))
        if key not in cache:
            llm = make_llm(tiny_llama, async_scheduling=async_scheduling, **kw)
            cache[key] = two_passes(llm, make_prompts())
            llm.shutdown()
        return cache[key]

    return get


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("max_num_batched_tokens", [None, 8], ids=["whole", "chunked"])
def test_offloading_matches_plain_run_and_serves_hits(tiny_llama, plain, async_scheduling, max_num_batched_tokens):
    kw = {"max_num_batched_tokens": max_num_batched_tokens} if max_num_batched_tokens else {}
    llm = make_llm(tiny_llama, async_scheduling=async_scheduling, kv_offloading_size=0.01, **kw)
    got = two_passes(llm, make_prompts())
    stats = llm.llm_engine.get_stats()
    assert stats.kv_connector_stats["cpu_stored_blocks"] > 0
    assert stats.kv_connector_stats["cpu_hit_tokens"] > 0
    assert stats.external_prefix_cache_hits == stats.kv_connector_stats["cpu_hit_tokens"]
    assert_same(got, plain(async_scheduling, **kw))


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_offloading_under_preemption_and_a_small_cpu_tier(tiny_llama, admit_while_blocks_last, async_scheduling):
    """Longer outputs preempt; a CPU tier of 24 blocks evicts (LRU) and still serves hits."""
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2)
    offloading = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"num_cpu_blocks": 24},
    }
    runs = []
    for kw in ({}, {"kv_transfer_config": offloading}):
        llm = make_llm(tiny_llama, async_scheduling=async_scheduling, **kw)
        runs.append(two_passes(llm, make_prompts(), params))
        stats = llm.llm_engine.get_stats()
        llm.shutdown()
    assert stats.num_preemptions > 0
    assert stats.kv_connector_stats["cpu_evicted_blocks"] > 0
    assert stats.kv_connector_stats["cpu_hit_tokens"] > 0
    assert_same(runs[1], runs[0])


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_failed_loads_fall_back_to_recompute(tiny_llama, plain, async_scheduling):
    llm = make_llm(tiny_llama, async_scheduling=async_scheduling, kv_transfer_config=FAILING)
    got = two_passes(llm, make_prompts())
    stats = llm.llm_engine.get_stats()
    assert stats.kv_connector_stats["cpu_hit_tokens"] > 0  # loads were tried ...
    assert stats.external_prefix_cache_hits == 0  # ... and none was used
    assert_same(got, plain(async_scheduling))


def test_abort_while_loading_frees_the_blocks(tiny_llama):
    # Async scheduling: a step's load is reported with its outputs, one step() later, so the request is seen
    # loading between two calls.
    llm = make_llm(tiny_llama, kv_offloading_size=0.01, async_scheduling=True)
    prompts = make_prompts()
    llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    engine = llm.llm_engine
    # Evict the device prefix cache so the next request hits the CPU tier only.
    assert engine.engine_core.kv_cache_manager.reset_prefix_cache()
    engine.add_request("x", {"prompt_token_ids": prompts[0]}, PARAMS)
    engine.step()
    assert "x" in engine.engine_core.scheduler.loading
    engine.abort_request("x")
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leaks(llm)


async def test_core_process_reports_cpu_tier_hits(tiny_llama):
    """Through AsyncLLM (the engine core in its own process): the CPU tier's hits reach the stats and Prometheus."""
    import asyncio

    from pagedllm.config import make_engine_config
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.metrics import PrometheusStatLogger
    from pagedllm.sampling_params import RequestOutputKind

    config = make_engine_config(
        tiny_llama,
        dtype="float32",
        device="cpu",
        block_size=BLOCK_SIZE,
        max_model_len=64,
        num_gpu_blocks_override=NUM_BLOCKS,
        kv_offloading_size=0.01,
    )
    metrics = PrometheusStatLogger("tiny")
    engine = AsyncLLM(config, stat_loggers=[metrics.record])
    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
    )
    try:
        async def run(i: int, prompt: list[int]) -> list[int]:
            outs = [o async for o in engine.generate({"prompt_token_ids": prompt}, params, f"r{i}")]
            return outs[-1].outputs[0].token_ids

        prompts = make_prompts()
        first = await asyncio.wait_for(asyncio.gather(*(run(i, p) for i, p in enumerate(prompts))), 120)
        second = await asyncio.wait_for(
            asyncio.gather(*(run(len(prompts) + i, p) for i, p in enumerate(prompts))), 120
        )
        assert first == second
        stats = await engine.get_stats()
        assert stats.external_prefix_cache_hits > 0 and stats.num_integrity_failures == 0
        await engine.check_integrity()
        metrics.record_scheduler_stats(stats)
        text = metrics.render().decode()
        assert f'pagedllm:external_prefix_cache_hits_total{{model_name="tiny"}} {float(stats.external_prefix_cache_hits)}' in text
    finally:
        engine.shutdown()


def test_reset_prefix_cache_forgets_the_cpu_tier_too(tiny_llama):
    llm = make_llm(tiny_llama, kv_offloading_size=0.01)
    prompts = make_prompts()
    llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    core = llm.llm_engine.engine_core
    assert core.get_stats().kv_connector_stats["cpu_used_blocks"] > 0
    assert core.reset_prefix_cache()
    assert core.get_stats().kv_connector_stats["cpu_used_blocks"] == 0
    llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    assert core.get_stats().external_prefix_cache_hits == 0
    assert_no_leaks(llm)
