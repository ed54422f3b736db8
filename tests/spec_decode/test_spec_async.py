"""Speculative decoding with async scheduling (CPU, float32, tiny random models): for every proposer, greedy output
equals plain decoding and synchronous speculation, the acceptance counters equal the synchronous run's, and no
KV block leaks, across batch sizes, max_tokens reached mid-draft, stop strings and tokens, preemption, prefix hits,
chunked prefill, max_model_len, logprobs, seeds, penalties, structured outputs and aborts."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from tests.spec_decode.test_eagle import deep_llama, make_eagle_head  # noqa: F401 - deep_llama is a fixture
from tests.spec_decode.test_mtp import _prompts as mtp_prompts
from tests.spec_decode.test_mtp import v3_dirs  # noqa: F401 - a fixture
from tests.spec_decode.test_spec_engine import (
    assert_no_leaks,
    check_n_stop_strings_and_logprobs,
    greedy,
    history_params,
    make_llm,
    make_prompts,
    spec_config,
    stats,
)

METHODS = ["ngram", "draft_other", "draft_self", "eagle", "medusa"]


def spec_counters(llm: LLM) -> tuple:
    s = stats(llm)
    return s.spec_num_drafts, s.spec_num_draft_tokens, s.spec_num_accepted_tokens, list(s.spec_accepted_per_pos)


def pair(path: str, spec: dict, **kw) -> tuple[LLM, LLM]:
    """The same speculative engine, synchronous and async."""
    sync = make_llm(path, spec, async_scheduling=False, **kw)
    asyn = make_llm(path, spec, async_scheduling=True, **kw)
    assert not sync.llm_engine.engine_core.async_scheduling
    assert asyn.llm_engine.engine_core.async_scheduling
    return sync, asyn


def check_equal_runs(path: str, spec: dict, prompts: list[list[int]], max_tokens: int = 40, **kw) -> LLM:
    """Greedy output of plain decoding, synchronous and async speculation is the same, batch by batch (all the
    prompts, one, a few), and so are the speculation counters of the last two. Returns the async engine."""
    plain = greedy(make_llm(path, spec=None, **kw), prompts, max_tokens)
    sync, asyn = pair(path, spec, **kw)
    for batch in (prompts, prompts[:1], prompts[2:5]):
        want = [plain[prompts.index(p)] for p in batch]
        assert greedy(sync, batch, max_tokens) == want
        assert greedy(asyn, batch, max_tokens) == want
    assert spec_counters(asyn) == spec_counters(sync)
    assert stats(asyn).spec_num_drafts > 0
    assert_no_leaks(asyn)
    return asyn


@pytest.mark.parametrize("method", METHODS)
def test_async_equals_plain_and_sync(tiny_model_dirs, tiny_llama, method):
    asyn = check_equal_runs(tiny_llama, spec_config(method, tiny_llama, tiny_model_dirs), make_prompts())
    if method == "draft_self":  # the target's own greedy drafts: all accepted
        s = stats(asyn)
        assert s.spec_num_accepted_tokens == s.spec_num_draft_tokens


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_async_eagle_heads(deep_llama, tmp_path, method):  # noqa: F811 - the fixture
    head = make_eagle_head(deep_llama, tmp_path / method, method)
    spec = {"method": method, "model": head, "num_speculative_tokens": 3}
    check_equal_runs(deep_llama, spec, make_prompts(6), max_tokens=30, max_model_len=128)


def test_async_mtp(v3_dirs):  # noqa: F811 - the fixture
    path = v3_dirs["mtp"]
    vocab = LLM(path, dtype="float32", device="cpu", max_model_len=64).llm_engine.engine_core.vocab_size
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    check_equal_runs(path, spec, mtp_prompts(vocab) + make_prompts(7)[:2], max_tokens=16, max_model_len=128)


@pytest.mark.parametrize("method", METHODS)
def test_async_small_chunks_prefix_hits_and_preemption(tiny_model_dirs, tiny_llama, method):
    """A token budget of 6 splits prompts and caps the reserved drafts (chunks share steps with verifications);
    shared prefixes hit the cache; a 21-block pool preempts requests with drafts in flight."""
    base = make_prompts(1)
    prefix = [11, 12, 13, 14, 15, 16, 17, 18]
    prompts = base + [prefix + p[:6] for p in base]
    kw = dict(max_num_batched_tokens=6, num_gpu_blocks_override=21, max_num_seqs=8, max_model_len=80)
    want = greedy(make_llm(tiny_llama, spec=None), prompts)
    llm = make_llm(tiny_llama, spec_config(method, tiny_llama, tiny_model_dirs), async_scheduling=True, **kw)
    assert greedy(llm, prompts) == want
    s = stats(llm)
    assert s.num_preemptions > 0, "the test meant to preempt"
    assert s.prefix_cache_hits > 0, "the test meant to hit the prefix cache"
    assert s.spec_num_drafts > 0
    assert_no_leaks(llm)


@pytest.mark.parametrize("method", METHODS)
def test_async_max_tokens_stops_and_max_model_len(tiny_model_dirs, tiny_llama, method):
    """max_tokens or a stop token reached in the middle of accepted drafts (while the next step is already
    scheduled with the request), and requests that run into max_model_len: the outputs end where plain
    decoding's do, and the counters equal synchronous speculation's."""
    prompts = make_prompts(2)
    spec = spec_config(method, tiny_llama, tiny_model_dirs)
    plain = make_llm(tiny_llama, spec=None)
    sync, asyn = pair(tiny_llama, spec)
    full = greedy(plain, prompts)
    for max_tokens in (1, 2, 3, 5, 13):
        want = [t[:max_tokens] for t in full]
        assert greedy(sync, prompts, max_tokens=max_tokens) == want
        assert greedy(asyn, prompts, max_tokens=max_tokens) == want
    stop_id = full[-1][len(full[-1]) // 2]
    sp = SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop_id])
    inputs = [{"prompt_token_ids": p} for p in prompts]
    want = plain.generate(inputs, sp, use_tqdm=False)
    for llm in (sync, asyn):
        got = llm.generate(inputs, sp, use_tqdm=False)
        assert [(g.outputs[0].token_ids, g.outputs[0].finish_reason, g.outputs[0].stop_reason) for g in got] == [
            (w.outputs[0].token_ids, w.outputs[0].finish_reason, w.outputs[0].stop_reason) for w in want
        ]
    assert any(w.outputs[0].stop_reason == stop_id for w in want)
    assert spec_counters(asyn) == spec_counters(sync)
    assert_no_leaks(asyn)
    # max_model_len 40: the 30-token prompt and the 22-token one stop at the length limit mid-draft.
    short = make_llm(tiny_llama, spec=None, max_model_len=40)
    want = greedy(short, prompts)
    s_sync, s_async = pair(tiny_llama, spec, max_model_len=40)
    assert greedy(s_sync, prompts) == want
    assert greedy(s_async, prompts) == want
    assert spec_counters(s_async) == spec_counters(s_sync)
    assert_no_leaks(s_async)


@pytest.mark.parametrize("method", ["ngram", "eagle"])
def test_async_n_stop_strings_and_logprobs(tiny_model_dirs, tiny_llama, method):
    plain = make_llm(tiny_llama, spec=None)
    spec = make_llm(tiny_llama, spec_config(method, tiny_llama, tiny_model_dirs), async_scheduling=True)
    check_n_stop_strings_and_logprobs(plain, spec)


def test_async_history_params_seeds_and_structured_outputs(tiny_llama):
    """Penalties and min_tokens decode without drafts next to requests that speculate; seeded random rows give
    synchronous speculation's tokens (the same drafts, so the same draws); constrained requests speculate too (a
    mask per draft position, filled once the previous step's tokens are in) and give plain decoding's tokens."""
    prompts = make_prompts(3)
    plain = make_llm(tiny_llama, spec=None)
    sync, asyn = pair(tiny_llama, spec_config("ngram", tiny_llama, {}))
    params = history_params(len(prompts))
    inputs = [{"prompt_token_ids": p} for p in prompts]
    want = [o.outputs[0].token_ids for o in plain.generate(inputs, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in asyn.generate(inputs, params, use_tqdm=False)] == want
    assert stats(asyn).spec_num_drafts > 0

    sp = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=7, max_tokens=30, ignore_eos=True)
    seeded = [[o.outputs[0].token_ids for o in llm.generate(inputs, sp, use_tqdm=False)] for llm in (sync, asyn)]
    assert seeded[0] == seeded[1]

    structured = [
        SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=StructuredOutputsParams(regex=r"(ab|cd)+[0-9]{2,6}")),
        SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=StructuredOutputsParams(choice=["red green blue", "red red red"])),
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    ]  # fmt: skip
    texts = ["abab12 cdcd", "red green", "hello hello hello hello", "the cat counted the stars and the stars"]
    want = plain.generate(texts, structured, use_tqdm=False)
    got = asyn.generate(texts, structured, use_tqdm=False)
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    assert got[1].outputs[0].text in ("red green blue", "red red red")
    # Constrained requests alone: they get drafts (the grammar forbids some, which verification rejects).
    looping = [
        SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=StructuredOutputsParams(regex=r"(ab )+")),
        SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=StructuredOutputsParams(regex=r"(cd|ab)+")),
    ]  # fmt: skip
    looping_texts = ["ab ab ab ab ab ab", "cdabcdabcdab"]
    before = stats(asyn).spec_num_drafts
    got = asyn.generate(looping_texts, looping, use_tqdm=False)
    assert stats(asyn).spec_num_drafts > before
    want = plain.generate(looping_texts, looping, use_tqdm=False)
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    assert [g.outputs[0].token_ids for g in sync.generate(looping_texts, looping, use_tqdm=False)] == [
        w.outputs[0].token_ids for w in want
    ]
    assert_no_leaks(asyn)


@pytest.mark.parametrize("method", ["ngram", "draft_other", "eagle", "medusa"])
def test_async_aborts_and_rejections_leak_no_blocks(tiny_model_dirs, tiny_llama, method):
    """Aborts between steps (with the next step in flight), rejected drafts and preemptions in a small pool: the
    pool invariants hold after every step, every block is back at the end, and the idle check passes."""
    llm = make_llm(
        tiny_llama,
        spec_config(method, tiny_llama, tiny_model_dirs),
        num_gpu_blocks_override=30,
        max_model_len=96,
        async_scheduling=True,
        check_integrity_on_idle=True,
    )
    engine = llm.llm_engine
    core = engine.engine_core
    prompts = make_prompts(5) * 2
    sp = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
    steps = 0
    k, bs = core.config.speculative_config.num_speculative_tokens, core.kv_cache_manager.block_size
    reserved_seen = 0
    while engine.has_unfinished_requests():
        engine.step()
        core.check_integrity()
        for r in core.scheduler.running:
            # What is certain never runs ahead of the known tokens, and the blocks held cover at most the known
            # tokens, two steps of reserved drafts and the lookahead.
            assert 0 <= r.num_reserved_drafts <= k
            assert r.num_computed_tokens - r.num_reserved_drafts <= r.num_tokens
            assert core.kv_cache_manager.num_blocks_of(r.request_id) <= -(-min(r.num_tokens + 3 * k, 96) // bs)
            reserved_seen += r.num_reserved_drafts
        steps += 1
        if steps in (3, 7, 12):
            engine.abort_request([f"r{steps % len(prompts)}", f"r{(steps + 5) % len(prompts)}"])
    assert core.on_idle() and core.num_integrity_failures == 0
    assert reserved_seen > 0
    s = stats(llm)
    assert s.spec_num_draft_tokens > s.spec_num_accepted_tokens  # rejections happened
    assert s.num_preemptions > 0
    assert_no_leaks(llm)


def test_async_step_overlaps_scheduling_and_output_processing(tiny_llama):
    """The loop's host work runs while the next step is launched: each step() schedules and launches step N+1
    before it processes step N's output, and the scheduler's state after the run is the synchronous one's."""
    llm = make_llm(tiny_llama, async_scheduling=True)
    core = llm.llm_engine.engine_core
    events: list[str] = []
    launch, update = core.runner.launch, core.scheduler.update_from_output

    def logged_launch(sched):
        events.append("launch")
        return launch(sched)

    def logged_update(sched, result):
        events.append("update")
        return update(sched, result)

    core.runner.launch = logged_launch
    core.scheduler.update_from_output = logged_update
    greedy(llm, make_prompts()[-2:], max_tokens=12)  # repetitive prompts: n-gram drafts
    assert events[:3] == ["launch", "launch", "update"]  # step 2 launched before step 1's output is processed
    assert stats(llm).spec_num_drafts > 0
    assert_no_leaks(llm)


@pytest.mark.parametrize("method", ["ngram", "draft_self", "eagle"])
def test_async_under_tensor_parallelism(tiny_model_dirs, tiny_llama, method):
    """TP=2 (CPU, gloo): the emitted tokens ride the next launch message as in synchronous speculation, the drafts
    ride the scheduler output; greedy output equals transformers', every rank's batch equals rank 0's."""
    from tests.spec_decode.test_spec_engine import reference
    from tests.spec_decode.test_spec_tp import shutdown, tp_spec_llm

    prompts = make_prompts()
    want = reference(tiny_llama, tuple(map(tuple, prompts)))
    llm = tp_spec_llm(tiny_llama, spec_config(method, tiny_llama, tiny_model_dirs), async_scheduling=True)
    try:
        core = llm.llm_engine.engine_core
        assert core.async_scheduling
        # max_tokens 2 and 3: steps with no draft slots at all, right after steps with and without them.
        for max_tokens in (2, 3, 40):
            assert greedy(llm, prompts, max_tokens) == [t[:max_tokens] for t in want]
        step, checks = core.step, [0]

        def checked_step():
            out = step()
            if core._in_flight is not None:  # its tokens into rank 0's batch and on their way to the workers
                core.runner.collect(core._in_flight[1])
            core.runner.check_batches()
            checks[0] += 1
            return out

        core.step = checked_step  # (collecting each step early changes no output)
        assert greedy(llm, prompts) == want
        assert stats(llm).spec_num_drafts > 0 and checks[0] > 0
        assert_no_leaks(llm)
    finally:
        shutdown(llm)


def test_async_launch_waits_only_for_steps_with_drafts(tiny_llama):
    """With nothing reserved in the step in flight nor in the next one (max_tokens=2 leaves no room for drafts),
    an n-gram engine launches the next step before it reads the previous one's tokens, as without speculation;
    with drafts reserved it reads them first."""
    llm = make_llm(tiny_llama, async_scheduling=True)
    core = llm.llm_engine.engine_core
    events: list[tuple[str, int]] = []
    launch, collect = core.runner.launch, core.runner.collect

    def logged_launch(sched):
        step = launch(sched)
        events.append(("launch", step.step_id))
        return step

    def logged_collect(step):
        if step.output is None:
            events.append(("collect", step.step_id))
        return collect(step)

    core.runner.launch, core.runner.collect = logged_launch, logged_collect
    prompts = make_prompts()[-2:]
    assert greedy(llm, prompts, max_tokens=2) == [t[:2] for t in greedy(make_llm(tiny_llama, None), prompts, 2)]
    assert events.index(("launch", 1)) < events.index(("collect", 0))
    events.clear()
    greedy(llm, prompts, max_tokens=12)
    first = events[0][1]
    assert events.index(("collect", first + 1)) < events.index(("launch", first + 2))
    assert stats(llm).spec_num_drafts > 0
    assert_no_leaks(llm)
