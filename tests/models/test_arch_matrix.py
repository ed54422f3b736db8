"""Every tiny architecture through the engine under pressure: prompts longer than the
sliding windows (16 and 32 tokens in the tiny configs), chunked prefill, prefix-cache hits and preemption at once;
greedy tokens equal transformers' and each generated token's logprob (and the top-3) agree within 1e-4."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.utils import TINY_ARCHS, TINY_WINDOWS, hf_greedy, hf_logprobs

MAX_NEW = 12
UNIFORM_WINDOW_POOL = {"mistral": 12, "phi3": 16}  # archs whose every layer has the window: KV pool size
# Hybrid archs (a full-attention and a sliding KV cache group sharing the pool): a block is a page of one layer, half
# the others' (two layers), so twice the blocks for the same memory.
HYBRID_POOL = {"gemma2": 40, "gemma3": 40, "gpt_oss": 40, "qwen2_moe-window-dense": 40}


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(11)
    shared = [rng.randrange(3, vocab) for _ in range(36)]  # 9 full blocks another prompt can hit
    return [
        shared + [rng.randrange(3, vocab) for _ in range(8)],
        [rng.randrange(3, vocab) for _ in range(41)],
        shared + [rng.randrange(3, vocab) for _ in range(5)],
    ]


@pytest.mark.usefixtures("admit_while_blocks_last")
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_long_prompts_chunked_prefix_hits_preemption(tiny_model_dirs, arch):
    path = tiny_model_dirs[arch]
    llm = LLM(
        path,
        device="cpu",
        dtype="float32",
        block_size=4,
        max_model_len=64,
        max_num_batched_tokens=8,  # prompts arrive in chunks of at most 8 tokens
        # three sequences of ~13 blocks cannot all fit: preemption. Models whose every layer slides free the blocks
        # behind the window (a sequence holds ~W / 4 + 2 blocks), so they get a smaller pool to be preempted too.
        num_gpu_blocks_override=UNIFORM_WINDOW_POOL.get(arch, HYBRID_POOL.get(arch, 20)),
    )
    # KV cache group 0: the window when every layer slides, else full attention (hybrid models add sliding groups)
    windows = [g.sliding_window for g in llm.llm_engine.engine_core.kv_cache_manager.groups]
    assert windows[0] == (TINY_WINDOWS[arch] if arch in UNIFORM_WINDOW_POOL else None)
    vocab = llm.llm_engine.engine_core.vocab_size
    prompts = _prompts(vocab)
    assert all(len(p) > TINY_WINDOWS.get(arch, 0) for p in prompts)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, prompts, MAX_NEW)
    for prompt, out in zip(prompts, outs):
        comp = out.outputs[0]
        ref = hf_logprobs(path, prompt + comp.token_ids[:-1])  # [len, vocab]
        for j, (tok, lps) in enumerate(zip(comp.token_ids, comp.logprobs)):
            row = ref[len(prompt) - 1 + j]
            assert abs(lps[tok].logprob - row[tok].item()) < 1e-4
            top = torch.topk(row, 3)
            for t, v in zip(top.indices.tolist(), top.values.tolist()):
                assert abs(lps[t].logprob - v) < 1e-4
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0, "the test meant to preempt"
    assert stats.prefix_cache_hits > 0, "the test meant to hit the prefix cache"
    core = llm.llm_engine.engine_core
    core.check_integrity()
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.pool.num_blocks
