"""The scheduler never issues a step outside appliance.core.step_limits.step_limits(rc), the description
the startup profile measures the worst steps of: random workloads, with prefix hits and preemption."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.config.compose import load_runtime_config
from appliance.core.request import SamplingParams
from appliance.core.step_limits import step_limits
from appliance.engine.kv_cache_manager import KvCacheManager
from appliance.engine.scheduler import Scheduler
from appliance.engine.sequence import Sequence
from tests.support.kv import blocks_per_group


def random_scheduler(rc, seed: int) -> tuple[Scheduler, KvCacheManager]:
    """A scheduler over a small KV pool (six slots: preemption happens too) holding 1-11 random requests that fit
    max_model_len 128."""
    kv = KvCacheManager(rc.model.cache_groups, rc.block_size, enable_prefix_caching=True)
    kv.initialize(blocks_per_group(kv.specs, 6 * rc.model.cache_groups[0].max_blocks_per_seq))
    sched = Scheduler(rc, kv)
    rng = random.Random(seed)
    for i in range(rng.randrange(1, 12)):
        prompt = [rng.randrange(3, 50) for _ in range(rng.randrange(1, 110))]
        sched.add(Sequence(f"r{i}", prompt, SamplingParams(max_tokens=rng.randrange(1, 128 - len(prompt) + 1)),
                           lambda out: None))
    return sched, kv


@settings(max_examples=12, deadline=None)
@given(st.sampled_from(["qwen3_tiny", "dsv4_tiny"]), st.integers(16, 96), st.integers(1, 6), st.integers(1, 8),
       st.integers(0, 10_000))
def test_the_scheduler_never_leaves_step_limits(model, budget, max_seqs, decode_batch, seed):
    rc = load_runtime_config([f"+model={model}", "max_model_len=128", f"max_num_batched_tokens={budget}",
                              f"max_num_seqs={max_seqs}", f"decode_batch={decode_batch}"])
    limits = step_limits(rc)
    sched, kv = random_scheduler(rc, seed)
    for _ in range(2000):
        if not sched.has_work():
            break
        scheduled = sched.schedule()
        sizes = [s.num_new_tokens for s in scheduled]
        assert sum(sizes) <= limits.max_tokens and len(sizes) <= limits.max_seqs
        assert sizes.count(1) <= limits.max_decode_rows and all(n <= limits.max_chunk for n in sizes)
        assert all(s.seq.num_computed_tokens + s.num_new_tokens <= limits.max_context for s in scheduled)
        assert all(s.seq.num_computed_tokens % limits.chunk_align == 0 for s in scheduled if s.num_new_tokens > 1)
        samplers = [s.seq for s in scheduled if s.samples]
        for s in scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
            kv.commit(s.seq.request_id, s.seq.num_computed_tokens)
        for seq in samplers:
            seq.append_token(7)
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                sched.remove(seq)
    assert not sched.has_work()
