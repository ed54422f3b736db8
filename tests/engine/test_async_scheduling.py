"""Async scheduling: step N+1 is planned and launched before step N's tokens are read.

What must hold: a request that stops at step N emits nothing after it and leaks no block; features that read the
output history on the host (penalties, bad words, min_tokens) give the same tokens as the synchronous loop; aborts
with a step in flight are clean; and the runner's per-step host work does not grow with the number of requests.
"""

from __future__ import annotations

import cProfile
import pstats
import random

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.core.sched_output import EngineCoreRequest
from tests.utils import hf_greedy


def _llm(path: str, async_scheduling: bool, **kw) -> LLM:
    kw.setdefault("block_size", 4)
    return LLM(path, dtype="float32", device="cpu", async_scheduling=async_scheduling, **kw)


def _prompts(n: int, seed: int = 0, lo: int = 2, hi: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _core_request(req_id: str, prompt: list[int], params: SamplingParams) -> EngineCoreRequest:
    return EngineCoreRequest(req_id, prompt, params, eos_token_id=None, arrival_time=0.0)


def test_request_stopping_at_step_n_emits_nothing_after(tiny_llama):
    prompts = _prompts(4, seed=3, lo=5, hi=12)
    want = hf_greedy(tiny_llama, prompts[:1], 8)[0]
    stop_at = next(j for j in range(2, 8) if want[j] not in want[:j])  # first fresh token from the third on
    llm = _llm(tiny_llama, True)
    core = llm.llm_engine.engine_core
    assert core.async_scheduling
    stopping = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[want[stop_at]], ignore_eos=True)
    long = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    core.add_request(_core_request("stopper", prompts[0], stopping))
    for i, p in enumerate(prompts[1:]):
        core.add_request(_core_request(f"other{i}", p, long))
    emitted: list[int] = []
    finished_at = None
    dropped_step_ran = False
    step = 0
    while core.has_unfinished_requests():
        outs = core.step()
        step += 1
        for o in outs.outputs:
            if o.request_id != "stopper":
                continue
            assert finished_at is None, f"output after the finishing one (step {step}): {o}"
            emitted += o.new_token_ids
            if o.finished:
                finished_at = step
                assert o.finish_reason == "stop" and o.stop_reason == want[stop_at]
                # The step already in flight computed for this request: its result must be dropped.
                dropped_step_ran = "stopper" in core._in_flight[0].num_scheduled_tokens
        if finished_at is not None:
            assert "stopper" not in core.scheduler.requests
            assert "stopper" not in core.kv_cache_manager.req_to_blocks  # blocks freed at once
    assert emitted == want[: stop_at + 1]
    assert dropped_step_ran
    core.check_integrity()
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.pool.num_blocks


def test_max_tokens_request_is_not_scheduled_past_its_last_token(tiny_llama):
    llm = _llm(tiny_llama, True)
    core = llm.llm_engine.engine_core
    core.add_request(_core_request("a", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=3)))
    scheduled = 0
    while core.has_unfinished_requests():
        core.step()
        if core._in_flight is not None:
            scheduled += core._in_flight[0].num_scheduled_tokens.get("a", 0)
    # 3 prompt tokens + 2 decode steps: the step after the third token would be certain waste.
    assert scheduled == 5


def test_history_features_same_tokens_as_sync(tiny_llama):
    """Penalties, bad words and min_tokens read the generated tokens on the host: the async loop must make them
    wait for the step in flight, and then give exactly the synchronous loop's tokens (and logprobs)."""
    prompts = _prompts(7, seed=5)
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0.9, seed=11, max_tokens=12, presence_penalty=0.8, frequency_penalty=0.4),
        SamplingParams(temperature=0.0, max_tokens=12, min_tokens=6, stop_token_ids=[7, 8, 9]),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logit_bias={17: 5.0, 29: -3.0}),
        SamplingParams(temperature=1.0, seed=3, top_k=20, top_p=0.8, max_tokens=12, logprobs=3),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, allowed_token_ids=[10, 11, 12, 40]),
        SamplingParams(temperature=0.7, seed=5, min_p=0.05, max_tokens=12, ignore_eos=True),
    ]
    batch = [{"prompt_token_ids": p} for p in prompts]
    results = []
    for mode in (False, True):
        llm = _llm(tiny_llama, mode, max_num_batched_tokens=16)
        # Bad words need text: take two single tokens of the tokenizer as words.
        tok = llm.get_tokenizer()
        words = [tok.decode([t]) for t in (50, 51)]
        params_bw = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, bad_words=words)
        outs = llm.generate(batch + batch[:1], params + [params_bw], use_tqdm=False)
        results.append(
            [(o.outputs[0].token_ids, [sorted(d) for d in (o.outputs[0].logprobs or [])]) for o in outs]
        )
        core = llm.llm_engine.engine_core
        core.check_integrity()
        assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.pool.num_blocks
    assert results[0] == results[1]


def test_abort_with_step_in_flight(tiny_llama):
    prompts = _prompts(5, seed=9)
    want = hf_greedy(tiny_llama, prompts, 10)
    llm = _llm(tiny_llama, True)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    got: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out.outputs[0].token_ids
        step += 1
        if step == 3:
            assert engine.engine_core._in_flight is not None
            engine.abort_request(["1", "3"])
    assert got.keys() == {"0", "2", "4"}
    assert [got[k] for k in ("0", "2", "4")] == [want[0], want[2], want[4]]
    core = engine.engine_core
    core.check_integrity()
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.pool.num_blocks
    # The runner drops finished rows when the next step tells it; every finished request is queued for that.
    assert set(core.runner.input_batch.req_id_to_row) <= core.scheduler.finished_req_ids


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_runner_host_work_does_not_grow_with_requests(tiny_llama, async_scheduling):
    """The runner's per-step host work (input preparation, sampling metadata, output collection) is array
    operations: the Python calls one decode step makes are about the same at 256 requests as at 8."""

    def calls_per_step(num_reqs: int) -> int:
        llm = _llm(tiny_llama, async_scheduling, max_num_seqs=256, max_model_len=64)
        core = llm.llm_engine.engine_core
        for i in range(num_reqs):
            params = SamplingParams(
                temperature=0.0 if i % 3 == 0 else 0.8, top_p=0.9 if i % 2 else 1.0, top_k=[0, 5, 50][i % 3],
                min_p=0.01 * (i % 2), max_tokens=40, ignore_eos=True, logprobs=2 if i % 5 == 0 else None,
            )  # fmt: skip
            core.add_request(_core_request(str(i), [5 + i % 7, 6, 7, 8], params))
        for _ in range(4):  # past the prefill: every request decodes from here on
            core.step()
        sched = core.scheduler.schedule()
        assert len(sched.num_scheduled_tokens) == num_reqs
        assert set(sched.num_scheduled_tokens.values()) == {1}
        profile = cProfile.Profile()
        profile.enable()
        result = core.runner.collect(core.runner.execute_model_async(sched))
        profile.disable()
        assert len(result.sampled_token_ids) == num_reqs
        return pstats.Stats(profile).total_calls

    small, large = calls_per_step(8), calls_per_step(256)
    # Logprob rows are the one per-request loop left (slicing each row's top-k): 1 in 5 rows here.
    assert large <= small * 1.25, (small, large)


def test_start_up_warm_up_of_mixed_steps_writes_nothing(tiny_llama):
    """The start-up warm-up (dummy mixed steps: each prefill tile configuration over a short context and over
    each longer one, for split-K; then the sampler; run after CUDA graph capture) leaves the KV cache as it was
    and the engine's output unchanged."""
    llm = _llm(tiny_llama, True)
    prompts = _prompts(3, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    before = [
        o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    ]
    runner = llm.llm_engine.engine_core.runner
    caches = [c.clone() for c in runner.kv_caches]
    steps = []
    real = runner._dummy_mixed_step
    runner._dummy_mixed_step = lambda chunk, seq_len: steps.append((chunk, seq_len)) or real(chunk, seq_len)
    runner._warm_up_eager_steps()
    assert runner.max_model_len == 512
    # every prefill tile configuration over a short context (no split) and over each longer one (split-K): a
    # request's last few prompt tokens over a long context split their keys too
    assert steps == [(c, n) for c in (2, 4, 8, 16, 32, 64) for n in (c, 512)]
    assert all(torch.equal(a, b) for a, b in zip(caches, runner.kv_caches, strict=True))
    after = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert after == before


@pytest.mark.parametrize("max_model_len", [512, 100])
def test_eager_block_table_width_is_one_rule(tiny_llama, max_model_len):
    """Eager steps and the warm-up's dummy steps size the block table by one rule (``_table_width``): a multiple
    of 16 columns, or the batch's whole table when that is narrower. Its row stride is a kernel argument Triton
    specializes on (divisible by 16 or not), so any other width would make a kernel variant the warm-up never
    compiled (a stall of seconds mid-run on a cold cache)."""
    llm = _llm(tiny_llama, True, max_model_len=max_model_len)
    runner = llm.llm_engine.engine_core.runner
    full = runner.max_blocks_per_req
    assert full == -(-max_model_len // 4)
    widths = []
    real = runner._forward

    def forward(input_ids, positions, kv_caches, meta, communicate=True):
        widths.append(meta.block_table.shape[1])
        return real(input_ids, positions, kv_caches, meta, communicate)

    runner._forward = forward
    prompts = _prompts(6, seed=3, lo=2, hi=90)
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=8))
    runner._warm_up_eager_steps()
    assert widths and all(w % 16 == 0 or w == full for w in widths), widths
    assert {runner._table_width(n) for n in (1, 4 * 16, 4 * 16 + 1, max_model_len)} == (
        {16, 32, full} if max_model_len == 512 else {16, full}
    )
