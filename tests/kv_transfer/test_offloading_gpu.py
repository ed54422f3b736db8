"""The CPU offloading tier on CUDA (pinned host pool, copies on a side stream, CUDA graphs on): greedy tokens and
logprobs equal a run without it, the tier served hits, and no block leaks."""

from __future__ import annotations

import pytest

from pagedllm import LLM
from tests.kv_transfer.test_cpu_offloading import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    assert_same,
    make_prompts,
    two_passes,
)

pytestmark = pytest.mark.gpu


def _llm(path: str, **kw) -> LLM:
    return LLM(path, dtype="float32", device="cuda", block_size=BLOCK_SIZE, max_model_len=64,
               num_gpu_blocks_override=NUM_BLOCKS, **kw)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_offloading_on_cuda_matches_plain_run(tiny_llama, async_scheduling):
    with _llm(tiny_llama, async_scheduling=async_scheduling) as llm:
        want = two_passes(llm, make_prompts())
    with _llm(tiny_llama, async_scheduling=async_scheduling, kv_offloading_size=0.01) as llm:
        got = two_passes(llm, make_prompts())
        stats = llm.llm_engine.get_stats()
    assert stats.kv_connector_stats["cpu_stored_blocks"] > 0
    assert stats.kv_connector_stats["cpu_hit_tokens"] > 0
    assert_same(got, want)
