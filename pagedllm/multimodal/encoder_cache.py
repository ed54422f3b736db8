"""The encoder cache, scheduler side: which images' embeddings the runner holds, and the room left for more.

Each image is encoded once, when the first chunk that covers part of its placeholder span is scheduled, and its
embeddings stay on the runner (keyed by content hash) while some running request still has placeholder tokens of
it to compute. Two requests with the same image share one entry. When the last such request has computed past the
image (or finished, or was preempted), the entry becomes freeable: it keeps its room and its embeddings (a later
request with the same image reuses them, as vLLM's encoder cache does) until a new image needs the room; then the
least recently released entries are evicted, and their hashes go to the runner with the next
``SchedulerOutput.free_encoder_mm_hashes``. A freeable entry the scheduler plans to reuse in a step is pinned
(``lookup``) so that no image of the same step evicts it; ``end_step`` unpins what was not used.

Room is counted in embedding rows (one per placeholder token); ``cache_size`` is at least the largest image, so
any one image always fits once the cache is empty. The per-step compute budget (``Scheduler``) uses the same
unit: vLLM's encoder budget, kept simple.

Hit counting: a request's first reference to an image is one query; it is a hit when the entry already existed
(encoded, or being encoded this step, for another request), so the image is not encoded again. A request that is
preempted and resumes queries its images again.
"""

from __future__ import annotations

from collections import OrderedDict

from pagedllm.multimodal.inputs import MultiModalFeature


class EncoderCacheManager:
    def __init__(self, cache_size: int) -> None:
        self.cache_size = cache_size
        self.num_free_slots = cache_size  # rows held by no entry
        self.cached: dict[str, set[str]] = {}  # mm_hash -> ids of the requests that still need it
        self.sizes: dict[str, int] = {}  # mm_hash -> embedding rows (every entry: used, freeable or pinned)
        self.freeable: OrderedDict[str, int] = OrderedDict()  # unused entries, least recently released first
        self.pinned: dict[str, int] = {}  # freeable entries this step's plan reuses (not evictable until end_step)
        self.freed: list[str] = []  # evicted since the last take_freed(): the runner drops them
        self.num_queries = 0  # cumulative first references of a request to an image
        self.num_hits = 0  # cumulative such references to an entry that already existed

    @property
    def num_freeable_slots(self) -> int:
        """Rows of entries no request needs (reclaimable, pinned ones included)."""
        return sum(self.freeable.values()) + sum(self.pinned.values())

    def has(self, mm_hash: str) -> bool:
        """Whether the runner holds (or encodes this step) ``mm_hash``'s embeddings."""
        return mm_hash in self.sizes

    def lookup(self, mm_hash: str) -> bool:
        """``has``, pinning a freeable entry for this step's plan (``end_step`` unpins it if unused)."""
        size = self.freeable.pop(mm_hash, None)
        if size is not None:
            self.pinned[mm_hash] = size
        return mm_hash in self.sizes

    def room(self) -> int:
        """Rows a new entry may take: free rows plus evictable ones."""
        return self.num_free_slots + sum(self.freeable.values())

    def can_allocate(self, feature: MultiModalFeature) -> bool:
        return feature.length <= self.room()

    def add_ref(self, request_id: str, feature: MultiModalFeature) -> None:
        """``request_id`` needs ``feature``'s embeddings: a new entry (the runner encodes it this step; older
        freeable entries are evicted for its room), a reused freeable one, or one more user of a used one."""
        h = feature.mm_hash
        users = self.cached.get(h)
        if users is None or request_id not in users:
            self.num_queries += 1
            self.num_hits += h in self.sizes
        if users is None:
            if h in self.sizes:  # freeable (or pinned): reused as it is
                self.pinned.pop(h, None)
                self.freeable.pop(h, None)
            else:
                assert feature.length <= self.room(), "allocate only after can_allocate"
                while self.num_free_slots < feature.length:
                    old, size = self.freeable.popitem(last=False)
                    del self.sizes[old]
                    self.num_free_slots += size
                    self.freed.append(old)
                self.sizes[h] = feature.length
                self.num_free_slots -= feature.length
                # (An entry evicted earlier this step is dropped by the runner first, then encoded anew.)
            users = self.cached[h] = set()
        users.add(request_id)

    def release(self, request_id: str, mm_hash: str) -> None:
        users = self.cached.get(mm_hash)
        if users is None or request_id not in users:
            return
        users.discard(request_id)
        if not users:
            del self.cached[mm_hash]
            self.freeable[mm_hash] = self.sizes[mm_hash]  # most recently released: evicted last

    def release_request(self, request_id: str, features: list[MultiModalFeature]) -> None:
        """Drop every reference ``request_id`` holds (finished, aborted or preempted)."""
        for f in features:
            self.release(request_id, f.mm_hash)

    def release_computed(self, request_id: str, features: list[MultiModalFeature], num_computed: int) -> None:
        """Drop the references to images whose placeholders ``request_id`` has computed entirely."""
        for f in features:
            if f.end <= num_computed:
                self.release(request_id, f.mm_hash)

    def end_step(self) -> None:
        """The step is planned: pinned entries no request took become freeable again (as just released)."""
        for h, size in self.pinned.items():
            self.freeable[h] = size
        self.pinned.clear()

    def take_freed(self) -> list[str]:
        freed, self.freed = self.freed, []
        return freed

    def check_integrity(self, live_request_ids: set[str]) -> None:
        used = sum(self.sizes.values())
        assert used + self.num_free_slots == self.cache_size, "encoder cache slots out of balance"
        assert not self.pinned, "encoder cache entries left pinned after a step"
        assert set(self.sizes) == set(self.cached) | set(self.freeable), "encoder cache entries out of balance"
        assert not set(self.cached) & set(self.freeable), "an encoder cache entry both used and freeable"
        for mm_hash, users in self.cached.items():
            assert users and users <= live_request_ids, f"encoder cache entry {mm_hash[:12]} held by dead requests"
