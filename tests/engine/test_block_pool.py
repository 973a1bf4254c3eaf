"""BlockPool on its own: sizes, reference counts, the prefix cache's first-wins registration, and the errors that
name the group and page when a caller breaks the pool's rules (a bug in the caller, so the message must say
where to look)."""

import pytest

from appliance.engine.block_pool import BlockPool


def test_a_pool_needs_at_least_one_page_and_one_page_is_enough():
    for bad in (0, -2):
        with pytest.raises(ValueError) as info:
            BlockPool("kv", bad)
        assert str(info.value) == f"cache group 'kv': number of pages must be positive, got {bad}"
    pool = BlockPool("kv", 1)
    assert (pool.num_pages, pool.num_free, pool.num_used, pool.refcount(0)) == (1, 1, 0, 0)
    assert pool.take() == 0 and (pool.num_free, pool.num_used) == (0, 1)


def test_a_new_pool_holds_nothing_and_hands_out_every_page_once():
    pool = BlockPool("kv", 3)
    assert [pool.refcount(p) for p in range(3)] == [0, 0, 0]
    with pytest.raises(RuntimeError) as info:
        pool.release(1)                            # never taken: a release would make its count negative
    assert str(info.value) == "cache group 'kv': page 1 released more often than taken"
    assert sorted(pool.take() for _ in range(3)) == [0, 1, 2]
    assert [pool.refcount(p) for p in range(3)] == [1, 1, 1]
    with pytest.raises(RuntimeError) as info:
        pool.take()
    assert str(info.value) == "cache group 'kv': no free page (the caller must check num_free first)"


def test_a_page_released_once_more_than_taken_is_refused_and_its_count_stays_zero():
    pool = BlockPool("full", 2)
    page = pool.take()
    pool.release(page)
    with pytest.raises(RuntimeError, match=f"^cache group 'full': page {page} released more often than taken$"):
        pool.release(page)
    assert pool.refcount(page) == 0 and pool.num_free == 2


def test_only_a_cached_page_can_be_shared_and_only_a_held_page_cached():
    pool = BlockPool("ring", 2)
    with pytest.raises(RuntimeError) as info:
        pool.share(1)
    assert str(info.value) == "cache group 'ring': page 1 is free, not cached; it cannot be shared"
    with pytest.raises(RuntimeError) as info:
        pool.register(b"h", 1)
    assert str(info.value) == "cache group 'ring': page 1 is not held; only held pages are cached"
    assert pool.num_cached == 0 and pool.lookup(b"h") is None
    page = pool.take()
    pool.release(page)                             # free again (never cached): still not registrable
    with pytest.raises(RuntimeError, match="is not held"):
        pool.register(b"h", page)


def test_the_first_page_registered_for_a_key_wins_and_a_page_is_cached_under_one_key():
    pool = BlockPool("kv", 3)
    a, b = pool.take(), pool.take()
    assert pool.register(b"h0", a) is True and pool.lookup(b"h0") == a
    assert pool.register(b"h0", b) is False and pool.lookup(b"h0") == a       # same contents, later page
    assert pool.register(b"h1", a) is False and pool.lookup(b"h1") is None    # a is already cached as h0
    assert pool.register(b"h1", b) is True
    assert (pool.num_cached, pool.is_cached(a), pool.is_cached(b)) == (2, True, True)


def test_released_cached_pages_are_shared_again_or_evicted_least_recently_released_first():
    pool = BlockPool("kv", 3)
    pages = [pool.take() for _ in range(3)]
    for i, page in enumerate(pages):
        pool.register(("h", i), page)
    for page in (pages[1], pages[0], pages[2]):    # release order decides the eviction order
        pool.release(page)
    assert (pool.num_free, pool.num_cached) == (3, 3)
    pool.share(pages[0])                            # a prefix hit takes it out of the evictable set
    assert pool.refcount(pages[0]) == 1 and pool.num_free == 2
    assert pool.take() == pages[1] and pool.lookup(("h", 1)) is None       # evicted: no longer cached
    assert pool.take() == pages[2] and pool.num_cached == 1
    assert pool.lookup(("h", 0)) == pages[0]
