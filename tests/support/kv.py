"""KV-cache views only tests need: a KvCacheManager that answers questions about its requests and pages, the
page counts the planner gives per group, and an engine's free and total pages per group."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from appliance.core.kv_cache_spec import CacheGroupSpec
from appliance.engine.kv_cache_manager import KvCacheManager

if TYPE_CHECKING:
    from appliance.engine.engine import Engine  # (torch: not loaded for the KV tests)


def blocks_per_group(specs: Sequence[CacheGroupSpec], first_group_blocks: int) -> dict[str, int]:
    """KvCacheManager.initialize's counts for as many capacity slots as `first_group_blocks` pages of the first
    group hold (as the planner gives them: slots x each group's max_blocks_per_seq); one group: the count itself."""
    if len(specs) == 1:
        return {specs[0].name: first_group_blocks}
    slots = first_group_blocks // specs[0].max_blocks_per_seq
    return {s.name: slots * s.max_blocks_per_seq for s in specs}


class InspectableKvCacheManager(KvCacheManager):
    """A KvCacheManager whose requests and pages a test can look at."""

    def initialize_slots(self, first_group_blocks: int) -> None:
        self.initialize(blocks_per_group(self.specs, first_group_blocks))

    def has_request(self, request_id: str) -> bool:
        return request_id in self._seqs

    def can_allocate(self, request_id: str, num_new_tokens: int) -> bool:
        """Whether allocate() for the next num_new_tokens would succeed now (an unknown request starts at 0)."""
        self._require_init()
        seq = self._seqs.get(request_id) or self._new_seq(request_id)
        demand = self._demand(seq, seq.num_computed + num_new_tokens)
        return all(len(new) <= free for new, free in demand.values())

    def num_computed_tokens(self, request_id: str) -> int:
        return self._get(request_id).num_computed

    def num_cached_tokens(self, request_id: str) -> int:
        """Prompt tokens served by the prefix cache."""
        return self._get(request_id).num_cached

    def page_refcount(self, group: str, page: int, partition: int = 0) -> int:
        return self._partitions(partition)[0][self._group_name(group)].refcount(page)

    def is_cached_page(self, group: str, page: int, partition: int = 0) -> bool:
        return self._partitions(partition)[0][self._group_name(group)].is_cached(page)


def free_blocks(engine: Engine) -> dict[str, int]:
    """Free (or evictable) pages per cache group of a started engine."""
    kv = engine.kv_cache_manager
    assert kv is not None, "the engine has not started"
    return {s.name: kv.num_free_blocks(s.name) for s in engine.rc.model.cache_groups}


def total_blocks(engine: Engine) -> dict[str, int]:
    """Pages per cache group of a started engine."""
    kv = engine.kv_cache_manager
    assert kv is not None, "the engine has not started"
    return {s.name: kv.num_total_blocks(s.name) for s in engine.rc.model.cache_groups}
