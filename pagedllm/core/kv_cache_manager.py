"""Per-request block lists on top of the block pool: prefix lookup, slot allocation, freeing.

Layout of one request's blocks (block_size 4, 10 tokens, 3 computed from the prefix cache)::

    tokens:  t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 __ __
    blocks:  [   b7    ] | [   b2    ] | [   b9    ]
    hashes:  h0=H(-,t0..3) h1=H(h0,t4..7)  (partial block: no hash)

Only full blocks get a hash; a block's hash chains its parent's, so equal hashes mean equal whole prefixes.

Sliding window (``sliding_window`` W: every attention layer of the model has that window). The query at position
p reads keys at positions > p - W only, so once a request has computed n tokens, keys at positions <= n - W are
never read again. Blocks wholly behind that line (with one block of margin) go back to the pool at the request's
next ``allocate_slots``, and ``NULL_BLOCK`` takes their place in its list: a request holds about W / block_size
blocks however long it runs. The runner's block table keeps the old ids at those positions, which the attention
backends never read (the Triton kernel skips tiles behind the window; the PyTorch path masks them). A freed block
keeps its hash, so it can still serve prefix hits until it is evicted.
"""

from __future__ import annotations

from pagedllm.core.block_pool import BlockPool, KVCacheBlock, hash_block_tokens
from pagedllm.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# Stands in a request's block list for a block freed behind the sliding window: never in the pool, never counted.
NULL_BLOCK = KVCacheBlock(0)


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool = True, sliding_window: int | None = None
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window  # W when every layer has that window: blocks behind it are freed
        self.num_freed_blocks: dict[str, int] = {}  # leading blocks of a request replaced by NULL_BLOCK
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # how many leading blocks of a request are registered
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
        for i in range(len(hashes), num_tokens // bs):
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, request.all_token_ids[i * bs : (i + 1) * bs], extra_keys))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of a request that has computed nothing yet: (blocks, number of tokens).

        At least one token is always left to compute, since its logits produce the next token. Requests that
        want prompt logprobs skip the cache: cached positions would have no logits.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        self._update_block_hashes(request, request.num_tokens)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        num_hit = len(blocks) * self.block_size
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_hit
        return blocks, num_hit

    def _num_blocks_short(
        self, request: Request, num_new_tokens: int, new_computed_blocks: list[KVCacheBlock]
    ) -> int:
        owned = self.req_to_blocks.get(request.request_id, [])
        num_total = request.num_computed_tokens + len(new_computed_blocks) * self.block_size + num_new_tokens
        num_needed = cdiv(num_total, self.block_size) - len(owned) - len(new_computed_blocks)
        # Reviving a free cached block takes it out of the free queue, so it counts against the free blocks.
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        return num_needed + num_revived - self.pool.num_free_blocks

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> bool:
        """Give ``request`` room for ``num_new_tokens`` more tokens after its computed (and newly hit) ones,
        plus ``num_lookahead_tokens`` slots past them (a draft model writes its drafts' KV there).

        Returns False, changing nothing, when the pool is short. New blocks enter the prefix cache only later,
        through ``cache_blocks`` once their KV has been computed: a request preempted before its forward must
        not leave hashes behind that point at unwritten blocks.
        """
        num_new_tokens += num_lookahead_tokens  # slots are slots: only cache_blocks cares what was computed
        if self.sliding_window is not None:
            self._free_behind_window(request)
        if not new_computed_blocks:
            # Fast path (most decode steps): the last block still has room.
            blocks = self.req_to_blocks.get(request.request_id)
            if (
                blocks is not None
                and request.num_computed_tokens + num_new_tokens <= len(blocks) * self.block_size
            ):
                return True
        new_computed_blocks = new_computed_blocks or []
        if self._num_blocks_short(request, num_new_tokens, new_computed_blocks) > 0:
            return False
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
        num_total = request.num_computed_tokens + len(new_computed_blocks) * self.block_size + num_new_tokens
        num_needed = cdiv(num_total, self.block_size) - len(blocks)
        if num_needed > 0:
            blocks.extend(self.pool.get_new_blocks(num_needed))
        return True

    def _free_behind_window(self, request: Request) -> None:
        """Return the blocks no query of ``request`` will read again (module docstring) to the pool."""
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return
        # Keys at positions <= num_computed - W are behind every later query's window; keep one block more.
        behind = request.num_computed_tokens - self.sliding_window - self.block_size + 1  # positions 0..behind-1
        num_behind = min(max(behind, 0) // self.block_size, len(blocks) - 1)
        start = self.num_freed_blocks.get(request.request_id, 0)
        if num_behind <= start:
            return
        freed = blocks[start:num_behind]
        blocks[start:num_behind] = [NULL_BLOCK] * (num_behind - start)
        self.num_freed_blocks[request.request_id] = num_behind
        self.pool.free_blocks(reversed([b for b in freed if b is not NULL_BLOCK]))

    def cache_blocks(self, request: Request) -> None:
        """Register the request's full blocks whose KV is computed (call after the step that computed them)."""
        if not self.enable_caching:
            return
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return
        num_full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        start = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        self._update_block_hashes(request, num_full * self.block_size)
        for i in range(start, num_full):
            if blocks[i] is not NULL_BLOCK:  # (freed behind the window before its step's output came back)
                self.pool.cache_block(blocks[i], request.block_hashes[i])
        self.num_cached_blocks[request.request_id] = num_full

    def get_block_ids(self, request_id: str, start: int = 0) -> list[int]:
        """Block ids of a request from its ``start``-th block on (the runner already holds the earlier ones)."""
        blocks = self.req_to_blocks.get(request_id, [])
        return [blocks[i].block_id for i in range(start, len(blocks))]

    def num_blocks_of(self, request_id: str) -> int:
        return len(self.req_to_blocks.get(request_id, ()))

    def free(self, request: Request) -> None:
        """Release a request's blocks (tail first, so its least shareable blocks are evicted first)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.num_freed_blocks.pop(request.request_id, None)
        self.pool.free_blocks(reversed([b for b in blocks if b is not NULL_BLOCK]))

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def check_integrity(self, block_ids: range | None = None) -> None:
        """Ref counts equal the number of requests holding each block (``block_ids``: only those blocks)."""
        owners: dict[int, int] = {}
        for blocks in self.req_to_blocks.values():
            for b in blocks:
                if b is not NULL_BLOCK:
                    owners[b.block_id] = owners.get(b.block_id, 0) + 1
        self.pool.check_integrity(owners, block_ids)
