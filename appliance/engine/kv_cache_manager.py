"""KvCacheManager: which physical page of every cache group each request holds (control plane, no torch).

- One BlockPool per cache group per partition (a partition = one data-parallel rank with its own pools).
- Allocation is atomic across groups: a request gets every page the next tokens need in every group, or
  nothing (KvCapacityError naming need and free per group).
- Each request holds one page table per group (page_table.py): full-history groups grow append-only,
  ring groups reuse max_blocks_per_seq slots (copy-on-write: a slot moving on releases its old page and
  takes a fresh one, so a cached old page stays in the cache for later hits instead of being overwritten).
- Prefix caching: blocks of block_size tokens are named by chained hashes; a group's page at logical index
  L inside block j is cached under (H_j, index of the page within the block). Pages are registered only
  once their whole block is computed (commit). A hit of h tokens must be valid in every group: full
  groups need all pages of [0, h), ring groups only spec.live_logical_pages(h).
- Length-keyed blocks (length_keyed_from, appliance/core/prefix_reuse.py): the first block reaching that
  position is hashed with the request's prompt length, so a hit past it comes only from a prompt of the same
  length (DeepSeek V4's tied indexer scores break by it); the blocks before it are shared by any prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from appliance.core.kv_cache_spec import CacheGroupSpec
from appliance.engine.block_pool import BlockPool
from appliance.engine.page_table import PageTable, new_page_table
from appliance.engine.prefix_cache import extend_block_hashes


class KvCapacityError(RuntimeError):
    """Not enough free pages for a request's next tokens; nothing was allocated. `need`/`free` are per group."""

    def __init__(self, message: str, need: dict[str, int], free: dict[str, int]):
        super().__init__(message)
        self.need = need
        self.free = free


@dataclass
class PrefixCacheStats:
    queries: int = 0           # match_prefix calls
    query_tokens: int = 0      # prompt tokens looked up
    hit_tokens: int = 0        # prompt tokens served from the cache (reported as cached prompt tokens)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class _Seq:
    """One request's pages (a page table per group, drawing on its partition's pools) and token counts."""

    def __init__(self, request_id: str, partition: int, tables: dict[str, PageTable]):
        self.request_id = request_id
        self.partition = partition
        self.tables = tables
        self.tokens: list[int] = []
        self.hashes: list[bytes] = []
        self.num_computed = 0       # tokens whose cache entries are written (match_prefix / commit)
        self.num_reserved = 0       # tokens that have pages (allocate)
        self.tokens_covered = 0     # tokens the assigned pages reach in every group (decode fast path)
        self.num_cached = 0         # prefix-hit tokens
        self.num_registered_blocks = 0
        self.prompt_len = 0         # its prompt's length (the key of length-keyed blocks)


class KvCacheManager:
    def __init__(self, specs: Sequence[CacheGroupSpec], block_size: int, *, enable_prefix_caching: bool = True,
                 num_partitions: int = 1, length_keyed_from: int | None = None):
        self.specs = tuple(specs)
        if not self.specs:
            raise ValueError("KvCacheManager needs at least one cache group spec")
        names = [s.name for s in self.specs]
        if len(set(names)) != len(names):
            raise ValueError(f"cache group names must be unique, got {names}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        for s in self.specs:
            if s.tokens_per_page <= 0 or block_size % s.tokens_per_page:
                raise ValueError(f"cache group {s.name!r}: tokens_per_page {s.tokens_per_page} must divide "
                                 f"block_size {block_size} (prefix-cache keys are pages within a block)")
        if num_partitions < 1:
            raise ValueError(f"num_partitions must be at least 1, got {num_partitions}")
        if length_keyed_from is not None and length_keyed_from < 0:
            raise ValueError(f"length_keyed_from must be a position >= 0, got {length_keyed_from}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # The first block keyed by the prompt's length too: the one holding position length_keyed_from.
        self.length_keyed_block = None if length_keyed_from is None else length_keyed_from // block_size
        self.num_partitions = num_partitions
        self.prefix_stats = PrefixCacheStats()
        self._pools: list[dict[str, BlockPool]] = []
        self._new_pages: list[dict[str, list[int]]] = []
        self._seqs: dict[str, _Seq] = {}
        self._num_seqs = [0] * num_partitions

    # -- sizing ------------------------------------------------------------------------------------
    def initialize(self, num_blocks: Mapping[str, int]) -> None:
        """Create every pool (per partition) with the pages per group the planner gives (CapacityPlan.num_blocks).

        One group: any positive count. Several groups: every count is the same number of capacity slots times
        the group's max_blocks_per_seq; counts that disagree are an error, never a guess.
        """
        if self._seqs:
            raise RuntimeError(f"cannot re-initialize while {len(self._seqs)} requests hold pages")
        counts = self._checked_counts(num_blocks)
        self._pools = [{s.name: BlockPool(s.name, counts[s.name]) for s in self.specs}
                       for _ in range(self.num_partitions)]
        self._new_pages = [{s.name: [] for s in self.specs} for _ in range(self.num_partitions)]

    def _checked_counts(self, num_blocks: Mapping[str, int]) -> dict[str, int]:
        names = [s.name for s in self.specs]
        if sorted(num_blocks) != sorted(names):
            raise ValueError(f"num_blocks must give the cache groups {names}; it gives {list(num_blocks)}")
        for name in names:
            count = num_blocks[name]
            if isinstance(count, bool) or not isinstance(count, int) or count <= 0:
                raise ValueError(f"num_blocks[{name!r}] must be a positive int, got {count!r}")
        first = self.specs[0]
        if len(self.specs) == 1:
            return {first.name: num_blocks[first.name]}
        mbps = first.max_blocks_per_seq
        if num_blocks[first.name] % mbps:
            raise ValueError(f"num_blocks[{first.name!r}] = {num_blocks[first.name]} must be a multiple of its "
                             f"max_blocks_per_seq {mbps} (one capacity slot); the planner gives slots x {mbps}")
        slots = num_blocks[first.name] // mbps
        for s in self.specs:
            if num_blocks[s.name] != slots * s.max_blocks_per_seq:
                raise ValueError(f"group {s.name!r}: expected {slots * s.max_blocks_per_seq} blocks ({slots} slots "
                                 f"x max_blocks_per_seq), given {num_blocks[s.name]}")
        return dict(num_blocks)

    # -- requests ----------------------------------------------------------------------------------
    def match_prefix(self, request_id: str, token_ids: Sequence[int], prompt_len: int | None = None) -> int:
        """Place a new request on a partition and share the longest cached prefix valid in every group.

        Returns the number of cached tokens h (a multiple of block_size, at most len - 1: the last prompt
        token is always recomputed). The request holds the hit pages (refcount + 1) until free(). prompt_len:
        the request's prompt length when token_ids holds output too (a preempted request); default all of them.
        """
        self._require_init()
        if request_id in self._seqs:
            raise ValueError(f"request {request_id!r} already holds pages; match_prefix is for new requests")
        seq = self._add_seq(request_id, len(token_ids) if prompt_len is None else prompt_len)
        seq.tokens = list(token_ids)
        self.prefix_stats.queries += 1
        self.prefix_stats.query_tokens += len(seq.tokens)
        if not self.enable_prefix_caching or len(seq.tokens) < 2:
            return 0
        self._extend_hashes(seq, (len(seq.tokens) - 1) // self.block_size)
        blocks = self._longest_hit(seq)
        if blocks:
            self._share_hit(seq, blocks)
        self.prefix_stats.hit_tokens += seq.num_cached
        return seq.num_cached

    def place(self, request_id: str, prompt_len: int = 0) -> int:
        """Place a new request (its prompt prompt_len tokens long) on the least loaded partition without a prefix
        lookup; returns the partition."""
        self._require_init()
        if request_id in self._seqs:
            raise ValueError(f"request {request_id!r} already holds pages; place is for new requests")
        return self._add_seq(request_id, prompt_len).partition

    def allocate(self, request_id: str, token_ids: Sequence[int], num_new_tokens: int,
                 num_lookahead: int = 0, prompt_len: int | None = None) -> dict[str, list[int]]:
        """Reserve, in every group at once, the pages for computing the next num_new_tokens tokens.

        token_ids is the request's whole sequence so far (prompt + output); the tokens computed next are
        token_ids[num_computed : num_computed + num_new_tokens], where num_computed comes from match_prefix
        and commit (so commit each step before allocating the next). Returns the pages newly assigned per
        group (also queued for take_new_pages). Raises KvCapacityError, with nothing allocated, when any
        group lacks pages; a request created by this call is then forgotten again. num_lookahead: pages for that
        many further positions too, whose tokens are not known yet (speculative decoding's drafts). prompt_len:
        as for match_prefix, read when this call creates the request.
        """
        self._require_init()
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        created = request_id not in self._seqs
        if created:
            seq = self._add_seq(request_id, len(token_ids) if prompt_len is None else prompt_len)
        else:
            seq = self._seqs[request_id]
        if len(token_ids) < len(seq.tokens):      # (never for a created request: it has no tokens yet)
            raise ValueError(f"request {request_id!r}: token_ids shrank from {len(seq.tokens)} to {len(token_ids)}")
        target = seq.num_computed + num_new_tokens
        reach = target + max(num_lookahead, 0)
        if not created and reach <= seq.tokens_covered and target <= len(token_ids):
            # Most decode steps: every group's current page still has room; nothing to assign.
            seq.tokens.extend(token_ids[len(seq.tokens):])
            seq.num_reserved = max(seq.num_reserved, reach)
            return {s.name: [] for s in self.specs}
        try:
            if target > len(token_ids):
                raise ValueError(f"request {request_id!r}: {seq.num_computed} computed + {num_new_tokens} new "
                                 f"tokens exceed the {len(token_ids)} token ids given")
            demand = self._demand(seq, reach)
            if any(len(new) > free for new, free in demand.values()):
                self._raise_capacity(seq, num_new_tokens, demand)
        except Exception:
            if created:
                self._remove_seq(seq)
            raise
        seq.tokens.extend(token_ids[len(seq.tokens):])
        queued = self._new_pages[seq.partition]
        added: dict[str, list[int]] = {}
        for name, table in seq.tables.items():
            new = demand[name][0]
            added[name] = table.assign(new) if new else []   # most groups' pages still have room
            queued[name].extend(added[name])
        seq.num_reserved = max(seq.num_reserved, reach)
        seq.tokens_covered = min(table.tokens_covered for table in seq.tables.values())
        return added

    def commit(self, request_id: str, num_computed_tokens: int, token_ids: Sequence[int] | None = None) -> None:
        """Record that the request's first num_computed_tokens tokens are written; cache newly completed blocks.
        token_ids: the request's tokens when some written ones were not yet known at allocate (accepted drafts)."""
        seq = self._get(request_id)
        if token_ids is not None:
            seq.tokens.extend(token_ids[len(seq.tokens):])
        if not seq.num_computed <= num_computed_tokens <= seq.num_reserved:
            raise ValueError(f"request {request_id!r}: num_computed_tokens {num_computed_tokens} must lie between "
                             f"the computed {seq.num_computed} and the allocated {seq.num_reserved} tokens")
        seq.num_computed = num_computed_tokens
        full_blocks = num_computed_tokens // self.block_size
        if self.enable_prefix_caching and full_blocks > seq.num_registered_blocks:
            self._extend_hashes(seq, full_blocks)
            for table in seq.tables.values():
                table.register_blocks(seq.hashes, seq.num_registered_blocks, full_blocks)
            seq.num_registered_blocks = full_blocks
        for table in seq.tables.values():
            table.release_stale(num_computed_tokens)

    def free(self, request_id: str) -> bool:
        """Release everything the request holds (cached pages become evictable). False if it held nothing."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return False
        for table in seq.tables.values():
            table.release_all()
        self._remove_seq(seq)
        return True

    # -- views for the scheduler and the runner ------------------------------------------------------
    def block_tables(self, request_id: str) -> dict[str, list[int]]:
        """SeqStep.block_tables: full groups one page per logical page; ring groups one per slot, -1 = none."""
        return {name: table.block_table() for name, table in self._get(request_id).tables.items()}

    def take_new_pages(self, partition: int | None = None) -> dict[str, list[int]]:
        """Pages (per group) assigned to a new logical page since the last call, for StepBatch.new_pages."""
        self._require_init()
        if partition is None:
            if self.num_partitions > 1:
                raise ValueError(f"take_new_pages needs a partition: page ids are per partition "
                                 f"(there are {self.num_partitions})")
            partition = 0
        queued = self._new_pages[self._check_partition(partition)]
        self._new_pages[partition] = {s.name: [] for s in self.specs}
        return {name: list(dict.fromkeys(pages)) for name, pages in queued.items()}

    def partition_of(self, request_id: str) -> int:
        return self._get(request_id).partition

    def num_free_blocks(self, group: str | None = None, partition: int | None = None) -> int:
        """Free plus evictable pages of a group (default: the first group), on one or all partitions."""
        return sum(pools[self._group_name(group)].num_free for pools in self._partitions(partition))

    def num_total_blocks(self, group: str | None = None, partition: int | None = None) -> int:
        return sum(pools[self._group_name(group)].num_pages for pools in self._partitions(partition))

    # -- internals ---------------------------------------------------------------------------------
    def _extend_hashes(self, seq: _Seq, num_blocks: int) -> None:
        keyed = None if self.length_keyed_block is None else (self.length_keyed_block, seq.prompt_len)
        extend_block_hashes(seq.hashes, seq.tokens, self.block_size, num_blocks, keyed)

    def _demand(self, seq: _Seq, target: int) -> dict[str, tuple[range, int]]:
        """Per group: logical pages to assign so that tokens [0, target) can be computed, and pages available
        (free in the pool plus those the request's own reused ring slots give back)."""
        pools = self._pools[seq.partition]
        demand = {}
        for name, table in seq.tables.items():
            try:
                new = table.new_logical_pages(seq.num_computed, target)
            except ValueError as err:
                raise ValueError(f"request {seq.request_id!r}: {err}") from None
            demand[name] = (new, pools[name].num_free + table.reusable_pages(new))
        return demand

    def _raise_capacity(self, seq: _Seq, num_new_tokens: int, demand: dict[str, tuple[range, int]]) -> None:
        need = {name: len(new) for name, (new, _) in demand.items()}
        free = {name: f for name, (_, f) in demand.items()}
        detail = "; ".join(f"{name}: need {need[name]}, free {free[name]}" for name in need)
        raise KvCapacityError(
            f"cannot allocate {num_new_tokens} tokens for request {seq.request_id!r} (computed {seq.num_computed}) "
            f"on partition {seq.partition}: {detail}", need, free)

    def _longest_hit(self, seq: _Seq) -> int:
        """Most whole blocks every group can serve from the cache.

        Each table answers the most blocks, at most those asked, it can serve; a ring's answer for fewer
        blocks needs other pages, so the count is lowered in turn until every table agrees on it.
        """
        tables = list(seq.tables.values())
        blocks, agreeing, turn = len(seq.hashes), 0, 0
        while blocks and agreeing < len(tables):
            fewer = tables[turn].longest_hit(seq.hashes, blocks)
            agreeing = agreeing + 1 if fewer == blocks else 1
            blocks, turn = fewer, (turn + 1) % len(tables)
        return blocks

    def _share_hit(self, seq: _Seq, blocks: int) -> None:
        for table in seq.tables.values():
            table.share_hit(seq.hashes, blocks)
        seq.num_computed = seq.num_reserved = seq.num_cached = seq.tokens_covered = blocks * self.block_size
        seq.num_registered_blocks = blocks

    def _least_loaded(self) -> int:
        first = self.specs[0].name
        return min(range(self.num_partitions),
                   key=lambda p: (self._num_seqs[p], self._pools[p][first].num_used, p))

    def _new_seq(self, request_id: str) -> _Seq:
        partition = self._least_loaded()
        pools = self._pools[partition]
        return _Seq(request_id, partition, {s.name: new_page_table(s, pools[s.name], self.block_size)
                                            for s in self.specs})

    def _add_seq(self, request_id: str, prompt_len: int) -> _Seq:
        seq = self._seqs[request_id] = self._new_seq(request_id)
        seq.prompt_len = prompt_len
        self._num_seqs[seq.partition] += 1
        return seq

    def _remove_seq(self, seq: _Seq) -> None:
        del self._seqs[seq.request_id]
        self._num_seqs[seq.partition] -= 1

    def _get(self, request_id: str) -> _Seq:
        seq = self._seqs.get(request_id)
        if seq is None:
            raise KeyError(f"request {request_id!r} holds no KV-cache pages (unknown or already freed)")
        return seq

    def _require_init(self) -> None:
        if not self._pools:
            raise RuntimeError("KvCacheManager.initialize() has not been called")

    def _check_partition(self, partition: int) -> int:
        if not 0 <= partition < self.num_partitions:
            raise ValueError(f"partition {partition} out of range [0, {self.num_partitions})")
        return partition

    def _partitions(self, partition: int | None) -> list[dict[str, BlockPool]]:
        self._require_init()
        return self._pools if partition is None else [self._pools[self._check_partition(partition)]]

    def _group_name(self, group: str | None) -> str:
        if group is None:
            return self.specs[0].name
        if group not in self._pools[0]:
            raise KeyError(f"unknown cache group {group!r}; groups: {[s.name for s in self.specs]}")
        return group
