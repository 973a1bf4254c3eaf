"""Scheduler.update_from_output (appliance/engine/scheduler.py), driven directly over a real KvCacheManager: no
runner, the test plays the sampler.

- Every scheduled sequence's computed tokens are committed, here and in the KV manager, sampling or not; a
  verifying row's kept drafts are committed with them.
- A sampling row's tokens are appended in order until a stop rule ends it: EOS (not with ignore_eos), a stop
  token id (STOP), max_tokens or max_model_len (LENGTH); the tokens after that one are not appended.
- A row whose grammar mask was refused appends nothing and ends ABORTED with why, naming the request's field.
"""

from __future__ import annotations

import dataclasses
import itertools

from appliance.config.compose import load_runtime_config
from appliance.core.constraint import OutputConstraint
from appliance.core.request import FinishReason, SamplingParams
from appliance.engine.scheduler import ScheduledSeq, Scheduler
from appliance.engine.sequence import Sequence
from tests.support.kv import InspectableKvCacheManager

EOS = 2
_ids = itertools.count()


def scheduler(max_model_len: int = 128, **settings) -> tuple[Scheduler, InspectableKvCacheManager]:
    rc = dataclasses.replace(load_runtime_config([f"max_model_len={max_model_len}", "enable_prefix_caching=false"]),
                             **settings)
    kv = InspectableKvCacheManager(rc.model.cache_groups, rc.block_size)
    kv.initialize_slots(4 * rc.model.cache_groups[0].max_blocks_per_seq)
    return Scheduler(rc, kv, eos_token_id=EOS), kv


def decoding(sched: Scheduler, *params: SamplingParams, prompt_len: int = 5) -> list[Sequence]:
    """Requests whose prompts have been computed and whose first tokens (9) were sampled: their next steps decode."""
    seqs = [Sequence(f"r{next(_ids)}", list(range(10, 10 + prompt_len)), p, lambda out: None) for p in params]
    for seq in seqs:
        sched.add(seq)
    prefills = sched.schedule()
    assert [s.seq for s in prefills] == seqs and all(s.samples for s in prefills)
    updates = sched.update_from_output(prefills, {seq.request_id: [9] for seq in seqs}, {})
    assert [(u.seq, u.num_new, u.finish_reason) for u in updates] == [(seq, 1, None) for seq in seqs]
    return seqs


def test_a_prefill_commits_its_tokens_and_appends_the_sampled_one():
    sched, kv = scheduler()
    seq = Sequence("p", list(range(10, 15)), SamplingParams(max_tokens=8), lambda out: None)
    sched.add(seq)
    (prefill,) = sched.schedule()
    assert prefill.samples and prefill.num_new_tokens == 5
    (update,) = sched.update_from_output([prefill], {"p": [42]}, {})
    assert (update.seq, update.num_new, update.finish_reason) == (seq, 1, None)
    assert seq.num_computed_tokens == kv.num_computed_tokens("p") == 5
    assert seq.output_token_ids == [42] and seq.token_ids == [*range(10, 15), 42]


def test_a_chunk_that_samples_nothing_is_committed_and_has_no_update():
    sched, kv = scheduler(max_num_batched_tokens=16)
    seq = Sequence("long", list(range(10, 50)), SamplingParams(max_tokens=4), lambda out: None)
    sched.add(seq)
    (chunk,) = sched.schedule()
    assert not chunk.samples and chunk.num_new_tokens < 40
    assert sched.update_from_output([chunk], {}, {}) == []
    assert seq.num_computed_tokens == kv.num_computed_tokens("long") == chunk.num_new_tokens
    assert seq.output_token_ids == []


def test_eos_ends_a_request_unless_it_ignores_eos():
    sched, _ = scheduler()
    plain, ignoring = decoding(sched, SamplingParams(max_tokens=8), SamplingParams(max_tokens=8, ignore_eos=True))
    rows = sched.schedule()
    updates = sched.update_from_output(rows, {plain.request_id: [EOS], ignoring.request_id: [EOS]}, {})
    assert [(u.seq, u.num_new, u.finish_reason) for u in updates] == [(plain, 1, FinishReason.EOS),
                                                                      (ignoring, 1, None)]
    assert plain.output_token_ids == ignoring.output_token_ids == [9, EOS]


def test_a_stop_token_id_ends_with_stop_and_max_tokens_with_length():
    sched, _ = scheduler()
    stopping, short, going = decoding(sched, SamplingParams(max_tokens=8, stop_token_ids=(77,)),
                                      SamplingParams(max_tokens=2), SamplingParams(max_tokens=8, stop_token_ids=(77,)))
    rows = sched.schedule()
    updates = sched.update_from_output(rows, {stopping.request_id: [77], short.request_id: [30],
                                              going.request_id: [31]}, {})
    assert {u.seq.request_id: u.finish_reason for u in updates} == {
        stopping.request_id: FinishReason.STOP, short.request_id: FinishReason.LENGTH, going.request_id: None}


def test_max_model_len_ends_with_length():
    sched, _ = scheduler(max_model_len=7)
    (seq,) = decoding(sched, SamplingParams(max_tokens=50), prompt_len=5)      # 6 tokens now
    (row,) = sched.schedule()
    (update,) = sched.update_from_output([row], {seq.request_id: [30]}, {})
    assert update.finish_reason is FinishReason.LENGTH and seq.num_tokens == 7


def test_a_verifying_row_commits_its_kept_drafts_and_stops_at_the_first_finishing_token():
    sched, kv = scheduler()
    (seq,) = decoding(sched, SamplingParams(max_tokens=20))
    kv.allocate(seq.request_id, seq.token_ids, 1, 3, seq.num_prompt_tokens)      # room for the row and 3 drafts
    row = ScheduledSeq(seq, 1, num_draft=3)
    (update,) = sched.update_from_output([row], {seq.request_id: [40, EOS, 41, 42]}, {})
    assert (update.num_new, update.finish_reason) == (2, FinishReason.EOS)
    assert seq.output_token_ids == [9, 40, EOS]
    # The row's own token and its three kept drafts (the last sampled token is not computed yet).
    assert seq.num_computed_tokens == kv.num_computed_tokens(seq.request_id) == 5 + 1 + 3


def test_a_refused_mask_appends_nothing_and_aborts_naming_the_field():
    sched, _ = scheduler()
    (seq,) = decoding(sched, SamplingParams(max_tokens=8, constraint=OutputConstraint.regex("[a-z]+")))
    (row,) = sched.schedule()
    (update,) = sched.update_from_output([row], {seq.request_id: [30]}, {seq.request_id: "its mask took too long"})
    assert (update.num_new, update.finish_reason) == (0, FinishReason.ABORTED)
    assert seq.output_token_ids == [9]
    assert seq.error == "its mask took too long" and seq.error_field == "structured_outputs.regex"


# -- async scheduling: commit when a step is launched, resolve when its tokens are read --------------------------


def test_a_committed_sampling_row_is_a_decode_row_before_its_token_is_known():
    sched, kv = scheduler(max_model_len=64)
    (seq,) = decoding(sched, SamplingParams(max_tokens=8))                   # prompt 5 + [9]
    (row,) = sched.schedule()
    sched.commit([row])                                                      # launched: its token is not read yet
    assert seq.num_unresolved == 1 and seq.token_ids == [*range(10, 15), 9] and seq.num_tokens == 7
    assert seq.num_computed_tokens == kv.num_computed_tokens(seq.request_id) == 6
    (ahead,) = sched.schedule()                                              # the next step, scheduled now
    assert (ahead.seq, ahead.num_new_tokens, ahead.num_draft, ahead.samples) == (seq, 1, 0, True)
    (update,) = sched.resolve([row], {seq.request_id: [31]}, {})
    assert (update.num_new, update.finish_reason, seq.num_unresolved) == (1, None, 0)
    assert seq.token_ids == [*range(10, 15), 9, 31]
    sched.commit([ahead])                                                    # the KV manager learns 31 now
    assert kv.num_computed_tokens(seq.request_id) == 7 and seq.num_unresolved == 1


def test_a_row_whose_unresolved_token_reaches_its_length_limits_is_not_scheduled_and_leaves_its_slot():
    sched, _ = scheduler(max_model_len=64, decode_batch=1)
    ending, waiting_row = decoding(sched, SamplingParams(max_tokens=2), SamplingParams(max_tokens=8))
    (first,) = sched.schedule()                                              # one decode row per step
    assert first.seq is ending
    sched.commit([first])
    (ahead,) = sched.schedule()      # `ending`'s second token is its last, whatever it is: the slot goes on
    assert ahead.seq is waiting_row
    (update,) = sched.resolve([first], {ending.request_id: [30]}, {})
    assert update.finish_reason is FinishReason.LENGTH


def test_a_row_preempted_before_its_token_is_read_is_readmitted_only_after_it():
    rc = load_runtime_config(["+model=qwen3_tiny", "max_model_len=64", "enable_prefix_caching=false"])
    kv = InspectableKvCacheManager(rc.model.cache_groups, rc.block_size)
    kv.initialize_slots(2)                                                   # one page each for two requests
    sched = Scheduler(rc, kv, eos_token_id=EOS)
    older, newer = decoding(sched, SamplingParams(max_tokens=8), SamplingParams(max_tokens=8),
                            prompt_len=rc.block_size - 1)                    # each page now full but for the row
    rows = sched.schedule()
    sched.commit(rows)                                                       # launched; the next rows need pages
    (ahead,) = sched.schedule()                                              # the newest is preempted for them
    assert ahead.seq is older and list(sched.waiting) == [newer] and newer.num_unresolved == 1
    sched.resolve(rows, {older.request_id: [31], newer.request_id: [32]}, {})
    sched.commit([ahead])
    sched.resolve([ahead], {older.request_id: [EOS]}, {})
    sched.remove(older)
    (again,) = sched.schedule()                                              # now with its token known
    assert (again.seq, again.num_new_tokens) == (newer, rc.block_size + 1) and newer.token_ids[-2:] == [9, 32]


def test_a_row_that_finished_while_its_step_ran_is_skipped_when_the_step_is_read():
    sched, _ = scheduler(max_model_len=64)
    gone, kept = decoding(sched, SamplingParams(max_tokens=8), SamplingParams(max_tokens=8))
    rows = sched.schedule()
    sched.commit(rows)
    sched.remove(gone)                                                       # aborted while the step ran
    updates = sched.resolve(rows, {kept.request_id: [31]}, {})
    assert [(u.seq, u.num_new) for u in updates] == [(kept, 1)] and gone.output_token_ids == [9]
