"""KVCacheManager: prefix lookup, all-or-nothing allocation, publishing rules, and a hypothesis state machine."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, precondition, rule

from tandem.request import Request
from tandem.scheduler import KVCacheManager, hash_block_tokens
from tandem.scheduler.kv_cache_manager import cdiv

from .sim import make_request


def admit(kv: KVCacheManager, request: Request, num_new: int | None = None) -> list[int] | None:
    computed, num_cached = kv.get_computed_blocks(request)
    if num_new is None:
        num_new = request.num_tokens - num_cached
    blocks = kv.allocate_slots(request, num_new, computed)
    if blocks is not None:
        request.num_computed_tokens = num_cached + num_new
    return blocks


def test_hash_chain_depends_on_the_whole_prefix() -> None:
    a = hash_block_tokens(None, [1, 2])
    b = hash_block_tokens(None, [1, 3])
    assert a != b and hash_block_tokens(a, [5, 6]) != hash_block_tokens(b, [5, 6])
    assert hash_block_tokens(a, [5, 6]) == hash_block_tokens(hash_block_tokens(None, [1, 2]), [5, 6])


def test_block_hash_is_the_digest_of_parent_and_tokens_and_repeats_are_remembered() -> None:
    """The remembered hashes are exactly the blake2b digests (the memo only skips recomputing them), and a
    second request with the same prompt prefix finds its blocks' hashes remembered."""
    import hashlib
    from array import array

    from tandem.scheduler.kv_cache_manager import _hash_block

    parent = hash_block_tokens(None, [7, 8, 9, 10])
    want = hashlib.blake2b(parent + array("q", [11, 12, 13, 14]).tobytes(), digest_size=16).digest()
    assert hash_block_tokens(parent, [11, 12, 13, 14]) == want
    assert hash_block_tokens(parent, (11, 12, 13, 14)) == want  # any sequence of the same tokens
    assert hash_block_tokens(parent, [11, 12, 13, 15]) != want
    kv = KVCacheManager(block_size=4, num_blocks=32)
    prompt = list(range(100, 113))  # three full blocks and one token
    admit(kv, make_request("a", prompt))
    hits = _hash_block.cache_info().hits
    computed, cached = kv.get_computed_blocks(make_request("b", prompt[:12] + [999]))
    assert cached == 12 and computed == kv.get_block_ids("a")[:3]
    assert _hash_block.cache_info().hits >= hits + 3


def test_prefix_hit_is_capped_below_the_last_token() -> None:
    kv = KVCacheManager(block_size=4, num_blocks=20)
    first = make_request("a", list(range(1, 13)))  # 12 tokens = 3 full blocks
    assert admit(kv, first) is not None
    assert kv.get_computed_blocks(make_request("b", list(range(1, 13))))[1] == 8
    assert kv.get_computed_blocks(make_request("c", list(range(1, 14))))[1] == 12
    assert kv.get_computed_blocks(make_request("d", [1, 2, 3, 9] + list(range(5, 14))))[1] == 0
    off = KVCacheManager(block_size=4, num_blocks=20, enable_prefix_caching=False)
    assert admit(off, make_request("a", list(range(1, 13)))) is not None
    assert off.get_computed_blocks(make_request("b", list(range(1, 14)))) == ([], 0)


def test_allocation_is_all_or_nothing_and_counts_evictable_blocks() -> None:
    kv = KVCacheManager(block_size=2, num_blocks=6)  # 5 usable blocks
    a = make_request("a", [1, 2, 3, 4, 5, 6])
    assert len(admit(kv, a)) == 3
    b = make_request("b", [7, 8, 9, 10, 11, 12])
    assert admit(kv, b) is None
    assert kv.num_free_blocks() == 2 and kv.get_block_ids("b") == []
    kv.free(a)  # its 3 blocks stay cached but are evictable
    assert kv.num_free_blocks() == 5 and kv.pool.num_cached_blocks() == 3
    assert len(admit(kv, b)) == 3
    kv.check_invariants()


def test_reclaiming_a_free_cached_block_counts_against_the_free_pool() -> None:
    kv = KVCacheManager(block_size=2, num_blocks=4)  # 3 usable blocks
    a = make_request("a", [1, 2, 3])
    admit(kv, a)
    kv.free(a)  # block of [1, 2] cached and free; 3 free in all
    b = make_request("b", [1, 2, 3, 4, 5, 6, 7])  # hit of 1 block + 3 new blocks = 4 > 3
    computed, num_cached = kv.get_computed_blocks(b)
    assert num_cached == 2
    assert kv.allocate_slots(b, 5, computed) is None
    assert kv.allocate_slots(b, 4, computed) is not None
    kv.check_invariants()


def test_free_evicts_the_tail_first() -> None:
    kv = KVCacheManager(block_size=2, num_blocks=4)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7])
    blocks = list(admit(kv, a, 6))
    kv.free(a)
    b = make_request("b", [9, 9, 9])
    assert admit(kv, b, 1) == [blocks[2]]  # the tail went first
    c = make_request("c", [1, 2, 3, 4, 5, 6, 7])
    assert kv.get_computed_blocks(c) == (blocks[:2], 4)


def test_publishes_only_known_tokens_up_to_the_computed_position() -> None:
    kv = KVCacheManager(block_size=2, num_blocks=10)
    a = make_request("a", [1, 2, 3, 4, 5])
    blocks = admit(kv, a, 3)  # chunk: positions 0..2
    assert kv.pool.block_hash(blocks[0]) is not None and kv.pool.block_hash(blocks[1]) is None
    admit_rest = kv.allocate_slots(a, 2)
    a.num_computed_tokens = 5
    assert kv.pool.block_hash(admit_rest[1]) is not None and kv.pool.block_hash(admit_rest[2]) is None
    # A pending position (placeholder) fills block 2 but its token is unknown: not published.
    a.num_pending_tokens = 1
    kv.allocate_slots(a, 1)
    a.num_computed_tokens = 6
    assert kv.pool.block_hash(blocks[2]) is None
    # Once the token is known, the next allocation publishes the block.
    a.num_pending_tokens = 0
    a.append_output_token(6)
    kv.allocate_slots(a, 0)
    assert kv.pool.block_hash(blocks[2]) == hash_block_tokens(kv.pool.block_hash(blocks[1]), [5, 6])


def test_usage_and_hit_rate() -> None:
    kv = KVCacheManager(block_size=2, num_blocks=11)
    assert kv.usage() == 0.0 and kv.prefix_hit_rate() == 0.0
    admit(kv, make_request("a", [1, 2, 3, 4, 5]))
    assert kv.usage() == pytest.approx(0.3)
    admit(kv, make_request("b", [1, 2, 3, 4, 6]))
    assert kv.num_queried_tokens == 10 and kv.num_hit_tokens == 4
    assert kv.prefix_hit_rate() == pytest.approx(0.4)


class KVCacheMachine(RuleBasedStateMachine):
    """Requests over a two-letter alphabet (many shared prefixes) driven by random admit/step/sample/free ops.

    A fake KV store records which token each slot was computed from, so a prefix hit that hands
    out a block with other contents, or a block reused while still published, is caught.
    """

    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.block_size = 2
        self.kv = KVCacheManager(block_size=self.block_size, num_blocks=12)
        self.live: dict[str, Request] = {}
        self.running: set[str] = set()
        self.contents: dict[int, list[int | None]] = {}
        self.deferred: dict[str, list[int]] = {}  # positions computed from a placeholder, per request
        self.hash_tokens: dict[bytes, tuple[int, ...]] = {}
        self.next_id = 0

    def _write(self, request: Request, start: int, end: int) -> None:
        blocks = self.kv.get_block_ids(request.request_id)
        for p in range(start, end):
            if p >= request.num_tokens:
                self.deferred.setdefault(request.request_id, []).append(p)
                continue
            b = blocks[p // self.block_size]
            self.contents.setdefault(b, [None] * self.block_size)[p % self.block_size] = request.all_token_ids[p]

    def _record_hashes(self, request: Request) -> None:
        parent, tokens = None, request.all_token_ids
        for j in range(request.num_tokens // self.block_size):
            block = tuple(tokens[j * self.block_size : (j + 1) * self.block_size])
            parent = hash_block_tokens(parent, block)
            self.hash_tokens[parent] = block

    def _allocate(self, request: Request, num_new: int, computed: list[int]) -> bool:
        before_free = self.kv.num_free_blocks()
        before_len = len(self.kv.get_block_ids(request.request_id))
        held = before_len + len(computed)
        total = request.num_computed_tokens + len(computed) * self.block_size + num_new
        needed = max(0, cdiv(total, self.block_size) - held)
        reclaimed = sum(1 for b in computed if self.kv.pool.is_free(b))
        result = self.kv.allocate_slots(request, num_new, computed)
        if result is None:
            assert needed + reclaimed > before_free
            assert self.kv.num_free_blocks() == before_free
            assert len(self.kv.get_block_ids(request.request_id)) == before_len
            return False
        assert needed + reclaimed <= before_free
        assert len(result) == max(held, cdiv(total, self.block_size))
        return True

    @rule(target=requests, prompt=st.lists(st.integers(1, 2), min_size=1, max_size=9))
    def new_request(self, prompt: list[int]) -> str:
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.live[rid] = make_request(rid, prompt)
        self._record_hashes(self.live[rid])
        return rid

    @rule(rid=requests, data=st.data())
    def admit(self, rid: str, data) -> None:
        request = self.live.get(rid)
        if request is None or rid in self.running or request.num_pending_tokens:
            return
        computed, num_cached = self.kv.get_computed_blocks(request)
        assert num_cached % self.block_size == 0 and num_cached <= request.num_tokens - 1
        for j, b in enumerate(computed):
            assert self.contents[b] == request.all_token_ids[j * self.block_size : (j + 1) * self.block_size]
        num_new = data.draw(st.integers(1, request.num_tokens - num_cached))
        if self._allocate(request, num_new, computed):
            self.running.add(rid)
            request.num_computed_tokens = num_cached
            self._write(request, num_cached, num_cached + num_new)
            request.num_computed_tokens += num_new

    @rule(rid=requests, data=st.data())
    def step(self, rid: str, data) -> None:
        request = self.live.get(rid)
        if request is None or rid not in self.running:
            return
        remaining = request.num_tokens_with_pending - request.num_computed_tokens
        if remaining == 0:
            if request.num_pending_tokens == 0:
                request.num_pending_tokens = 1  # the step that computed the last token samples
            return
        num_new = data.draw(st.integers(1, remaining))
        if self._allocate(request, num_new, []):
            start = request.num_computed_tokens
            self._write(request, start, start + num_new)
            request.num_computed_tokens += num_new

    @rule(rid=requests, token=st.integers(1, 2))
    def resolve(self, rid: str, token: int) -> None:
        request = self.live.get(rid)
        if request is None or not request.num_pending_tokens:
            return
        request.num_pending_tokens = 0
        request.append_output_token(token)
        self._record_hashes(request)
        for p in self.deferred.pop(rid, []):
            if rid in self.running:  # KV written from the carried token
                self._write(request, p, p + 1)

    @rule(rid=requests, finish=st.booleans())
    def free(self, rid: str, finish: bool) -> None:
        request = self.live.get(rid)
        if request is None:
            return
        self.kv.free(request)
        self.kv.free(request)  # a second free is a no-op
        self.running.discard(rid)
        self.deferred.pop(rid, None)
        request.num_computed_tokens = 0
        if finish:
            del self.live[rid]

    @precondition(lambda self: self.live)
    @rule()
    def free_all(self) -> None:
        for rid in list(self.running):
            self.free(rid, finish=False)
        assert self.kv.num_free_blocks() == self.kv.pool.num_blocks - 1 and self.kv.usage() == 0.0

    @invariant()
    def consistent(self) -> None:
        self.kv.check_invariants()
        pool = self.kv.pool
        for b in range(1, pool.num_blocks):
            h = pool.block_hash(b)
            if h is not None:
                assert tuple(self.contents[b]) == self.hash_tokens[h], "published block holds other tokens"
        for rid in self.running:
            request = self.live[rid]
            blocks = self.kv.get_block_ids(rid)
            assert len(blocks) * self.block_size >= request.num_computed_tokens
            assert len(set(blocks)) == len(blocks)
        for rid, request in self.live.items():
            if rid not in self.running:
                assert self.kv.get_block_ids(rid) == []
        assert 0.0 <= self.kv.usage() <= 1.0


TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
