"""KV cache groups (core/kv_cache_manager.py) without a model: how layers are grouped, what a sliding group holds,
which prefix hits every group can serve, and a randomized scheduler run that keeps every invariant."""

from __future__ import annotations

import random

import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import (
    NULL_BLOCK,
    KVCacheManager,
    blocks_per_sequence,
    cdiv,
    plan_kv_cache_layout,
    sliding_window_blocks,
)
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched_output import ModelRunnerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams

W, BS = 8, 4  # window, block size


def gemma3_windows(num_layers: int, window: int = 1024) -> list[int | None]:
    return [None if (i + 1) % 6 == 0 else window for i in range(num_layers)]


def test_layout_groups_layers_by_window() -> None:
    # Gemma 3 12B: 8 global + 40 local layers -> 1 + 5 groups of 8 layers over 8 shared cache tensors.
    layout = plan_kv_cache_layout(gemma3_windows(48), 32768)
    assert layout.group_windows == (None, 1024, 1024, 1024, 1024, 1024) and layout.num_slots == 8
    for g in range(layout.num_groups):  # a group's layers use distinct tensors
        slots = [s for s, lg in zip(layout.layer_slots, layout.layer_groups) if lg == g]
        assert sorted(slots) == list(range(8))
    assert [layout.layer_groups[i] for i in (5, 11, 47)] == [0, 0, 0]  # the global layers
    # Gemma 3 4B: 5 global + 29 local -> groups of 5, the last local group short (one slot unused in its blocks).
    layout = plan_kv_cache_layout(gemma3_windows(34), 32768)
    assert layout.group_windows == (None,) + (1024,) * 6 and layout.num_slots == 5
    assert sorted(layout.layer_groups).count(6) == 4
    # Gemma 2 / GPT-OSS alternate: one group per kind, as many layers each.
    assert plan_kv_cache_layout([W, None] * 4, 64).group_windows == (None, W)
    # Counts within 25% of each other: groups as large as the largest kind.
    layout = plan_kv_cache_layout([None] * 5 + [W] * 6, 64)
    assert layout.group_windows == (None, W) and layout.num_slots == 6
    # Two windows and full layers.
    assert plan_kv_cache_layout([None, 4, W, 4, W, None], 64).group_windows == (None, 4, W)


def test_layout_single_group_cases() -> None:
    plain = plan_kv_cache_layout([None] * 3, 64)
    assert plain.group_windows == (None,) and plain.layer_slots == (0, 1, 2)  # one tensor per layer, as ever
    assert plan_kv_cache_layout([W] * 3, 64).group_windows == (W,)  # Mistral: one sliding group
    # A window of max_model_len or more never leaves a key behind: full attention.
    assert plan_kv_cache_layout([64, None], 64).group_windows == (None,)
    assert plan_kv_cache_layout([64, 64], 64).group_windows == (None,)
    # Hybrid off: mixed windows keep every block; a window every layer has is still freed behind.
    assert plan_kv_cache_layout([W, None], 64, hybrid=False).group_windows == (None,)
    assert plan_kv_cache_layout([W, W], 64, hybrid=False).group_windows == (W,)
    assert plan_kv_cache_layout([], 64).group_windows == (None,)


def test_blocks_per_sequence() -> None:
    # 32k tokens, window 1024, blocks of 16: the full group holds 2048 blocks, a sliding one 66 while decoding.
    assert blocks_per_sequence((None, 1024), 16, 32768) == [2048, 66]
    assert blocks_per_sequence((None, 1024), 16, 100) == [7, 7]  # short sequences: no saving
    assert sliding_window_blocks(1024, 16, 1) <= cdiv(1024, 16) + 2


def request(rid: str, tokens: list[int], max_tokens: int = 1) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, temperature=0.0), None, 0.0)


def held(kv: KVCacheManager, rid: str) -> list[int]:
    """Non-null blocks the request holds in each group."""
    return [sum(b is not NULL_BLOCK for b in g.req_to_blocks.get(rid, [])) for g in kv.groups]


def compute(kv: KVCacheManager, req: Request, n: int) -> None:
    """Schedule and 'compute' n tokens of ``req`` (as the scheduler does around a step)."""
    assert kv.allocate_slots(req, n)
    req.num_computed_tokens += n
    kv.cache_blocks(req)


def test_sliding_group_holds_its_window_the_full_group_everything() -> None:
    kv = KVCacheManager(64, BS, group_windows=[None, W])
    req = request("a", list(range(100, 140)))  # 10 blocks
    for _ in range(5):
        compute(kv, req, 8)  # chunked prefill
        full, sliding = held(kv, "a")
        assert full == cdiv(req.num_computed_tokens, BS) and sliding <= cdiv(W, BS) + 2
        kv.check_integrity()
    # 40 computed: keys <= 32 are behind every later query's window; blocks 0..6 (positions < 28) went back.
    assert held(kv, "a") == [10, 3] and kv.num_free_blocks == 64 - 13
    for _ in range(7):  # decoding
        req.append_output_token(7)
        compute(kv, req, 1)
        assert held(kv, "a")[1] <= cdiv(W, BS) + 2
    assert len(kv.req_to_blocks["a"]) == len(kv.groups[1].req_to_blocks["a"]) == cdiv(47, BS)
    kv.free(req)
    kv.check_integrity()
    assert kv.num_free_blocks == 64


def test_hit_needs_only_the_window_in_a_sliding_group() -> None:
    kv = KVCacheManager(64, BS, group_windows=[None, W])
    tokens = list(range(100, 132))  # 8 blocks
    first = request("a", tokens)
    compute(kv, first, 32)  # sliding blocks 0..4 are behind the window: freed, still cached
    assert held(kv, "a") == [8, 3]
    second = request("b", tokens + [5])
    (full, sliding), num_hit = kv.get_computed_blocks(second)
    # The query at 32 reads keys 25..32: sliding blocks 6 and 7 (cdiv(W - 1, BS) = 2 blocks).
    assert num_hit == 32 and len(full) == len(sliding) == 8
    assert sliding[:6] == [NULL_BLOCK] * 6 and sliding[6:] == kv.groups[1].req_to_blocks["a"][6:]
    assert full == kv.req_to_blocks["a"]
    assert kv.allocate_slots(second, 1, (full, sliding))
    assert held(kv, "b") == [9, 3]
    kv.check_integrity()


def _cached(kv: KVCacheManager, group: int, req: Request, i: int):
    """The block group ``group`` has cached under ``req``'s i-th block hash."""
    block = kv.groups[group]._cached(req.block_hashes[i])
    assert block is not None
    return block


def test_hit_shortens_to_where_the_sliding_group_still_has_its_window() -> None:
    kv = KVCacheManager(64, BS, group_windows=[None, W])
    tokens = list(range(100, 132))
    first = request("a", tokens)
    compute(kv, first, 32)
    kv.free(first)
    # Evict the sliding group's blocks 6 and 7 (as later allocations would): the hit at 32 is gone, but blocks
    # 4 and 5 (freed behind the window, still cached) serve a hit at 24; the full group has everything.
    for i in (6, 7):
        kv.pool._evict(_cached(kv, 1, first, i))
    hit, num_hit = kv.get_computed_blocks(request("b", tokens + [5]))
    assert num_hit == 24 and [len(h) for h in hit] == [6, 6]
    assert hit[1][:4] == [NULL_BLOCK] * 4 and NULL_BLOCK not in hit[1][4:]
    # Sliding blocks 1, 3 and 5 left: a window's two blocks are never both there, and block 0 is gone: no hit.
    for i in (0, 2, 4):
        kv.pool._evict(_cached(kv, 1, first, i))
    assert kv.get_computed_blocks(request("c", tokens + [5]))[1] == 0
    kv.check_integrity()


def test_every_groups_hits_are_taken_before_new_blocks() -> None:
    """A free cached block that one group hits must not become another group's new block in the same call."""
    kv = KVCacheManager(6, BS, group_windows=[None, 4])
    tokens = list(range(100, 108))  # 2 blocks
    first, other = request("a", tokens), request("x", [1])
    compute(kv, first, 8)
    compute(kv, other, 1)
    kv.free(first)  # free queue (LRU first): sliding 1, sliding 0, full 1, full 0, then x's two blocks
    kv.free(other)
    hit, num_hit = kv.get_computed_blocks(request("b", tokens + [5]))
    sliding_hit = hit[1][1]
    assert num_hit == 8 and hit[1][0] is NULL_BLOCK and kv.pool.free_queue._head.next_free is sliding_hit
    second = request("b", tokens + [5])
    assert kv.allocate_slots(second, 1, hit)  # each group: one new block; 3 revived
    assert kv.groups[1].req_to_blocks["b"][1] is sliding_hit
    assert sliding_hit not in kv.req_to_blocks["b"]
    kv.check_integrity()
    assert kv.num_free_blocks == 1
    assert not kv.allocate_slots(request("c", list(range(50))), 50)  # a failed allocation changes nothing
    kv.check_integrity()
    assert kv.num_free_blocks == 1


def test_groups_do_not_share_cached_blocks() -> None:
    kv = KVCacheManager(32, BS, group_windows=[None, W, W])
    req = request("a", list(range(100, 112)))
    compute(kv, req, 12)
    ids = [set(g.req_to_blocks["a"]) - {NULL_BLOCK} for g in kv.groups]
    assert not (ids[0] & ids[1]) and not (ids[1] & ids[2]) and not (ids[0] & ids[2])
    keys = {b.block_hash for group_ids in ids for b in group_ids}
    assert len(keys) == sum(len(group_ids) for group_ids in ids)  # each group's blocks under its own keys
    kv.free(req)
    kv.check_integrity()
    assert kv.reset_prefix_cache() and not kv.pool.cached_blocks


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_randomized_scheduling_keeps_invariants(async_scheduling: bool) -> None:
    """Random prompts sharing prefixes, chunked prefill, decoding, preemption (a small pool) and aborts, through
    the real scheduler over a hybrid manager (two sliding groups): integrity after every step, each sliding group
    within its bound, and every block back at the end. Async: step N's tokens arrive after step N+1 is planned."""
    rng = random.Random(0)
    cfg = SchedulerConfig(
        max_model_len=96, max_num_seqs=4, max_num_batched_tokens=12, async_scheduling=async_scheduling
    )
    kv = KVCacheManager(48, BS, group_windows=[None, W, W])
    sched = Scheduler(cfg, kv)
    shared = [rng.randrange(3, 50) for _ in range(20)]
    in_flight = None

    def launch() -> tuple:
        out = sched.schedule()
        sampled = {}
        for rid, n in out.num_scheduled_tokens.items():
            req = sched.requests[rid]
            assert held(kv, rid)[1] == held(kv, rid)[2] <= sliding_window_blocks(W, BS, n)
            if req.num_computed_tokens >= req.num_tokens_with_placeholders - async_scheduling:
                sampled[rid] = [rng.randrange(3, 50)]  # the step reaches its last token: it samples one
        return out, ModelRunnerOutput(sampled_token_ids=sampled)

    for step in range(800):  # arrivals stop at 250; the rest drains (admission keeps headroom)
        if step < 250 and rng.random() < 0.3:
            prompt = shared[: rng.randrange(0, 21)] + [
                rng.randrange(3, 50) for _ in range(rng.randrange(1, 40))
            ]
            sched.add_request(request(f"r{step}", prompt, max_tokens=rng.randrange(1, 30)))
        if sched.requests and rng.random() < 0.05:
            sched.finish_requests([rng.choice(sorted(sched.requests))], RequestStatus.FINISHED_ABORTED)
        done = launch() if sched.has_unfinished_requests() else None
        if async_scheduling:
            done, in_flight = in_flight, done
        if done is not None:
            sched.update_from_output(*done)
        sched.check_integrity()
    assert not sched.has_unfinished_requests() and in_flight is None
    assert sched.num_preemptions > 0 and kv.prefix_cache_hits > 0
    assert kv.num_free_blocks == kv.pool.num_blocks
