"""One process or two: the same streaming workload on a server with the engine on a thread of its own process
(server.engine_process=false) and on one whose engine core runs in a child process (true, appliance/engine/process/:
the front process tokenizes, detokenizes and finds stop strings; the core sends token ids).

    python bench/bench_engine_process.py                          # default model (dsv4_tiny) on this machine
    python bench/bench_engine_process.py +model=qwen3_tiny device=cpu --concurrency 1,8,32 --protocol grpc,http

Both servers are `python -m appliance` with the same overrides and both front ends, started once, warmed up and
reused. For each concurrency and protocol, --runs N (default 3) rounds interleave the two servers (one process run
1, two processes run 1, ...); round i uses workload seed bench.seed + i on both (bench_grpc.workload: token-id
prompts, fixed output lengths, greedy with ignore_eos), so both do identical work, and their output texts are checked to
be equal. gRPC: grpc.aio streams; HTTP: streaming /v1/completions from
openai.AsyncOpenAI. Prints the CPU model and the load average at start and end, and a Markdown table whose every
figure is the median [min-max] over the rounds.
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

from bench_grpc import stop_server, workload  # noqa: E402
from bench_http import StreamResult, grpc_streams, openai_streams, start_server  # noqa: E402
from report import LoadWatch, add_runs_argument, interleave, spread  # noqa: E402

SERVERS = {"one process": "server.engine_process=false", "engine core process": "server.engine_process=true"}
PROTOCOLS = ("grpc", "http")


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def protocol_list(text: str) -> list[str]:
    names = [x for x in text.split(",") if x]
    bad = [x for x in names if x not in PROTOCOLS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown protocol {', '.join(bad)} (choose from {', '.join(PROTOCOLS)})")
    return names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for both servers, e.g. +model=qwen3_tiny")
    ap.add_argument("--concurrency", type=int_list, default=None,
                    help="concurrent requests per round, comma-separated (default bench.num_requests)")
    ap.add_argument("--protocol", type=protocol_list, default=["grpc"], help="grpc, http or grpc,http (default grpc)")
    add_runs_argument(ap)
    args = ap.parse_args()

    from appliance.config.compose import load_runtime_config
    watch = LoadWatch()
    rc = load_runtime_config(args.overrides)
    levels = args.concurrency or [rc.bench.num_requests]
    warmup = workload(rc, 4, rc.bench.seed + 10_000)
    model = rc.model.name

    def stream(protocol: str, address: tuple[str, str], batch, name: str) -> StreamResult:
        if protocol == "grpc":
            return asyncio.run(grpc_streams(address[0], batch, name))
        return asyncio.run(openai_streams(f"http://{address[1]}/v1", model, batch, name))

    table: list[tuple[str, int, str, list[StreamResult]]] = []
    ratios: dict[tuple[str, int], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        servers: dict[str, tuple] = {}
        try:
            for name, override in SERVERS.items():
                proc, grpc_address, http_address = start_server([*args.overrides, override], Path(tmp) / name[:3])
                servers[name] = (proc, (grpc_address, http_address))
                for protocol in args.protocol:
                    stream(protocol, servers[name][1], warmup, "warmup")
            for protocol in args.protocol:
                for n in levels:
                    works = [workload(rc, n, rc.bench.seed + i) for i in range(args.runs)]
                    runs = interleave(args.runs, {
                        name: (lambda i, a=address, name=name, p=protocol: stream(p, a, works[i], name))
                        for name, (_, address) in servers.items()}, f"bench_engine_process {protocol} x{n}")
                    first, second = runs.values()
                    for i, (a, b) in enumerate(zip(first, second)):
                        if a.texts != b.texts:
                            sys.exit(f"{protocol} x{n} round {i + 1}: the two servers' outputs differ: the timings "
                                     "would not compare")
                    table += [(protocol, n, name, results) for name, results in runs.items()]
                    ratios[(protocol, n)] = [b.tokens_per_s / a.tokens_per_s for a, b in zip(first, second)]
        finally:
            for proc, _ in servers.values():
                stop_server(proc)

    mean = lambda xs: 1000 * sum(xs) / len(xs) if xs else float("nan")     # noqa: E731
    print(f"\nmodel {rc.model.name}, overrides {' '.join(args.overrides) or '-'}; both servers started once and "
          f"reused (round i: workload seed {rc.bench.seed} + i on both); outputs identical")
    print(watch.header(args.runs))
    print("\n| protocol | concurrency | server | completion tokens | wall s | completion tok/s | mean TTFT ms | "
          "mean TPOT ms |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for protocol, n, name, results in table:
        tokens = sorted({r.completion_tokens for r in results})
        print(f"| {protocol} | {n} | {name} ({SERVERS[name]}) | {'/'.join(f'{t:,}' for t in tokens)} | "
              f"{spread([r.wall_s for r in results], '{:.2f}')} | {spread([r.tokens_per_s for r in results])} | "
              f"{spread([mean(r.ttft_s) for r in results])} | {spread([mean(r.tpot_s) for r in results], '{:,.2f}')} |")
    print("\nengine core process / one process, completion tok/s per round:")
    for (protocol, n), values in ratios.items():
        print(f"- {protocol} x{n}: {spread(values, '{:.2f}')} x")
    print(watch.footer())


if __name__ == "__main__":
    main()
