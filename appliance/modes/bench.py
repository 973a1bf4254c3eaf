"""`mode=bench`: start the engine in-process, run a seeded workload, report throughput and latency."""

from __future__ import annotations

import random
import resource
import threading
import time
from pathlib import Path
from typing import Any

from appliance.core.config import RuntimeConfig
from appliance.core.request import SamplingParams
from appliance.engine.engine import Engine
from appliance.engine.stats import EngineStats
from appliance.modes.results import write_result


def seeded_workload(rc: RuntimeConfig) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) per request, drawn from bench.seed; ids avoid special tokens."""
    b = rc.bench
    rng = random.Random(b.seed)
    vocab = rc.model.layout.vocab_size
    max_prompt = min(b.prompt_len_max, rc.max_model_len - b.output_len_max)
    work = []
    for _ in range(b.num_requests):
        n_prompt = rng.randint(min(b.prompt_len_min, max_prompt), max_prompt)
        n_out = rng.randint(b.output_len_min, b.output_len_max)
        work.append(([rng.randrange(3, vocab) for _ in range(n_prompt)], n_out))
    return work


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def run_workload(engine, work: list[tuple[list[int], int]], prefix: str = "bench") -> dict[str, Any]:
    """Submit every request at once and time first tokens and completions from the engine's callbacks."""
    start = time.perf_counter()
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    counts: dict[str, int] = {}
    all_done = threading.Event()

    def on_output(out) -> None:
        now = time.perf_counter()
        if out.new_token_ids and out.request_id not in first:
            first[out.request_id] = now
        counts[out.request_id] = counts.get(out.request_id, 0) + len(out.new_token_ids)
        if out.finished:
            done[out.request_id] = now
            if len(done) == len(work):
                all_done.set()

    for i, (prompt, n_out) in enumerate(work):
        engine.submit(f"{prefix}-{i}", prompt, SamplingParams(max_tokens=n_out, ignore_eos=True), on_output=on_output)
    all_done.wait()
    elapsed = time.perf_counter() - start
    ttft = [first[r] - start for r in first]
    tpot = [(done[r] - first[r]) / (counts[r] - 1) for r in done if counts.get(r, 0) > 1]
    output_tokens = sum(counts.values())
    return {
        "requests": len(work), "output_tokens": output_tokens, "elapsed_s": elapsed,
        "output_tokens_per_s": output_tokens / elapsed, "requests_per_s": len(work) / elapsed,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_s": percentile(tpot, 50), "tpot_p99_s": percentile(tpot, 99),
    }


def speculation_metrics(stats: EngineStats) -> dict[str, Any]:
    """Speculative decoding's figures (none when it is off): tokens each verifying decode row emitted on average
    (1 + accepted drafts) and the acceptance rate of each draft position."""
    if not stats.spec_rows:
        return {}
    return {"spec_verify_rows": stats.spec_rows, "spec_draft_tokens": stats.spec_proposed,
            "spec_accepted_tokens": stats.spec_accepted,
            "spec_tokens_per_verify_row": 1 + stats.spec_accepted / stats.spec_rows,
            "spec_acceptance_by_position": list(stats.spec_acceptance_by_position)}


def run_bench(rc: RuntimeConfig, output_dir: Path | None = None, quiet: bool = False) -> dict[str, Any]:
    """Run the seeded workload, print its figures (unless quiet: a job of a sweep, which prints one line per job)
    and write bench.json."""
    engine = Engine(rc)
    t0 = time.perf_counter()
    report = engine.start()
    startup_s = time.perf_counter() - t0
    try:
        metrics = run_workload(engine, seeded_workload(rc))
        metrics["startup_s"] = startup_s
        metrics["preemptions"] = engine.scheduler.num_preemptions
        metrics["peak_memory_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        metrics.update(speculation_metrics(engine.stats()))
    finally:
        engine.shutdown()
    if not quiet:
        print(f"bench {rc.model.name}: {metrics['requests']} requests, {metrics['output_tokens']} output tokens in "
              f"{metrics['elapsed_s']:.2f} s -> {metrics['output_tokens_per_s']:.1f} tok/s, "
              f"{metrics['requests_per_s']:.2f} req/s; TTFT p50 {metrics['ttft_p50_s'] * 1e3:.1f} ms "
              f"p99 {metrics['ttft_p99_s'] * 1e3:.1f} ms; TPOT p50 {metrics['tpot_p50_s'] * 1e3:.2f} ms "
              f"p99 {metrics['tpot_p99_s'] * 1e3:.2f} ms; startup {startup_s:.2f} s"
              + (f"; {metrics['spec_tokens_per_verify_row']:.2f} tokens per verifying row, acceptance by position "
                 f"{', '.join(f'{r:.2f}' for r in metrics['spec_acceptance_by_position'])}"
                 if metrics.get("spec_verify_rows") else ""))
    result = {"status": "ok", "mode": "bench", "model": rc.model.name, "startup": report.to_dict(),
              "metrics": metrics}
    write_result(output_dir, "bench.json", result)
    return result
