"""Tensor parallel 2 vs 1 on this machine: tok/s of the seeded bench workload through the engine, and what rank 0
spends communicating per step (the step it sends every rank, the row-parallel all-reduces, the vocab-parallel
logits gather), timed around each call on rank 0. A collective's time includes waiting for the slower rank.

    python bench/bench_tp.py                       # qwen3_tiny, 16 requests
    python bench/bench_tp.py --size small          # a wider qwen3 (hidden 1024, 8 layers): more compute per byte sent
    python bench/bench_tp.py --requests 32 max_model_len=256

Each rank runs device.cpu_threads (default 1) intra-op threads; TP 1 is one process, TP 2 two processes sharing
the host's cores and talking gloo over loopback TCP. On a CPU host TP 2 is not expected to be faster: the
figures are for cost accounting (how much of a step is communication), not a speedup claim.

--runs N (default 3): TP 1 run 1, TP 2 run 1, TP 1 run 2, ...; each run a fresh engine (its ranks started and
stopped, not timed); every figure the median [min-max] over the runs, with the load average at start and end.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import LoadWatch, add_runs_argument, interleave, spread  # noqa: E402

from appliance.config.compose import load_runtime_config  # noqa: E402
from appliance.engine.engine import Engine  # noqa: E402
from appliance.modes.bench import run_workload, seeded_workload  # noqa: E402
from npu.collectives import Collective  # noqa: E402
from npu.ranks import RankGroup  # noqa: E402

SIZES = {
    "tiny": [],
    "small": ["model.layout.hidden_size=1024", "model.layout.num_heads=16", "model.layout.num_kv_heads=8",
              "model.layout.head_dim=64", "model.layout.intermediate_size=2816", "model.layout.num_layers=8",
              "model.cache_groups.0.row.width=1024"],
}
TIMED = {"step broadcast": (RankGroup, "send"), "all-reduce": (Collective, "all_reduce"),
         "logits gather": (Collective, "all_gather_columns")}


def timed(spent: dict[str, list[float]]) -> None:
    """Wrap each communicating call so that every call's wall time lands in spent[kind]."""
    for kind, (cls, name) in TIMED.items():
        original = getattr(cls, name)

        def wrapper(*args, _original=original, _kind=kind, **kw):
            t0 = time.perf_counter()
            try:
                return _original(*args, **kw)
            finally:
                spent[_kind].append(time.perf_counter() - t0)

        setattr(cls, name, wrapper)


def run(overrides: list[str], spent: dict[str, list[float]]) -> dict:
    rc = load_runtime_config(overrides)
    engine = Engine(rc)
    engine.start()
    try:
        spent.clear()
        metrics = run_workload(engine, seeded_workload(rc))
        metrics["steps"] = engine.steps
    finally:
        engine.shutdown()
    metrics["comm_s"] = {kind: sum(times) for kind, times in spent.items()}
    metrics["comm_calls"] = {kind: len(times) for kind, times in spent.items()}
    return metrics


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    add_runs_argument(parser)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    watch = LoadWatch()
    base = ["+model=qwen3_tiny", "device=cpu", f"device.cpu_threads={args.threads}", "mode=bench",
            f"bench.num_requests={args.requests}", *SIZES[args.size], *args.overrides]
    spent: dict[str, list[float]] = defaultdict(list)
    timed(spent)
    runs = interleave(args.runs, {
        f"TP {tp}": lambda i, tp=tp: run(base + [f"device.count={tp}", f"parallel.tensor_parallel_size={tp}"], spent)
        for tp in (1, 2)}, "bench_tp")
    print(f"qwen3 {args.size}, {args.requests} requests, {args.threads} thread(s) per rank, "
          f"{' '.join(args.overrides) or 'default limits'}")
    print(watch.header(args.runs))
    print("\n| parallelism | tok/s | steps | ms/step | comm ms/step | comm share | breakdown: ms/step (calls/step) |")
    print("|---:|---:|---:|---:|---:|---:|---|")
    for name, ms in runs.items():
        step_ms = [1e3 * m["elapsed_s"] / m["steps"] for m in ms]
        comm_ms = [1e3 * sum(m["comm_s"].values()) / m["steps"] for m in ms]
        kinds = [k for k in TIMED if any(m["comm_s"].get(k) for m in ms)]
        parts = ", ".join(f"{k} {spread([1e3 * m['comm_s'].get(k, 0) / m['steps'] for m in ms], '{:.3f}')} "
                          f"({ms[0]['comm_calls'][k] / ms[0]['steps']:.0f})" for k in kinds)
        print(f"| {name} | {spread([m['output_tokens_per_s'] for m in ms])} | {spread([m['steps'] for m in ms], '{:.0f}')}"
              f" | {spread(step_ms, '{:.2f}')} | {spread(comm_ms, '{:.3f}')} | "
              f"{spread([100 * c / s for c, s in zip(comm_ms, step_ms)])} % | {parts or '-'} |")
    print(watch.footer())


if __name__ == "__main__":
    main(sys.argv[1:])
