"""Property tests: random request streams (new prompts with shared prefixes, prefill chunks, decode, free)
against the KvCacheManager, with a single-group Qwen3-like spec set and the dsv4_tiny spec set.

Besides pool accounting, a shadow records what a runner would have written into every page, so the tests
check that a prefix hit hands out pages holding exactly the hit tokens, that no step writes into a page
another request holds, and that pages a step reads were not overwritten.

Which pages a step reads comes from first principles (`needed_tokens`), from the layout alone and never
from the spec's own ring settings or CacheGroupSpec.live_logical_pages: a window of W tokens at position t
reads tokens t-W+1 .. t, a compressor of ratio r reads the tokens of its unfinished run, and a full-history
group reads every token so far."""

import math
import random

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from appliance.config.compose import load_runtime_config
from appliance.engine.kv_cache_manager import KvCapacityError
from tests.support.kv import InspectableKvCacheManager

_QWEN3 = load_runtime_config(["+model=qwen3_tiny", "max_model_len=512"])
_DSV4 = load_runtime_config([])
SPEC_SETS = {   # name: (specs, block size, most tokens a step may compute)
    "qwen3": (_QWEN3.model.cache_groups, _QWEN3.block_size, 48),
    "dsv4": (_DSV4.model.cache_groups, _DSV4.block_size, _DSV4.model.layout.tokens_in_flight),
}
MAX_LEN = 512
LAYOUTS = {"qwen3": _QWEN3.model.layout, "dsv4": _DSV4.model.layout}
_rng = random.Random(0)
BASES = [[_rng.randrange(512) for _ in range(120)] for _ in range(3)]   # shared prefixes make hits likely


def needed_tokens(spec, layout, t: int) -> range:
    """Tokens before position t whose rows in `spec`'s group a step computing tokens t, t+1, ... reads.

    Decided from the layout: a ring group that serves a window layer (ratio 0) keeps the sliding window,
    t-W+1 .. t-1 (token t itself is written by the step); a ring group whose layers all compress at ratio r
    keeps the run t is part of, r * (t // r) .. t-1 (a finished run is already compressed); any other group
    keeps everything."""
    if not spec.is_ring:
        return range(0, t)
    ratios = {layout.compress_ratios[layer] for layer in spec.layer_ids}
    if 0 in ratios:
        return range(max(0, t - layout.sliding_window + 1), t)
    (ratio,) = ratios
    return range(t // ratio * ratio, t)


def needed_pages(spec, layout, t: int) -> range:
    """Logical pages holding needed_tokens(spec, layout, t)."""
    tokens = needed_tokens(spec, layout, t)
    if not tokens:
        return range(0)
    return range(tokens.start // spec.tokens_per_page, (tokens.stop - 1) // spec.tokens_per_page + 1)


class Shadow:
    """The manager under test plus what a runner would have written to each (partition, group, page)."""

    def __init__(self, specs, block_size, step_cap, pool, partitions, layout):
        self.specs, self.bs, self.cap, self.partitions, self.layout = specs, block_size, step_cap, partitions, layout
        self.m = InspectableKvCacheManager(specs, block_size, num_partitions=partitions)
        self.m.initialize_slots(pool)
        self.tokens: dict[str, list[int]] = {}
        self.done: dict[str, int] = {}
        self.content: dict[tuple[int, str, int], tuple | None] = {}

    def page_of(self, rid, spec, logical):
        table = self.m.block_tables(rid)[spec.name]
        return table[logical % spec.max_blocks_per_seq] if spec.is_ring else table[logical]

    def expect(self, rid, logical, spec, upto):
        return logical, tuple(self.tokens[rid][:min((logical + 1) * spec.tokens_per_page, upto)])

    def check_history(self, rid, upto):
        """Every page a step from position `upto` reads from earlier steps is held and holds exactly those
        tokens (called after allocate, so a ring slot reused by the step must not be a needed one)."""
        part = self.m.partition_of(rid)
        for s in self.specs:
            for logical in needed_pages(s, self.layout, upto):
                page = self.page_of(rid, s, logical)
                assert page >= 0, (s.name, logical)
                assert self.content.get((part, s.name, page)) == self.expect(rid, logical, s, upto), (s.name, logical)

    def write(self, rid, start, n):
        part = self.m.partition_of(rid)
        for s in self.specs:
            tpp = s.tokens_per_page
            for logical in range(start // tpp, math.ceil((start + n) / tpp)):
                page = self.page_of(rid, s, logical)
                assert page >= 0
                assert self.m.page_refcount(s.name, page, part) == 1, f"write into shared page {s.name}/{page}"
                first = max(start, logical * tpp)
                if first > logical * tpp:             # continuing a partly written page: still ours
                    assert self.content.get((part, s.name, page)) == self.expect(rid, logical, s, first)
                self.content[(part, s.name, page)] = self.expect(rid, logical, s, start + n)

    def snapshot(self):
        tables = {rid: self.m.block_tables(rid) for rid in self.tokens}
        free = {(s.name, p): self.m.num_free_blocks(s.name, p) for s in self.specs for p in range(self.partitions)}
        return tables, free

    def step(self, rid, n):
        """allocate -> zero new pages -> check reads -> write -> commit; False when capacity is short."""
        c, part = self.done[rid], self.m.partition_of(rid)
        before, possible = self.snapshot(), self.m.can_allocate(rid, n)
        try:
            new = self.m.allocate(rid, self.tokens[rid], n)
        except KvCapacityError as err:
            event("capacity error")
            assert not possible
            alone = [r for r in self.tokens if self.m.partition_of(r) == part] == [rid]
            fits = all(s.is_ring or math.ceil((c + n) / s.tokens_per_page) <= self.m.num_total_blocks(s.name, part)
                       for s in self.specs)
            assert not (alone and fits), "a request alone on its partition must always fit"
            assert self.snapshot() == before, "failed allocation changed state"
            assert not any(self.m.take_new_pages(part).values())
            assert any(err.need[g] > err.free[g] for g in err.need)
            return False
        assert possible
        assert self.m.take_new_pages(part) == new
        for name, pages in new.items():
            for page in pages:
                self.content[(part, name, page)] = None   # the runner zeroes new pages
        self.check_history(rid, c)
        self.write(rid, c, n)
        self.m.commit(rid, c + n)
        self.check_history(rid, c + n)           # commit released nothing still needed
        self.done[rid] = c + n
        return True

    def check_invariants(self):
        for p in range(self.partitions):
            rids = [r for r in self.tokens if self.m.partition_of(r) == p]
            for s in self.specs:
                holders: dict[int, int] = {}
                for rid in rids:
                    table = self.m.block_tables(rid)[s.name]
                    held = [pg for pg in table if pg >= 0]
                    assert len(held) == len(set(held)), f"{rid} holds a page twice in {s.name}"
                    if s.is_ring:
                        assert len(table) == s.max_blocks_per_seq
                    for pg in held:
                        holders[pg] = holders.get(pg, 0) + 1
                for pg, k in holders.items():
                    assert self.m.page_refcount(s.name, pg, p) == k
                    assert k == 1 or self.m.is_cached_page(s.name, pg, p), f"{s.name}/{pg} shared but not cached"
                assert self.m.num_free_blocks(s.name, p) + len(holders) == self.m.num_total_blocks(s.name, p)


def run_stream(data, spec_set):
    specs, bs, cap = SPEC_SETS[spec_set]
    if spec_set == "dsv4":
        pool = data.draw(st.integers(1, 3), label="slots") * specs[0].max_blocks_per_seq
    else:
        pool = data.draw(st.integers(4, 40), label="blocks")
    sim = Shadow(specs, bs, cap, pool, data.draw(st.integers(1, 2), label="partitions"), LAYOUTS[spec_set])
    m = sim.m
    for i in range(data.draw(st.integers(5, 40), label="ops")):
        op = data.draw(st.sampled_from(["new", "new", "step", "step", "step", "free"]) if sim.tokens
                       else st.just("new"))
        if op == "new":
            base = data.draw(st.sampled_from(BASES))
            prompt = base[:data.draw(st.integers(0, len(base)))] + data.draw(
                st.lists(st.integers(0, 511), min_size=1, max_size=40))
            rid = f"r{i}"
            h = m.match_prefix(rid, prompt)
            assert h % bs == 0 and 0 <= h <= len(prompt) - 1 and m.num_cached_tokens(rid) == h
            sim.tokens[rid], sim.done[rid] = list(prompt), h
            sim.check_history(rid, h)                 # the hit pages hold exactly these tokens
            event("prefix hit" if h else "prefix miss")
            if h and m.match_prefix("probe", prompt) and m.partition_of("probe") == m.partition_of(rid):
                assert m.num_cached_tokens("probe") == h and m.block_tables("probe") == m.block_tables(rid)
            m.free("probe")
            n = min(len(prompt) - h, data.draw(st.integers(1, cap)))
            if not sim.step(rid, n):
                assert m.free(rid)
                del sim.tokens[rid], sim.done[rid]
        elif op == "step":
            rid = data.draw(st.sampled_from(sorted(sim.tokens)))
            left = len(sim.tokens[rid]) - sim.done[rid]
            if left == 0:                             # decode: the sampled token joins the sequence
                sim.tokens[rid].append(data.draw(st.integers(0, 511)))
                left = 1
            n = min(left, data.draw(st.integers(1, cap)))
            if sim.done[rid] + n > MAX_LEN:
                op = "free"
            else:
                sim.step(rid, n)
        if op == "free":
            rid = data.draw(st.sampled_from(sorted(sim.tokens)))
            assert m.free(rid)
            del sim.tokens[rid], sim.done[rid]
        sim.check_invariants()
    for rid in list(sim.tokens):
        assert m.free(rid)
    for s in specs:
        for p in range(sim.partitions):
            assert m.num_free_blocks(s.name, p) == m.num_total_blocks(s.name, p), s.name
    assert m.prefix_stats.hit_tokens <= m.prefix_stats.query_tokens


SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(st.data())
def test_qwen3_request_streams(data):
    run_stream(data, "qwen3")


@SETTINGS
@given(st.data())
def test_dsv4_tiny_request_streams(data):
    run_stream(data, "dsv4")


@pytest.mark.parametrize("chunk", [1, 5, 16, 32])
def test_ring_groups_hold_what_the_next_step_reads_and_nothing_older(chunk):
    """One request through 300 positions: after every commit each ring group holds every page the next step
    reads; a window group holds exactly those, a compressor state at most one finished run more."""
    specs, bs, cap = SPEC_SETS["dsv4"]
    layout = LAYOUTS["dsv4"]
    sim = Shadow(specs, bs, cap, specs[0].max_blocks_per_seq, 1, layout)
    tokens = [random.Random(chunk).randrange(512) for _ in range(300)]
    assert sim.m.match_prefix("a", tokens) == 0
    sim.tokens["a"], sim.done["a"] = tokens, 0
    checked = 0
    while sim.done["a"] < len(tokens):
        assert sim.step("a", min(chunk, len(tokens) - sim.done["a"]))
        t = sim.done["a"]
        for s in specs:
            if not s.is_ring:
                continue
            held = {sim.content[(0, s.name, p)][0] for p in sim.m.block_tables("a")[s.name] if p >= 0}
            needed = set(needed_pages(s, layout, t))
            assert needed <= held, (s.name, t)
            ratios = {layout.compress_ratios[layer] for layer in s.layer_ids}
            if 0 in ratios:
                assert held == needed, f"{s.name} at {t}: holds pages {sorted(held - needed)} outside the window"
            else:
                (ratio,) = ratios
                oldest = max(0, t // ratio * ratio - ratio) // s.tokens_per_page
                assert min(held, default=oldest) >= oldest, f"{s.name} at {t}: holds pages behind the last run"
            checked += 1
    assert checked == 4 * math.ceil(300 / chunk)
