"""Speculative decoding's figures: the recorder counts drafts proposed and accepted per position, and /metrics and
the gRPC Stats answer export the same snapshot."""

from __future__ import annotations

from appliance.engine.stats import StatsRecorder
from appliance.serve.convert import stats_response
from appliance.serve.metrics import metrics_registry, render


def recorded():
    rec = StatsRecorder()
    rec.record_speculation([3, 3], [0, 2])       # row 1 rejects its first draft; row 2 accepts two of three
    rec.record_speculation([3, 1], [3, 1])       # all accepted (a row near its end drafts only one)
    return rec.snapshot()


def test_recorder_counts_drafts_by_position():
    s = recorded()
    assert (s.spec_rows, s.spec_proposed, s.spec_accepted) == (4, 10, 6)
    assert s.spec_proposed_by_position == (4, 3, 3)
    assert s.spec_accepted_by_position == (3, 2, 1)
    assert s.spec_acceptance_by_position == (0.75, 2 / 3, 1 / 3)


def test_metrics_and_stats_export_the_speculation_counters():
    s = recorded()
    text = render(metrics_registry(lambda: s, "m")).decode()
    assert 'appliance:spec_decode_num_drafts_total{model_name="m"} 4.0' in text
    assert 'appliance:spec_decode_num_accepted_tokens_total{model_name="m"} 6.0' in text
    assert 'appliance:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 1.0' in text
    assert 'appliance:spec_decode_num_draft_tokens_per_pos_total{model_name="m",position="0"} 4.0' in text
    pb = stats_response(s, "serving")
    assert (pb.spec_verify_rows, pb.spec_draft_tokens, pb.spec_accepted_tokens) == (4, 10, 6)
    assert list(pb.spec_accepted_tokens_by_position) == [3, 2, 1]
    assert list(pb.spec_draft_tokens_by_position) == [4, 3, 3]


def test_bench_reports_tokens_per_verifying_row_and_acceptance_by_position():
    from appliance.engine.stats import EngineStats
    from appliance.modes.bench import speculation_metrics

    m = speculation_metrics(recorded())
    assert m["spec_tokens_per_verify_row"] == 1 + 6 / 4
    assert m["spec_acceptance_by_position"] == [0.75, 2 / 3, 1 / 3]
    assert speculation_metrics(EngineStats()) == {}          # speculation off: nothing reported
