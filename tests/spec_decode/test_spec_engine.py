"""Speculative decoding through the engine (n-gram and draft-model drafts, CPU, float32): greedy output equals transformers' and
the engine's own output without speculation, across chunked prefill, prefix hits, preemption, n > 1, stop
strings, stop tokens inside accepted drafts, logprobs and aborts; no KV block leaks; config errors; metrics."""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import add_engine_args, engine_kwargs_from_args
from tests.utils import hf_greedy

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
MAX_NEW = 40
# Proposers under test: n-gram, a draft model that is another tiny model with the same tokenizer (it guesses
# wrong most of the time: many rejections), and the target as its own draft (every draft accepted).
METHODS = ["ngram", "draft_other", "draft_self", "eagle"]


@pytest.fixture(params=METHODS)
def method(request):
    return request.param


@functools.cache
def eagle_head(target: str) -> str:
    """A random EAGLE-1 head for ``target`` (tests/spec_decode/test_eagle.py builds it in the published layout)."""
    import tempfile

    from tests.spec_decode.test_eagle import make_eagle_head

    return make_eagle_head(target, Path(tempfile.mkdtemp()) / "eagle", "eagle")


def spec_config(method: str, target: str, dirs: dict[str, str]) -> dict:
    if method == "ngram":
        return NGRAM
    if method == "eagle":
        return {"method": "eagle", "model": eagle_head(target), "num_speculative_tokens": 3}
    if method == "medusa":
        import tempfile

        from tests.spec_decode.test_medusa import make_medusa_heads

        heads, _ = make_medusa_heads(target, Path(tempfile.mkdtemp()) / "medusa")
        return {"method": "medusa", "model": heads, "num_speculative_tokens": 3}
    draft = target if method == "draft_self" else dirs["qwen3" if target != dirs["qwen3"] else "llama"]
    return {"model": draft, "num_speculative_tokens": 3}


def make_prompts(seed: int = 0) -> list[list[int]]:
    """Random prompts plus repetitive ones: the drafts come from both, and the tiny models loop often enough."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in (5, 17, 9, 30)]
    prompts += [[7, 8, 9, 10] * 5, [21, 22, 23] * 7 + [21]]
    return prompts


def make_llm(path: str, spec: dict | None = NGRAM, **kw) -> LLM:
    kw.setdefault("dtype", "float32")
    kw.setdefault("device", "cpu")
    kw.setdefault("block_size", 4)
    return LLM(path, speculative_config=spec, **kw)


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_NEW, **params) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **params)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@functools.cache
def reference(path: str, prompts: tuple[tuple[int, ...], ...], max_new: int = MAX_NEW) -> list[list[int]]:
    return hf_greedy(path, [list(p) for p in prompts], max_new)


def stats(llm: LLM):
    return llm.llm_engine.get_stats()


def assert_no_leaks(llm: LLM) -> None:
    core = llm.llm_engine.engine_core
    core.check_integrity()
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.pool.num_blocks
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma"])
def test_greedy_matches_transformers(tiny_model_dirs, arch, method):
    path = tiny_model_dirs[arch]
    prompts = make_prompts()
    llm = make_llm(path, spec_config(method, path, tiny_model_dirs))
    assert greedy(llm, prompts) == reference(path, tuple(map(tuple, prompts)))
    s = stats(llm)
    assert s.spec_num_drafts > 0 and s.spec_num_draft_tokens >= s.spec_num_drafts
    assert 0 <= s.spec_num_accepted_tokens <= s.spec_num_draft_tokens
    assert sum(s.spec_accepted_per_pos) == s.spec_num_accepted_tokens
    if method == "draft_self":  # greedy drafts of the target itself are the target's tokens
        assert s.spec_num_accepted_tokens == s.spec_num_draft_tokens
    assert_no_leaks(llm)


def test_ngram_accepts_drafts(tiny_llama):
    """These prompts make the tiny Llama repeat itself, so prompt lookup must be right some of the time; the
    counters must then say the verification step emitted more tokens than it ran steps for."""
    llm = make_llm(tiny_llama)
    greedy(llm, make_prompts())
    s = stats(llm)
    assert s.spec_num_accepted_tokens > 0
    assert s.spec_accepted_per_pos[0] >= max(s.spec_accepted_per_pos)  # position i needs positions < i


def test_exact_with_small_chunks_prefix_hits_and_preemption(tiny_model_dirs, tiny_llama, method):
    """A token budget of 6 splits prompts and caps drafts; shared prefixes hit the cache; a 21-block pool
    forces preemptions mid-generation. Output must still be transformers'."""
    base = make_prompts(1)
    prefix = [11, 12, 13, 14, 15, 16, 17, 18]
    prompts = base + [prefix + p[:6] for p in base]
    llm = make_llm(
        tiny_llama,
        spec_config(method, tiny_llama, tiny_model_dirs),
        max_num_batched_tokens=6,
        num_gpu_blocks_override=21,
        max_num_seqs=8,
        max_model_len=80,
    )
    assert greedy(llm, prompts) == reference(tiny_llama, tuple(map(tuple, prompts)))
    s = stats(llm)
    assert s.num_preemptions > 0, "the test meant to preempt"
    assert s.prefix_cache_hits > 0, "the test meant to hit the prefix cache"
    assert s.spec_num_drafts > 0
    assert_no_leaks(llm)


def test_stop_tokens_inside_drafts_and_max_tokens(tiny_model_dirs, tiny_llama, method):
    """A stop token or max_tokens reached in the middle of accepted drafts ends the output right there."""
    prompts = make_prompts(2)
    plain = make_llm(tiny_llama, spec=None)
    spec = make_llm(tiny_llama, spec_config(method, tiny_llama, tiny_model_dirs))
    full = greedy(plain, prompts)
    for max_tokens in (1, 2, 5, 13):
        assert greedy(spec, prompts, max_tokens=max_tokens) == [t[:max_tokens] for t in full]
    stop_id = full[-1][len(full[-1]) // 2]  # a token the last prompt's output produces midway
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, stop_token_ids=[stop_id])
    want = plain.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    got = spec.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert (g.outputs[0].finish_reason, g.outputs[0].stop_reason) == (
            w.outputs[0].finish_reason,
            w.outputs[0].stop_reason,
        )
    assert any(w.outputs[0].stop_reason == stop_id for w in want)
    assert_no_leaks(spec)


def test_n_text_prompts_stop_strings_and_logprobs(tiny_model_dirs, tiny_llama, method):
    plain = make_llm(tiny_llama, spec=None)
    check_n_stop_strings_and_logprobs(plain, make_llm(tiny_llama, spec_config(method, tiny_llama, tiny_model_dirs)))


def check_n_stop_strings_and_logprobs(plain, spec) -> None:
    """``spec`` (a speculating LLM) gives ``plain``'s texts, logprobs and ranks with n=2, and stops where it does on
    a stop string."""
    prompts = ["the cat counted the stars and the stars", "hello hello hello hello", "def fibonacci(n"]
    sp = SamplingParams(n=2, temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    want = plain.generate(prompts, sp, use_tqdm=False)
    got = spec.generate(prompts, sp, use_tqdm=False)
    for w, g in zip(want, got):
        assert len(g.outputs) == 2
        for wc, gc in zip(w.outputs, g.outputs):
            assert gc.token_ids == wc.token_ids and gc.text == wc.text
            assert len(gc.logprobs) == len(gc.token_ids)
            for wl, gl in zip(wc.logprobs, gc.logprobs):
                assert wl.keys() == gl.keys()
                for tok in wl:
                    assert gl[tok].logprob == pytest.approx(wl[tok].logprob, abs=1e-4)
                    assert gl[tok].rank == wl[tok].rank
    # A stop string taken from the middle of an output: the same text, cut at the same place.
    text = want[1].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
    w, g = plain.generate(prompts, sp, use_tqdm=False), spec.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].text for o in g] == [o.outputs[0].text for o in w]
    assert [o.outputs[0].finish_reason for o in g] == [o.outputs[0].finish_reason for o in w]
    assert w[1].outputs[0].finish_reason == "stop"
    assert stats(spec).spec_num_drafts > 0
    assert_no_leaks(spec)


def history_params(n: int) -> list[SamplingParams]:
    """Greedy params for ``n`` prompts: penalties, min_tokens and a logit bias on the first four (the first three read
    the history, so those requests decode without drafts), plain greedy on the rest."""
    return [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, frequency_penalty=0.5),
        SamplingParams(temperature=0.0, max_tokens=20, min_tokens=5),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logit_bias={5: 2.0}),
    ] + [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * (n - 4)


def test_sampling_params_that_read_history_decode_without_drafts(tiny_llama):
    """Penalties and min_tokens change the target distribution position by position: such requests run
    without drafts (exactly as without speculation), next to requests that do speculate."""
    prompts = make_prompts(3)
    plain = make_llm(tiny_llama, spec=None)
    spec = make_llm(tiny_llama)
    params = history_params(len(prompts))
    inputs = [{"prompt_token_ids": p} for p in prompts]
    want = plain.generate(inputs, params, use_tqdm=False)
    got = spec.generate(inputs, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert stats(spec).spec_num_drafts > 0
    assert_no_leaks(spec)


def test_seeded_sampling_with_drafts_repeats(tiny_llama):
    """Seeded random rows draw from their own generators: the same seed gives the same output, alone or in a
    batch with other requests."""
    spec = make_llm(tiny_llama)
    prompts = make_prompts(4)
    sp = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=7, max_tokens=30, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    batch = [o.outputs[0].token_ids for o in spec.generate(inputs, sp, use_tqdm=False)]
    alone = [spec.generate([i], sp, use_tqdm=False)[0].outputs[0].token_ids for i in inputs[-2:]]
    assert batch[-2:] == alone
    assert stats(spec).spec_num_drafts > 0
    assert_no_leaks(spec)


@pytest.mark.parametrize("method", ["ngram", "draft_other", "eagle", "medusa"])
def test_aborts_and_rejections_leak_no_blocks(tiny_model_dirs, tiny_llama, method):
    """Steps with rejected drafts, requests aborted between steps, and a small pool: the pool invariants hold
    after every step and everything is returned at the end."""
    llm = make_llm(
        tiny_llama,
        spec_config(method, tiny_llama, tiny_model_dirs),
        num_gpu_blocks_override=30,
        max_model_len=96,
    )
    engine = llm.llm_engine
    core = engine.engine_core
    prompts = make_prompts(5) * 2
    sp = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        core.check_integrity()
        steps += 1
        if steps in (3, 7, 12):
            engine.abort_request([f"r{steps % len(prompts)}", f"r{(steps + 5) % len(prompts)}"])
    s = stats(llm)
    assert s.spec_num_draft_tokens > s.spec_num_accepted_tokens  # rejections happened
    assert s.spec_num_accepted_tokens > 0 or method in ("draft_other", "eagle", "medusa")  # random: maybe none
    assert s.num_preemptions > 0
    assert_no_leaks(llm)


@pytest.mark.parametrize(
    "spec, field",
    [
        ({"method": "bogus", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
            "prompt_lookup_max",
        ),
        ({"model": "/no/such/draft", "num_speculative_tokens": 2}, "model"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "model"),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "lookahead"),
        ("ngram", "speculative_config"),
    ],
)
def test_invalid_speculative_config_fails_at_startup(tiny_llama, spec, field):
    with pytest.raises(ValueError, match=field):
        make_llm(tiny_llama, spec=spec)


def test_draft_with_another_vocabulary_is_refused(tiny_llama, tmp_path):
    config = json.loads((Path(tiny_llama) / "config.json").read_text())
    config["vocab_size"] += 10
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="vocab_size"):
        make_llm(tiny_llama, spec={"model": str(tmp_path), "num_speculative_tokens": 2})


def test_cli_flag_and_async_scheduling_kept_on(tiny_llama):
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}', "--async-scheduling"]
    )
    kw = engine_kwargs_from_args(args)
    assert kw["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", "{not json"])
    llm = make_llm(tiny_llama, spec=kw["speculative_config"], async_scheduling=True)
    config = llm.llm_engine.engine_core.config
    assert config.speculative_config.prompt_lookup_min == config.speculative_config.prompt_lookup_max == 5
    assert config.scheduler_config.async_scheduling  # speculation runs with async scheduling too


def test_metrics_and_summary_line():
    from pagedllm.core.sched_output import SchedulerStats
    from pagedllm.metrics import PrometheusStatLogger, spec_decode_summary

    logger = PrometheusStatLogger("m")
    logger.record_scheduler_stats(
        SchedulerStats(
            spec_num_drafts=4,
            spec_num_draft_tokens=12,
            spec_num_accepted_tokens=6,
            spec_accepted_per_pos=[3, 2, 1],
        )
    )
    later = SchedulerStats(
        spec_num_drafts=6,
        spec_num_draft_tokens=18,
        spec_num_accepted_tokens=9,
        spec_accepted_per_pos=[5, 3, 1],
    )
    logger.record_scheduler_stats(later)
    text = logger.render().decode()
    assert 'pagedllm:spec_decode_num_drafts_total{model_name="m"} 6.0' in text
    assert 'pagedllm:spec_decode_num_draft_tokens_total{model_name="m"} 18.0' in text
    assert 'pagedllm:spec_decode_num_accepted_tokens_total{model_name="m"} 9.0' in text
    assert 'pagedllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 5.0' in text
    line = spec_decode_summary(later)
    assert "Mean acceptance length: 2.50" in line and "Avg Draft acceptance rate: 50.0%" in line
    assert spec_decode_summary(later, later) is None
    assert "Mean acceptance length: 2.50" in spec_decode_summary(later, SchedulerStats())


def test_draft_model_cache_shares_the_target_blocks(tiny_model_dirs, tiny_llama):
    """A draft model's KV cache holds the target's blocks (same ids), so a byte budget buys blocks for both,
    and the scheduler reserves k lookahead slots for the drafts' KV."""
    budget = 1 << 20
    plain = make_llm(tiny_llama, spec=None, kv_cache_memory_bytes=budget)
    draft = make_llm(
        tiny_llama, spec_config("draft_other", tiny_llama, tiny_model_dirs), kv_cache_memory_bytes=budget
    )
    target_bytes = plain.llm_engine.engine_core.runner.kv_block_bytes()
    core = draft.llm_engine.engine_core
    draft_bytes = core.proposer.kv_block_bytes()
    assert core.kv_cache_manager.pool.num_blocks == budget // (target_bytes + draft_bytes)
    assert core.proposer.runner.num_blocks == core.kv_cache_manager.pool.num_blocks
    assert core.config.scheduler_config.num_lookahead_tokens == 3
    assert plain.llm_engine.engine_core.config.scheduler_config.num_lookahead_tokens == 0


def test_draft_model_catches_up_a_prompt_longer_than_the_token_budget(tiny_llama):
    """A prompt longer than max_num_batched_tokens reaches the draft model over several steps (a chunk per step)
    and then gets drafts; with draft = target every one is accepted."""
    spec = {"model": tiny_llama, "num_speculative_tokens": 3}
    llm = make_llm(tiny_llama, spec, max_num_batched_tokens=8)
    prompt = make_prompts(6)[3]  # 30 tokens
    assert len(prompt) > 8
    assert greedy(llm, [prompt], max_tokens=24) == reference(tiny_llama, (tuple(prompt),), 24)
    s = stats(llm)
    assert s.spec_num_drafts > 0 and s.spec_num_accepted_tokens == s.spec_num_draft_tokens
    assert_no_leaks(llm)
