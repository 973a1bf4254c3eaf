"""Page tables on their own: full-history growth, ring slot reuse and release, prefix-cache sharing."""

import pytest

from appliance.core.kv_cache_spec import CacheGroupSpec
from appliance.engine.block_pool import BlockPool
from appliance.engine.page_table import FullHistoryTable, RingTable, new_page_table
from appliance.engine.prefix_cache import extend_block_hashes

BLOCK = 4   # tokens per prefix-cache block


def spec(history, mbps, span=0):
    """Two tokens per page, so a block holds two pages."""
    return CacheGroupSpec(name=history, layer_ids=(0,), rows_per_block=2, tokens_per_row=1, row_dtype="float32",
                          row_width=8, row_extra_bytes=0, history=history, max_blocks_per_seq=mbps,
                          ring_span_tokens=span, ring_aligned=True)


def grow(table, num_computed, target):
    return table.assign(table.new_logical_pages(num_computed, target))


def test_kind_follows_the_spec():
    assert type(new_page_table(spec("full", 4), BlockPool("f", 4), BLOCK)) is FullHistoryTable
    assert type(new_page_table(spec("ring", 3, span=4), BlockPool("r", 4), BLOCK)) is RingTable


def test_full_history_appends_and_refuses_more_than_max_blocks():
    pool = BlockPool("full", 8)
    table = FullHistoryTable(spec("full", 4), pool, BLOCK)
    assert grow(table, 0, 3) == [0, 1] and grow(table, 3, 6) == [2]
    assert table.block_table() == [0, 1, 2] and table.tokens_covered == 6
    assert [table.page_at(i) for i in range(4)] == [0, 1, 2, None]
    table.release_stale(6)                                  # the whole history stays live
    assert pool.num_free == 5
    with pytest.raises(ValueError, match=r"10 tokens need 5 pages of group 'full', more than max_blocks_per_seq 4"):
        table.new_logical_pages(6, 10)


def test_ring_reuses_slots_releasing_the_old_page_and_keeps_only_the_live_tail():
    pool = BlockPool("ring", 8)
    table = RingTable(spec("ring", 3, span=4), pool, BLOCK)   # live: the last 4 tokens = 2 pages
    assert grow(table, 0, 6) == [0, 1, 2] and table.block_table() == [0, 1, 2]
    assert table.reusable_pages(range(3, 4)) == 1           # slot 0 gives back logical page 0
    assert grow(table, 6, 8) == [3]                         # ... and takes a fresh page (copy-on-write)
    assert table.block_table() == [3, 1, 2] and table.page_at(0) is None and table.page_at(3) == 3
    assert pool.refcount(0) == 0
    table.release_stale(8)                                  # tokens [4, 8) live: logical pages 2, 3
    assert table.block_table() == [3, -1, 2] and pool.refcount(1) == 0
    with pytest.raises(ValueError, match=r"tokens \[8, 16\) need logical pages \[4, 8\) of ring group 'ring', "
                                         r"more than its 3 slots"):
        table.new_logical_pages(8, 16)


def test_release_all_goes_newest_first_so_the_tail_of_a_cached_prefix_is_evicted_first():
    pool = BlockPool("full", 3)
    table = FullHistoryTable(spec("full", 4), pool, BLOCK)
    grow(table, 0, 6)
    hashes = extend_block_hashes([], list(range(6)), BLOCK, 1)
    table.register_blocks(hashes, 0, 1)                     # pages 0, 1 cached; page 2 not
    table.release_all()
    assert pool.num_free == 3 and pool.take() == 2          # the uncached page is free
    assert pool.take() == 1 and pool.is_cached(0)           # then eviction: the newest cached page first


def test_prefix_hit_shares_all_pages_of_full_history_but_only_the_live_tail_of_a_ring():
    full_pool, ring_pool = BlockPool("full", 8), BlockPool("ring", 8)
    tokens = list(range(9))
    hashes = extend_block_hashes([], tokens, BLOCK, 2)
    writer_full = FullHistoryTable(spec("full", 5), full_pool, BLOCK)
    writer_ring = RingTable(spec("ring", 3, span=4), ring_pool, BLOCK)
    for table in (writer_full, writer_ring):
        grow(table, 0, 6)
        grow(table, 6, 8)
        table.register_blocks(hashes, 0, 2)
    reader_full = FullHistoryTable(spec("full", 5), full_pool, BLOCK)
    reader_ring = RingTable(spec("ring", 3, span=4), ring_pool, BLOCK)
    assert reader_full.longest_hit(hashes, 2) == reader_ring.longest_hit(hashes, 2) == 2
    reader_full.share_hit(hashes, 2)
    reader_ring.share_hit(hashes, 2)
    assert reader_full.block_table() == writer_full.block_table() == [0, 1, 2, 3]
    assert reader_ring.block_table() == [3, -1, 2]           # logical pages 2, 3 (tokens [4, 8)) only
    assert [full_pool.refcount(p) for p in range(4)] == [2, 2, 2, 2]
    assert (ring_pool.refcount(3), ring_pool.refcount(2), ring_pool.refcount(1)) == (2, 2, 1)
    # The writer's ring had already reused logical page 0's slot when block 0 completed, so a one-block
    # hit (live tail: logical pages 0, 1) misses in the ring although a longer one hits.
    assert reader_ring.longest_hit(hashes, 1) == 0 and reader_full.longest_hit(hashes, 1) == 1


def test_full_history_may_fill_exactly_max_blocks_per_seq():
    table = FullHistoryTable(spec("full", 4), BlockPool("full", 8), BLOCK)
    assert table.new_logical_pages(0, 8) == range(0, 4)                  # max_model_len tokens: every page
    assert grow(table, 0, 8) == [0, 1, 2, 3] and table.tokens_covered == 8


def test_reusable_pages_counts_every_reused_slot_whose_page_only_this_table_holds():
    pool = BlockPool("ring", 8)
    table = RingTable(spec("ring", 3, span=4), pool, BLOCK)
    grow(table, 0, 6)                                                    # logical pages 0, 1, 2 in slots 0, 1, 2
    assert table.reusable_pages(range(3, 5)) == 2                        # slots 0 and 1 give back pages 0 and 1
    pool.register(b"h", 0)
    pool.share(0)                                                        # page 0 cached and held by another request
    assert table.reusable_pages(range(3, 5)) == 1                        # releasing page 0 frees nothing


def test_register_blocks_caches_the_pages_of_the_named_blocks_only():
    pool = BlockPool("full", 8)
    table = FullHistoryTable(spec("full", 6), pool, BLOCK)
    grow(table, 0, 12)                                                   # 3 blocks of 2 pages: pages 0..5
    hashes = extend_block_hashes([], list(range(12)), BLOCK, 3)
    table.register_blocks(hashes, 1, 2)
    assert [pool.is_cached(p) for p in range(6)] == [False, False, True, True, False, False]
    assert [pool.lookup(table.cache_key(hashes, logical)) for logical in (2, 3)] == [2, 3]


def test_release_stale_gives_pages_back_in_slot_order_where_the_ring_wraps():
    """The order the docstring states: it decides which pages the pool hands out next (and, for cached pages,
    which of those released together is evicted first)."""
    pool = BlockPool("ring", 6)
    table = RingTable(spec("ring", 3, span=2), pool, BLOCK)   # live: the last page
    grow(table, 0, 6)                                       # logical pages 0, 1, 2 in slots 0, 1, 2
    table.release_stale(6)                                  # 0 and 1 go back; 2 (slot 2) stays
    grow(table, 6, 10)                                      # logical 3, 4 in slots 0, 1
    page_of = {logical: table.page_at(logical) for logical in (2, 3)}
    for _ in range(pool.num_free):
        pool.take()                                         # empty the pool: the next takes are the released pages
    table.release_stale(10)                                 # live: logical 4; 2 (slot 2) and 3 (slot 0) go back
    assert [pool.take(), pool.take()] == [page_of[3], page_of[2]]
