"""Speculation that reads the target's hidden states under pipeline parallelism on two CUDA GPUs: the demo target
split over two stages, its EAGLE head and Medusa heads on rank 0 (cuda:0) fed the last stage's hidden states
(cuda:1, through host memory on the gloo link). Greedy output and every drafted token equal the one-GPU engine's
eager run (float32: each stage computes its layers as one GPU does). Skipped with fewer than two GPUs."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM
from pagedllm.demo import DEMO_MODEL_DIR
from tests.distributed.test_pp_engine import greedy_ids, record_drafts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

KW = dict(dtype="float32", device="cuda", max_model_len=256, kv_cache_memory_bytes=64 * 2**20, max_num_seqs=8)


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_pp2_demo_heads_draft_as_one_gpu(method):
    spec = {"method": method, "model": str(DEMO_MODEL_DIR / method), "num_speculative_tokens": 3}
    prompts = [list(range(100 + 7 * i, 140 + 7 * i)) for i in range(4)]
    one = LLM(str(DEMO_MODEL_DIR), speculative_config=spec, enforce_eager=True, **KW)
    drafts_one = record_drafts(one)
    expected = greedy_ids(one, prompts, max_tokens_override=32)
    one.llm_engine.engine_core.shutdown()
    llm = LLM(str(DEMO_MODEL_DIR), speculative_config=spec, pipeline_parallel_size=2, **KW)
    try:
        drafts = record_drafts(llm)
        assert greedy_ids(llm, prompts, max_tokens_override=32) == expected
        assert drafts == drafts_one and llm.llm_engine.get_stats().spec_num_draft_tokens > 0
        llm.llm_engine.engine_core.check_integrity()
    finally:
        llm.llm_engine.engine_core.shutdown()
