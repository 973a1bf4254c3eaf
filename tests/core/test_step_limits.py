"""step_limits: one description of a legal step; worst_steps stays inside it and reaches its extremes
(tests/engine/test_scheduler_limits.py checks that the scheduler never leaves it)."""

from hypothesis import given
from hypothesis import strategies as st

from appliance.config.compose import load_runtime_config
from appliance.core.step_limits import SeqShape, StepLimits, least_steps, step_limits, worst_steps


def test_limits_come_from_the_config_and_cap_chunks_at_tokens_in_flight():
    dsv4 = step_limits(load_runtime_config(["max_num_seqs=4", "max_num_batched_tokens=512", "decode_batch=8",
                                            "max_model_len=512"]))
    assert dsv4 == StepLimits(max_tokens=512, max_seqs=4, max_decode_rows=4, max_chunk=32, max_context=512,
                             chunk_align=16)
    qwen = step_limits(load_runtime_config(["+model=qwen3_tiny", "max_model_len=256", "max_num_batched_tokens=1024"]))
    assert (qwen.max_chunk, qwen.max_context, qwen.max_sampled_rows) == (256, 256, 16)


limits_strategy = st.builds(
    lambda t, s, d, c, m, a: StepLimits(max_tokens=t, max_seqs=s, max_decode_rows=min(d, s, t),
                                        max_chunk=min(c, t, m), max_context=m, chunk_align=a),
    st.integers(1, 300), st.integers(1, 40), st.integers(1, 40), st.integers(1, 300), st.integers(2, 600),
    st.sampled_from([1, 4, 16, 128]))


@given(limits_strategy)
def test_worst_steps_are_legal_and_reach_every_extreme(limits):
    listed = worst_steps(limits)
    steps = {name: s for s in listed for name in s.name.split(" = ")}     # a step reached by two extremes: both names
    shapes = [sorted((s.num_tokens, s.start_pos) for s in step.seqs) for step in listed]
    assert all(a != b for i, a in enumerate(shapes) for b in shapes[i + 1:])   # each shape is run once
    for step in steps.values():
        assert 0 < step.num_tokens <= limits.max_tokens and len(step.seqs) <= limits.max_seqs
        assert sum(s.num_tokens == 1 for s in step.seqs) <= limits.max_decode_rows
        assert all(1 <= s.num_tokens <= limits.max_chunk and s.start_pos >= 0 and s.end <= limits.max_context
                   for s in step.seqs)
        assert all(s.start_pos % limits.chunk_align == 0 for s in step.seqs if s.num_tokens > 1)   # as scheduled
    assert next(iter(steps)) == "decode_gather"               # buffers kept between steps grow to their largest first
    gather = steps["decode_gather"].seqs
    assert len(gather) == limits.max_decode_rows and all(s.end == limits.max_context for s in gather)
    if limits.max_chunk >= 2:
        # every aligned chunk at the end of the context is dominated (fewer tokens, an earlier end) by a profiled one
        ends = [s.seqs[0] for name, s in steps.items() if name in ("long_chunk", "chunk_to_full_context")]
        assert ends[0].num_tokens == limits.max_chunk
        ctx, align = limits.max_context, limits.chunk_align
        for start in range(0, ctx - 1, align):
            n = min(limits.max_chunk, ctx - start)
            if n >= 2:
                assert any(n <= s.num_tokens and start + n <= s.end for s in ends), (start, n, ends)
        # the budget as equal chunks ending at the context, in the fewest chunks and in the most
        ends_at_context = [steps[n].seqs for n in ("long_chunks_at_full_context", "short_chunks_at_full_context")
                           if n in steps]
        for wave in ends_at_context:
            assert len({s.num_tokens for s in wave}) == 1 and all(s.end > ctx - align for s in wave)
            assert sum(s.num_tokens for s in wave) > min(limits.max_tokens, len(wave) * limits.max_chunk) - len(wave)
        counts = sorted(len(wave) for wave in ends_at_context)
        most = min(limits.max_seqs, limits.max_tokens // 2)       # a chunk holds 2+ tokens
        assert counts == sorted({n for n in (min(most, -(-limits.max_tokens // limits.max_chunk)), most) if n > 1})
        rest = limits.max_tokens - limits.max_decode_rows
        if rest >= 2 and limits.max_seqs > limits.max_decode_rows:
            mixed = steps["decodes_and_chunks"].seqs
            assert sum(s.num_tokens == 1 for s in mixed) == limits.max_decode_rows
            assert max(s.num_tokens for s in mixed) == min(limits.max_chunk, rest)
    else:
        assert list(steps) == ["decode_gather"]


def test_extremes_that_are_the_same_step_run_once_under_both_names():
    """The issue-16 bench config: max_model_len is the chunk, so the prefill wave (two 1,024-token chunks from
    position 0) is also the long chunks at full context."""
    limits = StepLimits(max_tokens=2048, max_seqs=64, max_decode_rows=64, max_chunk=1024, max_context=1024,
                        chunk_align=16)
    assert [s.name for s in worst_steps(limits)] == [
        "decode_gather", "long_chunk", "prefill_wave = long_chunks_at_full_context", "short_chunks_at_full_context"]


@given(limits_strategy, st.integers(0, 3))
def test_least_steps_are_legal_and_hold_the_fewest_tokens(limits, drafts):
    """One decode row (with its drafts), a 2-token chunk from position 0 and one after a block of cached tokens: the
    sizes and paths the worst steps may not take, run at start after them."""
    limits = StepLimits(**{**limits.__dict__, "draft_tokens": drafts,
                           "max_decode_rows": min(limits.max_decode_rows, limits.max_tokens // (1 + drafts))})
    steps = {s.name: s for s in least_steps(limits)}
    for step in steps.values():
        assert len(step.seqs) == 1 and step.num_tokens <= limits.max_tokens and step.seqs[0].end <= limits.max_context
    if limits.max_decode_rows:
        (row,) = steps["one_decode_row"].seqs
        assert (row.num_tokens, row.draft_tokens, row.end) == (1 + drafts, drafts, limits.max_context)
    else:
        assert "one_decode_row" not in steps
    assert ("short_chunk" in steps) == (limits.max_chunk >= 2)
    after_cached = limits.max_chunk >= 2 and limits.chunk_align + 2 <= limits.max_context
    assert ("short_chunk_after_cached" in steps) == after_cached
    if "short_chunk" in steps:
        assert steps["short_chunk"].seqs[0] == SeqShape(2, 0)
    if "short_chunk_after_cached" in steps:
        assert steps["short_chunk_after_cached"].seqs[0] == SeqShape(2, limits.chunk_align)   # aligned, as scheduled
