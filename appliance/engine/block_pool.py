"""BlockPool: the pages of one cache group on one partition, with reference counts and the prefix cache.

Every page is in exactly one state:
    free       refcount 0, not cached            (in the free queue)
    evictable  refcount 0, cached                (in LRU order: least recently released first)
    used       refcount > 0, cached or not       (held by one request, or shared by several when cached)
A cached page keeps its contents after its last holder releases it, so a later prefix hit can share it
again; it is only evicted (least recently released first) when the free queue is empty.

Host memory: every record of every page (count, key, place in the LRU order, slot in the key index) is made
here, at once, in fixed-size arrays; caching a page adds only its key object (appliance/engine/page_table.py
keeps those small). Records that grew as pages were cached (dicts, an OrderedDict: ~330 B per page) made a
server's RSS creep until every page of its pools had been cached (+230 MB for the embedded default's 700k pages).
"""

from __future__ import annotations

import ctypes
from array import array
from collections import deque
from typing import Hashable

EMPTY, REMOVED = -1, -2        # key index slots that hold no page: never used, or a page's key removed since


class BlockPool:
    def __init__(self, name: str, num_pages: int):
        if num_pages <= 0:
            raise ValueError(f"cache group {name!r}: number of pages must be positive, got {num_pages}")
        self.name = name
        self.num_pages = num_pages
        self._refcount = [0] * num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._key_of: list[Hashable | None] = [None] * num_pages     # the key a cached page is found by
        self._num_cached = 0
        # Evictable pages, least recently released first: a ring linked through the page ids; num_pages is its
        # head (newer[head] is the oldest page, older[head] the newest).
        self._newer = array("q", [num_pages]) * (num_pages + 1)
        self._older = array("q", [num_pages]) * (num_pages + 1)
        self._num_evictable = 0
        # The key index: open addressing over a power of two of slots, at least twice the pages, each a page id,
        # EMPTY or REMOVED; rebuilt in place when removed slots would leave fewer than a quarter empty.
        size = 1 << (2 * num_pages - 1).bit_length()
        self._index = array("q", [EMPTY]) * size
        self._removed = 0

    @property
    def num_free(self) -> int:
        """Pages a request can take now: free plus evictable."""
        return len(self._free) + self._num_evictable

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    @property
    def num_cached(self) -> int:
        return self._num_cached

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    def is_cached(self, page: int) -> bool:
        return self._key_of[page] is not None

    def take(self) -> int:
        """A fresh page for one holder: from the free queue, else evict the least recently released cached page."""
        if self._free:
            page = self._free.popleft()
        elif self._num_evictable:
            page = self._newer[self.num_pages]
            self._unlink(page)
            self._forget(page)
        else:
            raise RuntimeError(f"cache group {self.name!r}: no free page (the caller must check num_free first)")
        self._refcount[page] = 1
        return page

    def share(self, page: int) -> None:
        """One more holder of a cached page (a prefix hit)."""
        if self._refcount[page] == 0:
            if self._key_of[page] is None:
                raise RuntimeError(f"cache group {self.name!r}: page {page} is free, not cached; it cannot be shared")
            self._unlink(page)
        self._refcount[page] += 1

    def release(self, page: int) -> None:
        """One holder fewer; at zero a cached page becomes evictable, any other page free."""
        count = self._refcount[page]
        if count <= 0:
            raise RuntimeError(f"cache group {self.name!r}: page {page} released more often than taken")
        self._refcount[page] = count - 1
        if count == 1:
            if self._key_of[page] is not None:
                self._link_newest(page)
            else:
                self._free.append(page)

    def lookup(self, key: Hashable) -> int | None:
        page = self._index[self._find(key)]
        return page if page >= 0 else None

    def register(self, key: Hashable, page: int) -> bool:
        """Cache a held, complete page under `key`. The first page registered for a key wins; False if not added."""
        if self._refcount[page] <= 0:
            raise RuntimeError(f"cache group {self.name!r}: page {page} is not held; only held pages are cached")
        slot = self._find(key)
        if self._index[slot] >= 0 or self._key_of[page] is not None:
            return False
        first_removed = self._first_removed(key, slot)
        if first_removed is not None:
            slot = first_removed
            self._removed -= 1
        self._index[slot] = page
        self._key_of[page] = key
        self._num_cached += 1
        self._keep_slots_empty()
        return True

    # -- internals ---------------------------------------------------------------------------------
    def _find(self, key: Hashable) -> int:
        """The slot holding key's page, else the EMPTY slot that ends key's probe sequence."""
        mask = len(self._index) - 1
        slot = hash(key) & mask
        while True:
            page = self._index[slot]
            if page == EMPTY or (page >= 0 and self._key_of[page] == key):
                return slot
            slot = (slot + 1) & mask

    def _first_removed(self, key: Hashable, end: int) -> int | None:
        """The first REMOVED slot on key's probe sequence before `end` (reused by an insert), if any."""
        mask = len(self._index) - 1
        slot = hash(key) & mask
        while slot != end:
            if self._index[slot] == REMOVED:
                return slot
            slot = (slot + 1) & mask
        return None

    def _forget(self, page: int) -> None:
        """Evict: the page's key leaves the index."""
        key = self._key_of[page]
        self._index[self._find(key)] = REMOVED
        self._key_of[page] = None
        self._num_cached -= 1
        self._removed += 1
        self._keep_slots_empty()

    def _keep_slots_empty(self) -> None:
        """At least a quarter of the index's slots EMPTY (every probe ends, and soon): else rebuild it."""
        if 4 * (self._num_cached + self._removed) > 3 * len(self._index):
            self._rebuild()

    def _rebuild(self) -> None:
        """Every cached page's key put back into the index, emptied in place (EMPTY is every bit set)."""
        mask = len(self._index) - 1
        address, slots = self._index.buffer_info()
        ctypes.memset(address, 0xFF, slots * self._index.itemsize)
        self._removed = 0
        for page, key in enumerate(self._key_of):
            if key is not None:
                slot = hash(key) & mask
                while self._index[slot] != EMPTY:
                    slot = (slot + 1) & mask
                self._index[slot] = page

    def _link_newest(self, page: int) -> None:
        head = self.num_pages
        newest = self._older[head]
        self._newer[newest], self._older[page] = page, newest
        self._newer[page], self._older[head] = head, page
        self._num_evictable += 1

    def _unlink(self, page: int) -> None:
        older, newer = self._older[page], self._newer[page]
        self._newer[older], self._older[newer] = newer, older
        self._num_evictable -= 1
