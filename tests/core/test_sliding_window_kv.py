"""Models whose every layer has a sliding window free the KV blocks behind it: a long sequence holds about
W / block_size blocks, the output stays transformers' token for token, freed blocks keep serving prefix hits, and
unwindowed models keep every block (hybrid models: tests/core/test_hybrid_kv.py)."""

from __future__ import annotations

import random

from pagedllm import LLM, SamplingParams
from pagedllm.core.kv_cache_manager import NULL_BLOCK, KVCacheManager
from pagedllm.core.request import Request
from tests.utils import TINY_WINDOWS, hf_greedy


def _peak_blocks(llm: LLM) -> dict[str, int]:
    """Wrap the KV manager so each request's most blocks held (not counting freed ones) is recorded."""
    kv = llm.llm_engine.engine_core.kv_cache_manager
    peak: dict[str, int] = {}
    allocate = kv.allocate_slots

    def recording(request, *args, **kwargs):
        ok = allocate(request, *args, **kwargs)
        held = sum(b is not NULL_BLOCK for b in kv.req_to_blocks.get(request.request_id, []))
        peak[request.request_id] = max(peak.get(request.request_id, 0), held)
        return ok

    kv.allocate_slots = recording
    return peak


def test_long_generation_holds_only_the_window(tiny_model_dirs) -> None:
    path = tiny_model_dirs["mistral"]  # window 16, every layer
    llm = LLM(path, device="cpu", dtype="float32", block_size=4, max_model_len=160, max_num_batched_tokens=16)
    kv = llm.llm_engine.engine_core.kv_cache_manager
    assert [g.sliding_window for g in kv.groups] == [TINY_WINDOWS["mistral"]] == [16]
    peak = _peak_blocks(llm)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in (23, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, prompts, 100)
    # 123 and 140 tokens would take 31 and 35 blocks; the window (16), a block of margin and one step's 16 new
    # tokens take at most 10
    assert 0 < max(peak.values()) <= 10, peak
    core = llm.llm_engine.engine_core
    core.check_integrity()
    assert kv.num_free_blocks == kv.pool.num_blocks


def test_unwindowed_and_hybrid_off_models_keep_every_block(tiny_model_dirs) -> None:
    for arch, kw in (("llama", {}), ("gemma2", {"disable_hybrid_kv_cache_manager": True})):
        llm = LLM(tiny_model_dirs[arch], device="cpu", dtype="float32", block_size=4, max_model_len=64, **kw)
        assert [g.sliding_window for g in llm.llm_engine.engine_core.kv_cache_manager.groups] == [None]


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=1), None, 0.0)


def test_freed_blocks_keep_their_hashes_for_prefix_hits() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=True, group_windows=[4])
    tokens = list(range(100, 124))  # 6 full blocks
    first = _request("a", tokens)
    assert kv.allocate_slots(first, 24)
    first.num_computed_tokens = 24
    kv.cache_blocks(first)
    kv.allocate_slots(first, 1)  # 24 computed: keys at positions <= 20 - 4 are behind; blocks 0..3 freed
    held = kv.req_to_blocks["a"]
    assert held[:4] == [NULL_BLOCK] * 4 and all(b is not NULL_BLOCK for b in held[4:])
    assert kv.num_free_blocks == 16 - 3  # blocks 4, 5 and the new one
    kv.check_integrity()
    second = _request("b", tokens + [7])
    hit_blocks, num_hit = kv.get_computed_blocks(second)  # the freed blocks still hold their KV and hashes
    # The query at 24 reads keys 21..24: only the last block is needed (NULL_BLOCK before it).
    assert num_hit == 24 and hit_blocks[0][:5] == [NULL_BLOCK] * 5 and hit_blocks[0][5] is held[5]
    assert kv.allocate_slots(second, 1, hit_blocks)
    kv.check_integrity()
    kv.free(first)
    kv.free(second)
    kv.check_integrity()
    assert kv.num_free_blocks == 16
