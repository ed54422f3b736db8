"""AsyncLLM with the engine core in its own process: output kinds, n, cancellation and abort free everything,
bad input, a request the core refuses, start-up errors, and the core process dying."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import pytest_asyncio

from pagedllm.config import make_engine_config
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.core_process import EngineDeadError
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="module")


def _config(path: str, **kw):
    kw.setdefault("dtype", "float32")
    kw.setdefault("device", "cpu")
    kw.setdefault("kv_cache_memory_bytes", 4 << 20)
    return make_engine_config(path, **kw)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_llama):
    eng = AsyncLLM(_config(tiny_llama))
    yield eng
    eng.shutdown()


async def collect(engine: AsyncLLM, prompt, params: SamplingParams, request_id: str):
    return [out async for out in engine.generate(prompt, params, request_id)]


async def wait_idle(engine: AsyncLLM, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while True:
        stats = await engine.get_stats()
        if stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0:
            return stats
        assert time.monotonic() < deadline, stats
        await asyncio.sleep(0.05)


async def assert_clean(engine: AsyncLLM) -> None:
    stats = await wait_idle(engine)
    assert stats.kv_cache_usage == 0.0
    await engine.check_integrity()
    assert engine.num_unfinished_requests == 0
    assert not engine.output_processor.has_unfinished_requests()


async def test_output_kinds_agree(engine):
    base = dict(temperature=0.0, max_tokens=12, ignore_eos=True)
    deltas = await collect(
        engine, "def f(x):", SamplingParams(**base, output_kind=RequestOutputKind.DELTA), "k-delta"
    )
    cumulative = await collect(engine, "def f(x):", SamplingParams(**base), "k-cum")
    final = await collect(
        engine, "def f(x):", SamplingParams(**base, output_kind=RequestOutputKind.FINAL_ONLY), "k-final"
    )
    assert len(final) == 1 and final[0].finished
    text = final[0].outputs[0].text
    assert len(final[0].outputs[0].token_ids) == 12
    assert "".join(o.outputs[0].text for o in deltas) == text
    assert [t for o in deltas for t in o.outputs[0].token_ids] == final[0].outputs[0].token_ids
    assert cumulative[-1].outputs[0].text == text and cumulative[-1].finished
    assert all(not o.finished for o in cumulative[:-1])
    assert final[0].metrics.first_token_time >= final[0].metrics.arrival_time
    await assert_clean(engine)


async def test_a_consumer_behind_gets_merged_outputs(engine):
    """Outputs that queued up while the consumer was away come as one (vLLM's collector does the same): deltas
    concatenated per sequence, logprobs included; cumulative outputs as the latest. Nothing is lost or repeated."""
    base = dict(temperature=0.0, max_tokens=12, ignore_eos=True)
    final = await collect(
        engine, "def g(y):", SamplingParams(**base, n=2, output_kind=RequestOutputKind.FINAL_ONLY), "m-final"
    )
    want = {c.index: c for c in final[-1].outputs}
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE):
        params = SamplingParams(**base, n=2, logprobs=1, output_kind=kind)
        stream = engine.add_request(f"m-{kind.name}", "def g(y):", params)
        deadline = time.monotonic() + 20
        while engine.output_processor.has_unfinished_requests():  # everything queued, nothing read yet
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        outs = [out async for out in stream]
        assert len(outs) == 1 and outs[0].finished, kind
        got = {c.index: c for c in outs[0].outputs}
        assert sorted(got) == [0, 1]
        for i, c in got.items():
            assert c.token_ids == want[i].token_ids and c.text == want[i].text, kind
            assert len(c.logprobs) == 12 and c.finish_reason == "length"
    await assert_clean(engine)


async def test_n_and_concurrency(engine):
    params = SamplingParams(
        n=3, temperature=1.0, seed=3, max_tokens=8, output_kind=RequestOutputKind.FINAL_ONLY
    )
    outs = await asyncio.gather(*(collect(engine, [5, 6, 7, 8], params, f"n-{i}") for i in range(4)))
    for out in outs:
        assert [c.index for c in out[-1].outputs] == [0, 1, 2]
    # same seed, same prompt: the same samples whatever the batch around them
    assert len({tuple(tuple(c.token_ids) for c in out[-1].outputs) for out in outs}) == 1
    await assert_clean(engine)


async def test_leaving_the_iteration_aborts(engine):
    params = SamplingParams(max_tokens=400, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    count = 0
    async for _ in engine.generate("x", params, "leave"):
        count += 1
        if count == 3:
            break
    await assert_clean(engine)

    started = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate("y", params, "cancelled-task"):
            started.set()
            await asyncio.sleep(0.05)  # a slow reader: 400 outputs take far longer than this test waits

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), timeout=60)
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await assert_clean(engine)


async def test_abort(engine):
    params = SamplingParams(max_tokens=400, ignore_eos=True, n=2)
    outputs = []

    async def consume() -> None:
        async for out in engine.generate("z", params, "to-abort"):
            outputs.append(out)

    task = asyncio.create_task(consume())
    while not outputs:
        await asyncio.sleep(0.01)
    await engine.abort("to-abort")
    await asyncio.wait_for(task, 10)
    last = outputs[-1]
    assert last.finished and [c.finish_reason for c in last.outputs] == ["abort", "abort"]
    # cumulative: the final output keeps what the previous one held
    if len(outputs) > 1:
        previous = {c.index: c.token_ids for c in outputs[-2].outputs}
        assert [c.token_ids for c in last.outputs] == [previous[c.index] for c in last.outputs]
    await assert_clean(engine)


async def test_stop_string_finishes_and_frees(engine):
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    free = (await collect(engine, "import os", params, "free-run"))[-1].outputs[0].text
    stop = next(
        free[i : i + 2]
        for i in range(2, len(free) - 2)
        if free[i : i + 2].strip() and "\ufffd" not in free[i : i + 2]
    )
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop])
    out = (await collect(engine, "import os", params, "stopped"))[-1].outputs[0]
    assert out.text == free[: free.index(stop)] and out.finish_reason == "stop" and out.stop_reason == stop
    await assert_clean(engine)


async def test_bad_input(engine):
    with pytest.raises(ValueError, match="^prompt_token_ids"):
        await collect(engine, [1, 10**6], SamplingParams(), "oov")
    with pytest.raises(ValueError, match="^prompt"):
        await collect(engine, "", SamplingParams(), "empty")
    with pytest.raises(ValueError, match="^logprobs"):
        await collect(engine, "a", SamplingParams(logprobs=50), "lp")
    with pytest.raises(ValueError, match="^prompt"):
        await collect(engine, [5] * 600, SamplingParams(), "long")
    gen = engine.generate("a", SamplingParams(max_tokens=50, ignore_eos=True), "dup")
    await gen.__anext__()
    with pytest.raises(ValueError, match="already in flight"):
        await collect(engine, "a", SamplingParams(), "dup")
    await gen.aclose()
    await assert_clean(engine)


async def test_core_refusal_does_not_stop_the_loop(engine, monkeypatch):
    # Let an out-of-vocabulary prompt past the front-end: the core refuses it, the request fails with the core's
    # ValueError, and the core keeps serving.
    monkeypatch.setattr(engine.input_processor, "vocab_size", 10**7)
    with pytest.raises(ValueError, match="out of vocabulary"):
        await collect(engine, [1, 10**6], SamplingParams(n=2), "refused")
    monkeypatch.undo()
    out = await collect(engine, "ok", SamplingParams(max_tokens=3, ignore_eos=True), "after-refusal")
    assert out[-1].finished and len(out[-1].outputs[0].token_ids) == 3
    await assert_clean(engine)


async def test_startup_error_is_raised_in_the_caller(tiny_llama):
    with pytest.raises(ValueError, match="KV cache holds 1 blocks"):
        AsyncLLM(_config(tiny_llama, num_gpu_blocks_override=1, kv_cache_memory_bytes=None))


async def test_engine_death_fails_requests(engine):
    """Last: kills the shared engine."""
    params = SamplingParams(max_tokens=450, ignore_eos=True)
    got_one = asyncio.Event()

    async def consume(request_id: str) -> None:
        async for _ in engine.generate("w", params, request_id):
            got_one.set()

    tasks = [asyncio.create_task(consume(f"doomed-{i}")) for i in range(3)]
    await asyncio.wait_for(got_one.wait(), 30)
    os.kill(engine.engine_core.pid, signal.SIGKILL)
    start = time.monotonic()
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
    assert time.monotonic() - start < 5
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert engine.errored and not engine.is_running
    assert isinstance(engine.dead_error, EngineDeadError) and "exit code -9" in str(engine.dead_error)
    with pytest.raises(EngineDeadError):
        await collect(engine, "again", SamplingParams(), "after-death")
    with pytest.raises(EngineDeadError):
        await engine.get_stats()
    with pytest.raises(EngineDeadError):
        await engine.check_health()
