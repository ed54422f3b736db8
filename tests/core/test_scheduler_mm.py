"""The scheduler's encoder planning and the multimodal block-hash keys, with a fake runner (no model)."""

from __future__ import annotations

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.multimodal.inputs import MultiModalFeature
from pagedllm.sampling_params import SamplingParams
from tests.core.test_scheduler import step

IMAGE = 99


def make_scheduler(budget: int, encoder_cache_size: int, num_blocks: int = 64) -> Scheduler:
    cfg = SchedulerConfig(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=budget)
    return Scheduler(cfg, KVCacheManager(num_blocks, 4, True), encoder_cache_size=encoder_cache_size)


def mm_request(req_id: str, images: list[tuple[str, int, int]], n_prompt: int, text: int = 1) -> Request:
    """A prompt of ``n_prompt`` tokens with images ``(hash, offset, length)`` (placeholder token IMAGE)."""
    tokens = [text] * n_prompt
    features = []
    for h, offset, length in images:
        tokens[offset : offset + length] = [IMAGE] * length
        features.append(MultiModalFeature("image", h, offset, length))
    return Request(req_id, tokens, SamplingParams(max_tokens=2), 7, 0.0, mm_features=features)


def test_chunk_stops_before_an_image_the_step_cannot_encode() -> None:
    """Encoder budget and cache 16: the first step encodes image a (16 rows) and cannot also encode b, so its chunk
    ends where b's placeholders start (20); the next step encodes b and computes the rest."""
    sched = make_scheduler(budget=64, encoder_cache_size=16)
    sched.add_request(mm_request("r", [("a", 2, 16), ("b", 20, 16)], 40))
    out, _ = step(sched)
    assert out.scheduled_encoder_inputs == {"r": [0]} and out.num_scheduled_tokens == {"r": 20}
    out, _ = step(sched)  # a's placeholders are computed: its entry is freeable, evicted for b's room
    assert out.free_encoder_mm_hashes == ["a"]
    assert out.scheduled_encoder_inputs == {"r": [1]} and out.num_scheduled_tokens == {"r": 20}
    out, _ = step(sched)  # a decode: b is freeable now, kept until a new image needs its room
    assert out.free_encoder_mm_hashes == [] and out.num_scheduled_tokens == {"r": 1}
    assert list(sched.encoder_cache.freeable) == ["b"]
    sched.check_integrity()


def test_a_chunk_inside_an_image_encodes_it_once() -> None:
    sched = make_scheduler(budget=8, encoder_cache_size=16)
    sched.add_request(mm_request("r", [("a", 2, 16)], 24))
    encoded = []
    for _ in range(3):
        out, _ = step(sched)
        encoded += out.scheduled_encoder_inputs.get("r", [])
        assert out.num_scheduled_tokens == {"r": 8}  # chunks of 8: the image span is cut twice
    assert encoded == [0]
    assert list(sched.encoder_cache.freeable) == ["a"] and not sched.encoder_cache.cached  # computed past it
    sched.check_integrity()


def test_block_hashes_key_on_the_image() -> None:
    """Same tokens, different image: blocks before the image hash alike, blocks from the image on differ."""
    kv = KVCacheManager(64, 4, True)
    a = mm_request("a", [("img1", 6, 8)], 20)
    b = mm_request("b", [("img2", 6, 8)], 20)
    c = mm_request("c", [("img1", 6, 8)], 20)
    for r in (a, b, c):
        kv.update_block_hashes(r, 20)
    assert a.block_hashes[0] == b.block_hashes[0]  # tokens 0..3: text only
    assert all(x != y for x, y in zip(a.block_hashes[1:], b.block_hashes[1:]))  # 4..7 covers img from 6 on
    assert a.block_hashes == c.block_hashes


def test_shared_image_is_encoded_once_and_released_with_its_last_user() -> None:
    """Two requests with the same image in one step: one encoder input; the entry becomes freeable once both
    computed it, and a later request with the image reuses it."""
    sched = make_scheduler(budget=64, encoder_cache_size=32)
    sched.add_request(mm_request("r1", [("a", 1, 8)], 12, text=1))
    sched.add_request(mm_request("r2", [("a", 1, 8)], 12, text=2))
    out, _ = step(sched)
    assert out.scheduled_encoder_inputs == {"r1": [0]}  # r2 reads r1's entry
    out, _ = step(sched)  # their decodes (max_tokens=2: the last step)
    assert sched.encoder_cache.freeable == {"a": 8} and not sched.encoder_cache.cached
    assert not sched.requests
    sched.check_integrity()
    sched.add_request(mm_request("r3", [("a", 1, 8)], 12, text=3))
    out, _ = step(sched)
    assert out.scheduled_encoder_inputs == {} and out.num_scheduled_tokens == {"r3": 12}  # not encoded again
    assert sched.make_stats().encoder_cache_hits == 2


def test_encoder_cache_queries_and_hits() -> None:
    """Same image in two requests of one step: two queries, one hit (the second reads the first's entry); a chunk
    that continues an image already referenced is no new query; different images: no hit."""
    sched = make_scheduler(budget=64, encoder_cache_size=64)
    sched.add_request(mm_request("r1", [("a", 1, 8)], 12, text=1))
    sched.add_request(mm_request("r2", [("a", 1, 8)], 12, text=2))
    step(sched)
    stats = sched.make_stats()
    assert (stats.encoder_cache_queries, stats.encoder_cache_hits) == (2, 1)
    step(sched)
    sched = make_scheduler(budget=6, encoder_cache_size=64)  # r3's image spans two chunks: one query
    sched.add_request(mm_request("r3", [("b", 1, 8)], 12, text=3))
    sched.add_request(mm_request("r4", [("c", 1, 8)], 12, text=4))
    for _ in range(6):
        step(sched)
    stats = sched.make_stats()
    assert (stats.encoder_cache_queries, stats.encoder_cache_hits) == (2, 0)
    assert not sched.requests
