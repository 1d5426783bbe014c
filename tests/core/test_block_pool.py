"""BlockPool: O(1) allocate/free, reference counts, prefix hashes kept after free, LRU reuse."""

from __future__ import annotations

import time

import pytest

from aiocb.core.block_pool import ROOT_HASH, BlockPool, hash_block


def _register(pool: BlockPool, block: int, tokens: list[int], parent: bytes = ROOT_HASH) -> bytes:
    """Register ``block`` as holding ``tokens`` after ``parent``; returns its hash."""
    block_hash = hash_block(parent, tokens)
    pool.register(block, block_hash, parent, tokens)
    return block_hash


# ---------------------------------------------------------------------- hash_block


def test_hash_block_is_deterministic_and_chained() -> None:
    h = hash_block(ROOT_HASH, [1, 2, 3, 4])
    assert h == hash_block(ROOT_HASH, (1, 2, 3, 4))
    assert isinstance(h, bytes)
    assert len(h) == 16
    assert h != hash_block(ROOT_HASH, [1, 2, 3, 5])
    assert h != hash_block(ROOT_HASH, [4, 3, 2, 1])  # order matters
    assert h != hash_block(b"another-parent", [1, 2, 3, 4])  # the parent is part of the hash
    assert hash_block(h, [1, 2, 3, 4]) != h
    # token ids are not truncated to a byte or 32 bits
    assert hash_block(ROOT_HASH, [256]) != hash_block(ROOT_HASH, [0])
    assert hash_block(ROOT_HASH, [2**32]) != hash_block(ROOT_HASH, [0])


# ---------------------------------------------------------------------- allocate / free


@pytest.mark.parametrize("num_blocks", [0, -1])
def test_pool_needs_a_block(num_blocks: int) -> None:
    with pytest.raises(ValueError, match="at least one block"):
        BlockPool(num_blocks)


def test_allocate_gives_distinct_blocks_with_one_reference() -> None:
    pool = BlockPool(8)
    assert pool.num_free == 8
    blocks = pool.allocate(5)
    assert blocks is not None
    assert len(blocks) == 5
    assert len(set(blocks)) == 5
    assert all(0 <= b < 8 for b in blocks)
    assert all(pool.ref_count(b) == 1 for b in blocks)
    assert pool.num_free == 3
    rest = pool.allocate(3)
    assert rest is not None
    assert sorted(blocks + rest) == list(range(8))
    assert pool.num_free == 0


def test_allocate_zero_is_empty() -> None:
    pool = BlockPool(2)
    assert pool.allocate(0) == []
    assert pool.num_free == 2


def test_allocate_is_all_or_nothing() -> None:
    pool = BlockPool(4)
    held = pool.allocate(3)
    assert held is not None
    assert pool.allocate(2) is None
    assert pool.num_free == 1  # nothing was taken by the failed call
    assert [pool.ref_count(b) for b in range(4)].count(0) == 1
    assert pool.allocate(1) is not None
    assert pool.allocate(1) is None


def test_allocate_all_or_nothing_with_hashed_free_blocks() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    assert blocks is not None
    _register(pool, blocks[0], [1, 2])
    pool.free(blocks)
    assert pool.num_free == 3
    assert pool.allocate(4) is None
    assert pool.num_cached == 1  # the failed call did not evict the hashed block
    assert pool.allocate(3) is not None
    assert pool.num_cached == 0


def test_free_returns_blocks_for_reuse() -> None:
    pool = BlockPool(2)
    first = pool.allocate(2)
    assert first is not None
    pool.free(first)
    assert pool.num_free == 2
    assert all(pool.ref_count(b) == 0 for b in first)
    second = pool.allocate(2)
    assert second is not None
    assert sorted(second) == sorted(first)


def test_double_free_raises() -> None:
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    assert blocks is not None
    pool.free(blocks)
    with pytest.raises(RuntimeError, match="freed more often than allocated"):
        pool.free(blocks)
    assert pool.num_free == 2  # the bad free did not put the block in the pool twice
    assert pool.allocate(2) is not None
    assert pool.allocate(1) is None


def test_free_of_never_allocated_block_raises() -> None:
    pool = BlockPool(3)
    with pytest.raises(RuntimeError):
        pool.free([1])
    assert pool.num_free == 3


def test_reference_counts() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(1)
    assert blocks is not None
    (block,) = blocks
    _register(pool, block, [7, 7])
    pool.acquire(block)
    pool.acquire(block)
    assert pool.ref_count(block) == 3
    assert pool.num_free == 3
    pool.free([block])
    pool.free([block])
    assert pool.ref_count(block) == 1
    assert pool.num_free == 3  # still held by one request
    pool.free([block])
    assert pool.ref_count(block) == 0
    assert pool.num_free == 4
    with pytest.raises(RuntimeError):
        pool.free([block])


def _time_alloc_free_cycles(num_blocks: int, cycles: int) -> float:
    pool = BlockPool(num_blocks)
    held = pool.allocate(num_blocks // 2)  # a large part in use, a large part free
    assert held is not None
    for i, block in enumerate(held[:64]):
        _register(pool, block, [i])  # some hashed blocks in the free pool, too
    pool.free(held[:64])
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(cycles):
            blocks = pool.allocate(4)
            assert blocks is not None
            pool.free(blocks)
            pool.free(pool.allocate(1) or [])
        best = min(best, time.perf_counter() - start)
    return best


def test_allocate_and_free_do_not_scale_with_pool_size() -> None:
    cycles = 2000
    small = _time_alloc_free_cycles(256, cycles)
    large = _time_alloc_free_cycles(400_000, cycles)
    # O(1) operations take about as long in a pool 1500x larger; a scan of the free list
    # (or of the reference counts) would be hundreds of times slower.
    assert large < 5 * small + 0.1, (small, large)


# ---------------------------------------------------------------------- prefix hashes


def test_hashed_block_stays_findable_after_free_until_reallocated() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    assert blocks is not None
    h = _register(pool, blocks[0], [1, 2, 3])
    assert pool.block_hash(blocks[0]) == h
    assert pool.lookup(h, ROOT_HASH, [1, 2, 3]) == blocks[0]
    pool.free(blocks)
    assert pool.num_free == 3  # a free hashed block counts as free
    assert pool.num_cached == 1
    assert pool.lookup(h, ROOT_HASH, [1, 2, 3]) == blocks[0]
    assert pool.block_hash(blocks[0]) == h
    # the two plain blocks go first; the hashed one survives them
    plain = pool.allocate(2)
    assert plain is not None
    assert blocks[0] not in plain
    assert pool.lookup(h, ROOT_HASH, [1, 2, 3]) == blocks[0]
    # reallocating it drops the hash: it no longer holds those tokens
    assert pool.allocate(1) == [blocks[0]]
    assert pool.lookup(h, ROOT_HASH, [1, 2, 3]) is None
    assert pool.block_hash(blocks[0]) is None
    assert pool.num_cached == 0


def test_unhashed_free_blocks_are_handed_out_before_hashed_ones() -> None:
    pool = BlockPool(6)
    blocks = pool.allocate(6)
    assert blocks is not None
    hashed = blocks[:3]
    for i, block in enumerate(hashed):
        _register(pool, block, [i])
    # free the hashed ones first, the plain ones last: plain still go out first
    pool.free(hashed)
    pool.free(blocks[3:])
    first = pool.allocate(3)
    assert first is not None
    assert sorted(first) == sorted(blocks[3:])
    assert pool.num_cached == 3
    second = pool.allocate(3)
    assert second is not None
    assert sorted(second) == sorted(hashed)
    assert pool.num_cached == 0


def test_hashed_free_blocks_are_reused_least_recently_freed_first() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    assert blocks is not None
    a, b, c, d = blocks
    for i, block in enumerate(blocks):
        _register(pool, block, [i])
    pool.free([b])
    pool.free([d])
    pool.free([a])
    pool.free([c])
    assert [pool.allocate(1) for _ in range(4)] == [[b], [d], [a], [c]]


def test_free_of_a_block_list_keeps_the_first_blocks_longest() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    assert blocks is not None
    parent = ROOT_HASH
    for i, block in enumerate(blocks):
        parent = _register(pool, block, [i], parent)
    pool.free(blocks)  # one request's table, in order: its last block is evicted first
    assert pool.allocate(1) == [blocks[2]]
    assert pool.allocate(1) == [blocks[1]]
    assert pool.allocate(1) == [blocks[0]]


def test_a_block_freed_again_becomes_most_recently_freed() -> None:
    pool = BlockPool(2)
    blocks = pool.allocate(2)
    assert blocks is not None
    a, b = blocks
    ha = _register(pool, a, [1])
    _register(pool, b, [2])
    pool.free([a])
    pool.free([b])
    assert pool.lookup(ha, ROOT_HASH, [1]) == a
    pool.acquire(a)  # a prefix hit revives a ...
    pool.free([a])  # ... and frees it again: now b is the older one
    assert pool.allocate(1) == [b]
    assert pool.allocate(1) == [a]


def test_lookup_rejects_a_hash_whose_stored_content_differs() -> None:
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    assert blocks is not None
    block_hash = _register(pool, blocks[0], [5, 6, 7, 8])
    assert pool.lookup(block_hash, ROOT_HASH, [5, 6, 7, 8]) == blocks[0]
    assert pool.lookup(block_hash, ROOT_HASH, (5, 6, 7, 8)) == blocks[0]
    # the same hash claimed for other tokens or another parent: a collision, never a hit
    assert pool.lookup(block_hash, ROOT_HASH, [5, 6, 7, 9]) is None
    assert pool.lookup(block_hash, ROOT_HASH, [5, 6, 7]) is None
    assert pool.lookup(block_hash, b"other-parent", [5, 6, 7, 8]) is None
    assert pool.lookup(hash_block(ROOT_HASH, [1]), ROOT_HASH, [1]) is None  # unknown hash


def test_register_of_a_duplicate_hash_keeps_the_first_block_canonical() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(2)
    assert blocks is not None
    first, second = blocks
    h = _register(pool, first, [3, 4])
    assert _register(pool, second, [3, 4]) == h
    assert pool.lookup(h, ROOT_HASH, [3, 4]) == first
    assert pool.block_hash(second) is None
    assert pool.num_cached == 1
    # the duplicate stays plain: freed, it is handed out before the canonical block
    pool.free([first])
    pool.free([second])
    plain = pool.allocate(2)
    assert plain is not None
    assert sorted(plain) == sorted([second, 2])
    assert pool.lookup(h, ROOT_HASH, [3, 4]) == first
    assert pool.allocate(1) == [first]


def test_register_does_not_rehash_a_hashed_block() -> None:
    pool = BlockPool(1)
    blocks = pool.allocate(1)
    assert blocks is not None
    h1 = _register(pool, blocks[0], [1])
    h2 = _register(pool, blocks[0], [2])
    assert pool.block_hash(blocks[0]) == h1
    assert pool.lookup(h1, ROOT_HASH, [1]) == blocks[0]
    assert pool.lookup(h2, ROOT_HASH, [2]) is None
    assert pool.num_cached == 1


def test_an_evicted_hash_can_be_registered_again_on_another_block() -> None:
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    assert blocks is not None
    h = _register(pool, blocks[0], [9])
    pool.free(blocks)
    evicted = pool.allocate(2)  # takes the plain block and then evicts the hashed one
    assert evicted is not None
    assert pool.lookup(h, ROOT_HASH, [9]) is None
    other = next(b for b in evicted if b != blocks[0])
    _register(pool, other, [9])
    assert pool.lookup(h, ROOT_HASH, [9]) == other


def test_prefix_hit_on_a_free_block_keeps_its_hash_and_takes_it_out_of_the_pool() -> None:
    # Regression: a freed hashed block revived by acquire() must leave the free pool,
    # or the pool hands it to another request while the first one reads it.
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    assert blocks is not None
    block = blocks[0]
    h = _register(pool, block, [1, 2])
    pool.free(blocks)
    assert pool.num_free == 3
    hit = pool.lookup(h, ROOT_HASH, [1, 2])
    assert hit == block
    pool.acquire(block)
    assert pool.ref_count(block) == 1
    assert pool.block_hash(block) == h
    assert pool.num_free == 2
    assert pool.num_cached == 1
    others = pool.allocate(2)
    assert others is not None
    assert block not in others
    assert pool.allocate(1) is None
    assert pool.lookup(h, ROOT_HASH, [1, 2]) == block  # still findable while in use
    pool.free([block])
    assert pool.num_free == 1
    assert pool.lookup(h, ROOT_HASH, [1, 2]) == block
    assert pool.allocate(1) == [block]
    assert pool.block_hash(block) is None


def test_acquire_of_a_block_in_use_shares_it() -> None:
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    assert blocks is not None
    block = blocks[0]
    _register(pool, block, [4])
    pool.acquire(block)
    assert pool.ref_count(block) == 2
    assert pool.num_free == 1
    pool.free([block])
    assert pool.num_free == 1
    assert pool.allocate(2) is None
