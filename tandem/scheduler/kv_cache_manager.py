"""KVCacheManager: per-request block tables over a BlockPool, with hash-chained prefix caching."""

from __future__ import annotations

import functools
import hashlib
from array import array
from collections.abc import Sequence

from tandem.request import Request
from tandem.scheduler.block_pool import BlockHash, BlockPool


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Hash of (parent hash, token ids of one full block): equal hashes mean equal whole prefixes.

    A cryptographic digest rather than Python's hash(): a collision would silently serve one
    request another prompt's KV, and token ids are user-controlled. Recently hashed blocks are
    remembered by their exact (parent, tokens) key, so requests that share a prompt prefix hash
    it once: 256 requests behind a 1,024-token system prompt spent ~8 of the ~10 ms of each
    admitting step hashing the same 64 blocks again (scripts/bench_host_step.py --shared-prefix 1024).
    """
    return _hash_block(parent, tuple(token_ids))


def adapter_root(request: Request) -> BlockHash | None:
    """The parent of a request's first block: None for the base model, a digest of the adapter's identity (and of
    how often its id was unloaded before) under a LoRA adapter, so KV computed under one adapter is never reused
    under another, without it, or after it was unloaded and loaded again."""
    lora = request.lora_request
    if lora is None:
        return None
    return hashlib.blake2b(lora.cache_key() + b"\0%d" % request.lora_epoch, digest_size=16).digest()


HASH_MEMO_BLOCKS = 1 << 14  # (parent, tokens) keys remembered, least recently used out first (~5 MB)


@functools.lru_cache(maxsize=HASH_MEMO_BLOCKS)
def _hash_block(parent: BlockHash | None, token_ids: tuple[int, ...]) -> BlockHash:
    digest = hashlib.blake2b(digest_size=16)
    if parent is not None:
        digest.update(parent)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, block_size: int, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self._blocks: dict[str, list[int]] = {}  # request_id -> block table (logical order)
        self._hashes: dict[str, list[BlockHash]] = {}  # request_id -> hashes of its full known blocks
        self._num_published: dict[str, int] = {}  # request_id -> leading blocks already published
        self.num_queried_tokens = 0  # prompt (+ known output) tokens looked up at admission
        self.num_hit_tokens = 0  # of those, served from the prefix cache

    # --- queries ---------------------------------------------------------------------------
    @property
    def tables(self) -> dict[str, list[int]]:
        """Block tables by request id (read-only for callers: the scheduler's decode fast path reads them)."""
        return self._blocks

    @property
    def published(self) -> dict[str, int]:
        """Leading blocks already published, by request id (read-only for callers)."""
        return self._num_published

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's live block table ([] when it holds none); callers must not mutate it."""
        return self._blocks.get(request_id, [])

    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks()

    def usage(self) -> float:
        return self.pool.num_used_blocks() / (self.pool.num_blocks - 1)

    def prefix_hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    # --- prefix lookup ---------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Cached blocks of the longest known prefix, and the tokens they cover.

        Capped at num_tokens - 1 (rounded down to a block): the last token is always computed,
        because its logits are what the next step samples from.
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._ensure_hashes(request, max_blocks)
        computed: list[int] = []
        for block_hash in hashes[:max_blocks]:
            block_id = self.pool.get_cached_block(block_hash)
            if block_id is None:
                break
            computed.append(block_id)
        return computed, len(computed) * self.block_size

    def _ensure_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """Extends the request's hash chain to `num_blocks` full blocks of known tokens."""
        hashes = self._hashes.setdefault(request.request_id, [])
        assert num_blocks * self.block_size <= request.num_tokens, "hashing a block with unknown tokens"
        tokens, size = request.all_token_ids, self.block_size
        for j in range(len(hashes), num_blocks):
            parent = hashes[j - 1] if j else adapter_root(request)
            hashes.append(hash_block_tokens(parent, tokens[j * size : (j + 1) * size]))
        return hashes

    # --- allocation ------------------------------------------------------------------------
    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()
    ) -> list[int] | None:
        """Grows the block table to hold positions < num_computed + cached + num_new_tokens.

        All or nothing: None (and no change) when the free pool, evictable cached blocks
        included, cannot supply it. `computed_blocks` (from get_computed_blocks) is only
        given at admission, before request.num_computed_tokens counts them. Returns the live
        block table.
        """
        request_id = request.request_id
        blocks = self._blocks.get(request_id)
        if blocks is not None and not computed_blocks:
            # Fast path of a decode step: the new positions fit the blocks held, and no block filled up
            # with known tokens since the last publish (publishing once per block, not once per token).
            total = request.num_computed_tokens + num_new_tokens
            if total <= len(blocks) * self.block_size and (
                not self.enable_prefix_caching
                or min(total, len(request.all_token_ids)) // self.block_size <= self._num_published[request_id]
            ):
                return blocks
        assert not (computed_blocks and blocks), "prefix blocks are only taken at admission"
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        total = num_computed + num_new_tokens
        num_held = len(blocks or ()) + len(computed_blocks)
        num_needed = max(0, cdiv(total, self.block_size) - num_held)
        # A free cached block we take as a prefix hit leaves the free list too.
        num_reclaimed = sum(1 for b in computed_blocks if self.pool.is_free(b))
        if num_needed + num_reclaimed > self.pool.num_free_blocks():
            return None

        if blocks is None:
            blocks = self._blocks[request_id] = []
            self._num_published[request_id] = len(computed_blocks)
            if self.enable_prefix_caching:
                self.num_queried_tokens += request.num_tokens
                self.num_hit_tokens += len(computed_blocks) * self.block_size
        self.pool.touch(computed_blocks)
        blocks.extend(computed_blocks)
        blocks.extend(self.pool.allocate(num_needed))
        if self.enable_prefix_caching:
            self._publish(request, blocks, total)
        return blocks

    def _publish(self, request: Request, blocks: list[int], total: int) -> None:
        """Publishes full blocks whose tokens are all known and whose KV this or an earlier step computes.

        Pending (placeholder) positions are excluded by capping at request.num_tokens; blocks of
        the same step may be shared at once because every layer writes the whole batch's KV
        before any attention reads it.
        """
        request_id = request.request_id
        num_full = min(total, request.num_tokens) // self.block_size
        start = self._num_published[request_id]
        if num_full <= start:
            return
        hashes = self._ensure_hashes(request, num_full)
        for j in range(start, num_full):
            self.pool.cache_block(blocks[j], hashes[j])
        self._num_published[request_id] = num_full

    def free(self, request: Request) -> None:
        """Releases the request's blocks tail first (so the tail is evicted first); a no-op if it holds none."""
        request_id = request.request_id
        blocks = self._blocks.pop(request_id, None)
        self._hashes.pop(request_id, None)
        self._num_published.pop(request_id, None)
        if blocks:
            self.pool.free(reversed(blocks))

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

    def check_invariants(self) -> None:
        """Pool invariants, and every reference the pool counts is held by exactly one table slot."""
        self.pool.check_invariants()
        held = [0] * self.pool.num_blocks
        for blocks in self._blocks.values():
            for block_id in blocks:
                held[block_id] += 1
        for block_id in range(1, self.pool.num_blocks):
            assert held[block_id] == self.pool.ref_count(block_id), f"block {block_id} ref count drift"
