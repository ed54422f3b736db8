"""The KV block pool: ref counts, an O(1) LRU free-block queue, and the block-hash -> block map.

A block is in exactly one of two states:
- in use: ``ref_cnt > 0``, owned by that many requests (prefix sharing makes it more than one);
- free: ``ref_cnt == 0`` and linked into the free queue. A free block may still hold a cached prefix (its hash is
  in ``cached_blocks``): a later request can revive it with ``touch`` until ``get_new_blocks`` evicts it.

Why a hand-made doubly linked list rather than a deque: a prefix hit must pull a block out of the *middle* of the
free queue, and eviction must take the least recently freed block; both are O(1) only with prev/next links.
Freed blocks go to the tail, so the head is always the least recently used.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None  # set while the block is registered in the prefix cache
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks between two sentinels: popleft, append and remove are all O(1)."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def __iter__(self):
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free


def hash_block_tokens(parent_hash: bytes | None, token_ids: Iterable[int], extra_keys: tuple = ()) -> bytes:
    """Chained hash of one full block: it depends on every token before it through ``parent_hash``.

    ``extra_keys`` leaves room for what else changes a block's KV (a LoRA id, multimodal hashes).
    A 128-bit cryptographic digest: a collision would silently serve another prompt's KV, so no 64-bit hashes.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(parent_hash or b"\x00" * 16)
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks: dict[bytes, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def usage(self) -> float:
        """Fraction of blocks in use (0..1)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block; a free (cached) block leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` least recently used free blocks, evicting their cached prefixes."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, only {self.num_free_blocks} free")
        out = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) is block:
                del self.cached_blocks[block.block_hash]
            block.block_hash = None

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Register a full, computed block under its hash (first writer wins; a duplicate stays unregistered)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached_blocks:
            return
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block, in the order given; blocks reaching zero join the free queue's tail.

        Callers pass a request's blocks tail first, so its last (least shareable) blocks are evicted first.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise AssertionError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if not self.enable_caching:
                    block.block_hash = None
                self.free_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; only possible when no block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_blocks.clear()
        return True

    def check_integrity(self, owners: dict[int, int], block_ids: range | None = None) -> None:
        """Assert the pool's invariants; ``owners`` maps block_id -> number of requests holding it.

        ``block_ids=None`` checks everything: O(num_blocks), walking the free queue (about 20 ms for 100k blocks
        in CPython). A range checks only those blocks (ref count, free-queue membership by its links, cache map)
        plus the O(1) counters: the cheap, partial check that the idle hook rotates through a large pool.
        """
        if block_ids is not None:
            assert 0 <= self.num_free_blocks <= self.num_blocks, "free-block count out of range"
            blocks = self.blocks
            cached = self.cached_blocks
            for block_id in block_ids:
                block = blocks[block_id]
                expected = owners.get(block_id, 0)
                assert block.ref_cnt == expected, f"{block}: ref_cnt {block.ref_cnt} != owners {expected}"
                assert (block.ref_cnt == 0) == (block.prev_free is not None), (
                    f"{block}: free-queue membership wrong"
                )
                assert block.block_hash is None or cached.get(block.block_hash) is block, (
                    f"{block}: cache map out of sync"
                )
            return
        free_ids = [b.block_id for b in self.free_queue]
        assert len(free_ids) == len(set(free_ids)) == self.num_free_blocks, "free queue corrupt"
        free_set = set(free_ids)
        for block in self.blocks:
            expected = owners.get(block.block_id, 0)
            assert block.ref_cnt == expected, f"{block}: ref_cnt {block.ref_cnt} != owners {expected}"
            assert (block.ref_cnt == 0) == (block.block_id in free_set), (
                f"{block}: free-queue membership wrong"
            )
        for block_hash, block in self.cached_blocks.items():
            assert block.block_hash == block_hash, f"{block}: cache map out of sync"
        assert self.num_free_blocks + sum(1 for b in self.blocks if b.ref_cnt > 0) == self.num_blocks
