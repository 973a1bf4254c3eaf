"""The engine's live figures (appliance/engine/stats.py): counters equal what the requests report, latency
histograms count every first token and every gap, and every group's blocks are free again when idle."""

from __future__ import annotations

import time

import pytest

from appliance.core.request import SamplingParams
from appliance.engine.stats import LATENCY_BUCKETS_S, StatsRecorder
from appliance.offline import Appliance
from tests.support.kv import total_blocks


def test_histograms_are_cumulative_with_sum_and_count():
    rec = StatsRecorder()
    rec.record_step(prompt_tokens=7, first_token_latencies=[0.003, 0.2], inter_token_latencies=[1e3],
                    generation_tokens=3)
    rec.record_finished("length", 0.05)
    s = rec.snapshot()
    h = s.time_to_first_token
    assert h.upper_bounds == LATENCY_BUCKETS_S and h.count == 2 and h.sum == pytest.approx(0.203)
    assert [c for b, c in zip(h.upper_bounds, h.bucket_counts) if b in (0.001, 0.005, 0.1, 0.25, 80.0)] == \
        [0, 1, 1, 2, 2]
    assert s.time_per_output_token.bucket_counts[-1] == 0 and s.time_per_output_token.count == 1   # only +Inf
    assert (s.prompt_tokens, s.generation_tokens, dict(s.finished)) == (7, 3, {"length": 1})


def test_engine_figures_match_the_requests():
    overrides = ["+model=qwen3_tiny", "device=cpu", "max_model_len=128", "kv_cache.num_slots_override=8"]
    prompts = ["The cache holds pages of many layers. " * 6, "Weather notes from a small town", "hello"]
    with Appliance.from_config(overrides) as app:
        results = app.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
        results += app.generate(prompts[:1] * 2, SamplingParams(max_tokens=3, ignore_eos=True))
        deadline = time.monotonic() + 30        # gauges are published once per loop iteration, after the step
        while app.engine.stats().num_running and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = app.engine.stats()
        completion = sum(r.usage.completion_tokens for r in results)
        assert stats.generation_tokens == completion == 3 * 6 + 2 * 3
        assert stats.prompt_tokens == sum(r.usage.prompt_tokens for r in results)
        assert dict(stats.finished) == {"length": 5}
        assert stats.time_to_first_token.count == stats.e2e_request_latency.count == 5
        assert stats.time_per_output_token.count == completion - 5
        assert stats.prefix_cache_hits == sum(r.usage.cached_prompt_tokens for r in results) > 0
        assert stats.prefix_cache_queries >= sum(r.usage.prompt_tokens for r in results)
        assert (stats.num_running, stats.num_waiting) == (0, 0)
        assert [(g.name, g.used_blocks, g.free_blocks) for g in stats.groups] == \
            [("kv", 0, total_blocks(app.engine)["kv"])]
