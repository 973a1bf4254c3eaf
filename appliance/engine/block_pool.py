"""BlockPool: the pages of one cache group on one partition, with reference counts and the prefix cache.

Every page is in exactly one state:
    free       refcount 0, not cached            (in the free queue)
    evictable  refcount 0, cached                (in LRU order: least recently released first)
    used       refcount > 0, cached or not       (held by one request, or shared by several when cached)
A cached page keeps its contents after its last holder releases it, so a later prefix hit can share it
again; it is only evicted (least recently released first) when the free queue is empty.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Hashable


class BlockPool:
    def __init__(self, name: str, num_pages: int):
        if num_pages <= 0:
            raise ValueError(f"cache group {name!r}: number of pages must be positive, got {num_pages}")
        self.name = name
        self.num_pages = num_pages
        self._refcount = [0] * num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._page_of: dict[Hashable, int] = {}      # cache key -> page
        self._key_of: dict[int, Hashable] = {}       # page -> cache key

    @property
    def num_free(self) -> int:
        """Pages a request can take now: free plus evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._page_of)

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    def is_cached(self, page: int) -> bool:
        return page in self._key_of

    def take(self) -> int:
        """A fresh page for one holder: from the free queue, else evict the least recently released cached page."""
        if self._free:
            page = self._free.popleft()
        elif self._evictable:
            page, _ = self._evictable.popitem(last=False)
            del self._page_of[self._key_of.pop(page)]
        else:
            raise RuntimeError(f"cache group {self.name!r}: no free page (the caller must check num_free first)")
        self._refcount[page] = 1
        return page

    def share(self, page: int) -> None:
        """One more holder of a cached page (a prefix hit)."""
        if self._refcount[page] == 0:
            if page not in self._evictable:
                raise RuntimeError(f"cache group {self.name!r}: page {page} is free, not cached; it cannot be shared")
            del self._evictable[page]
        self._refcount[page] += 1

    def release(self, page: int) -> None:
        """One holder fewer; at zero a cached page becomes evictable, any other page free."""
        count = self._refcount[page]
        if count <= 0:
            raise RuntimeError(f"cache group {self.name!r}: page {page} released more often than taken")
        self._refcount[page] = count - 1
        if count == 1:
            if page in self._key_of:
                self._evictable[page] = None
            else:
                self._free.append(page)

    def lookup(self, key: Hashable) -> int | None:
        return self._page_of.get(key)

    def register(self, key: Hashable, page: int) -> bool:
        """Cache a held, complete page under `key`. The first page registered for a key wins; False if not added."""
        if self._refcount[page] <= 0:
            raise RuntimeError(f"cache group {self.name!r}: page {page} is not held; only held pages are cached")
        if key in self._page_of or page in self._key_of:
            return False
        self._page_of[key] = page
        self._key_of[page] = key
        return True
