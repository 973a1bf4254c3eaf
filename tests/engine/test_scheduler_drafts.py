"""With speculation the scheduler's decode rows verify drafts inside step_limits: a row's token plus its drafts
count against the step's budget, drafts never pass max_model_len or the request's max_tokens, and accepting any
number of them (committed with the accepted tokens) keeps every request progressing to its end."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.config.compose import load_runtime_config
from appliance.core.step_limits import step_limits
from tests.engine.test_scheduler_limits import random_scheduler


@settings(max_examples=12, deadline=None)
@given(st.integers(1, 3), st.integers(16, 96), st.integers(1, 6), st.integers(1, 8), st.integers(0, 10_000))
def test_drafting_rows_stay_inside_step_limits(k, budget, max_seqs, decode_batch, seed):
    rc = load_runtime_config(["max_model_len=128", f"max_num_batched_tokens={budget}", f"max_num_seqs={max_seqs}",
                              f"decode_batch={decode_batch}", "speculative.method=mtp", f"speculative.num_tokens={k}"])
    limits = step_limits(rc)
    sched, kv = random_scheduler(rc, seed)
    rng = random.Random(seed)                         # how many drafts each verify accepts
    drafted = 0
    for _ in range(2000):
        if not sched.has_work():
            break
        scheduled = sched.schedule()
        assert sum(s.num_new_tokens + s.num_draft for s in scheduled) <= limits.max_tokens
        assert sum(s.num_new_tokens == 1 for s in scheduled) <= limits.max_decode_rows
        for s in scheduled:
            assert 0 <= s.num_draft <= k and (s.num_draft == 0 or s.num_new_tokens == 1)
            end = s.seq.num_computed_tokens + s.num_new_tokens + s.num_draft       # positions computed, drafts too
            assert end <= rc.max_model_len - 1 or s.num_draft == 0
            assert s.num_draft + 1 <= s.seq.params.max_tokens - len(s.seq.output_token_ids) or s.num_draft == 0
        drafted += sum(s.num_draft for s in scheduled)
        samplers = {id(s) for s in scheduled if s.samples}
        for s in scheduled:
            kept = [7] * rng.randint(0, s.num_draft)                 # drafts accepted (any number)
            s.seq.num_computed_tokens += s.num_new_tokens + len(kept)
            kv.commit(s.seq.request_id, s.seq.num_computed_tokens, s.seq.token_ids + kept if kept else None)
            if id(s) in samplers:
                for token in kept + [7]:
                    s.seq.append_token(token)
                if len(s.seq.output_token_ids) >= s.seq.params.max_tokens or s.seq.num_tokens >= rc.max_model_len:
                    sched.remove(s.seq)
    assert not sched.has_work()
