"""The block allocator and prefix cache: hypothesis state machine (no leak, no double free, no
block shared after a write), LRU eviction, and chained hashes."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lmforge.serve.blocks import BlockAllocator, NoFreeBlocks, block_hashes


def test_block_hashes_chain_the_prefix() -> None:
    a = block_hashes([1, 2, 3, 4, 5, 6, 7], 2)
    b = block_hashes([9, 2, 3, 4, 5, 6], 2)
    assert len(a) == 3 and len(b) == 3  # the trailing partial block has no hash
    assert a[0] != b[0] and a[1] != b[1]  # same block tokens, different prefix: different hash
    assert block_hashes([1, 2, 3, 4], 2) == a[:2]
    assert block_hashes([3, 4], 2, parent=a[0]) == [a[1]]


def test_double_free_and_exhaustion_raise() -> None:
    alloc = BlockAllocator(2)
    x, y = alloc.allocate(), alloc.allocate()
    with pytest.raises(NoFreeBlocks):
        alloc.allocate()
    alloc.free(x)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(x)
    alloc.free(y)
    assert alloc.num_used == 0


def test_lru_evicts_least_recently_freed_and_hits_revive() -> None:
    alloc = BlockAllocator(3)
    blocks = [alloc.allocate() for _ in range(3)]
    for i, b in enumerate(blocks):
        alloc.register(b, 100 + i)
    for b in blocks:
        alloc.free(b)
    assert alloc.num_used == 0 and alloc.num_free == 3
    assert alloc.lookup(101) == blocks[1]  # a hit takes the cached block back
    fresh = alloc.allocate()  # evicts hash 100 (freed first)
    assert fresh == blocks[0]
    assert alloc.lookup(100) is None and alloc.lookup(102) == blocks[2]
    with pytest.raises(RuntimeError, match="shared"):
        alloc.check_writable(blocks[1])  # cached content is read-only
    alloc.check_writable(fresh)


class AllocatorMachine(RuleBasedStateMachine):
    """Sequences that allocate, write, register, share by hash and free, against a model."""

    def __init__(self) -> None:
        super().__init__()
        self.alloc = BlockAllocator(8)
        self.tables: list[list[int]] = []  # what each live "sequence" holds
        self.content: dict[int, int] = {}  # block -> hash of what was written into it
        self.cached: dict[int, int] = {}  # hash -> block, our model of the prefix cache

    @rule()
    def new_sequence(self) -> None:
        self.tables.append([])

    @precondition(lambda self: self.tables)
    @rule(i=st.integers(0, 50), h=st.integers(0, 5))
    def allocate_and_write(self, i: int, h: int) -> None:
        table = self.tables[i % len(self.tables)]
        try:
            block = self.alloc.allocate()
        except NoFreeBlocks:
            assert self.alloc.num_free == 0
            return
        self.alloc.check_writable(block)  # a fresh block is private
        for hh, b in list(self.cached.items()):
            if b == block:
                del self.cached[hh]  # evicted
        self.content[block] = h
        table.append(block)

    @precondition(lambda self: any(self.tables))
    @rule(i=st.integers(0, 50))
    def register_last(self, i: int) -> None:
        table = [t for t in self.tables if t][i % len([t for t in self.tables if t])]
        block = table[-1]
        h = self.content[block]
        self.alloc.register(block, h)
        if h not in self.cached and block not in self.cached.values():
            self.cached[h] = block

    @precondition(lambda self: self.tables)
    @rule(i=st.integers(0, 50), h=st.integers(0, 5))
    def share_by_hash(self, i: int, h: int) -> None:
        block = self.alloc.lookup(h)
        assert block == self.cached.get(h)
        if block is not None:
            assert self.content[block] == h  # a hit returns exactly that content
            self.tables[i % len(self.tables)].append(block)

    @precondition(lambda self: self.tables)
    @rule(i=st.integers(0, 50))
    def finish_sequence(self, i: int) -> None:
        table = self.tables.pop(i % len(self.tables))
        self.alloc.free_all(table)

    @invariant()
    def refcounts_match_tables(self) -> None:
        held: dict[int, int] = {}
        for t in self.tables:
            for b in t:
                held[b] = held.get(b, 0) + 1
        for b in range(self.alloc.num_blocks):
            assert self.alloc.refcount[b] == held.get(b, 0)
        assert self.alloc.num_used == len(held)  # no leak: unheld blocks are all allocatable

    @invariant()
    def shared_blocks_are_read_only(self) -> None:
        for b in range(self.alloc.num_blocks):
            if self.alloc.refcount[b] > 1:
                assert self.alloc.is_registered(b)
                with pytest.raises(RuntimeError):
                    self.alloc.check_writable(b)

    def teardown(self) -> None:
        for t in self.tables:
            self.alloc.free_all(t)
        assert self.alloc.num_used == 0


AllocatorMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None
)
TestAllocator = AllocatorMachine.TestCase
