"""Per-request block lists on top of the block pool: prefix lookup, slot allocation, freeing.

Layout of one request's blocks (block_size 4, 10 tokens, 3 computed from the prefix cache)::

    tokens:  t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 __ __
    blocks:  [   b7    ] | [   b2    ] | [   b9    ]
    hashes:  h0=H(-,t0..3) h1=H(h0,t4..7)  (partial block: no hash)

Only full blocks get a hash; a block's hash chains its parent's, so equal hashes mean equal whole prefixes.

KV cache groups (``plan_kv_cache_layout``). The attention layers are grouped by sliding window: a model without
windows is one full-attention group (everything below is then the plain paged cache), a model whose every layer
slides over W (Mistral) one sliding group, a hybrid model (Gemma 2/3, GPT-OSS) full-attention groups and sliding
ones. A request has one block list per group; all its lists have one entry per ``block_size`` positions (so the
same length) and share the request's chained hashes (keyed per group in the prefix cache). Every group draws on
the one pool: the groups have equally many layers, the i-th layer of every group uses the runner's cache tensor i,
so block b is page b of each tensor, used by whichever group holds b. A long sequence thus costs the full groups'
blocks for its whole length and each sliding group's for its window only, and short sequences cost what they cost
without groups: the pool adapts to the mix, with no fixed split between kinds of layers.

Sliding window W (a sliding group). The query at position p reads keys at positions > p - W only, so once a
request has computed n tokens, keys at positions <= n - W are never read again. Blocks wholly behind that line
(with one block of margin) go back to the pool after each step (``cache_blocks``) and at the request's next
``allocate_slots``, and ``NULL_BLOCK`` takes their place in its list: a request holds about W / block_size blocks
there however long it runs (``sliding_window_blocks``). The runner's block table keeps the old ids at those
positions (or NULL_BLOCK's 0), which the attention backends never read (the Triton kernel skips tiles behind the
window; the PyTorch path masks them). A freed block keeps its hash, so it can still serve prefix hits until it is
evicted.

Prefix hits (``get_computed_blocks``): a hit of L tokens (whole blocks) needs, in a full group, every block of
[0, L) cached; in a sliding group only the blocks of the W - 1 keys before L, the ones the query at L reads (its
list holds NULL_BLOCK before them). The hit is the longest L every group accepts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedllm.core.block_pool import BlockPool, KVCacheBlock, hash_block_tokens
from pagedllm.core.request import Request
from pagedllm.multimodal.inputs import block_extra_keys


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# Stands in a request's block list for a block freed behind the sliding window: never in the pool, never counted.
NULL_BLOCK = KVCacheBlock(0)


@dataclass(frozen=True)
class KVCacheLayout:
    """Which KV cache group and which cache tensor ("slot") each attention layer uses (``plan_kv_cache_layout``).

    The layers of one group use distinct slots and every group has at most ``num_slots`` layers, so block b is page
    b of every slot tensor and serves exactly one group. One group means one slot per layer: the plain layout."""

    group_windows: tuple[int | None, ...]  # [num_groups] each group's layers' sliding window (None: full)
    layer_groups: tuple[int, ...]  # [num_layers] each layer's group
    layer_slots: tuple[int, ...]  # [num_layers] each layer's cache tensor

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def num_slots(self) -> int:
        return max(self.layer_slots, default=-1) + 1

    def describe(self) -> str:
        """E.g. "full attention x1, sliding window 1024 x5 (8 layers each)" (for the start-up log)."""
        kinds: dict[int | None, int] = {}
        for w in self.group_windows:
            kinds[w] = kinds.get(w, 0) + 1
        names = [
            ("full attention" if w is None else f"sliding window {w}") + f" x{n}" for w, n in kinds.items()
        ]
        return f"{', '.join(names)} (up to {self.num_slots} layer{'s' if self.num_slots > 1 else ''} each)"


def plan_kv_cache_layout(
    layer_windows: Sequence[int | None], max_model_len: int, hybrid: bool = True
) -> KVCacheLayout:
    """Group attention layers by sliding window (``layer_windows``: each layer's, None for full attention).

    A window of ``max_model_len`` or more never leaves a key behind: its layer counts as full attention. When every
    layer has the same window, or ``hybrid`` is off, there is one group and one slot per layer (a window shared by
    every layer is still freed behind; mixed windows are not: every layer keeps every block). Otherwise each kind's
    layers, in order, form groups of k layers, full attention first: k is the fewest layers of any kind, or the
    most when no kind has 25% more layers than the fewest (vLLM's rule; a kind's last group may be short, leaving a
    slot unused in its blocks). Gemma 3 12B (8 global, 40 local layers): 1 + 5 groups of 8 layers over 8 slots.
    """
    windows = [w if w is not None and w < max_model_len else None for w in layer_windows]
    kinds = sorted(set(windows), key=lambda w: -1 if w is None else w)
    n = len(windows)
    if len(kinds) <= 1 or not hybrid:
        return KVCacheLayout((kinds[0] if len(kinds) == 1 else None,), (0,) * n, tuple(range(n)))
    layers_of = {w: [i for i, x in enumerate(windows) if x == w] for w in kinds}
    fewest = min(len(v) for v in layers_of.values())
    most = max(len(v) for v in layers_of.values())
    k = most if most < 1.25 * fewest else fewest
    group_windows: list[int | None] = []
    layer_groups, layer_slots = [0] * n, [0] * n
    for w in kinds:
        layers = layers_of[w]
        for start in range(0, len(layers), k):
            for slot, layer in enumerate(layers[start : start + k]):
                layer_groups[layer], layer_slots[layer] = len(group_windows), slot
            group_windows.append(w)
    return KVCacheLayout(tuple(group_windows), tuple(layer_groups), tuple(layer_slots))


def sliding_window_blocks(window: int, block_size: int, num_new_tokens: int) -> int:
    """The most blocks a request holds in a group with ``window`` once ``allocate_slots`` gave it ``num_new_tokens``
    slots past its computed tokens (those behind the window, less a block of margin, went back first)."""
    return cdiv(window + num_new_tokens + 2 * block_size - 2, block_size)


def blocks_per_sequence(
    group_windows: Sequence[int | None], block_size: int, num_tokens: int, num_new_tokens: int = 1
) -> list[int]:
    """Blocks one sequence of ``num_tokens`` tokens holds in each group while a step computes ``num_new_tokens``
    of them (1: decoding): the whole sequence in a full group, its window in a sliding one."""
    full = cdiv(num_tokens, block_size)
    return [
        full if w is None else min(full, sliding_window_blocks(w, block_size, num_new_tokens))
        for w in group_windows
    ]


class _Group:
    """One KV cache group's block list per request, over the shared pool."""

    def __init__(self, group_id: int, sliding_window: int | None, block_size: int, pool: BlockPool) -> None:
        self.sliding_window = sliding_window
        self.block_size = block_size
        self.pool = pool
        # Prefix-cache keys: the block hash, plus the group id past group 0 (groups hold different layers' KV).
        self.key_suffix = b"" if group_id == 0 else group_id.to_bytes(2, "little")
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # how many leading blocks of a request are registered
        self.num_freed_blocks: dict[str, int] = {}  # leading blocks of a request replaced by NULL_BLOCK

    def _cached(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.pool.get_cached_block(block_hash + self.key_suffix if self.key_suffix else block_hash)

    def find_hit(self, hashes: list[bytes]) -> list[KVCacheBlock]:
        """The blocks of the longest prefix hit within ``hashes`` this group can serve (NULL_BLOCK where it needs
        none): full attention, the cached run from the start; sliding, the last run of enough cached blocks."""
        if self.sliding_window is None:
            hit = []
            for block_hash in hashes:
                block = self._cached(block_hash)
                if block is None:
                    break
                hit.append(block)
            return hit
        # The query at a hit's end L reads keys L - W + 1 .. L - 1: the last `needed` blocks before L.
        needed = max(1, cdiv(self.sliding_window - 1, self.block_size))
        hit = [NULL_BLOCK] * len(hashes)
        run = 0
        for i in range(len(hashes) - 1, -1, -1):
            block = self._cached(hashes[i])
            if block is None:
                run = 0
                continue
            hit[i] = block
            run += 1
            if run == needed:
                return hit[: i + needed]
        return hit[:run]  # the run reached the start: every block of the shorter hit is there

    def num_new_blocks(self, request_id: str, num_blocks: int, hit: list[KVCacheBlock]) -> int:
        """Free blocks the request takes to hold ``num_blocks`` blocks after ``hit`` (reviving a free cached block
        takes it out of the free queue: it counts)."""
        owned = len(self.req_to_blocks.get(request_id, ()))
        num_revived = sum(1 for b in hit if b.ref_cnt == 0 and b is not NULL_BLOCK)
        return max(num_blocks - owned - len(hit), 0) + num_revived

    def allocate(self, request_id: str, num_blocks: int, hit: list[KVCacheBlock]) -> None:
        """Append ``hit`` (already touched) and new blocks up to ``num_blocks``."""
        blocks = self.req_to_blocks.setdefault(request_id, [])
        blocks.extend(hit)
        if num_blocks > len(blocks):
            blocks.extend(self.pool.get_new_blocks(num_blocks - len(blocks)))

    def free_behind_window(self, request: Request) -> None:
        """Return the blocks no query of ``request`` will read again (module docstring) to the pool."""
        blocks = self.req_to_blocks.get(request.request_id)
        if self.sliding_window is None or not blocks:
            return
        # Keys at positions <= num_computed - W are behind every later query's window; keep one block more: the
        # blocks wholly within positions 0..behind-1 go.
        behind = request.num_computed_tokens - self.sliding_window - self.block_size + 1
        num_behind = min(max(behind, 0) // self.block_size, len(blocks) - 1)
        start = self.num_freed_blocks.get(request.request_id, 0)
        if num_behind <= start:
            return
        freed = blocks[start:num_behind]
        blocks[start:num_behind] = [NULL_BLOCK] * (num_behind - start)
        self.num_freed_blocks[request.request_id] = num_behind
        self.pool.free_blocks(reversed([b for b in freed if b is not NULL_BLOCK]))

    def cache_blocks(self, request: Request, num_full: int) -> None:
        """Register the request's first ``num_full`` blocks (their hashes are in ``request.block_hashes``)."""
        blocks = self.req_to_blocks.get(request.request_id)
        start = self.num_cached_blocks.get(request.request_id, 0)
        if not blocks or num_full <= start:
            return
        suffix = self.key_suffix
        for i in range(start, num_full):
            if blocks[i] is not NULL_BLOCK:  # (freed behind the window before its step's output came back)
                block_hash = request.block_hashes[i]
                self.pool.cache_block(blocks[i], block_hash + suffix if suffix else block_hash)
        self.num_cached_blocks[request.request_id] = num_full

    def free(self, request_id: str) -> None:
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_blocks.pop(request_id, None)
        self.num_freed_blocks.pop(request_id, None)
        self.pool.free_blocks(reversed([b for b in blocks if b is not NULL_BLOCK]))


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        group_windows: Sequence[int | None] = (None,),
        longrope_original_max: int | None = None,
    ) -> None:
        """``group_windows``: each KV cache group's sliding window (None: full attention), ``KVCacheLayout``'s; the
        default is one full-attention group. ``longrope_original_max``: a LongRoPE model's switch length (None for
        other models): requests longer than it rotate every position with the long frequencies (``Request.rope_long``,
        see ``Scheduler.schedule``), so their blocks get a hash space of their own."""
        self.block_size = block_size
        self.longrope_original_max = longrope_original_max
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.groups = [_Group(g, w, block_size, self.pool) for g, w in enumerate(group_windows)]
        self._sliding = [g for g in self.groups if g.sliding_window is not None]
        # Group 0's block list of each request holding blocks (a request holds blocks in every group or in none),
        # and how many of them are registered (every group registers as many).
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = self.groups[0].req_to_blocks
        self._num_cached_blocks = self.groups[0].num_cached_blocks
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def _update_block_hashes(self, request: Request, num_tokens: int) -> None:
        """Extend ``request.block_hashes`` to cover every full block among its first ``num_tokens`` tokens."""
        bs = self.block_size
        hashes = request.block_hashes
        lora_id = request.lora_int_id
        extra_keys = (lora_id,) if lora_id else ()  # an adapter changes every layer's KV: its own hash space
        if request.rope_long:  # LongRoPE keys rotated with the long frequencies: never shared with short ones
            extra_keys += ("longrope-long",)
        features = request.mm_features
        for i in range(len(hashes), num_tokens // bs):
            parent = hashes[-1] if hashes else None
            keys = extra_keys
            if features:  # the content hash of each image whose placeholders this block covers
                mm_keys = block_extra_keys(features, i, bs)
                if mm_keys:
                    keys = extra_keys + mm_keys
            hashes.append(hash_block_tokens(parent, request.all_token_ids[i * bs : (i + 1) * bs], keys))

    def update_block_hashes(self, request: Request, num_tokens: int) -> None:
        """Make ``request.block_hashes`` cover every full block among its first ``num_tokens`` tokens (a KV
        connector keys its store by them)."""
        self._update_block_hashes(request, num_tokens)

    def get_computed_blocks(self, request: Request) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """Longest cached prefix of a request that has computed nothing yet: (its blocks in each group, number of
        tokens). Every group's list has one entry per hit block (NULL_BLOCK where a sliding group needs none).

        At least one token is always left to compute, since its logits produce the next token. Requests that
        want prompt logprobs skip the cache: cached positions would have no logits.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return tuple([] for _ in self.groups), 0
        self._update_block_hashes(request, request.num_tokens)
        hashes = request.block_hashes
        num_hit_blocks = (request.num_tokens - 1) // self.block_size
        # Shorten the hit until every group serves it whole: each group answers within what the groups before it
        # (full attention first) accepted, and a pass that shortens it asks again, since where a hit ends changes
        # which blocks a sliding group needs.
        while True:
            hits = []
            for group in self.groups:
                hits.append(group.find_hit(hashes[:num_hit_blocks]))
                num_hit_blocks = len(hits[-1])
            if all(len(h) == num_hit_blocks for h in hits):
                break
        num_hit = num_hit_blocks * self.block_size
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_hit
        return tuple(hits), num_hit

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: tuple[list[KVCacheBlock], ...] | None = None,
        num_lookahead_tokens: int = 0,
        reserve_blocks: int = 0,
    ) -> bool:
        """Give ``request`` room for ``num_new_tokens`` more tokens after its computed (and newly hit, one list per
        group from ``get_computed_blocks``) ones, plus ``num_lookahead_tokens`` slots past them (a draft model
        writes its drafts' KV there), in every group. ``reserve_blocks``: free blocks that must remain afterwards
        (the scheduler's admission headroom).

        Returns False, changing nothing, when the pool is short. New blocks enter the prefix cache only later,
        through ``cache_blocks`` once their KV has been computed: a request preempted before its forward must
        not leave hashes behind that point at unwritten blocks.
        """
        num_new_tokens += num_lookahead_tokens  # slots are slots: only cache_blocks cares what was computed
        if self._sliding:
            for group in self._sliding:
                group.free_behind_window(request)
        rid = request.request_id
        hits = new_computed_blocks
        if not hits or not hits[0]:
            # Fast path (most decode steps): the last block still has room.
            blocks = self.req_to_blocks.get(rid)
            if (
                blocks is not None
                and request.num_computed_tokens + num_new_tokens <= len(blocks) * self.block_size
            ):
                return True
            hits = tuple([] for _ in self.groups)
        num_total = request.num_computed_tokens + len(hits[0]) * self.block_size + num_new_tokens
        num_blocks = cdiv(num_total, self.block_size)
        num_new = sum(g.num_new_blocks(rid, num_blocks, hit) for g, hit in zip(self.groups, hits))
        if num_new + reserve_blocks > self.pool.num_free_blocks:
            return False
        for hit in hits:  # every group's hits leave the free queue before any group takes new blocks
            self.pool.touch(b for b in hit if b is not NULL_BLOCK)
        for group, hit in zip(self.groups, hits):
            group.allocate(rid, num_blocks, hit)
        return True

    def cache_blocks(self, request: Request) -> None:
        """After the step that computed them: register the request's full blocks whose KV is computed, then free
        the blocks behind its sliding windows (the step's new tokens moved them)."""
        num_full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        rid = request.request_id
        if (
            self.enable_caching
            and num_full > self._num_cached_blocks.get(rid, 0)
            and rid in self.req_to_blocks
        ):
            self._update_block_hashes(request, num_full * self.block_size)
            for group in self.groups:
                group.cache_blocks(request, num_full)
        if self._sliding:
            for group in self._sliding:
                group.free_behind_window(request)

    def get_block_ids(self, request_id: str, start: int = 0, group: int = 0) -> list[int]:
        """Block ids of a request in one group from its ``start``-th block on (the runner already holds the
        earlier ones)."""
        blocks = self.groups[group].req_to_blocks.get(request_id, [])
        return [blocks[i].block_id for i in range(start, len(blocks))]

    def get_all_block_ids(self, request_id: str, start: int = 0) -> tuple[list[int], ...]:
        """``get_block_ids`` of every group (what ``NewRequestData`` / ``CachedRequestData`` carry)."""
        return tuple(self.get_block_ids(request_id, start, g) for g in range(len(self.groups)))

    def num_blocks_of(self, request_id: str) -> int:
        """Length of the request's block lists (the same in every group)."""
        return len(self.req_to_blocks.get(request_id, ()))

    def free(self, request: Request) -> None:
        """Release a request's blocks in every group (tail first, so its least shareable blocks are evicted
        first)."""
        for group in reversed(self.groups):
            group.free(request.request_id)

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def check_integrity(self, block_ids: range | None = None) -> None:
        """Ref counts equal the number of request lists holding each block (``block_ids``: only those blocks); a
        block serves one group only; every group's list of a request has the same length."""
        owners: dict[int, int] = {}
        owner_group: dict[int, int] = {}
        for g, group in enumerate(self.groups):
            assert group.req_to_blocks.keys() == self.req_to_blocks.keys(), "groups hold different requests"
            for req_id, blocks in group.req_to_blocks.items():
                assert len(blocks) == len(self.req_to_blocks[req_id]), (
                    f"{req_id}: group lists differ in length"
                )
                for b in blocks:
                    if b is not NULL_BLOCK:
                        owners[b.block_id] = owners.get(b.block_id, 0) + 1
                        assert owner_group.setdefault(b.block_id, g) == g, f"{b} is in two groups' lists"
        self.pool.check_integrity(owners, block_ids)
