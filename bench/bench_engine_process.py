"""One process or two: the same gRPC streaming workload on a server with the engine on a thread of its own process
(server.engine_process=false) and on one whose engine core runs in a child process (true, appliance/engine/process/).

    python bench/bench_engine_process.py                          # default model (dsv4_tiny) on this machine
    python bench/bench_engine_process.py +model=qwen3_tiny device=cpu --requests 64

Both servers are `python -m appliance` with the same overrides, started once, warmed up and reused across rounds;
--runs N (default 3) rounds interleaved (one process run 1, two processes run 1, ...), round i with workload seed
bench.seed + i on both (bench_grpc.workload: token-id prompts, fixed output lengths, greedy with ignore_eos), so both
do identical work and their token ids are checked to be equal. Both servers are up for the whole run (an idle one
costs next to nothing: no engine step runs). Every figure is the median [min-max] over the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench_grpc import _streams, grpc_server, workload  # noqa: E402
from report import LoadWatch, add_runs_argument, interleave, spread  # noqa: E402

SERVERS = {"one process": "server.engine_process=false", "engine core process": "server.engine_process=true"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for both servers, e.g. +model=qwen3_tiny")
    ap.add_argument("--requests", type=int, default=None, help="concurrent requests (default bench.num_requests)")
    add_runs_argument(ap)
    args = ap.parse_args()

    from appliance.config.compose import load_runtime_config
    watch = LoadWatch()
    rc = load_runtime_config(args.overrides)
    n = args.requests or rc.bench.num_requests
    works = [workload(rc, n, rc.bench.seed + i) for i in range(args.runs)]
    warmup = workload(rc, 4, rc.bench.seed + 10_000)

    with tempfile.TemporaryDirectory() as tmp, \
            grpc_server([*args.overrides, SERVERS["one process"]], warmup, Path(tmp) / "one") as one, \
            grpc_server([*args.overrides, SERVERS["engine core process"]], warmup, Path(tmp) / "two") as two:
        addresses = {"one process": one, "engine core process": two}
        runs = interleave(args.runs, {name: (lambda i, a=address, name=name: asyncio.run(_streams(a, works[i], name)))
                                      for name, address in addresses.items()}, "bench_engine_process")
    first, second = runs.values()
    for i, (a, b) in enumerate(zip(first, second)):
        if a.tokens != b.tokens:
            sys.exit(f"round {i + 1}: the two servers' outputs differ: the timings would not compare")

    print(f"\n{n} concurrent gRPC streams per round, model {rc.model.name}, overrides "
          f"{' '.join(args.overrides) or '-'}; both servers started once and reused (round i: workload seed "
          f"{rc.bench.seed} + i on both)")
    print(watch.header(args.runs))
    print("\n| server | completion tokens | wall s | completion tok/s | mean TTFT ms |")
    print("|---|---:|---:|---:|---:|")
    for name, results in runs.items():
        tokens = sorted({r.completion_tokens for r in results})
        print(f"| {name} ({SERVERS[name]}) | {'/'.join(f'{t:,}' for t in tokens)} | "
              f"{spread([r.wall_s for r in results], '{:.2f}')} | {spread([r.tokens_per_s for r in results])} | "
              f"{spread([r.mean_ttft_ms for r in results])} |")
    ratios = [b.tokens_per_s / a.tokens_per_s for a, b in zip(first, second)]
    print(f"\nengine core process / one process, completion tok/s per round: {spread(ratios, '{:.2f}')} x; "
          "outputs identical")
    print(watch.footer())


if __name__ == "__main__":
    main()
