"""Speculative decoding on a CUDA GPU (Triton attention, CUDA graphs for the draft's decode steps): greedy output
close to the same engine without speculation (bf16: vLLM's check_logprobs_close rule), nothing leaked."""

from __future__ import annotations

import random

import pytest

from pagedllm import LLM, SamplingParams

pytestmark = pytest.mark.gpu


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (5, 33, 17, 64)]
    return prompts + [[7, 8, 9, 10] * 8]


def _spec(method: str, tiny_model_dirs: dict) -> dict:
    """k = 3 drafts for the tiny llama: prompt lookup, itself as draft (every draft accepted), or qwen3 as draft."""
    return {
        "ngram": {
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_max": 3,
            "prompt_lookup_min": 1,
        },
        "draft_self": {"model": tiny_model_dirs["llama"], "num_speculative_tokens": 3},
        "draft_other": {"model": tiny_model_dirs["qwen3"], "num_speculative_tokens": 3},
    }[method]


@pytest.mark.parametrize("method", ["ngram", "draft_self", "draft_other"])
def test_spec_decode_on_gpu_close_to_plain(tiny_model_dirs, method):
    path = tiny_model_dirs["llama"]
    spec = _spec(method, tiny_model_dirs)
    kw = dict(dtype="bfloat16", device="cuda", kv_cache_memory_bytes=64 * 2**20, max_model_len=512)
    plain = LLM(path, **kw)
    llm = LLM(path, speculative_config=spec, **kw)
    prompts = [{"prompt_token_ids": p} for p in _prompts(llm.llm_engine.engine_core.vocab_size)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=5)
    want = plain.generate(prompts, params, use_tqdm=False)
    got = llm.generate(prompts, params, use_tqdm=False)
    for w, g in zip(want, got):
        a, b = g.outputs[0], w.outputs[0]
        for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
            if x != y:  # bf16: the first divergence must be a near-tie, after it anything goes
                assert x in b.logprobs[j] and y in a.logprobs[j], f"step {j}: {x} vs {y}"
                break
    stats = llm.llm_engine.get_stats()
    assert stats.spec_num_drafts > 0
    if method == "draft_self":
        assert stats.spec_num_accepted_tokens >= 0.9 * stats.spec_num_draft_tokens
    llm.llm_engine.check_integrity()


@pytest.mark.parametrize("method", ["ngram", "draft_self"])
def test_verification_replays_graphs_and_matches_eager(tiny_model_dirs, method):
    """Verification steps (up to k + 1 tokens a request, drafts of any count, requests joining and leaving) and the
    draft model's catch-up passes replay the multi-token CUDA graphs, with the eager engine's greedy output
    (float32: any difference would be a wrong token, not rounding). With draft_self every draft is accepted, so
    the draft's catch-up passes compute 2 tokens a request (an always-rejected draft catches up 1: pure decodes)."""
    path = tiny_model_dirs["llama"]
    spec = _spec(method, tiny_model_dirs)
    kw = dict(dtype="float32", device="cuda", kv_cache_memory_bytes=64 * 2**20, max_model_len=512)
    eager = LLM(path, speculative_config=spec, enforce_eager=True, **kw)
    graphed = LLM(path, speculative_config=spec, **kw)
    prompts = [{"prompt_token_ids": p} for p in _prompts(graphed.llm_engine.engine_core.vocab_size)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=8 + 7 * i, ignore_eos=True) for i in range(len(prompts))
    ]
    want = eager.generate(prompts, params, use_tqdm=False)
    got = graphed.generate(prompts, params, use_tqdm=False)
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    runner = graphed.llm_engine.engine_core.runner.graph_runner
    assert runner.q == 4 and sum(c for (_, q), c in runner.num_replays.items() if q == 4) > 0
    if method == "draft_self":
        draft = graphed.llm_engine.engine_core.proposer.runner.graph_runner
        assert sum(c for (_, q), c in draft.num_replays.items() if q == 4) > 0
    assert graphed.llm_engine.get_stats().spec_num_accepted_tokens > 0
    graphed.llm_engine.check_integrity()
