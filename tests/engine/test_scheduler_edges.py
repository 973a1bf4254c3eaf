"""Scheduler rules at their edges (appliance/engine/scheduler.py), driven like test_scheduler.py (its Driver
checks every step rule), written against the mutants docs/TESTING.md lists: the last token of the budget
still goes to a decoder, used-up decode rows never hold back a prefill chunk, and remove() takes a request
out of either queue for good."""

from __future__ import annotations

from appliance.engine.sequence import SeqStatus
from tests.engine.test_scheduler import Driver, steps_of


def test_the_last_token_of_the_budget_still_goes_to_a_decoder():
    """16 decoders and a budget of 16 tokens: every step runs all of them, the last on the budget's last token."""
    n = 16
    d = Driver(blocks=2 * n, decode_batch=n, max_num_seqs=n, max_num_batched_tokens=n, enable_prefix_caching=False)
    seqs = [d.add([7 + i], 20) for i in range(n)]     # one-token prompts: all admitted in the first step
    assert len(d.step()) == n
    assert all(s.status is SeqStatus.RUNNING and s.num_pending_tokens == 1 for s in seqs)
    for _ in range(5):
        assert sorted(s.seq.request_id for s in d.step()) == sorted(s.request_id for s in seqs)


def test_a_prefill_chunk_runs_while_a_decoder_holds_the_only_decode_row():
    """decode_batch 1: `a` decodes in the one row; `b`'s prompt still advances in the same steps, also when only
    two tokens of it are left (a chunk of two is prefill, not a decode row)."""
    d = Driver(blocks=16, decode_batch=1, max_num_seqs=4, max_num_batched_tokens=17, enable_prefix_caching=False)
    a = d.add([5] * 4, 30)
    d.step()
    b = d.add([6] * 34, 5)
    chunks = []
    for _ in range(3):
        step = {item.seq.request_id: item.num_new_tokens for item in d.step()}
        assert step[a.request_id] == 1
        chunks.append(step.get(b.request_id))
    assert chunks == [16, 16, 2]


def test_removing_a_waiting_request_takes_it_out_of_the_queue_for_good():
    d = Driver(blocks=16, decode_batch=2, max_num_seqs=1, max_num_batched_tokens=64, enable_prefix_caching=False)
    first, second, third = (d.add([9 + i] * 4, 3) for i in range(3))
    d.step()
    assert d.sched.running == [first] and list(d.sched.waiting) == [second, third]
    d.sched.remove(second)
    assert second.status is SeqStatus.FINISHED and list(d.sched.waiting) == [third]
    d.run()
    assert steps_of(d, second) == [] and [s.request_id for s in d.finished] == [first.request_id, third.request_id]


def test_removing_a_running_request_frees_its_pages_and_finishes_it():
    d = Driver(blocks=16, decode_batch=2, max_num_seqs=2, max_num_batched_tokens=64, enable_prefix_caching=False)
    seq = d.add([3] * 20, 10)
    d.step()
    assert d.kv.num_free_blocks() < 16
    d.sched.remove(seq)
    assert seq.status is SeqStatus.FINISHED and not d.sched.has_work()
    assert d.kv.num_free_blocks() == 16 and not d.kv.has_request(seq.request_id)


def test_one_token_prompts_are_decode_rows_and_admission_stops_at_decode_batch():
    d = Driver(blocks=16, decode_batch=2, max_num_seqs=8, max_num_batched_tokens=64, enable_prefix_caching=False)
    seqs = [d.add([11 + i], 3) for i in range(3)]
    assert [item.seq for item in d.step()] == seqs[:2]
    assert list(d.sched.waiting) == seqs[2:]


def test_the_last_token_of_the_budget_admits_a_one_token_prompt():
    d = Driver(blocks=16, decode_batch=2, max_num_seqs=4, max_num_batched_tokens=17, enable_prefix_caching=False)
    long, short = d.add([4] * 16, 3), d.add([5], 3)
    assert [(item.seq, item.num_new_tokens) for item in d.step()] == [(long, 16), (short, 1)]


def test_the_waiting_head_is_not_looked_up_while_running_requests_use_the_whole_budget():
    """A prefix-cache query counts in the hit rate (/metrics); a step with no budget left must not make one."""
    d = Driver(blocks=32, decode_batch=2, max_num_seqs=4, max_num_batched_tokens=32, enable_prefix_caching=True)
    d.add([8] * 100, 3)
    d.step()
    d.add([9] * 8, 3)
    for _ in range(2):                          # [32, 64) and [64, 96) take the whole budget
        assert [item.num_new_tokens for item in d.step()] == [32]
    assert d.kv.prefix_stats.queries == 1


def test_a_request_arriving_while_others_run_takes_the_last_running_slot():
    """max_num_seqs 2 with one request already running: the next arrival is admitted at once, the one after it
    waits until a running request finishes."""
    d = Driver(blocks=16, decode_batch=2, max_num_seqs=2, max_num_batched_tokens=64, enable_prefix_caching=False)
    first = d.add([3] * 4, 2)
    d.step()
    second, third = d.add([4] * 4, 5), d.add([5] * 4, 5)
    assert [item.seq for item in d.step()] == [first, second]
    assert list(d.sched.waiting) == [third]


def test_the_waiting_head_is_not_looked_up_while_max_num_seqs_requests_run():
    """The same for a full running set: with max_num_seqs running, a step makes no prefix-cache query."""
    d = Driver(blocks=32, decode_batch=2, max_num_seqs=1, max_num_batched_tokens=64, enable_prefix_caching=True)
    first = d.add([8] * 8, 4)
    d.step()
    d.add([9] * 8, 3)
    for _ in range(2):
        assert [item.seq for item in d.step()] == [first]
    assert d.kv.prefix_stats.queries == 1
