"""Page tables: which page of one cache group's pool holds each logical page of one request.

Logical page L of a group holds the request's tokens [L * tokens_per_page, (L + 1) * tokens_per_page).
The table takes pages from, and gives them back to, the group's BlockPool on the request's partition.
Pages are assigned in logical order: num_pages is the next logical page to assign.

FullHistoryTable (append-only history): pages[L] is logical page L; the table only grows, and every
page stays held until the request is freed.

RingTable: max_blocks_per_seq slots; logical page L lives in slot spec.ring_slot(L). Each slot is
    empty   page -1                                  (never used, or released behind the live tail)
    held    page >= 0, holding logical page L        (L in the held range below)
The held logical pages are always one run [first_held, num_pages), at most max_blocks_per_seq long:
pages are assigned at the front, a slot moving on to L + max_blocks_per_seq releases L, and the pages
behind the live tail are released from the back. Copy-on-write: a slot moving on always releases its
old page and takes a fresh one, so a page another request shares, or the prefix cache keeps, is never
overwritten.

Prefix caching: a table registers its pages of whole computed blocks and shares the pages of a hit,
under the keys the KvCacheManager docstring describes (cache_key).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence

from appliance.core.kv_cache_spec import CacheGroupSpec
from appliance.engine.block_pool import BlockPool


class PageTable(ABC):
    """What both kinds share: the group, the pool its pages come from, the pages, prefix-cache keys."""

    def __init__(self, spec: CacheGroupSpec, pool: BlockPool, block_size: int, pages: list[int]):
        self.spec = spec
        self.pool = pool
        self.block_size = block_size
        self.tokens_per_page = spec.tokens_per_page      # copied: the spec computes it on every read
        self.pages_per_block = block_size // self.tokens_per_page
        self.pages = pages       # the block table the runner reads (SeqStep.block_tables), -1 = no page
        self.num_pages = 0       # logical pages assigned so far (the next one to assign)
        self.first_held = 0      # oldest logical page still held (full history: always 0)

    @property
    def tokens_covered(self) -> int:
        """Tokens the assigned pages reach."""
        return self.num_pages * self.tokens_per_page

    def block_table(self) -> list[int]:
        return list(self.pages)

    def page_at(self, logical: int) -> int | None:
        """Page holding `logical`, or None when not (or no longer) held."""
        return self.pages[self.spec.ring_slot(logical)] if self.first_held <= logical < self.num_pages else None

    def new_logical_pages(self, num_computed: int, target: int) -> range:
        """Logical pages to assign so that tokens [0, target) can be computed (tokens [0, num_computed) are).

        Raises ValueError (without the request's name, which the caller adds) when the group cannot hold them.
        """
        end = -(-target // self.tokens_per_page)
        self._check_fits(num_computed, target, end)
        return range(self.num_pages, max(self.num_pages, end))

    @abstractmethod
    def _check_fits(self, num_computed: int, target: int, end: int) -> None:
        """Raise ValueError when computing tokens [num_computed, target) needs more than the group holds."""

    @abstractmethod
    def reusable_pages(self, new: range) -> int:
        """Pages that assigning `new` releases to the pool first (so this request's own takes can use them)."""

    @abstractmethod
    def assign(self, new: range) -> list[int]:
        """Take a fresh page for each logical page in `new` (from new_logical_pages); returns them in order."""

    @abstractmethod
    def release_stale(self, num_computed: int) -> None:
        """Give back pages no later step reads (cached ones stay evictable in the pool)."""

    def release_all(self) -> None:
        """Give back every held page, newest first, so the tail of a cached prefix is evicted first."""
        for logical in reversed(range(self.first_held, self.num_pages)):
            self.pool.release(self.pages[self.spec.ring_slot(logical)])

    # -- prefix cache ------------------------------------------------------------------------------
    def cache_key(self, hashes: Sequence[bytes], logical: int) -> Hashable:
        """(H_j, index of the page within block j) for the block j holding `logical`; H_j alone when a block is one
        page (no tuple per cached page: H_j is the request's own hash object, shared by every such group)."""
        if self.pages_per_block == 1:
            return hashes[logical]
        return hashes[logical // self.pages_per_block], logical % self.pages_per_block

    def register_blocks(self, hashes: Sequence[bytes], first_block: int, end_block: int) -> None:
        """Cache the held pages of whole blocks [first_block, end_block), whose tokens are all computed."""
        for logical in range(first_block * self.pages_per_block, end_block * self.pages_per_block):
            page = self.page_at(logical)
            if page is not None:
                self.pool.register(self.cache_key(hashes, logical), page)

    @abstractmethod
    def hit_pages(self, blocks: int) -> range:
        """Logical pages a prefix hit of `blocks` whole blocks shares (the pages it must find cached)."""

    def longest_hit(self, hashes: Sequence[bytes], blocks: int) -> int:
        """Most whole blocks, at most `blocks`, whose hit pages this group finds in the cache."""
        while blocks and not all(self.pool.lookup(self.cache_key(hashes, logical)) is not None
                                 for logical in self.hit_pages(blocks)):
            blocks -= 1
        return blocks

    def share_hit(self, hashes: Sequence[bytes], blocks: int) -> None:
        """Hold (refcount + 1) the cached pages of a hit of `blocks` blocks (longest_hit found them all)."""
        hit = self.hit_pages(blocks)
        for logical in hit:
            page = self.pool.lookup(self.cache_key(hashes, logical))
            if page is None:
                raise KeyError(f"logical page {logical} of a {blocks}-block hit is not cached (ask longest_hit first)")
            self.pool.share(page)
            self._hold(logical, page)
        self.num_pages = blocks * self.pages_per_block
        self.first_held = hit.start

    @abstractmethod
    def _hold(self, logical: int, page: int) -> None:
        """Put a shared page in the table as logical page `logical`."""


class FullHistoryTable(PageTable):
    """Append-only: pages[L] holds logical page L, up to max_blocks_per_seq (max_model_len)."""

    def __init__(self, spec: CacheGroupSpec, pool: BlockPool, block_size: int):
        super().__init__(spec, pool, block_size, [])

    def _check_fits(self, num_computed: int, target: int, end: int) -> None:
        if end > self.spec.max_blocks_per_seq:
            raise ValueError(f"{target} tokens need {end} pages of group {self.spec.name!r}, more than "
                             f"max_blocks_per_seq {self.spec.max_blocks_per_seq} (max_model_len)")

    def reusable_pages(self, new: range) -> int:
        return 0                 # nothing is released before the request ends

    def assign(self, new: range) -> list[int]:
        added = [self.pool.take() for _ in new]
        self.pages.extend(added)
        self.num_pages = new.stop
        return added

    def release_stale(self, num_computed: int) -> None:
        """Nothing is stale: every later step reads the whole history."""

    def hit_pages(self, blocks: int) -> range:
        return range(blocks * self.pages_per_block)

    def longest_hit(self, hashes: Sequence[bytes], blocks: int) -> int:
        """A hit of fewer blocks needs a prefix of the same pages, so one scan from the start finds it."""
        logical = 0
        while logical < blocks * self.pages_per_block and \
                self.pool.lookup(self.cache_key(hashes, logical)) is not None:
            logical += 1
        return logical // self.pages_per_block

    def _hold(self, logical: int, page: int) -> None:
        self.pages.append(page)


class RingTable(PageTable):
    """max_blocks_per_seq slots reused in turn; holds only the live tail (see the module docstring)."""

    def __init__(self, spec: CacheGroupSpec, pool: BlockPool, block_size: int):
        super().__init__(spec, pool, block_size, [-1] * spec.max_blocks_per_seq)

    def _check_fits(self, num_computed: int, target: int, end: int) -> None:
        start = min(num_computed // self.tokens_per_page, self.spec.live_logical_pages(target).start)
        if end - start > self.spec.max_blocks_per_seq:
            raise ValueError(
                f"tokens [{num_computed}, {target}) need logical pages [{start}, {end}) of ring group "
                f"{self.spec.name!r}, more than its {self.spec.max_blocks_per_seq} slots; a step must not "
                f"exceed tokens_in_flight")

    def reusable_pages(self, new: range) -> int:
        count = 0
        for logical in new:
            page = self.pages[self.spec.ring_slot(logical)]
            if page >= 0 and self.pool.refcount(page) == 1:
                count += 1
        return count

    def assign(self, new: range) -> list[int]:
        """Release what the reused slots held first, then take: the request may take what it released."""
        slots = [self.spec.ring_slot(logical) for logical in new]
        for slot in slots:
            if self.pages[slot] >= 0:
                self.pool.release(self.pages[slot])
        added = [self.pool.take() for _ in slots]
        for slot, page in zip(slots, added):
            self.pages[slot] = page
        self.first_held = max(self.first_held, new.stop - self.spec.max_blocks_per_seq)
        self.num_pages = new.stop
        return added

    def release_stale(self, num_computed: int) -> None:
        """Release held pages behind the live tail, in slot order (the order decides which pages the pool
        hands out next; kept as it was when the manager scanned slots).

        A decoding request then holds only the pages its window or compressor span needs, not all
        max_blocks_per_seq slots, so short requests can run beyond capacity_slots at once.
        """
        first_live = self.spec.live_logical_pages(num_computed).start
        if first_live <= self.first_held:
            return
        for logical in sorted(range(self.first_held, first_live), key=self.spec.ring_slot):
            slot = self.spec.ring_slot(logical)
            self.pool.release(self.pages[slot])
            self.pages[slot] = -1
        self.first_held = first_live

    def hit_pages(self, blocks: int) -> range:
        return self.spec.live_logical_pages(blocks * self.block_size)[-self.spec.max_blocks_per_seq:]

    def _hold(self, logical: int, page: int) -> None:
        self.pages[self.spec.ring_slot(logical)] = page


def new_page_table(spec: CacheGroupSpec, pool: BlockPool, block_size: int) -> PageTable:
    """An empty table of the group's kind, drawing pages from `pool`."""
    return RingTable(spec, pool, block_size) if spec.is_ring else FullHistoryTable(spec, pool, block_size)
