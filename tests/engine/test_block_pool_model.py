"""BlockPool against a plain model of its contract (dicts and an LRU list, as it was written before its records
became fixed arrays), over random operation streams long enough to wrap the key index's rebuilds; and the reason
for the arrays: caching and evicting pages allocates nothing that stays (the soak's RSS creep, issue 32)."""

from __future__ import annotations

import tracemalloc
from collections import OrderedDict, deque

from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.engine.block_pool import BlockPool


class ModelPool:
    """The contract in the obvious data structures: free queue, LRU of evictable pages, key <-> page maps."""

    def __init__(self, num_pages: int):
        self.refcount = [0] * num_pages
        self.free = deque(range(num_pages))
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.page_of: dict = {}
        self.key_of: dict = {}

    def take(self) -> int:
        if self.free:
            page = self.free.popleft()
        else:
            page, _ = self.evictable.popitem(last=False)
            del self.page_of[self.key_of.pop(page)]
        self.refcount[page] = 1
        return page

    def share(self, page: int) -> None:
        self.evictable.pop(page, None)
        self.refcount[page] += 1

    def release(self, page: int) -> None:
        self.refcount[page] -= 1
        if self.refcount[page] == 0:
            if page in self.key_of:
                self.evictable[page] = None
            else:
                self.free.append(page)

    def register(self, key, page: int) -> bool:
        if key in self.page_of or page in self.key_of:
            return False
        self.page_of[key], self.key_of[page] = page, key
        return True


OPS = st.lists(st.tuples(st.sampled_from(["take", "share", "release", "register", "lookup"]),
                         st.integers(0, 10_000), st.integers(0, 40)), min_size=1, max_size=400)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 12), OPS)
def test_block_pool_behaves_as_its_model(num_pages, ops):
    pool, model = BlockPool("kv", num_pages), ModelPool(num_pages)
    for op, pick, key in ops:
        held = [p for p in range(num_pages) if model.refcount[p] > 0]
        cached = sorted(model.key_of)
        if op == "take" and pool.num_free:
            assert pool.take() == model.take()
        elif op == "share" and cached:
            page = cached[pick % len(cached)]
            pool.share(page)
            model.share(page)
        elif op == "release" and held:
            page = held[pick % len(held)]
            pool.release(page)
            model.release(page)
        elif op == "register" and held:
            page = held[pick % len(held)]
            assert pool.register(("h", key), page) == model.register(("h", key), page)
        assert pool.lookup(("h", key)) == model.page_of.get(("h", key))
        assert pool.num_free == len(model.free) + len(model.evictable)
        assert pool.num_cached == len(model.key_of)
        assert [pool.refcount(p) for p in range(num_pages)] == model.refcount
        assert [pool.is_cached(p) for p in range(num_pages)] == [p in model.key_of for p in range(num_pages)]


def test_caching_and_evicting_every_page_allocates_nothing_that_stays():
    """The records of 4096 pages exist from the start: cycling every page through cached, evictable and evicted
    (new keys each round, made beforehand as requests make them) leaves no allocation behind but the keys held."""
    pages = 4096
    pool = BlockPool("kv", pages)
    rounds = [[(b"%06d" % r, i) for i in range(pages)] for r in range(3)]

    def cycle(keys):
        taken = [pool.take() for _ in range(pages)]
        for key, page in zip(keys, taken):
            assert pool.register(key, page)
        for page in taken:
            pool.release(page)

    cycle(rounds[0])                        # the first round reaches every page (and the index's first rebuild)
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        cycle(rounds[1])
        cycle(rounds[2])
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert pool.num_cached == pages and pool.lookup(rounds[2][7]) is not None and pool.lookup(rounds[1][7]) is None
    assert grown < 64 * 1024, grown         # (a dict-based pool grew by ~330 B per cached page here: 1.3 MB)
