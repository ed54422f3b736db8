"""Tensor parallelism through the engine on CPU (gloo): ``LLM(..., tensor_parallel_size=2)`` starts one worker
process and shards the model over both ranks. Greedy output equals transformers' (and so TP=1's) for every tiny
architecture; chunked prefill, prefix hits, preemption, n > 1 and logprobs work; bad combinations fail at
start-up; a dead worker fails the next step at once instead of hanging."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from tests.utils import TINY_ARCHS, assert_greedy_and_logprobs_match_hf, hf_greedy

MAX_NEW = 8


def _prompts(n: int = 4, seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randrange(2, 40))] for _ in range(n)]


def tp_llm(path: str, **kw) -> LLM:
    kw.setdefault("device", "cpu")
    kw.setdefault("dtype", "float32")
    kw.setdefault("block_size", 4)
    return LLM(path, tensor_parallel_size=2, **kw)


def shutdown(llm: LLM) -> None:
    llm.llm_engine.engine_core.shutdown()


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tp2_greedy_matches_transformers(tiny_model_dirs, arch):
    path = tiny_model_dirs[arch]
    llm = tp_llm(path)
    try:
        prompts = _prompts()
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, prompts, MAX_NEW)
        llm.llm_engine.engine_core.check_integrity()
    finally:
        shutdown(llm)


def test_tp2_chunks_prefix_hits_preemption_n_and_logprobs(tiny_llama):
    llm = tp_llm(tiny_llama, max_num_batched_tokens=8, num_gpu_blocks_override=20, max_model_len=64)
    try:
        shared = list(range(40, 76))
        prompts = [shared + [5, 6, 7], list(range(100, 141)), shared + [9]]
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert_greedy_and_logprobs_match_hf(outs, tiny_llama, prompts, MAX_NEW)
        stats = llm.llm_engine.get_stats()
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
        # n > 1 with seeded sampling: the same as TP=1 would give is not asserted (different RNG streams are
        # not promised); both samples must be valid and the pool intact.
        out = llm.generate(
            "hello hello", SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=6), use_tqdm=False
        )
        assert len(out[0].outputs) == 2 and all(len(c.token_ids) == 6 for c in out[0].outputs)
        core = llm.llm_engine.engine_core
        core.check_integrity()
        assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.pool.num_blocks
    finally:
        shutdown(llm)


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"tensor_parallel_size": 3}, "num_attention_heads"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
        ({"tensor_parallel_size": 2, "distributed_executor_backend": "rya"}, "distributed_executor_backend"),
    ],
)
def test_bad_parallel_configs_fail_at_startup(tiny_llama, kw, field):
    """(Speculation under TP works: tests/spec_decode/test_spec_tp.py.)"""
    with pytest.raises(ValueError, match=field):
        LLM(tiny_llama, device="cpu", **kw)


def _exit_at_start(*args, **kwargs) -> None:
    """Stands in for the worker's main function: the process dies before joining the ranks."""
    os._exit(3)


def test_worker_dying_at_startup_fails_fast(tiny_llama, monkeypatch):
    """A worker process that dies before joining (a broken import, an unpicklable config) fails the engine's
    start-up at once, naming the rank and exit code, instead of rank 0 waiting out the rendezvous timeout."""
    import torch.distributed as dist

    from pagedllm.distributed import executor

    monkeypatch.setattr(executor, "_worker_main", _exit_at_start)  # spawn pickles the target by name
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 exited with code 3"):
        tp_llm(tiny_llama)
    assert time.monotonic() - t0 < 60
    assert not dist.is_initialized()


def test_dead_worker_fails_the_next_step_at_once(tiny_llama):
    llm = tp_llm(tiny_llama)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        assert (
            len(
                llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)[0]
                .outputs[0]
                .token_ids
            )
            == 4
        )
        worker = llm.llm_engine.engine_core.runner.workers[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        start = time.monotonic()
        with pytest.raises(RuntimeError):
            llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
        assert time.monotonic() - start < 10
    finally:
        shutdown(llm)


def test_async_engine_with_tp_and_a_dead_worker(tiny_llama):
    """Through AsyncLLM (the server's engine): TP=2 serves, and killing the worker rank inside the engine core
    process ends the requests with EngineDeadError and makes the health check fail (the server's 503)."""
    import asyncio

    from pagedllm.config import make_engine_config
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.engine.core_process import EngineDeadError

    children = "/proc/{pid}/task/{pid}/children"
    if not os.path.exists(children.format(pid=os.getpid())):
        pytest.skip("needs /proc/<pid>/task/<pid>/children (Linux)")

    async def run() -> None:
        config = make_engine_config(
            tiny_llama, device="cpu", dtype="float32", tensor_parallel_size=2, kv_cache_memory_bytes=4 << 20
        )
        engine = AsyncLLM(config)
        try:
            params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
            last = None
            async for out in engine.generate({"prompt_token_ids": [5, 6, 7]}, params, "a"):
                last = out
            assert last.outputs[0].token_ids == hf_greedy(tiny_llama, [[5, 6, 7]], MAX_NEW)[0]
            core_pid = engine.engine_core.pid
            with open(children.format(pid=core_pid)) as f:
                workers = [int(p) for p in f.read().split()]
            assert workers, "the engine core should have a worker process"
            got = asyncio.Event()

            async def consume() -> None:
                async for _ in engine.generate("w", SamplingParams(max_tokens=400, ignore_eos=True), "b"):
                    got.set()

            task = asyncio.create_task(consume())
            await asyncio.wait_for(got.wait(), 30)
            for pid in workers:
                os.kill(pid, signal.SIGKILL)
            result = await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 20)
            assert isinstance(result[0], EngineDeadError), result
            with pytest.raises(EngineDeadError):
                await engine.check_health()
        finally:
            engine.shutdown()

    asyncio.run(run())


# --- async scheduling (last: the module's engine lives until the module ends, and a process holds one
# multi-rank engine at a time) ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def async_tp(tiny_llama):
    """TP=2 with async scheduling (the default on CUDA): rank 0 broadcasts each step's sampled tokens on the device
    over the TP group; a small pool and token budget give chunks, prefix hits and preemption."""
    llm = tp_llm(
        tiny_llama,
        async_scheduling=True,
        max_num_batched_tokens=8,
        num_gpu_blocks_override=20,
        max_model_len=64,
    )
    assert llm.llm_engine.config.scheduler_config.async_scheduling
    yield llm
    shutdown(llm)


def test_tp2_async_scheduling_chunks_prefix_hits_preemption_and_logprobs(async_tp, tiny_llama):
    shared = list(range(40, 76))
    prompts = [shared + [5, 6, 7], list(range(100, 141)), shared + [9], [3, 4]]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2)
    outs = async_tp.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_greedy_and_logprobs_match_hf(outs, tiny_llama, prompts, MAX_NEW)
    stats = async_tp.llm_engine.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    core = async_tp.llm_engine.engine_core
    core.runner.check_batches()  # every rank's batch holds rank 0's tokens, none left as a placeholder
    core.check_integrity()
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.pool.num_blocks


def test_tp2_async_scheduling_stops_aborts_seeds_and_grammars(async_tp, tiny_llama):
    """Requests that end at different steps (max_tokens, a stop token) emit nothing after their end while the
    others go on; an abort mid-run frees its blocks; a seed repeats; a grammar's bitmask (filled while the step's
    forward runs) constrains rank 0's sampling."""
    engine = async_tp.llm_engine
    prompts = [[5, 6, 7, 8], list(range(30, 52)), [200, 3, 9]]
    ref = hf_greedy(tiny_llama, prompts, 12)
    stop_at = ref[1][4]  # request 1 stops at the first time this token comes (step <= 5)
    params = [
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_at]),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    ]
    outs = async_tp.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got[0] == ref[0][:3] and got[2] == ref[2]
    assert got[1] == ref[1][: ref[1].index(stop_at) + 1] and outs[1].outputs[0].finish_reason == "stop"
    # an abort while it runs
    engine.add_request(
        "gone", {"prompt_token_ids": [7, 8, 9]}, SamplingParams(max_tokens=50, ignore_eos=True)
    )
    engine.add_request("kept", {"prompt_token_ids": [9, 8]}, SamplingParams(temperature=0.0, max_tokens=6))
    done = {}
    for i in range(40):
        if i == 3:
            engine.abort_request("gone")
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if "kept" in done and not engine.has_unfinished_requests():
            break
    assert "kept" in done and len(done["kept"].outputs[0].token_ids) <= 6
    seeded = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=6, ignore_eos=True)
    first = async_tp.generate("hello hello", seeded, use_tqdm=False)[0].outputs
    again = async_tp.generate("hello hello", seeded, use_tqdm=False)[0].outputs
    assert [c.token_ids for c in first] == [c.token_ids for c in again] and len(first) == 2
    choices = ["yes", "no", "maybe so"]
    params = SamplingParams(
        temperature=0.0, max_tokens=12, structured_outputs=StructuredOutputsParams(choice=choices)
    )
    outs = async_tp.generate(["Answer:", "Well"], params, use_tqdm=False)
    assert all(o.outputs[0].text in choices for o in outs)
    core = engine.engine_core
    core.runner.check_batches()
    core.check_integrity()
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.pool.num_blocks
