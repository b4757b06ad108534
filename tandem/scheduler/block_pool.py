"""BlockPool: ref-counted KV cache blocks, an LRU free list and the hash -> block map for prefix sharing."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

BlockHash = bytes

RESERVED_BLOCK_ID = 0  # never handed out; padding rows of block tables point at it


class BlockPool:
    """Blocks 1..num_blocks-1 are handed out; a block is either free (ref 0, in the free list) or in use.

    A free block that carries a published hash stays findable through `get_cached_block` until
    `allocate` reuses it; the free list is in LRU order, so the least recently freed block is
    reused (evicted) first. All operations are O(1) per block.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._block_hashes: list[BlockHash | None] = [None] * num_blocks
        # Insertion order is eviction order: popitem(last=False) takes the least recently freed.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self._cached: dict[BlockHash, int] = {}
        self.num_evictions = 0

    # --- queries ---------------------------------------------------------------------------
    def num_free_blocks(self) -> int:
        """Free blocks, cached ones included (they are evictable)."""
        return len(self._free)

    def num_used_blocks(self) -> int:
        return self.num_blocks - 1 - len(self._free)

    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self._block_hashes[block_id]

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        return self._cached.get(block_hash)

    # --- mutations -------------------------------------------------------------------------
    def allocate(self, num: int) -> list[int]:
        """Takes `num` blocks from the head of the free list (evicting their hashes); ref count 1 each."""
        assert 0 <= num <= len(self._free), f"allocate({num}) with {len(self._free)} free blocks"
        block_ids = []
        for _ in range(num):
            block_id, _ = self._free.popitem(last=False)
            assert self._ref_counts[block_id] == 0
            self._evict_hash(block_id)
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Takes one more reference on each block (a prefix hit); a free cached block leaves the free list."""
        for block_id in block_ids:
            assert block_id != RESERVED_BLOCK_ID
            if self._ref_counts[block_id] == 0:
                del self._free[block_id]
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drops one reference on each block; blocks reaching 0 join the free list in the given order."""
        for block_id in block_ids:
            assert block_id != RESERVED_BLOCK_ID
            assert self._ref_counts[block_id] > 0, f"block {block_id} freed more times than it was taken"
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free[block_id] = None

    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Publishes an in-use block under `block_hash`; False when another block already holds that hash."""
        assert self._ref_counts[block_id] > 0, f"publishing block {block_id}, which is not in use"
        current = self._block_hashes[block_id]
        if current is not None:
            assert current == block_hash, f"block {block_id} republished under a different hash"
            return True
        if block_hash in self._cached:
            return False  # computed twice concurrently; the first copy stays the shared one
        self._block_hashes[block_id] = block_hash
        self._cached[block_hash] = block_id
        return True

    def reset_prefix_cache(self) -> None:
        """Forgets every published hash (e.g. after an engine error left KV contents in doubt)."""
        for block_id in self._cached.values():
            self._block_hashes[block_id] = None
        self._cached.clear()

    def _evict_hash(self, block_id: int) -> None:
        block_hash = self._block_hashes[block_id]
        if block_hash is not None:
            assert self._cached.get(block_hash) == block_id
            del self._cached[block_hash]
            self._block_hashes[block_id] = None
            self.num_evictions += 1

    # --- invariants (tests and debugging) --------------------------------------------------
    def check_invariants(self) -> None:
        assert self._ref_counts[RESERVED_BLOCK_ID] == 0 and RESERVED_BLOCK_ID not in self._free
        assert self._block_hashes[RESERVED_BLOCK_ID] is None
        for block_id in range(1, self.num_blocks):
            ref = self._ref_counts[block_id]
            assert ref >= 0, f"block {block_id} has ref count {ref}"
            assert (ref == 0) == (block_id in self._free), f"block {block_id}: ref {ref} vs free list"
            block_hash = self._block_hashes[block_id]
            if block_hash is not None:
                assert self._cached.get(block_hash) == block_id
        for block_hash, block_id in self._cached.items():
            assert self._block_hashes[block_id] == block_hash
        assert len(self._free) + sum(1 for r in self._ref_counts if r > 0) == self.num_blocks - 1
