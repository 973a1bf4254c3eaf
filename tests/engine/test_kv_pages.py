"""KvCacheManager at the edges of its contract: every argument check with its whole message, the counts that
place requests on partitions, which pages a prefix hit shares when the cache groups disagree, and the
boundaries of allocate and commit. Written against the mutants docs/TESTING.md lists (issue 18 item 7); each
test states behaviour the scheduler, the runner or an operator reading an error relies on."""

import pytest

from appliance.config.compose import load_runtime_config
from appliance.core.kv_cache_spec import CacheGroupSpec
from appliance.core.planner import DeviceMemory, plan_capacity
from appliance.engine.kv_cache_manager import KvCacheManager, KvCapacityError
from tests.engine.test_kv_cache_manager import run_prompt
from tests.support.kv import InspectableKvCacheManager

QWEN3_TINY = load_runtime_config(["+model=qwen3_tiny"])
DSV4_TINY = load_runtime_config(["max_model_len=512"])


def spec(name, history="full", mbps=8, rows=4):
    """One token per row: a page holds `rows` tokens. Rings keep a 4-token span, aligned to pages."""
    return CacheGroupSpec(name=name, layer_ids=(0,), rows_per_block=rows, tokens_per_row=1, row_dtype="float32",
                          row_width=8, row_extra_bytes=0, history=history, max_blocks_per_seq=mbps,
                          ring_span_tokens=4 if history == "ring" else 0, ring_aligned=history == "ring")


def qwen3(blocks=16, **kw):
    m = InspectableKvCacheManager(QWEN3_TINY.model.cache_groups, QWEN3_TINY.block_size, **kw)
    m.initialize_slots(blocks)
    return m


def message(raises) -> str:
    return raises.value.args[0]


# -- construction and sizing -------------------------------------------------------------------------
def test_construction_refuses_bad_arguments_naming_them():
    cases = [
        (([], 4), {}, "KvCacheManager needs at least one cache group spec"),
        (([spec("a"), spec("a")], 4), {}, "cache group names must be unique, got ['a', 'a']"),
        (([spec("a")], 0), {}, "block_size must be positive, got 0"),
        (([spec("a")], -4), {}, "block_size must be positive, got -4"),
        (([spec("a", rows=4)], 6), {},
         "cache group 'a': tokens_per_page 4 must divide block_size 6 (prefix-cache keys are pages within a block)"),
        (([spec("a", rows=0)], 4), {},
         "cache group 'a': tokens_per_page 0 must divide block_size 4 (prefix-cache keys are pages within a block)"),
        (([spec("a")], 4), {"num_partitions": 0}, "num_partitions must be at least 1, got 0"),
    ]
    for args, kw, expected in cases:
        with pytest.raises(ValueError) as info:
            InspectableKvCacheManager(*args, **kw)
        assert message(info) == expected


def test_one_token_blocks_and_one_token_pages_are_allowed():
    m = KvCacheManager([spec("a", rows=1), spec("b", "ring", mbps=6, rows=1)], block_size=1)
    m.initialize({"a": 8, "b": 6})
    assert (m.num_total_blocks("a"), m.num_total_blocks("b")) == (8, 6)
    m = KvCacheManager([spec("a", rows=1)], block_size=4)          # a block of 4 one-token pages
    m.initialize({"a": 1})                                         # one page is a valid pool
    assert m.num_total_blocks("a") == 1


def test_initialize_refuses_counts_that_are_not_positive_ints_with_the_value():
    m = KvCacheManager(QWEN3_TINY.model.cache_groups, QWEN3_TINY.block_size)
    for bad in (True, 7.0, "8", 0, -1):
        with pytest.raises(ValueError) as info:
            m.initialize({"kv": bad})
        assert message(info) == f"num_blocks['kv'] must be a positive int, got {bad!r}"


def test_initialize_names_every_group_it_needs_and_what_it_was_given():
    m = KvCacheManager([spec("ring", "ring", mbps=3), spec("full", mbps=5)], block_size=4)
    for given in ({"ring": 6}, {"ring": 6, "full": 10, "kv": 4}, {}):
        with pytest.raises(ValueError) as info:
            m.initialize(given)
        assert message(info) == f"num_blocks must give the cache groups ['ring', 'full']; it gives {list(given)}"


def test_several_groups_count_in_slots_of_the_first_groups_max_blocks_per_seq():
    m = KvCacheManager([spec("ring", "ring", mbps=3), spec("full", mbps=5)], block_size=4)
    with pytest.raises(ValueError) as info:
        m.initialize({"ring": 6, "full": 11})
    assert message(info) == "group 'full': expected 10 blocks (2 slots x max_blocks_per_seq), given 11"
    with pytest.raises(ValueError) as info:
        m.initialize({"ring": 7, "full": 10})
    assert message(info) == ("num_blocks['ring'] = 7 must be a multiple of its max_blocks_per_seq 3 (one capacity "
                             "slot); the planner gives slots x 3")
    one = KvCacheManager([spec("ring", "ring", mbps=1), spec("full", mbps=5)], block_size=4)
    one.initialize({"ring": 1, "full": 5})                         # one slot of a 1-page ring
    assert (one.num_total_blocks("ring"), one.num_total_blocks("full")) == (1, 5)


def test_reinitializing_while_requests_hold_pages_is_refused_with_how_many():
    m = qwen3()
    m.allocate("a", [1, 2, 3], 3)
    with pytest.raises(RuntimeError) as info:
        m.initialize_slots(32)
    assert message(info) == "cannot re-initialize while 1 requests hold pages"
    m.free("a")
    m.initialize_slots(32)
    assert m.num_total_blocks() == 32


def test_a_plan_for_another_model_or_max_model_len_is_refused_not_reinterpreted():
    def plan_for(rc):
        return plan_capacity(rc.model.cache_groups, [DeviceMemory("cpu", 1 << 30, 1 << 30, 0)], utilization=0.5,
                             decode_batch=2, max_model_len=rc.max_model_len, block_size=rc.block_size,
                             num_slots_override=2)
    m = KvCacheManager(DSV4_TINY.model.cache_groups, DSV4_TINY.block_size)
    with pytest.raises(ValueError) as info:
        m.initialize(plan_for(QWEN3_TINY).num_blocks)
    assert message(info).startswith("num_blocks must give the cache groups ['ori', ") and \
        message(info).endswith("; it gives ['kv']")
    short = load_runtime_config(["max_model_len=128"])             # same groups, full histories 4x shorter
    m = KvCacheManager(short.model.cache_groups, short.block_size)
    with pytest.raises(ValueError) as info:                        # slots from 'ori' agree; 'cmp_c16' does not
        m.initialize(plan_for(DSV4_TINY).num_blocks)
    assert message(info) == "group 'cmp_c16': expected 16 blocks (2 slots x max_blocks_per_seq), given 64"


# -- views -------------------------------------------------------------------------------------------
def test_views_refuse_use_before_initialize_an_unknown_group_and_a_partition_out_of_range():
    m = InspectableKvCacheManager(QWEN3_TINY.model.cache_groups, QWEN3_TINY.block_size, num_partitions=2)
    with pytest.raises(RuntimeError) as info:
        m.num_free_blocks()
    assert message(info) == "KvCacheManager.initialize() has not been called"
    m.initialize_slots(4)
    with pytest.raises(KeyError) as info:
        m.num_free_blocks("nope")
    assert message(info) == "unknown cache group 'nope'; groups: ['kv']"
    for bad in (2, -1):
        with pytest.raises(ValueError) as info:
            m.num_free_blocks(partition=bad)
        assert message(info) == f"partition {bad} out of range [0, 2)"
    assert m.num_free_blocks(partition=1) == 4


# -- placement ---------------------------------------------------------------------------------------
def test_new_requests_go_to_the_partition_running_fewest_and_freed_ones_stop_counting():
    """place() (the scheduler's call when prefix caching is off): fewest requests, then fewest used pages, then
    the lower partition. No request here holds pages, so only the counts decide."""
    m = InspectableKvCacheManager(QWEN3_TINY.model.cache_groups, QWEN3_TINY.block_size, num_partitions=2)
    m.initialize_slots(8)
    count = [0, 0]

    def place(rid):
        expected = min((0, 1), key=lambda p: (count[p], p))
        assert m.place(rid) == expected and m.partition_of(rid) == expected and m.has_request(rid)
        count[expected] += 1

    def free(rid):
        count[m.partition_of(rid)] -= 1
        assert m.free(rid)

    for rid in "abcdef":
        place(rid)                                                 # a c e on 0, b d f on 1
    free("b")
    free("d")
    free("a")                                                      # counts 2 and 1: the next goes to 1
    place("g")
    place("h")                                                     # 2 and 2: the lower partition
    free("c")
    free("e")
    free("h")                                                      # 0 and 2
    place("i")
    place("j")
    assert [m.partition_of(r) for r in "fgij"] == [1, 1, 0, 0]
    free("j")                                                      # 1 and 2
    for n in range(3):                                             # requests that come and go on partition 0
        place(f"k{n}")
        free(f"k{n}")
    place("l")
    assert m.partition_of("l") == 0
    with pytest.raises(ValueError) as info:
        m.place("i")
    assert message(info) == "request 'i' already holds pages; place is for new requests"


# -- prefix hits ---------------------------------------------------------------------------------------
def test_match_prefix_is_for_new_requests_only():
    m = qwen3()
    m.match_prefix("a", list(range(40)))
    with pytest.raises(ValueError) as info:
        m.match_prefix("a", list(range(40)))
    assert message(info) == "request 'a' already holds pages; match_prefix is for new requests"


def test_with_one_token_blocks_a_two_token_prompt_hits_its_first_token():
    m = InspectableKvCacheManager([spec("kv", rows=1)], block_size=1)
    m.initialize_slots(16)
    run_prompt(m, "a", [5, 6, 7], chunk=3)
    assert m.match_prefix("b", [5, 6]) == 1                        # the last token is always recomputed
    assert m.block_tables("b")["kv"] == m.block_tables("a")["kv"][:1]
    assert m.num_computed_tokens("b") == 1
    assert m.match_prefix("c", [5]) == 0


@pytest.mark.parametrize("ring_first", [False, True], ids=["full-then-ring", "ring-then-full"])
def test_a_hit_is_the_longest_prefix_every_group_serves_whatever_their_order(ring_first):
    """The full group still caches blocks 0-1 of the prompt (its tail was evicted first), the ring only the pages
    a 3- or 4-block hit needs (its oldest pages were evicted first). A 2-block hit would need the ring's page of
    block 1, a 4-block hit the full group's blocks 2-3: no prefix is served by both, so the request misses and
    computes its whole prompt, sharing nothing."""
    specs = [spec("full", mbps=8), spec("ring", "ring", mbps=8)]
    m = InspectableKvCacheManager(specs[::-1] if ring_first else specs, block_size=4)
    m.initialize_slots(8)                                                # one slot: 8 pages in each group
    prompt = list(range(100, 117))                                 # 4 whole blocks + 1 token
    run_prompt(m, "x", prompt, chunk=4)
    full_pages = m.block_tables("x")["full"]                       # logical page = block (4 tokens a page)
    m.free("x")
    run_prompt(m, "z", list(range(500, 524)), chunk=4)             # 6 pages: evicts 2 cached pages per group
    z_pages = m.block_tables("z")["full"]
    assert set(full_pages[2:4]) <= set(z_pages) and not set(full_pages[:2]) & set(z_pages)   # blocks 2-3 evicted
    assert all(m.is_cached_page("full", p) for p in full_pages[:2])
    assert m.match_prefix("y", prompt) == 0
    assert m.num_computed_tokens("y") == 0
    m.free("z")
    new = m.allocate("y", prompt, len(prompt))
    assert all(m.page_refcount(name, p) == 1 for name, pages in new.items() for p in pages)
    m.free("y")
    assert all(m.num_free_blocks(s.name) == 8 for s in specs)


# -- allocate and commit ----------------------------------------------------------------------------
def test_allocate_takes_zero_new_tokens_and_refuses_negative_ones():
    m = qwen3()
    assert m.allocate("a", [], 0) == {"kv": []} and m.has_request("a")
    m.allocate("a", list(range(20)), 20)
    m.commit("a", 20)
    free = m.num_free_blocks()
    assert m.allocate("a", list(range(20)), 0) == {"kv": []} and m.num_free_blocks() == free
    with pytest.raises(ValueError) as info:
        m.allocate("a", list(range(20)), -1)
    assert message(info) == "num_new_tokens must be >= 0, got -1"


def test_token_ids_that_shrink_are_refused_also_when_the_pages_have_room():
    m = qwen3()
    tokens = list(range(20))
    m.allocate("a", tokens, 20)
    m.commit("a", 20)
    m.allocate("a", tokens + [7], 1)                               # decode: page 1 still has room
    m.commit("a", 21)
    for n in (0, 12):                                              # page 1 has room / needs page 2
        with pytest.raises(ValueError) as info:
            m.allocate("a", tokens[:19], n)
        assert message(info) == "request 'a': token_ids shrank from 21 to 19"
    assert m.allocate("a", tokens + [7, 8], 1) == {"kv": []}          # the request is unchanged


def test_a_capacity_error_says_what_was_asked_where_and_every_groups_shortfall():
    m = InspectableKvCacheManager(DSV4_TINY.model.cache_groups, DSV4_TINY.block_size)
    m.initialize_slots(DSV4_TINY.model.cache_groups[0].max_blocks_per_seq)
    tokens = list(range(100))
    m.allocate("a", tokens, 32)
    m.commit("a", 32)
    m.allocate("a", tokens, 32)
    with pytest.raises(KvCapacityError) as info:
        m.allocate("b", tokens, 32)
    detail = "; ".join(f"{name}: need {info.value.need[name]}, free {info.value.free[name]}"
                       for name in (s.name for s in DSV4_TINY.model.cache_groups))
    assert message(info) == f"cannot allocate 32 tokens for request 'b' (computed 0) on partition 0: {detail}"


def test_can_allocate_names_an_unknown_request_it_cannot_fit_and_forgets_it():
    m = qwen3(blocks=64)
    limit = QWEN3_TINY.model.cache_groups[0].max_blocks_per_seq * QWEN3_TINY.block_size
    with pytest.raises(ValueError) as info:
        m.can_allocate("b", limit + 1)
    assert message(info).startswith("request 'b': ") and "max_model_len" in message(info)
    assert not m.has_request("b") and m.can_allocate("b", limit)


def test_commit_may_repeat_the_computed_count_but_not_pass_the_allocated_one():
    m = qwen3()
    prompt = list(range(40))
    run_prompt(m, "a", prompt, chunk=40)
    assert m.match_prefix("b", prompt) == 32
    m.commit("b", 32)                                              # nothing new computed: allowed
    assert m.num_computed_tokens("b") == 32
    m.allocate("b", prompt, 8)
    m.commit("b", 36)
    m.commit("b", 36)
    assert m.num_computed_tokens("b") == 36
    m.match_prefix("c", [1, 2, 3])
    with pytest.raises(ValueError) as info:                        # nothing allocated yet: nothing to commit
        m.commit("c", 1)
    assert message(info) == ("request 'c': num_computed_tokens 1 must lie between the computed 0 and the "
                             "allocated 0 tokens")

