import pytest

from pagedllm.core.block_pool import BlockPool, hash_block_tokens
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams


def make_request(req_id: str, tokens: list[int], **params) -> Request:
    return Request(req_id, tokens, SamplingParams(**params), eos_token_id=None, arrival_time=0.0)


def test_free_queue_is_lru_and_o1_remove():
    pool = BlockPool(4)
    a, b, c = pool.get_new_blocks(3)
    assert [x.block_id for x in (a, b, c)] == [0, 1, 2]
    pool.free_blocks([c, a, b])  # freed order: c, a, b -> after the never-used block 3
    assert [blk.block_id for blk in pool.free_queue] == [3, 2, 0, 1]
    pool.touch([a])  # a prefix hit pulls a block out of the middle
    assert [blk.block_id for blk in pool.free_queue] == [3, 2, 1]
    assert pool.num_free_blocks == 3 and a.ref_cnt == 1
    pool.check_integrity({a.block_id: 1})


def test_double_free_is_caught():
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    pool.free_blocks([a])
    with pytest.raises(AssertionError):
        pool.free_blocks([a])


def test_get_new_blocks_evicts_cached_hash():
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1, 2])
    pool.cache_block(a, h)
    pool.free_blocks([a])
    assert pool.get_cached_block(h) is a  # still reusable while free
    pool.get_new_blocks(2)  # takes block 1 then the LRU cached block 0: evicted
    assert pool.get_cached_block(h) is None and a.block_hash is None


def test_chained_hash_depends_on_whole_prefix():
    h1 = hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(None, [1, 2, 3, 4]) == h1
    assert hash_block_tokens(h1, [5, 6]) != hash_block_tokens(hash_block_tokens(None, [9, 2, 3, 4]), [5, 6])
    assert hash_block_tokens(None, [1, 2, 3, 4], extra_keys=("lora-1",)) != h1


def test_prefix_hit_reuses_blocks_and_leaves_one_token():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    r1 = make_request("a", list(range(10)))
    assert kv.get_computed_blocks(r1) == (([],), 0)  # one list per KV cache group (here one group)
    assert kv.allocate_slots(r1, 10)
    r1.num_computed_tokens = 10
    kv.cache_blocks(r1)  # two full blocks registered
    r2 = make_request("b", list(range(8)) + [99, 98])
    (blocks,), n = kv.get_computed_blocks(r2)
    assert n == 8 and [b.block_id for b in blocks] == kv.get_block_ids("a")[:2]
    # An exact repeat of a block-aligned prompt still computes its last token.
    r3 = make_request("c", list(range(8)))
    _, n = kv.get_computed_blocks(r3)
    assert n == 4
    assert kv.prefix_cache_hits == 12 and kv.prefix_cache_queries == 28
    # Freed blocks stay cached and are revived by the next hit.
    kv.free(r1)
    assert kv.num_free_blocks == 10
    hit, n = kv.get_computed_blocks(r2)
    assert kv.allocate_slots(r2, 2, hit)
    assert kv.get_block_ids("b")[:2] == [b.block_id for b in hit[0]]
    assert kv.num_free_blocks == 10 - 3
    kv.check_integrity()


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    r = make_request("a", list(range(20)))
    assert not kv.allocate_slots(r, 20)
    assert kv.num_free_blocks == 3 and kv.get_block_ids("a") == []
    assert kv.allocate_slots(r, 12)
    r.num_computed_tokens = 12
    assert not kv.allocate_slots(r, 1)
    assert len(kv.get_block_ids("a")) == 3
    kv.free(r)
    kv.check_integrity()


def test_prompt_logprobs_requests_skip_prefix_cache():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    r1 = make_request("a", list(range(9)))
    kv.allocate_slots(r1, 9)
    r1.num_computed_tokens = 9
    kv.cache_blocks(r1)
    r2 = make_request("b", list(range(9)), prompt_logprobs=1)
    assert kv.get_computed_blocks(r2) == (([],), 0)
