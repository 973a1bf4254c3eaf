"""Data parallel in the scheduler: one KV partition per data-parallel rank, each stepping its own sequences.

New requests go to the least loaded partition; the step's limits (tokens, decode rows, running sequences)
hold per partition, as each rank runs its own batch; pages run out per partition, so preemption takes the
newest request of that partition, never one whose pages could not help.
"""

from __future__ import annotations

import dataclasses

from appliance.config.compose import load_runtime_config
from appliance.core.request import SamplingParams
from appliance.engine.kv_cache_manager import KvCacheManager
from appliance.engine.scheduler import Scheduler
from appliance.engine.sequence import SeqStatus, Sequence
from tests.support.kv import blocks_per_group


def setup(blocks: int, **settings) -> tuple[KvCacheManager, Scheduler]:
    rc = dataclasses.replace(load_runtime_config(["+model=qwen3_tiny", "max_model_len=128"]), **settings)
    kv = KvCacheManager(rc.model.cache_groups, rc.block_size, enable_prefix_caching=False, num_partitions=2)
    kv.initialize(blocks_per_group(kv.specs, blocks))
    return kv, Scheduler(rc, kv)


def add(sched: Scheduler, name: str, prompt_len: int, max_tokens: int = 50) -> Sequence:
    seq = Sequence(name, [5] * prompt_len, SamplingParams(max_tokens=max_tokens, ignore_eos=True), lambda out: None)
    sched.add(seq)
    return seq


def apply(kv: KvCacheManager, scheduled) -> None:
    """What the engine does after a step: commit, and append a token where the step sampled."""
    for item in scheduled:
        samples = item.samples
        item.seq.num_computed_tokens += item.num_new_tokens
        kv.commit(item.seq.request_id, item.seq.num_computed_tokens)
        if samples:
            item.seq.append_token(7)


def test_limits_hold_per_partition_and_requests_alternate():
    kv, sched = setup(64, max_num_seqs=2, decode_batch=1, max_num_batched_tokens=32)
    seqs = [add(sched, f"r{i}", 10) for i in range(5)]
    first = sched.schedule()
    where = {item.seq.request_id: kv.partition_of(item.seq.request_id) for item in first}
    assert sorted(where) == ["r0", "r1", "r2", "r3"]                    # two running per partition
    assert where == {"r0": 0, "r1": 1, "r2": 0, "r3": 1}                 # least loaded: they alternate
    assert seqs[4].status is SeqStatus.WAITING
    for p in (0, 1):                                                     # each partition's budget: 32 tokens
        assert sum(i.num_new_tokens for i in first if where[i.seq.request_id] == p) == 20
    apply(kv, first)
    decodes = sched.schedule()                                           # decode_batch 1 per partition
    assert sorted(kv.partition_of(i.seq.request_id) for i in decodes) == [0, 1]
    assert all(i.num_new_tokens == 1 for i in decodes)


def test_preemption_takes_the_newest_request_of_the_partition_that_ran_out():
    # 4 pages of 16 tokens per partition: r0 and r2 (3 pages) fill partition 0, r1 and r3 share partition 1.
    kv, sched = setup(4, max_num_seqs=4, decode_batch=4, max_num_batched_tokens=64)
    r0, r1, r2, r3 = (add(sched, f"r{i}", n) for i, n in enumerate((8, 8, 40, 8)))
    apply(kv, sched.schedule())
    assert [kv.partition_of(s.request_id) for s in (r0, r1, r2, r3)] == [0, 1, 0, 1]
    steps = 0
    while r2.num_preemptions == 0:                                       # r0 grows into a 2nd page: none left
        apply(kv, sched.schedule())
        steps += 1
        assert steps < 20 and r3.num_preemptions == 0
    assert r2.status is SeqStatus.WAITING and r0.num_computed_tokens > 16   # the newest of partition 0 went ...
    assert r3.status is SeqStatus.RUNNING and r3.num_preemptions == 0   # ... not the newest overall
    assert r0.status is SeqStatus.RUNNING and r1.status is SeqStatus.RUNNING


def test_a_preemption_on_one_partition_leaves_the_other_partitions_step_whole():
    """The step that preempts r2 (partition 0) still runs r3, which comes after r2 in arrival order but lives on
    partition 1: a preempted request is passed over, not the end of the step."""
    kv, sched = setup(4, max_num_seqs=4, decode_batch=4, max_num_batched_tokens=64)
    r0, r1, r2, r3 = (add(sched, f"r{i}", n) for i, n in enumerate((8, 8, 40, 8)))
    apply(kv, sched.schedule())
    for _ in range(20):
        step = sched.schedule()
        apply(kv, step)
        if r2.num_preemptions:
            break
    assert r2.num_preemptions == 1
    assert sorted((item.seq.request_id, item.num_new_tokens) for item in step) == [("r0", 1), ("r1", 1), ("r3", 1)]


def test_without_prefix_caching_requests_are_still_placed_on_the_least_loaded_partition():
    """enable_prefix_caching off in the config: no prefix lookup places the request, the scheduler places it."""
    kv, sched = setup(64, max_num_seqs=2, decode_batch=1, max_num_batched_tokens=32, enable_prefix_caching=False)
    seqs = [add(sched, f"r{i}", 10) for i in range(5)]
    first = sched.schedule()
    assert {item.seq.request_id: kv.partition_of(item.seq.request_id) for item in first} == {
        "r0": 0, "r1": 1, "r2": 0, "r3": 1}
    assert seqs[4].status is SeqStatus.WAITING and kv.prefix_stats.queries == 0


def test_a_partition_whose_budget_a_prefill_used_up_does_not_end_the_step_for_the_others():
    """Partition 0 runs `a` (mid-prefill) and the newer `c`; partition 1 runs `d`, newer still. When `a`'s chunk
    takes partition 0's whole budget, `c` waits for the next step but `d`, after it in arrival order, still
    decodes: a used-up budget is that partition's, not the step's."""
    kv, sched = setup(64, max_num_seqs=4, decode_batch=4, max_num_batched_tokens=32)
    z, y, a, x, c, d = (add(sched, name, n, max_tokens=1 if name == "z" else 50)
                        for name, n in (("z", 8), ("y", 16), ("a", 80), ("x", 8), ("c", 8), ("d", 8)))
    first = sched.schedule()
    # z takes 8 of partition 0's 32 tokens, so a gets a 16-token chunk (block-aligned) and c the last 8.
    assert {i.seq.request_id: (kv.partition_of(i.seq.request_id), i.num_new_tokens) for i in first} == {
        "z": (0, 8), "y": (1, 16), "a": (0, 16), "x": (1, 8), "c": (0, 8), "d": (1, 8)}
    apply(kv, first)
    sched.remove(z)                                                      # max_tokens 1: finished
    second = {i.seq.request_id: i.num_new_tokens for i in sched.schedule()}
    assert second == {"y": 1, "a": 32, "x": 1, "d": 1}
    assert c.status is SeqStatus.RUNNING and c.num_pending_tokens == 1
