"""KvCacheManager: sizing rules, atomic allocation, ring slots, block tables, partitions, prefix caching."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.config.compose import load_runtime_config
from appliance.core.kv_cache_spec import CacheGroupSpec
from appliance.core.planner import DeviceMemory, plan_capacity
from appliance.engine.kv_cache_manager import KvCacheManager, KvCapacityError
from appliance.engine.prefix_cache import extend_block_hashes
from tests.support.kv import InspectableKvCacheManager, blocks_per_group

DSV4_TINY = load_runtime_config([])
QWEN3_TINY = load_runtime_config(["+model=qwen3_tiny"])
REPO = Path(__file__).resolve().parents[2]


def spec(name, history, mbps, rows=4, tokens_per_row=1):
    return CacheGroupSpec(name=name, layer_ids=(0,), rows_per_block=rows, tokens_per_row=tokens_per_row,
                          row_dtype="float32", row_width=8, row_extra_bytes=0, history=history,
                          max_blocks_per_seq=mbps, ring_span_tokens=4 if history == "ring" else 0,
                          ring_aligned=history == "ring")


def dsv4_tiny(slots=2, **kw):
    m = InspectableKvCacheManager(DSV4_TINY.model.cache_groups, DSV4_TINY.block_size, **kw)
    m.initialize_slots(slots * DSV4_TINY.model.cache_groups[0].max_blocks_per_seq)
    return m


def qwen3_tiny(blocks=16, **kw):
    m = InspectableKvCacheManager(QWEN3_TINY.model.cache_groups, QWEN3_TINY.block_size, **kw)
    m.initialize_slots(blocks)
    return m


def group(rc, name):
    return rc.model.group(name)


# -- sizing ----------------------------------------------------------------------------------------
def test_first_group_count_must_be_a_whole_number_of_slots():
    m = KvCacheManager([spec("ring", "ring", 3), spec("full", "full", 5)], block_size=4)
    for bad in (7, 4):
        with pytest.raises(ValueError, match="multiple") as info:
            m.initialize({"ring": bad, "full": 10})
        assert str(bad) in str(info.value) and "'ring'" in str(info.value) and "3" in str(info.value)
    for bad in (0, -3):
        with pytest.raises(ValueError, match="positive int"):
            m.initialize({"ring": bad, "full": 10})
    m.initialize({"ring": 6, "full": 10})
    assert (m.num_total_blocks("ring"), m.num_total_blocks("full")) == (6, 10)


def test_group_count_that_disagrees_is_an_error_naming_group_expected_and_given():
    m = KvCacheManager([spec("ring", "ring", 3), spec("full", "full", 5)], block_size=4)
    with pytest.raises(ValueError) as info:
        m.initialize({"ring": 6, "full": 11})
    msg = str(info.value)
    assert "'full'" in msg and "expected 10" in msg and "given 11" in msg
    with pytest.raises(ValueError, match="'nope'"):
        m.initialize({"ring": 6, "nope": 10})
    with pytest.raises(ValueError, match="'full'"):
        m.initialize({"ring": 6})
    m.initialize({"ring": 6, "full": 10})
    assert m.num_total_blocks("full") == 10


def test_single_group_accepts_any_positive_count():
    m = KvCacheManager(QWEN3_TINY.model.cache_groups, QWEN3_TINY.block_size)
    m.initialize({"kv": 7})              # not a multiple of max_blocks_per_seq (32): fine for one pool
    assert m.num_total_blocks() == m.num_free_blocks() == 7
    with pytest.raises(ValueError, match="positive"):
        m.initialize({"kv": 0})


def test_dsv4_reference_three_slots_at_8192():
    rc = load_runtime_config(["+model=dsv4", "max_model_len=8192"])
    m = KvCacheManager(rc.model.cache_groups, rc.block_size)
    m.initialize(blocks_per_group(m.specs, 12))
    got = {s.name: m.num_total_blocks(s.name) for s in rc.model.cache_groups}
    assert got == {"ori": 12, "cmp_c128": 192, "cmp_c4": 192, "idx": 192, "hca_state": 144,
                   "csa_state": 195, "csa_inner_state": 195}


def test_initialize_with_the_plans_counts():
    specs = DSV4_TINY.model.cache_groups
    plan = plan_capacity(specs, [DeviceMemory("cpu", 1 << 30, 1 << 30, 0)], utilization=0.5, decode_batch=2,
                         max_model_len=DSV4_TINY.max_model_len, block_size=DSV4_TINY.block_size,
                         num_slots_override=3)
    m = InspectableKvCacheManager(specs, DSV4_TINY.block_size)
    m.initialize(plan.num_blocks)
    assert {s.name: m.num_total_blocks(s.name) for s in specs} == plan.num_blocks


def test_use_before_initialize_is_a_clear_error():
    m = InspectableKvCacheManager(QWEN3_TINY.model.cache_groups, QWEN3_TINY.block_size)
    with pytest.raises(RuntimeError, match="initialize"):
        m.allocate("a", [1, 2], 2)


# -- allocation, block tables, ring slots ---------------------------------------------------------
def test_full_groups_grow_append_only_and_ring_tables_have_one_entry_per_slot():
    m = dsv4_tiny(enable_prefix_caching=False)
    tokens = list(range(40))
    m.allocate("a", tokens, 24)
    tables = m.block_tables("a")
    for s in DSV4_TINY.model.cache_groups:
        table = tables[s.name]
        if s.is_ring:
            assert len(table) == s.max_blocks_per_seq
            held = [p for p in table if p >= 0]
            assert len(held) == min(math.ceil(24 / s.tokens_per_page), s.max_blocks_per_seq)
        else:
            assert len(table) == math.ceil(24 / s.tokens_per_page) and -1 not in table
    m.commit("a", 24)
    m.allocate("a", tokens, 16)
    grown = m.block_tables("a")
    for s in DSV4_TINY.model.cache_groups:
        if not s.is_ring:
            assert grown[s.name][:len(tables[s.name])] == tables[s.name]       # earlier pages never move
            assert len(grown[s.name]) == math.ceil(40 / s.tokens_per_page)


def test_ring_slot_mapping_and_release_behind_the_tail():
    m = dsv4_tiny(enable_prefix_caching=False)
    csa = group(DSV4_TINY, "csa_state")
    mbps, tpp = csa.max_blocks_per_seq, csa.tokens_per_page
    total = m.num_total_blocks("csa_state")
    tokens = list(range(200))
    n = mbps * tpp                                   # a tile this long in flight fills every slot
    m.allocate("a", tokens, n)
    tile = m.block_tables("a")["csa_state"]
    assert -1 not in tile and len(set(tile)) == mbps
    m.commit("a", n)
    # After the step only the live tail stays held, in the same slots and pages.
    held = m.block_tables("a")["csa_state"]
    live = csa.live_logical_pages(n)
    assert {slot for slot in range(mbps) if held[slot] >= 0} == {lg % mbps for lg in live}
    assert all(held[lg % mbps] == tile[lg % mbps] for lg in live)
    assert m.num_free_blocks("csa_state") == total - len(live)
    m.take_new_pages()
    # Decode: logical page L lives in slot L % mbps on one page for as long as it is live; new pages are
    # announced once; pages behind the tail go back to the pool.
    done, page_of = n, {lg: held[lg % mbps] for lg in live}
    for _ in range(3 * tpp * mbps):
        m.allocate("a", tokens, 1)
        table = m.block_tables("a")["csa_state"]
        new_pages = m.take_new_pages()["csa_state"]
        writing = done // tpp
        if done % tpp == 0:                          # this token starts a new logical page
            assert new_pages == [table[writing % mbps]] and table[writing % mbps] not in page_of.values()
        else:
            assert not new_pages
        for lg in list(csa.live_logical_pages(done)) + [writing]:
            assert table[lg % mbps] == page_of.setdefault(lg, table[lg % mbps])
        done += 1
        m.commit("a", done)
        live = csa.live_logical_pages(done)
        held = m.block_tables("a")["csa_state"]
        assert {slot for slot in range(mbps) if held[slot] >= 0} == {lg % mbps for lg in live}
        assert m.num_free_blocks("csa_state") == total - len(live)
        page_of = {lg: p for lg, p in page_of.items() if lg in live}


def test_step_larger_than_the_ring_is_rejected():
    m = dsv4_tiny()
    with pytest.raises(ValueError, match="tokens_in_flight"):
        m.allocate("a", list(range(100)), 2 * DSV4_TINY.model.layout.tokens_in_flight)
    assert not m.has_request("a")


def test_allocation_past_max_model_len_or_token_ids_is_rejected():
    m = qwen3_tiny(blocks=64)
    limit = QWEN3_TINY.model.cache_groups[0].max_blocks_per_seq * QWEN3_TINY.block_size
    with pytest.raises(ValueError, match="max_model_len"):
        m.allocate("a", list(range(limit + 1)), limit + 1)
    with pytest.raises(ValueError, match="exceed the 5 token ids"):
        m.allocate("a", [1, 2, 3, 4, 5], 6)


def test_capacity_error_lists_need_and_free_per_group_and_allocates_nothing():
    m = dsv4_tiny(slots=1)
    tokens = list(range(100))
    m.allocate("a", tokens, 32)
    m.commit("a", 32)
    m.allocate("a", tokens, 32)                      # ori (4 pages): page 0 went back, pages 1-3 held by "a"
    free = {s.name: m.num_free_blocks(s.name) for s in DSV4_TINY.model.cache_groups}
    tables = m.block_tables("a")
    assert not m.can_allocate("b", 32)
    with pytest.raises(KvCapacityError) as info:
        m.allocate("b", tokens, 32)
    msg = str(info.value)
    for s in DSV4_TINY.model.cache_groups:
        need = math.ceil(32 / s.tokens_per_page)
        assert f"{s.name}: need {need}, free {free[s.name]}" in msg
    assert info.value.need["ori"] == 2 and info.value.free["ori"] == 1
    assert {s.name: m.num_free_blocks(s.name) for s in DSV4_TINY.model.cache_groups} == free
    assert m.block_tables("a") == tables and not m.has_request("b")
    m.free("a")
    assert m.can_allocate("b", 32)
    m.allocate("b", tokens, 32)


def test_free_returns_every_page_and_is_idempotent():
    m = dsv4_tiny(enable_prefix_caching=False)
    tokens = list(range(90))
    for rid in ("a", "b"):
        for done in (0, 32, 64):
            m.allocate(rid, tokens, min(32, 90 - done))
            m.commit(rid, min(done + 32, 90))
    assert m.free("a") and m.free("b") and not m.free("a")
    for s in DSV4_TINY.model.cache_groups:
        assert m.num_free_blocks(s.name) == m.num_total_blocks(s.name)
    with pytest.raises(KeyError, match="'a'"):
        m.block_tables("a")


def test_take_new_pages_reports_each_assignment_once():
    m = qwen3_tiny()
    first = m.allocate("a", list(range(20)), 20)
    assert m.take_new_pages() == first == {"kv": m.block_tables("a")["kv"]}
    assert m.take_new_pages() == {"kv": []}


# -- partitions ------------------------------------------------------------------------------------
def test_partitions_place_new_requests_on_the_least_loaded_one():
    m = InspectableKvCacheManager(QWEN3_TINY.model.cache_groups, QWEN3_TINY.block_size, num_partitions=2)
    m.initialize_slots(8)
    assert m.num_total_blocks() == 16 and m.num_total_blocks(partition=1) == 8
    m.allocate("a", list(range(40)), 40)
    m.allocate("b", list(range(8)), 8)
    assert (m.partition_of("a"), m.partition_of("b")) == (0, 1)
    m.allocate("c", list(range(8)), 8)               # equal request counts: partition 1 has more free pages
    assert m.partition_of("c") == 1
    m.free("b")
    m.free("c")
    m.allocate("d", list(range(8)), 8)
    assert m.partition_of("d") == 1
    assert m.num_free_blocks(partition=0) == 5 and m.num_free_blocks(partition=1) == 7
    with pytest.raises(ValueError, match="partition"):
        m.take_new_pages()
    assert m.take_new_pages(0) == {"kv": m.block_tables("a")["kv"]}


# -- prefix caching --------------------------------------------------------------------------------
def run_prompt(m, rid, tokens, chunk=32):
    """Schedule a whole prompt the way the engine does: match, then allocate/commit chunk by chunk."""
    done = m.match_prefix(rid, tokens)
    while done < len(tokens):
        n = min(chunk, len(tokens) - done)
        m.allocate(rid, tokens, n)
        done += n
        m.commit(rid, done)
    return m.num_cached_tokens(rid)


def test_prefix_hit_shares_whole_blocks_and_recomputes_the_last_token():
    m = qwen3_tiny()
    prompt = list(range(100, 140))                   # 40 tokens: blocks 0 and 1 complete
    assert run_prompt(m, "a", prompt) == 0
    assert m.match_prefix("b", prompt) == 32
    assert m.block_tables("b")["kv"] == m.block_tables("a")["kv"][:2]
    assert all(m.page_refcount("kv", p) == 2 for p in m.block_tables("b")["kv"])
    assert m.match_prefix("c", prompt[:32]) == 16    # floor((32 - 1) / 16) blocks at most
    assert m.match_prefix("d", prompt[:16] + [7] * 24) == 16
    assert m.match_prefix("e", [7] + prompt[1:]) == 0   # chained: block 1 alone never hits
    assert (m.prefix_stats.queries, m.prefix_stats.hit_tokens) == (5, 64)
    assert m.prefix_stats.query_tokens == 40 * 4 + 32


@pytest.mark.parametrize("position", [0, 7, 15], ids=["first", "middle", "last"])
def test_a_block_differing_in_any_one_token_never_hits(position):
    """Fixed cases for what the property tests find only by chance: a prompt that differs from a cached one
    in one token of block 1 (its first, a middle or its last) shares block 0 and nothing after it."""
    m = qwen3_tiny()
    prompt = list(range(100, 140))                   # 40 tokens: blocks 0 and 1 complete (16 tokens each)
    run_prompt(m, "a", prompt)
    other = list(prompt)
    other[16 + position] = 7
    assert m.match_prefix("b", other) == 16
    assert m.block_tables("b")["kv"] == m.block_tables("a")["kv"][:1]


@pytest.mark.parametrize("position", range(16))
def test_every_token_of_a_block_is_in_its_hash(position):
    tokens = list(range(32))
    changed = list(tokens)
    changed[16 + position] = 999
    first, second = extend_block_hashes([], tokens, 16, 2), extend_block_hashes([], changed, 16, 2)
    assert first[0] == second[0] and first[1] != second[1]


def test_length_keyed_blocks_hit_only_prompts_of_the_same_length():
    """length_keyed_from=40 (block 2 holds it): blocks 0-1 are shared by any prompt that starts alike, block 2 on
    only by a prompt of the same length; a preempted request, recomputing prompt + output, finds its own."""
    m = qwen3_tiny(length_keyed_from=40)
    prompt = list(range(100, 170))                   # 70 tokens: blocks 0-3 complete
    run_prompt(m, "a", prompt)
    assert m.match_prefix("longer", prompt + [5]) == 32
    assert m.match_prefix("again", prompt) == 64
    output = list(range(900, 920))
    m.allocate("a", prompt + output, 20)             # a's 20 output tokens computed, then a is preempted
    m.commit("a", 90)
    m.free("a")
    assert m.match_prefix("a-again", prompt + output, prompt_len=70) == 80
    assert m.match_prefix("as-a-prompt", prompt + output) == 32     # the same tokens, all of them a prompt
    plain = qwen3_tiny()
    run_prompt(plain, "a", prompt)
    assert plain.match_prefix("longer", prompt + [5]) == 64


def test_the_first_length_keyed_block_is_the_one_holding_the_position():
    for keyed_from, shared in ((15, 0), (16, 16), (31, 16), (32, 32)):
        m = qwen3_tiny(length_keyed_from=keyed_from)
        run_prompt(m, "a", list(range(100, 150)))
        assert m.match_prefix("b", list(range(100, 160))) == shared, keyed_from


def test_shared_pages_are_never_written_new_tokens_get_fresh_pages():
    m = qwen3_tiny()
    prompt = list(range(50))
    run_prompt(m, "a", prompt)
    a_pages = m.block_tables("a")["kv"]
    m.match_prefix("b", prompt + [1, 2])
    new = m.allocate("b", prompt + [1, 2], 52 - 48)
    assert m.block_tables("b")["kv"][:3] == a_pages[:3] and not set(new["kv"]) & set(a_pages)


def test_freed_cached_pages_stay_hittable_until_evicted_lru():
    m = qwen3_tiny(blocks=6)
    p1, p2 = list(range(33)), list(range(500, 533))
    run_prompt(m, "a", p1)                           # 3 pages, blocks 0-1 cached
    run_prompt(m, "b", p2)
    pages_a = m.block_tables("a")["kv"]
    m.free("a")
    m.free("b")
    assert m.num_free_blocks() == 6
    assert m.match_prefix("c", p1) == 32 and m.block_tables("c")["kv"] == pages_a[:2]
    m.free("c")                                      # p1's blocks are now the most recently released
    m.allocate("d", list(range(900, 964)), 64)       # needs 4: 2 free, then evict the LRU: p2's blocks
    assert m.match_prefix("e", p2) == 0
    assert m.match_prefix("f", p1) == 32


def test_commit_registers_only_computed_whole_blocks():
    m = qwen3_tiny()
    prompt = list(range(60))
    m.match_prefix("a", prompt)
    m.allocate("a", prompt, 40)
    m.commit("a", 20)                                # block 1 only half computed
    assert m.match_prefix("b", prompt) == 16
    with pytest.raises(ValueError, match="between"):
        m.commit("a", 41)
    with pytest.raises(ValueError, match="between"):
        m.commit("a", 10)


def test_grouped_hit_must_be_valid_in_every_group():
    """dsv4_tiny, one slot: ring pages of early blocks get evicted, so a short prefix misses although
    every full group still has it; a longer prefix whose ring tail is still cached hits."""
    m = dsv4_tiny(slots=1)
    prompt = list(range(1000, 1064))
    run_prompt(m, "a", prompt)
    assert all(m.is_cached_page(s.name, m.block_tables("a")[s.name][0])
               for s in DSV4_TINY.model.cache_groups if not s.is_ring)
    assert m.match_prefix("b", prompt[:17] + [1] * 20) == 0
    m.free("b")
    assert m.match_prefix("c", prompt[:49] + [1] * 20) == 48
    tables_a, tables_c = m.block_tables("a"), m.block_tables("c")
    for s in DSV4_TINY.model.cache_groups:
        if s.is_ring:
            live = s.live_logical_pages(48)
            held = {slot: p for slot, p in enumerate(tables_c[s.name]) if p >= 0}
            assert set(held) == {lg % s.max_blocks_per_seq for lg in live}
            assert all(m.is_cached_page(s.name, p) for p in held.values())   # "a" gave them back to the cache
        else:
            assert tables_c[s.name] == tables_a[s.name][:48 // s.tokens_per_page]
    m.free("c")
    assert m.prefix_stats.hit_tokens == 48


def test_ring_slot_moving_off_a_shared_page_takes_a_fresh_one():
    m = dsv4_tiny(slots=3)
    prompt = list(range(64)) + [5]
    run_prompt(m, "a", prompt)
    a_tables = m.block_tables("a")
    assert m.match_prefix("b", prompt) == 64
    hca = group(DSV4_TINY, "hca_state")
    shared = m.block_tables("b")["hca_state"]
    assert all(m.page_refcount("hca_state", p) == 2 for p in shared if p >= 0)
    # b's hca ring holds logical 12..15 in slots 0..3; writing logical 24..27 reuses those slots.
    m.allocate("b", prompt, 1)
    m.commit("b", 65)
    extended = prompt + list(range(47))
    for done in range(65, 112, 16):
        n = min(16, 112 - done)
        m.allocate("b", extended, n)
        m.commit("b", done + n)
    b_hca = m.block_tables("b")["hca_state"]
    assert m.block_tables("a") == a_tables           # the other holder's pages are untouched
    for slot in range(4):
        assert b_hca[slot] != shared[slot] and m.page_refcount("hca_state", shared[slot]) == 1
    assert hca.max_blocks_per_seq == 12


def test_prefix_caching_disabled_never_hits():
    m = qwen3_tiny(enable_prefix_caching=False)
    prompt = list(range(40))
    run_prompt(m, "a", prompt)
    assert m.match_prefix("b", prompt) == 0
    assert not any(m.is_cached_page("kv", p) for p in m.block_tables("a")["kv"])


def test_block_hashes_are_chained_and_stable_across_processes():
    tokens = list(range(64))
    hashes = extend_block_hashes([], tokens, 16, 4)
    assert len(set(hashes)) == 4
    assert extend_block_hashes([], [9] + tokens[1:], 16, 4)[3] != hashes[3]     # depends on the whole prefix
    assert extend_block_hashes(hashes[:2], tokens, 16, 4) == hashes
    code = ("from appliance.engine.prefix_cache import extend_block_hashes as e;"
            "print(e([], list(range(64)), 16, 4)[3].hex())")
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                             env=dict(os.environ, PYTHONHASHSEED=seed), check=True).stdout.strip()
        assert out == hashes[3].hex()


def test_manager_does_not_import_torch():
    code = "import sys, appliance.engine.kv_cache_manager; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
