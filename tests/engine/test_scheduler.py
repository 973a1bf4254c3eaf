"""The scheduler's policy, driven directly (appliance/engine/scheduler.py) over a real KvCacheManager with
small pools: no runner, the test plays the engine (commit what was scheduled, append a token where a step
samples, finish at max_tokens).

Rules checked at every step: the token budget, the per-sequence chunk cap, block-aligned partial prefill
chunks, at most decode_batch decode rows, at most max_num_seqs running; preemption takes the newest running
requests, they return to the head of the wait queue in arrival order, and the head is never overtaken
(every running request arrived before every waiting one). Decode rows rotate: with n decoders and room for
decode_batch rows, none waits more than ceil(n / decode_batch) steps.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from functools import lru_cache

import pytest

from appliance.config.compose import load_runtime_config
from appliance.core.config import RuntimeConfig
from appliance.core.request import SamplingParams
from appliance.engine.scheduler import ScheduledSeq, Scheduler
from appliance.engine.sequence import SeqStatus, Sequence
from tests.support.kv import InspectableKvCacheManager


@lru_cache(maxsize=None)
def base_config(model: str) -> RuntimeConfig:
    return load_runtime_config([f"+model={model}", "max_model_len=128"])


@dataclasses.dataclass(frozen=True)
class Scheduled:
    """What one step did for one sequence (ScheduledSeq.samples changes once the step is applied)."""

    seq: Sequence
    num_new_tokens: int
    samples: bool


class Driver:
    """A Scheduler with its KvCacheManager, stepped the way the engine loop steps them."""

    def __init__(self, model: str = "qwen3_tiny", *, slots: int = 2, blocks: int | None = None, **settings):
        """Pools of `slots` capacity slots (max_model_len 128 each), or of `blocks` pages for a single-group
        model; `settings` replace RuntimeConfig fields (decode_batch, max_num_batched_tokens, ...)."""
        rc = dataclasses.replace(base_config(model), **settings)
        self.rc = rc
        self.kv = InspectableKvCacheManager(rc.model.cache_groups, rc.block_size,
                                            enable_prefix_caching=rc.enable_prefix_caching)
        self.kv.initialize_slots(blocks if blocks is not None else slots * rc.model.cache_groups[0].max_blocks_per_seq)
        self.sched = Scheduler(rc, self.kv)
        self.finished: list[Sequence] = []
        self.history: list[list[Scheduled]] = []
        self._rng = random.Random(0)
        self._ids = itertools.count()

    def add(self, prompt: list[int], max_tokens: int) -> Sequence:
        seq = Sequence(f"r{next(self._ids)}", prompt,
                       SamplingParams(max_tokens=max_tokens, ignore_eos=True), lambda out: None)
        self.sched.add(seq)
        return seq

    def step(self) -> list[Scheduled]:
        """One schedule() with every rule checked, then what the engine does with the result."""
        before = {id(s): (s, s.num_computed_tokens, s.num_preemptions) for s in self.sched.running}
        scheduled = self.sched.schedule()
        self.check_step(scheduled, before)
        done = [Scheduled(item.seq, item.num_new_tokens, item.samples) for item in scheduled]
        for item in done:
            if id(item.seq) in before and item.seq.num_preemptions == before[id(item.seq)][2]:
                assert item.seq.num_computed_tokens == before[id(item.seq)][1], \
                    "a running sequence's progress changed inside schedule() without a preemption"
            item.seq.num_computed_tokens += item.num_new_tokens
            self.kv.commit(item.seq.request_id, item.seq.num_computed_tokens)
        for item in done:
            if item.samples:
                item.seq.append_token(self._rng.randrange(3, 512))
                if len(item.seq.output_token_ids) >= item.seq.params.max_tokens:
                    self.sched.remove(item.seq)
                    self.finished.append(item.seq)
        self.history.append(done)
        return done

    def check_step(self, scheduled: list[ScheduledSeq], before: dict[int, tuple[Sequence, int, int]]) -> None:
        rc, sched = self.rc, self.sched
        sizes = [item.num_new_tokens for item in scheduled]
        assert all(n >= 1 for n in sizes)
        assert sum(sizes) <= rc.max_num_batched_tokens, "token budget exceeded"
        cap = rc.model.layout.tokens_in_flight or rc.max_num_batched_tokens
        assert max(sizes, default=0) <= cap, "a sequence computed more than tokens_in_flight in one step"
        assert sum(1 for n in sizes if n == 1) <= rc.decode_batch, "more decode rows than decode_batch"
        assert len({id(item.seq) for item in scheduled}) == len(scheduled), "a sequence scheduled twice"
        for item in scheduled:
            seq = item.seq
            assert seq.status is SeqStatus.RUNNING and self.kv.has_request(seq.request_id)
            assert seq.num_computed_tokens + item.num_new_tokens <= seq.num_tokens
            if not item.samples:       # a partial prefill chunk ends on a block boundary
                assert (seq.num_computed_tokens + item.num_new_tokens) % rc.block_size == 0, \
                    f"chunk [{seq.num_computed_tokens}, +{item.num_new_tokens}) is not block aligned"
        assert len(sched.running) <= rc.max_num_seqs
        waiting = [s.arrival for s in sched.waiting]
        assert waiting == sorted(waiting), "the wait queue left arrival order"
        if sched.running and sched.waiting:
            assert max(s.arrival for s in sched.running) < min(waiting), \
                "a request runs while an earlier one waits: the head was overtaken"
        # A victim may be readmitted in the same step (from the head of the queue), so count preemptions.
        preempted = [s for s, _, count in before.values() if s.num_preemptions > count]
        newest = sorted((s for s, _, _ in before.values()), key=lambda s: s.arrival)[len(before) - len(preempted):]
        assert sorted(s.arrival for s in preempted) == [s.arrival for s in newest], \
            "preemption must take the newest running requests"
        assert all(s.num_preemptions == count + 1 for s, _, count in before.values() if s in preempted)
        for seq in preempted:
            if seq.status is SeqStatus.WAITING:
                assert seq.num_computed_tokens == 0 and not self.kv.has_request(seq.request_id)

    def run(self, max_steps: int = 5000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_work():
                return
            self.step()
        raise AssertionError(f"requests still unfinished after {max_steps} steps: the scheduler starves them")


def steps_of(driver: Driver, seq: Sequence) -> list[int]:
    return [i for i, step in enumerate(driver.history) if any(item.seq is seq for item in step)]


# -- targeted rules ------------------------------------------------------------------------------------

def test_newest_running_request_is_preempted_and_readmitted_first():
    # Three requests fit one block each; when the two long ones need a second block, the pool (3 blocks)
    # is empty: the oldest (a) keeps running, c (newest) and then b are preempted, and they wait in
    # arrival order ahead of a later arrival.
    d = Driver(blocks=3, decode_batch=4, max_num_seqs=8, max_num_batched_tokens=64, enable_prefix_caching=False)
    a, b, c = d.add([5] * 15, 20), d.add([6] * 15, 20), d.add([7] * 3, 20)
    d.step()
    assert d.sched.running == [a, b, c]
    late = d.add([8] * 4, 2)
    d.step()
    assert late.status is SeqStatus.WAITING      # no room: the pool is full
    d.step()                                     # a and b need a second block
    assert d.sched.running == [a]
    assert list(d.sched.waiting) == [b, c, late]
    assert (a.num_preemptions, b.num_preemptions, c.num_preemptions) == (0, 1, 1)
    assert d.sched.num_preemptions == 2
    d.run()
    first_back = {s.request_id: next(i for i in steps_of(d, s) if i > 2) for s in (b, c, late)}
    assert first_back[b.request_id] <= first_back[c.request_id] <= first_back[late.request_id]
    assert all(len(s.output_token_ids) == s.params.max_tokens for s in (a, b, c, late))


def test_a_preempted_request_recomputes_its_prompt_and_outputs():
    d = Driver(blocks=3, decode_batch=4, max_num_seqs=8, max_num_batched_tokens=64, enable_prefix_caching=False)
    a, b, c = d.add([5] * 15, 30), d.add([6] * 15, 30), d.add([7] * 15, 30)
    for _ in range(3):
        d.step()
    assert a.status is SeqStatus.RUNNING and c.status is SeqStatus.WAITING
    assert b.status is SeqStatus.WAITING and b.num_preemptions == 1
    tokens = list(b.token_ids)
    while b.status is SeqStatus.WAITING:
        d.step()
    readmit = next(item for item in d.history[-1] if item.seq is b)
    assert (readmit.num_new_tokens, readmit.samples) == (len(tokens), True)
    assert b.token_ids[:len(tokens)] == tokens and b.output_token_ids[:len(tokens) - 15] == tokens[15:]
    d.run()
    assert len(b.output_token_ids) == 30 and b.usage().prompt_tokens == 15


def test_the_head_of_the_queue_is_never_overtaken_by_a_request_that_would_fit():
    # The head needs more pages than are free; a short request behind it would fit but must wait.
    d = Driver(blocks=4, decode_batch=4, max_num_seqs=8, max_num_batched_tokens=128, enable_prefix_caching=False)
    big = d.add([5] * 40, 20)
    d.step()
    head, small = d.add([6] * 40, 2), d.add([7] * 2, 2)
    while big.status is SeqStatus.RUNNING:
        d.step()
        if big.status is SeqStatus.RUNNING:
            assert head.status is SeqStatus.WAITING and small.status is SeqStatus.WAITING
    d.run()
    assert steps_of(d, head)[0] <= steps_of(d, small)[0]


def test_partial_prefill_chunks_end_on_block_boundaries_within_the_budget():
    d = Driver(decode_batch=2, max_num_seqs=4, max_num_batched_tokens=40, enable_prefix_caching=False)
    a = d.add(list(range(3, 103)), 1)     # 100 tokens
    first = d.step()
    assert [(item.seq, item.num_new_tokens) for item in first] == [(a, 32)]   # 40 cut back to the block boundary
    assert [item.num_new_tokens for item in d.step()] == [32]
    assert [(item.num_new_tokens, item.samples) for item in d.step()] == [(36, True)]   # the rest, unaligned


def test_a_waiting_chunk_that_would_not_reach_a_block_boundary_waits():
    d = Driver(decode_batch=2, max_num_seqs=4, max_num_batched_tokens=40, enable_prefix_caching=False)
    a = d.add(list(range(3, 103)), 1)
    b = d.add(list(range(3, 53)), 1)
    d.step()
    assert a.status is SeqStatus.RUNNING and b.status is SeqStatus.WAITING   # 8 tokens left: no whole block
    second = d.step()
    assert [(item.seq, item.num_new_tokens) for item in second] == [(a, 32)]


def test_dsv4_chunks_are_capped_at_tokens_in_flight():
    d = Driver("dsv4_tiny", slots=2, decode_batch=2, max_num_seqs=4, max_num_batched_tokens=200,
               enable_prefix_caching=False)
    tif = d.rc.model.layout.tokens_in_flight
    a = d.add(list(range(3, 103)), 1)
    sizes = [item.num_new_tokens for item in d.step() if item.seq is a]
    assert sizes == [tif]


def test_decode_rows_rotate_so_no_decoder_waits_longer_than_its_turn():
    n, rows = 7, 3
    d = Driver(slots=n, decode_batch=rows, max_num_seqs=n, max_num_batched_tokens=256, enable_prefix_caching=False)
    seqs = [d.add([10 + i] * 5, 60) for i in range(n)]
    while any(s.num_pending_tokens != 1 or s.status is not SeqStatus.RUNNING for s in seqs):
        d.step()
    start = len(d.history)
    for _ in range(30):
        step = d.step()
        assert len(step) == rows, "every free decode row must be used"
    for s in seqs:
        mine = [i for i in steps_of(d, s) if i >= start]
        gaps = [b - a for a, b in zip([start - 1] + mine, mine + [len(d.history)], strict=True)]
        assert max(gaps) <= math.ceil(n / rows), f"{s.request_id} waited {max(gaps)} steps for a decode row"


def test_max_num_seqs_bounds_admission():
    d = Driver(slots=8, decode_batch=8, max_num_seqs=3, max_num_batched_tokens=256, enable_prefix_caching=False)
    seqs = [d.add([20 + i] * 4, 5) for i in range(6)]
    d.step()
    assert d.sched.running == seqs[:3] and list(d.sched.waiting) == seqs[3:]
    d.run()
    assert len(d.finished) == 6


def test_prefix_hit_starts_the_first_chunk_after_the_cached_blocks():
    d = Driver(slots=4, decode_batch=4, max_num_seqs=4, max_num_batched_tokens=256, enable_prefix_caching=True)
    shared = list(range(3, 43))          # 40 tokens: two whole blocks
    first = d.add(shared + [100, 101], 1)
    d.run()
    second = d.add(shared + [200], 3)
    step = d.step()
    assert [(item.seq, item.num_new_tokens) for item in step] == [(second, len(second.prompt_token_ids) - 32)]
    assert second.num_cached_prompt_tokens == 32 and first.num_cached_prompt_tokens == 0


# -- every rule on random workloads ----------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(12))
def test_random_workloads_keep_every_rule(seed):
    rng = random.Random(seed)
    model = "dsv4_tiny" if seed % 3 == 2 else "qwen3_tiny"
    shared = [rng.randrange(3, 512) for _ in range(64)]
    pools = {"blocks": rng.choice([8, 12, 16, 24])} if model == "qwen3_tiny" else {"slots": rng.choice([1, 2])}
    d = Driver(model, **pools, decode_batch=rng.randint(1, 4), max_num_seqs=rng.randint(2, 6),
               max_num_batched_tokens=rng.choice([16, 24, 40, 64, 100]), enable_prefix_caching=bool(seed % 2))
    added = []
    for _ in range(400):
        if len(added) < 24 and rng.random() < 0.3:
            head = shared[:rng.randint(0, 64)] if rng.random() < 0.5 else []
            prompt = head + [rng.randrange(3, 512) for _ in range(rng.randint(1, 50))]
            added.append(d.add(prompt[:100], rng.randint(1, 128 - len(prompt[:100]))))
        if d.sched.has_work():
            d.step()
    d.run()
    assert len(d.finished) == len(added)
    assert all(len(s.output_token_ids) == s.params.max_tokens for s in added)
    assert all(d.kv.num_free_blocks(s.name) == d.kv.num_total_blocks(s.name) for s in d.rc.model.cache_groups)
