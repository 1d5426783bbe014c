"""KVCacheManager: block tables per cache group, sliding rings, prefix sharing."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiocb.core.kv_cache import CacheGroup, KVCacheManager, ring_size
from aiocb.core.params import ResolvedParams
from aiocb.core.request import Request
from tests.fuzzing import fuzz_settings

PAGE = 4


def make_request(prompt: list[int], request_id: str = "r") -> Request:
    return Request(request_id, list(prompt), ResolvedParams(max_new_tokens=8), arrival_time=0.0)


def full_cache(num_blocks: int = 16, *, prefix: bool = True, page: int = PAGE) -> KVCacheManager:
    return KVCacheManager([CacheGroup((0, 1), num_blocks)], page, enable_prefix_caching=prefix)


def hybrid_cache(full_blocks: int = 16, sliding_blocks: int = 6, window: int = 8) -> KVCacheManager:
    groups = [CacheGroup((0,), full_blocks), CacheGroup((1,), sliding_blocks, sliding_window=window)]
    return KVCacheManager(groups, PAGE, enable_prefix_caching=True)


def compute(kv: KVCacheManager, request: Request, num_tokens: int) -> None:
    """Allocate and 'compute' ``num_tokens`` more tokens of ``request``, as a step would."""
    assert kv.allocate(request, num_tokens)
    request.num_computed_tokens += num_tokens
    kv.cache_full_blocks(request)


def assert_no_leak(kv: KVCacheManager) -> None:
    assert kv.num_free_blocks == kv.num_total_blocks
    for pool in kv.pools:
        assert all(pool.ref_count(b) == 0 for b in range(pool.num_blocks))


# ---------------------------------------------------------------------- construction, sizes


def test_a_cache_needs_a_group() -> None:
    with pytest.raises(ValueError, match="at least one cache group"):
        KVCacheManager([], PAGE, enable_prefix_caching=True)


def test_pools_per_group_and_totals() -> None:
    kv = hybrid_cache(full_blocks=10, sliding_blocks=6)
    assert [pool.num_blocks for pool in kv.pools] == [10, 6]
    assert kv.num_total_blocks == 16
    assert kv.num_free_blocks == 16
    assert kv.free_fraction == 1.0


@pytest.mark.parametrize(
    ("window", "page", "expected"),
    [(1, 4, 1), (2, 4, 2), (4, 4, 2), (5, 4, 2), (6, 4, 3), (8, 4, 3), (9, 4, 3), (10, 4, 4), (4096, 256, 17)],
)
def test_ring_size_examples(window: int, page: int, expected: int) -> None:
    assert ring_size(window, page) == expected


@fuzz_settings(100)
@given(window=st.integers(1, 64), page=st.integers(1, 16))
def test_ring_size_is_the_most_blocks_one_window_spans(window: int, page: int) -> None:
    # A query at position p reads keys p - window + 1 .. p: every such range must sit in
    # distinct ring blocks, and some range needs the whole ring (it is not oversized).
    ring = ring_size(window, page)
    spans = [len({q // page for q in range(max(0, p - window + 1), p + 1)}) for p in range(window + 3 * page)]
    assert max(spans) == ring


def test_capacity_tokens() -> None:
    assert full_cache(10).capacity_tokens == 10 * PAGE
    # hybrid: the full group bounds the length, the sliding ring does not
    assert hybrid_cache(full_blocks=7, sliding_blocks=3).capacity_tokens == 7 * PAGE
    only_sliding = KVCacheManager([CacheGroup((0,), 3, sliding_window=8)], PAGE, enable_prefix_caching=False)
    assert only_sliding.capacity_tokens >= 2**40
    assert only_sliding.fits_alone(2**40)


def test_capacity_tokens_of_a_sliding_pool_smaller_than_its_ring() -> None:
    # Regression: a sliding pool scaled below one ring (memory sizing does that) bounds the
    # length too; reporting "any length" admits requests that can never get their ring.
    sliding = KVCacheManager([CacheGroup((0,), 2, sliding_window=9)], PAGE, enable_prefix_caching=False)
    assert ring_size(9, PAGE) == 3
    assert sliding.capacity_tokens == 2 * PAGE
    assert sliding.fits_alone(2 * PAGE)
    assert not sliding.fits_alone(2 * PAGE + 1)
    hybrid = hybrid_cache(full_blocks=10, sliding_blocks=2, window=9)
    assert hybrid.capacity_tokens == 2 * PAGE


def test_fits_alone() -> None:
    kv = full_cache(5)
    assert kv.fits_alone(1)
    assert kv.fits_alone(5 * PAGE)
    assert not kv.fits_alone(5 * PAGE + 1)
    hybrid = hybrid_cache(full_blocks=5, sliding_blocks=3, window=8)  # ring of 3
    assert hybrid.fits_alone(5 * PAGE)
    assert not hybrid.fits_alone(5 * PAGE + 1)
    too_small_ring = hybrid_cache(full_blocks=50, sliding_blocks=2, window=8)
    assert too_small_ring.fits_alone(2 * PAGE)
    assert not too_small_ring.fits_alone(2 * PAGE + 1)


@fuzz_settings(100)
@given(
    full=st.one_of(st.none(), st.integers(1, 12)),
    sliding=st.lists(st.tuples(st.integers(1, 8), st.integers(1, 20)), max_size=2),
)
def test_capacity_tokens_agrees_with_fits_alone(full: int | None, sliding: list[tuple[int, int]]) -> None:
    groups = [CacheGroup((0,), full)] if full is not None else []
    groups += [CacheGroup((i + 1,), n, sliding_window=w) for i, (n, w) in enumerate(sliding)]
    if not groups:
        return
    kv = KVCacheManager(groups, PAGE, enable_prefix_caching=False)
    capacity = kv.capacity_tokens
    assert kv.fits_alone(capacity)
    if capacity < 2**40:
        assert not kv.fits_alone(capacity + 1)


# ---------------------------------------------------------------------- allocate / free


def test_allocate_per_group_full_grows_sliding_stays_within_ring() -> None:
    kv = hybrid_cache(full_blocks=16, sliding_blocks=6, window=8)  # ring of 3 blocks
    request = make_request(list(range(1, 21)))  # 20 tokens = 5 pages
    assert kv.allocate(request, 2)
    assert [len(t) for t in request.block_ids] == [1, 1]
    request.num_computed_tokens = 2
    assert kv.allocate(request, 18)
    assert [len(t) for t in request.block_ids] == [5, 3]
    request.num_computed_tokens = 20
    for _ in range(30):  # decode far past the window: the ring never grows
        request.token_ids.append(7)
        assert kv.allocate(request, 1)
        request.num_computed_tokens += 1
        assert len(request.block_ids[1]) == 3
    assert len(request.block_ids[0]) == -(-50 // PAGE)
    assert kv.pools[1].num_free == 3
    assert len(set(request.block_ids[0])) == len(request.block_ids[0])
    assert len(set(request.block_ids[1])) == 3


def test_allocate_only_what_is_missing() -> None:
    kv = full_cache(8)
    request = make_request(list(range(1, 10)))
    assert kv.allocate(request, 3)  # 1 page
    first = list(request.block_ids[0])
    assert kv.allocate(request, 3)  # asking again for the same tokens takes nothing more
    assert request.block_ids[0] == first
    request.num_computed_tokens = 3
    assert kv.allocate(request, 2)  # tokens 3..4 reach into page 1
    assert request.block_ids[0][:1] == first
    assert len(request.block_ids[0]) == 2
    assert kv.num_free_blocks == 6


def test_allocate_is_all_or_nothing_across_groups() -> None:
    kv = hybrid_cache(full_blocks=16, sliding_blocks=2, window=8)  # ring of 3, pool of 2
    request = make_request(list(range(1, 13)))
    assert not kv.allocate(request, 12)  # the full group could, the sliding one cannot
    assert [pool.num_free for pool in kv.pools] == [16, 2]
    assert all(not table for table in request.block_ids)
    other = make_request(list(range(1, 30)), "other")
    assert kv.allocate(other, 4)
    assert not kv.allocate(make_request(list(range(50)), "third"), 50)  # full group too small now
    assert kv.pools[0].num_free == 15


@pytest.mark.parametrize("hybrid", [False, True])
def test_free_returns_every_block(hybrid: bool) -> None:
    kv = hybrid_cache(sliding_blocks=10) if hybrid else full_cache(16)
    requests = [make_request(list(range(1, 11 + i)), f"r{i}") for i in range(3)]
    for request in requests:
        assert kv.allocate(request, request.num_tokens)
        request.num_computed_tokens = request.num_tokens
        kv.cache_full_blocks(request)
    assert kv.num_free_blocks < kv.num_total_blocks
    assert 0.0 < kv.free_fraction < 1.0
    for request in requests:
        kv.free(request)
        assert not request.block_ids
        assert request.num_registered_blocks == 0
    assert_no_leak(kv)
    assert kv.free_fraction == 1.0


def test_free_of_a_request_without_blocks_is_harmless() -> None:
    kv = full_cache(4)
    request = make_request([1, 2, 3])
    kv.free(request)
    kv.free(request)
    assert_no_leak(kv)


def test_free_fraction_is_the_tightest_group() -> None:
    kv = hybrid_cache(full_blocks=20, sliding_blocks=4, window=8)
    request = make_request(list(range(1, 13)))
    assert kv.allocate(request, 12)  # 3 full blocks of 20, 3 ring blocks of 4
    assert kv.free_fraction == pytest.approx(1 / 4)


# ---------------------------------------------------------------------- prefix sharing


def test_requests_with_the_same_prefix_share_blocks() -> None:
    kv = full_cache(16)
    prefix = list(range(100, 112))  # 3 full pages
    first = make_request([*prefix, 1, 2], "first")
    assert kv.match_prefix(first) == 0
    compute(kv, first, first.num_tokens)
    assert kv.pools[0].num_cached == 3  # the partial 4th page is not registered
    second = make_request([*prefix, 9, 9, 9], "second")
    assert kv.match_prefix(second) == 12
    assert second.block_ids[0] == first.block_ids[0][:3]
    assert all(kv.pools[0].ref_count(b) == 2 for b in first.block_ids[0][:3])
    second.num_computed_tokens = 12
    compute(kv, second, 3)
    assert len(second.block_ids[0]) == 4
    assert second.block_ids[0][3] not in first.block_ids[0]
    # freeing one sharer keeps the blocks for the other
    kv.free(first)
    assert all(kv.pools[0].ref_count(b) == 1 for b in second.block_ids[0])
    kv.free(second)
    assert_no_leak(kv)


def test_prefix_hit_stops_at_the_first_differing_page() -> None:
    kv = full_cache(16)
    first = make_request(list(range(1, 17)), "first")
    compute(kv, first, 16)
    diverged = list(range(1, 17))
    diverged[5] = 999  # page 1 differs: pages 2 and 3 cannot be reused (their parent differs)
    second = make_request([*diverged, 0], "second")
    assert kv.match_prefix(second) == PAGE
    assert second.block_ids[0] == first.block_ids[0][:1]


def test_a_lookup_hashes_a_prompt_only_up_to_its_first_miss() -> None:
    """A long new prompt's blocks are hashed as they complete, not all at its admission (a
    100,000-token prompt's held the event loop 8-9 ms in one go)."""
    kv = full_cache(64)
    first = make_request(list(range(1, 17)), "first")
    compute(kv, first, 16)
    long_prompt = [*range(1, 9), *range(100, 200)]  # (its first two pages are first's)
    second = make_request(long_prompt, "second")
    assert kv.match_prefix(second) == 2 * PAGE
    assert len(second.block_hashes) == 3  # (two hits and the miss)
    second.num_computed_tokens = 2 * PAGE
    compute(kv, second, len(long_prompt) - 2 * PAGE)  # (the rest hashed as they complete)
    assert len(second.block_hashes) == len(long_prompt) // PAGE
    third = make_request([*long_prompt, 7], "third")
    assert kv.match_prefix(third) == len(long_prompt)
    kv.free(first)
    kv.free(second)
    kv.free(third)
    assert_no_leak(kv)


def test_a_later_page_alone_is_not_a_hit() -> None:
    kv = full_cache(16)
    first = make_request(list(range(1, 13)), "first")
    compute(kv, first, 12)
    second = make_request([77, 77, 77, 77, *range(5, 13), 1], "second")  # same page 1, other page 0
    assert kv.match_prefix(second) == 0
    assert second.block_ids == [[]]


def test_the_last_prompt_token_is_never_served_from_the_cache() -> None:
    kv = full_cache(16)
    tokens = list(range(1, 13))  # exactly 3 pages
    first = make_request(tokens, "first")
    compute(kv, first, 12)
    assert kv.pools[0].num_cached == 3
    same = make_request(tokens, "same")
    assert kv.match_prefix(same) == 2 * PAGE  # k pages of prompt: at most k - 1 from the cache
    assert len(same.block_ids[0]) == 2
    one_more = make_request([*tokens, 5], "one_more")
    assert kv.match_prefix(one_more) == 3 * PAGE


@pytest.mark.parametrize("length", [1, 2, 3, 4, 5])
def test_short_prompts_get_no_hit(length: int) -> None:
    kv = full_cache(8)
    compute(kv, make_request(list(range(1, 9)), "first"), 8)
    request = make_request(list(range(1, 1 + length)), "short")
    expected = PAGE if length > PAGE else 0
    assert kv.match_prefix(request) == expected


def test_blocks_are_registered_only_once_fully_computed() -> None:
    kv = full_cache(8)
    request = make_request(list(range(1, 11)))
    compute(kv, request, 3)
    assert kv.pools[0].num_cached == 0
    compute(kv, request, 3)  # 6 computed: page 0 is full
    assert kv.pools[0].num_cached == 1
    assert request.num_registered_blocks == 1
    compute(kv, request, 2)
    assert kv.pools[0].num_cached == 2
    assert request.num_registered_blocks == 2
    other = make_request(list(range(1, 11)), "other")
    assert kv.match_prefix(other) == 8


def test_cached_blocks_of_a_finished_request_are_hit_from_the_free_pool() -> None:
    kv = full_cache(6)
    tokens = list(range(1, 10))
    first = make_request(tokens, "first")
    compute(kv, first, 9)
    cached = first.block_ids[0][:2]
    kv.free(first)
    assert_no_leak(kv)
    second = make_request(tokens, "second")
    assert kv.match_prefix(second) == 8
    assert second.block_ids[0] == cached
    assert kv.num_free_blocks == 4  # the two hits left the free pool
    second.num_computed_tokens = 8
    assert kv.allocate(second, 1)
    # the rest of the pool can be taken without ever handing out a hit block
    thief = make_request(list(range(200, 212)), "thief")
    assert kv.allocate(thief, 12)
    assert not set(thief.block_ids[0]) & set(second.block_ids[0])
    kv.free(second)
    kv.free(thief)
    assert_no_leak(kv)


def test_match_prefix_is_a_no_op_for_a_request_that_holds_blocks() -> None:
    kv = full_cache(8)
    compute(kv, make_request(list(range(1, 10)), "first"), 9)
    request = make_request(list(range(1, 10)), "second")
    assert kv.allocate(request, 2)
    table = [list(t) for t in request.block_ids]
    assert kv.match_prefix(request) == 0
    assert request.block_ids == table


def test_prefix_caching_can_be_turned_off() -> None:
    kv = full_cache(8, prefix=False)
    assert not kv.prefix_caching
    first = make_request(list(range(1, 10)), "first")
    compute(kv, first, 9)
    assert kv.pools[0].num_cached == 0
    assert kv.match_prefix(make_request(list(range(1, 10)), "second")) == 0


@pytest.mark.parametrize("sliding_first", [False, True])
def test_prefix_caching_is_off_when_any_group_slides(sliding_first: bool) -> None:
    groups = [CacheGroup((0,), 16), CacheGroup((1,), 6, sliding_window=8)]
    if sliding_first:
        groups.reverse()
    kv = KVCacheManager(groups, PAGE, enable_prefix_caching=True)
    assert not kv.prefix_caching
    first = make_request(list(range(1, 14)), "first")
    assert kv.match_prefix(first) == 0
    compute(kv, first, 13)
    assert all(pool.num_cached == 0 for pool in kv.pools)
    second = make_request(list(range(1, 14)), "second")
    assert kv.match_prefix(second) == 0
    assert kv.num_prefix_hit_tokens == 0


def test_prefix_caching_is_off_with_several_full_groups() -> None:
    # Hits are only looked up in the first pool: with two pools the second would hold no KV
    # for the "cached" positions, so sharing must be off rather than silently wrong.
    kv = KVCacheManager([CacheGroup((0,), 8), CacheGroup((1,), 8)], PAGE, enable_prefix_caching=True)
    assert not kv.prefix_caching
    first = make_request(list(range(1, 10)), "first")
    compute(kv, first, 9)
    second = make_request(list(range(1, 10)), "second")
    assert kv.match_prefix(second) == 0
    assert kv.allocate(second, 9)
    assert [len(t) for t in second.block_ids] == [3, 3]
