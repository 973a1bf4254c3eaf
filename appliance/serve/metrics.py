"""GET /metrics: the engine's live figures in Prometheus format (prometheus_client).

Names follow vLLM's where they mean the same, with the `appliance:` prefix instead of `vllm:` (dashboards
port by a rename); every family carries vLLM's `model_name` label. Added here: each cache group's used and
free blocks and usage fraction, one gauge family each with a `group` label. A collector reads the engine's
stats snapshot at scrape time, so /metrics and the gRPC Stats RPC report the same numbers and nothing is
counted twice.
"""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from appliance.engine.stats import EngineStats, HistogramSnapshot

PREFIX = "appliance:"
FINISH_REASONS = ("length", "stop", "eos", "aborted")      # always exported, so rates start from 0


def _histogram(name: str, doc: str, h: HistogramSnapshot, model: str) -> HistogramMetricFamily:
    family = HistogramMetricFamily(PREFIX + name, doc, labels=["model_name"])
    buckets = [(repr(float(b)), c) for b, c in zip(h.upper_bounds, h.bucket_counts)] + [("+Inf", h.count)]
    family.add_metric([model], buckets, h.sum)
    return family


class EngineCollector(Collector):
    """Reads `stats()` on every scrape and yields the metric families."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str):
        self._stats = stats
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        s, m = self._stats(), self._model

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric([m], value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric([m], value)
            return family

        yield gauge("num_requests_running", "Requests holding KV-cache blocks (prefilling or decoding).", s.num_running)
        yield gauge("num_requests_waiting", "Requests queued or preempted, waiting for blocks.", s.num_waiting)
        yield counter("num_preemptions", "Requests preempted (blocks freed, recomputed later).", s.num_preemptions)
        yield counter("engine_failed_steps", "Engine steps that raised (each retried one request at a time).",
                      s.failed_steps)
        yield counter("prompt_tokens", "Prompt tokens of requests that produced a first token.", s.prompt_tokens)
        yield counter("generation_tokens", "Generated tokens.", s.generation_tokens)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.", s.prefix_cache_hits)
        yield counter("spec_decode_num_drafts", "Decode rows that verified drafted tokens (speculative decoding).",
                      s.spec_rows)
        yield counter("spec_decode_num_draft_tokens", "Tokens drafted (speculative decoding).", s.spec_proposed)
        yield counter("spec_decode_num_accepted_tokens", "Drafted tokens the model accepted.", s.spec_accepted)
        for name, doc, values in (
                ("spec_decode_num_draft_tokens_per_pos", "Tokens drafted at each draft position (0-based).",
                 s.spec_proposed_by_position),
                ("spec_decode_num_accepted_tokens_per_pos", "Drafted tokens accepted at each draft position "
                 "(acceptance rate = this / spec_decode_num_draft_tokens_per_pos).", s.spec_accepted_by_position)):
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name", "position"])
            for k, value in enumerate(values):
                family.add_metric([m, str(k)], value)
            yield family
        finished = CounterMetricFamily(PREFIX + "request_success", "Finished requests by finish reason.",
                                       labels=["model_name", "finished_reason"])
        for reason in sorted(set(FINISH_REASONS) | set(s.finished)):
            finished.add_metric([m, reason], s.finished.get(reason, 0))
        yield finished
        yield _histogram("time_to_first_token_seconds", "Time from submit to the first token.",
                         s.time_to_first_token, m)
        yield _histogram("time_per_output_token_seconds", "Time between two tokens of a request.",
                         s.time_per_output_token, m)
        yield _histogram("e2e_request_latency_seconds", "Time from submit to finish.", s.e2e_request_latency, m)
        families = {
            "kv_cache_used_blocks": ("Blocks of the cache group held by requests.", lambda g: g.used_blocks),
            "kv_cache_free_blocks": ("Blocks of the cache group free or evictable.", lambda g: g.free_blocks),
            "kv_cache_usage_perc": ("Fraction of the cache group's blocks held by requests (0..1).",
                                    lambda g: g.usage),
        }
        for name, (doc, of_group) in families.items():
            per_group = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name", "group"])
            for g in s.groups:
                per_group.add_metric([m, g.name], of_group(g))
            yield per_group


def metrics_registry(stats: Callable[[], EngineStats], model_name: str) -> CollectorRegistry:
    """A registry of its own per server (not the process-global one), holding only the engine's figures."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(stats, model_name))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
