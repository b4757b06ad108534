"""BlockPool: unit tests and a hypothesis state machine over allocate / touch / free / cache / evict."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tandem.scheduler import BlockPool


def test_block_zero_is_never_handed_out() -> None:
    pool = BlockPool(5)
    assert pool.num_free_blocks() == 4
    assert sorted(pool.allocate(4)) == [1, 2, 3, 4]
    assert pool.num_free_blocks() == 0
    with pytest.raises(AssertionError):
        pool.allocate(1)
    with pytest.raises(ValueError):
        BlockPool(1)


def test_double_free_asserts() -> None:
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(AssertionError):
        pool.free([b])
    with pytest.raises(AssertionError):
        pool.free([0])


def test_lru_eviction_of_cached_blocks() -> None:
    pool = BlockPool(4)
    a, b, c = pool.allocate(3)
    for block, h in ((a, b"a"), (b, b"b"), (c, b"c")):
        assert pool.cache_block(block, h)
    pool.free([b, a, c])  # freed order: b is least recently freed
    assert pool.get_cached_block(b"b") == b and pool.num_free_blocks() == 3
    pool.touch([pool.get_cached_block(b"a")])  # a prefix hit revives a
    assert pool.ref_count(a) == 1 and not pool.is_free(a)
    assert pool.allocate(1) == [b]  # evicts b's hash
    assert pool.get_cached_block(b"b") is None and pool.block_hash(b) is None
    assert pool.get_cached_block(b"c") == c
    pool.check_invariants()


def test_duplicate_hash_keeps_first_block() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, b"h")
    assert not pool.cache_block(b, b"h")
    assert pool.get_cached_block(b"h") == a and pool.block_hash(b) is None
    pool.reset_prefix_cache()
    assert pool.get_cached_block(b"h") is None and pool.num_cached_blocks() == 0
    pool.check_invariants()


class BlockPoolMachine(RuleBasedStateMachine):
    """The model: a multiset of references we hold, and the hash each block's contents stand for."""

    def __init__(self) -> None:
        super().__init__()
        self.num_blocks = 9
        self.pool = BlockPool(self.num_blocks)
        self.held: list[int] = []  # one entry per reference taken
        self.contents: dict[int, bytes] = {}  # block -> hash of what it holds (dropped when reused)
        self.freed_to_zero = 0
        self.taken_from_zero = 0

    @rule(n=st.integers(0, 4))
    def allocate(self, n: int) -> None:
        if n > self.pool.num_free_blocks():
            with pytest.raises(AssertionError):
                self.pool.allocate(n)
            return
        blocks = self.pool.allocate(n)
        assert len(set(blocks)) == n and 0 not in blocks
        for b in blocks:
            assert b not in self.held, "handed out a block still in use"
            self.contents.pop(b, None)
        self.held.extend(blocks)
        self.taken_from_zero += n

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data) -> None:
        b = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.pool.free([b])
        if b not in self.held:
            self.freed_to_zero += 1

    @precondition(lambda self: self.held)
    @rule(data=st.data(), h=st.binary(min_size=1, max_size=1))
    def cache(self, data, h: bytes) -> None:
        b = data.draw(st.sampled_from(self.held))
        if self.pool.block_hash(b) is not None:
            return
        if self.pool.cache_block(b, h):
            self.contents[b] = h

    @rule(h=st.binary(min_size=1, max_size=1))
    def hit(self, h: bytes) -> None:
        b = self.pool.get_cached_block(h)
        if b is None:
            return
        assert self.contents.get(b) == h, "cached hash maps to a block not holding it"
        if b not in self.held:
            self.taken_from_zero += 1
        self.pool.touch([b])
        self.held.append(b)

    @rule()
    def free_unheld_asserts(self) -> None:
        for b in range(1, self.num_blocks):
            if b not in self.held:
                with pytest.raises(AssertionError):
                    self.pool.free([b])
                return

    @invariant()
    def consistent(self) -> None:
        self.pool.check_invariants()
        for b in range(1, self.num_blocks):
            refs = self.held.count(b)
            assert self.pool.ref_count(b) == refs >= 0
            assert self.pool.is_free(b) == (refs == 0)  # never both free and in use
            h = self.pool.block_hash(b)
            if h is not None:
                assert self.contents.get(b) == h and self.pool.get_cached_block(h) == b
        assert self.pool.num_free_blocks() + len(set(self.held)) == self.num_blocks - 1
        # Every block that left the free list went back at most once per trip.
        assert self.taken_from_zero - self.freed_to_zero == len(set(self.held))


TestBlockPoolMachine = BlockPoolMachine.TestCase
TestBlockPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
