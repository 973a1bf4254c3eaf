"""Live engine figures for the front ends (Prometheus /metrics, the gRPC Stats RPC): one thread-safe recorder.

Why a recorder with snapshots: the engine loop thread owns the scheduler and the KV-cache manager, while
the front ends answer on other threads. The loop publishes its gauges (running, waiting, blocks per cache
group) once per iteration and counts events as they happen; a reader takes `snapshot()`, a frozen copy made
under one lock, and never touches engine internals. Both front ends read the same snapshot, so /metrics and
Stats always agree. Nothing here knows Prometheus: the front ends name and export the figures.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field
from typing import Iterable, Mapping

# Latency bucket bounds in seconds, wide enough for a CPU test model and a loaded accelerator alike.
LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                     10.0, 20.0, 40.0, 80.0)


@dataclass(frozen=True)
class HistogramSnapshot:
    """Cumulative bucket counts (Prometheus style): bucket_counts[i] observations <= upper_bounds[i]."""

    upper_bounds: tuple[float, ...] = LATENCY_BUCKETS_S
    bucket_counts: tuple[int, ...] = (0,) * len(LATENCY_BUCKETS_S)
    count: int = 0
    sum: float = 0.0


class _Histogram:
    """A latency histogram updated under the recorder's lock."""

    def __init__(self, upper_bounds: tuple[float, ...] = LATENCY_BUCKETS_S):
        self.upper_bounds = upper_bounds
        self.counts = [0] * len(upper_bounds)      # per bucket (not cumulative); beyond the last bound: none
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.upper_bounds, value)
        if i < len(self.counts):
            self.counts[i] += 1
        self.count += 1
        self.sum += value

    def snapshot(self) -> HistogramSnapshot:
        cumulative, total = [], 0
        for c in self.counts:
            total += c
            cumulative.append(total)
        return HistogramSnapshot(self.upper_bounds, tuple(cumulative), self.count, self.sum)


@dataclass(frozen=True)
class GroupUsage:
    """Blocks of one cache group, summed over partitions. Free includes cached pages nobody holds (evictable)."""

    name: str
    total_blocks: int
    free_blocks: int

    @property
    def used_blocks(self) -> int:
        return self.total_blocks - self.free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the group's blocks held by requests (0 when the group has no blocks yet)."""
        return self.used_blocks / self.total_blocks if self.total_blocks else 0.0


@dataclass(frozen=True, kw_only=True)
class EngineStats:
    """One consistent reading of the engine. Counters are totals since start; gauges are the latest values."""

    num_running: int = 0
    num_waiting: int = 0
    num_preemptions: int = 0
    failed_steps: int = 0                   # engine steps that raised (each retried one request at a time)
    prompt_tokens: int = 0                  # prompt tokens of requests that produced their first token
    generation_tokens: int = 0              # sampled tokens
    prefix_cache_queries: int = 0           # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0              # of those, tokens served from the cache
    finished: Mapping[str, int] = field(default_factory=dict)   # finish reason -> requests
    groups: tuple[GroupUsage, ...] = ()
    time_to_first_token: HistogramSnapshot = HistogramSnapshot()
    time_per_output_token: HistogramSnapshot = HistogramSnapshot()   # one observation per gap between tokens
    e2e_request_latency: HistogramSnapshot = HistogramSnapshot()
    # Speculative decoding (totals): verifying rows, drafts proposed, drafts accepted, and accepted drafts by
    # position (index k: the (k + 1)-th draft of a row); acceptance rate at k = spec_accepted_by_position[k] over
    # spec_proposed_by_position[k]. Tokens per verifying row = 1 + spec_accepted / spec_rows.
    spec_rows: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    spec_proposed_by_position: tuple[int, ...] = ()
    spec_accepted_by_position: tuple[int, ...] = ()

    @property
    def spec_acceptance_by_position(self) -> tuple[float, ...]:
        return tuple(a / p if p else 0.0 for a, p in zip(self.spec_accepted_by_position, self.spec_proposed_by_position))


class StatsRecorder:
    """Written by the engine loop thread, read by any thread through snapshot()."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._gauges = EngineStats()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._finished: dict[str, int] = {}
        self._ttft = _Histogram()
        self._tpot = _Histogram()
        self._e2e = _Histogram()
        self._spec_proposed: list[int] = []          # by draft position
        self._spec_accepted: list[int] = []
        self._spec_rows = 0
        self._failed_steps = 0

    def publish(self, *, num_running: int, num_waiting: int, num_preemptions: int, prefix_cache_queries: int,
                prefix_cache_hits: int, groups: Iterable[GroupUsage]) -> None:
        """The loop's current gauges and the counters it keeps elsewhere (scheduler, KV-cache manager)."""
        gauges = EngineStats(num_running=num_running, num_waiting=num_waiting, num_preemptions=num_preemptions,
                             prefix_cache_queries=prefix_cache_queries, prefix_cache_hits=prefix_cache_hits,
                             groups=tuple(groups))
        with self._lock:
            self._gauges = gauges

    def record_step(self, *, prompt_tokens: int, first_token_latencies: Iterable[float],
                    inter_token_latencies: Iterable[float], generation_tokens: int) -> None:
        """What one engine step produced: new tokens, first-token latencies and gaps between tokens."""
        with self._lock:
            self._prompt_tokens += prompt_tokens
            self._generation_tokens += generation_tokens
            for s in first_token_latencies:
                self._ttft.observe(s)
            for s in inter_token_latencies:
                self._tpot.observe(s)

    def record_speculation(self, proposed: list[int], accepted: list[int]) -> None:
        """One step's verifying rows: drafts proposed and drafts accepted (a prefix of them) per row."""
        with self._lock:
            self._spec_rows += len(proposed)
            for num_proposed, num_accepted in zip(proposed, accepted, strict=True):
                width = max(num_proposed, len(self._spec_proposed))
                self._spec_proposed += [0] * (width - len(self._spec_proposed))
                self._spec_accepted += [0] * (width - len(self._spec_accepted))
                for k in range(num_proposed):
                    self._spec_proposed[k] += 1
                    self._spec_accepted[k] += k < num_accepted

    def discount_tokens(self, num_tokens: int) -> None:
        """Sampled tokens counted in a step that no client received: computed past a stop string that a front end
        found after the step (split mode; the in-process engine counts only the kept tokens in the first place)."""
        with self._lock:
            self._generation_tokens -= num_tokens

    def record_failed_step(self) -> None:
        with self._lock:
            self._failed_steps += 1

    def record_finished(self, reason: str, e2e_latency_s: float) -> None:
        with self._lock:
            self._finished[reason] = self._finished.get(reason, 0) + 1
            self._e2e.observe(e2e_latency_s)

    def snapshot(self) -> EngineStats:
        with self._lock:
            g = self._gauges
            return EngineStats(
                num_running=g.num_running, num_waiting=g.num_waiting, num_preemptions=g.num_preemptions,
                failed_steps=self._failed_steps, prompt_tokens=self._prompt_tokens, generation_tokens=self._generation_tokens,
                prefix_cache_queries=g.prefix_cache_queries, prefix_cache_hits=g.prefix_cache_hits,
                finished=dict(self._finished), groups=g.groups, time_to_first_token=self._ttft.snapshot(),
                time_per_output_token=self._tpot.snapshot(), e2e_request_latency=self._e2e.snapshot(),
                spec_rows=self._spec_rows, spec_proposed=sum(self._spec_proposed),
                spec_accepted=sum(self._spec_accepted), spec_proposed_by_position=tuple(self._spec_proposed),
                spec_accepted_by_position=tuple(self._spec_accepted))
