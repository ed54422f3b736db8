"""The encoder cache, scheduler side: which images' embeddings the runner holds, and the room left for more.

Each image is encoded once, when the first chunk that covers part of its placeholder span is scheduled, and its
embeddings stay on the runner (keyed by content hash) while some running request still has placeholder tokens of
it to compute. Two requests with the same image share one entry. When the last such request has computed past the
image (or finished, or was preempted), the entry is freed: its hash goes to the runner with the next
``SchedulerOutput.free_encoder_mm_hashes``.

Room is counted in embedding rows (one per placeholder token); ``cache_size`` is at least the largest image, so
any one image always fits once the cache is empty. The per-step compute budget (``Scheduler``) uses the same
unit: vLLM's encoder budget, kept simple.

Hit counting: a request's first reference to an image is one query; it is a hit when the entry already existed
(encoded, or being encoded this step, for another request), so the image is not encoded again. A request that is
preempted and resumes queries its images again.
"""

from __future__ import annotations

from pagedllm.multimodal.inputs import MultiModalFeature


class EncoderCacheManager:
    def __init__(self, cache_size: int) -> None:
        self.cache_size = cache_size
        self.num_free_slots = cache_size
        self.cached: dict[str, set[str]] = {}  # mm_hash -> ids of the requests that still need it
        self.sizes: dict[str, int] = {}  # mm_hash -> embedding rows
        self.freed: list[str] = []  # freed since the last take_freed(): the runner drops them
        self.num_queries = 0  # cumulative first references of a request to an image
        self.num_hits = 0  # cumulative such references to an entry that already existed

    def has(self, mm_hash: str) -> bool:
        return mm_hash in self.cached

    def can_allocate(self, feature: MultiModalFeature) -> bool:
        return feature.length <= self.num_free_slots

    def add_ref(self, request_id: str, feature: MultiModalFeature) -> None:
        """``request_id`` needs ``feature``'s embeddings: a new entry (the runner encodes it this step) or one
        more user of an existing one."""
        users = self.cached.get(feature.mm_hash)
        if users is None or request_id not in users:
            self.num_queries += 1
            self.num_hits += users is not None
        if users is None:
            assert feature.length <= self.num_free_slots, "allocate only after can_allocate"
            users = self.cached[feature.mm_hash] = set()
            self.sizes[feature.mm_hash] = feature.length
            self.num_free_slots -= feature.length
            # (If it was freed earlier this step, the runner drops the old entry first, then encodes it anew.)
        users.add(request_id)

    def release(self, request_id: str, mm_hash: str) -> None:
        users = self.cached.get(mm_hash)
        if users is None or request_id not in users:
            return
        users.discard(request_id)
        if not users:
            del self.cached[mm_hash]
            self.num_free_slots += self.sizes.pop(mm_hash)
            self.freed.append(mm_hash)

    def release_request(self, request_id: str, features: list[MultiModalFeature]) -> None:
        """Drop every reference ``request_id`` holds (finished, aborted or preempted)."""
        for f in features:
            self.release(request_id, f.mm_hash)

    def release_computed(self, request_id: str, features: list[MultiModalFeature], num_computed: int) -> None:
        """Drop the references to images whose placeholders ``request_id`` has computed entirely."""
        for f in features:
            if f.end <= num_computed:
                self.release(request_id, f.mm_hash)

    def take_freed(self) -> list[str]:
        freed, self.freed = self.freed, []
        return freed

    def check_integrity(self, live_request_ids: set[str]) -> None:
        used = sum(self.sizes.values())
        assert used + self.num_free_slots == self.cache_size, "encoder cache slots out of balance"
        for mm_hash, users in self.cached.items():
            assert users and users <= live_request_ids, f"encoder cache entry {mm_hash[:12]} held by dead requests"
