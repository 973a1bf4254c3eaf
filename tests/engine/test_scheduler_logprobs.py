"""A request that asked for prompt logprobs gets logits for every token it computes: the scheduler holds its
chunks to the logits rows the startup profile sized (max_sampled_rows, at least one block), so a long prompt
never makes a step return more rows than that, and it still completes; and it never takes a prefix-cache hit."""

from __future__ import annotations

import dataclasses

from appliance.core.request import SamplingParams
from appliance.engine.sequence import Sequence
from tests.engine.test_scheduler import Driver


def test_prompt_logprobs_chunks_stay_within_the_profiled_logits_rows():
    d = Driver(max_num_seqs=4, decode_batch=4, max_num_batched_tokens=96)
    rows = max(d.sched.limits.max_sampled_rows, d.rc.block_size)
    assert rows < 96
    prompt = list(range(3, 103))
    seq = Sequence("lp", prompt, SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=1), lambda out: None)
    d.sched.add(seq)
    plain = d.add(list(range(3, 103)), 2)
    while d.sched.has_work():
        d.step()
    chunks = [s.num_new_tokens for step in d.history for s in step if s.seq is seq]
    plain_chunks = [s.num_new_tokens for step in d.history for s in step if s.seq is plain]
    assert sum(chunks) == len(prompt) + 1 and max(chunks) <= rows
    assert max(plain_chunks) > rows                     # the cap is the logprobs request's alone
    assert seq.num_cached_prompt_tokens == 0


def test_prompt_logprobs_request_takes_no_prefix_hit():
    d = Driver()
    first = d.add(list(range(3, 60)), 1)
    while d.sched.has_work():
        d.step()
    params = dataclasses.replace(first.params, prompt_logprobs=0)
    seq = Sequence("lp", list(range(3, 60)), params, lambda out: None)
    d.sched.add(seq)
    again = d.add(list(range(3, 60)), 1)
    while d.sched.has_work():
        d.step()
    assert again.num_cached_prompt_tokens > 0 and seq.num_cached_prompt_tokens == 0
