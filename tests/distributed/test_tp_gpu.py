"""Tensor parallelism on two CUDA GPUs (NCCL): TP=2 with decode CUDA graphs (the all-reduces captured inside them)
and async scheduling (the sampled ids broadcast on the device) gives TP=1's greedy tokens, and eager TP=2 gives the
same. Skipped with fewer than two GPUs."""

from __future__ import annotations

import os
import random

import pytest
import torch

from pagedllm import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]


def _run(path: str, prompts: list[list[int]], **kw) -> tuple[list[list[int]], list[list[dict]], bool]:
    llm = LLM(path, dtype="float32", device="cuda", kv_cache_memory_bytes=64 * 2**20, max_model_len=256, **kw)
    core = llm.llm_engine.engine_core
    assert llm.llm_engine.config.scheduler_config.async_scheduling  # the default on CUDA, under TP too
    try:
        graphs = getattr(core.runner, "graph_runner", None) is not None
        piecewise = os.environ.get("PAGEDLLM_TP_PIECEWISE", "1") != "0" and not kw.get("enforce_eager")
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        if piecewise:  # rank 0's runner replayed piecewise graphs
            assert sum(core.runner.piecewise.num_replays.values()) > 0
        core.check_integrity()
        return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs], graphs
    finally:
        core.shutdown()


def _assert_close(ids_a, lps_a, ids_b, lps_b) -> None:
    """Equal up to a first divergence, where each side's token must be in the other's top 5 (a near tie that
    a different float32 summation order may flip); later tokens may differ."""
    for a_seq, la, b_seq, lb in zip(ids_a, lps_a, ids_b, lps_b):
        for j, (a, b) in enumerate(zip(a_seq, b_seq)):
            if a != b:
                assert a in lb[j] and b in la[j], f"step {j}: {a} vs {b} is not a near tie"
                break


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tp2_cuda_graphs_match_tp1(tiny_model_dirs, arch):
    path = tiny_model_dirs[arch]
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (3, 40, 17, 90, 5, 64, 1, 33)]
    ids1, lps1, graphs1 = _run(path, prompts)
    ids2, lps2, graphs2 = _run(path, prompts, tensor_parallel_size=2)
    ids2e, lps2e, graphs2e = _run(path, prompts, tensor_parallel_size=2, enforce_eager=True)
    assert graphs1 and graphs2 and not graphs2e
    _assert_close(ids2, lps2, ids1, lps1)
    _assert_close(ids2e, lps2e, ids2, lps2)


def test_tp2_piecewise_graphs_match_eager(tiny_model_dirs, monkeypatch):
    """Mixed steps (a 64-token budget chunks the prompts) replay piecewise graphs on both ranks, the all-reduces
    captured inside the pieces (on by default under TP; PAGEDLLM_TP_PIECEWISE=0 switches them off): eager
    TP=2's tokens."""
    path = tiny_model_dirs["llama"]
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (3, 140, 17, 90, 5, 64, 1, 200)]
    kw = {"tensor_parallel_size": 2, "max_num_batched_tokens": 64}
    monkeypatch.delenv("PAGEDLLM_TP_PIECEWISE", raising=False)
    ids_e, lps_e, _ = _run(path, prompts, enforce_eager=True, **kw)
    ids_p, lps_p, graphs = _run(path, prompts, **kw)
    assert graphs
    _assert_close(ids_p, lps_p, ids_e, lps_e)
