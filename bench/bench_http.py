"""A serving benchmark through the OpenAI API (the official `openai` client), beside gRPC on the same server.

    python bench/bench_http.py                                  # default model (dsv4_tiny) on this machine
    python bench/bench_http.py +model=qwen3_tiny device=cpu --requests 64

One `python -m appliance` process serves both front ends; the same workload (bench_grpc.workload: token-id
prompts, fixed output lengths, greedy with ignore_eos) runs as concurrent gRPC streams and then as concurrent
streaming /v1/completions requests from openai.AsyncOpenAI, one after the other so they never share the CPU.
The texts are checked to be equal, so the difference is the API's cost (JSON + server-sent events vs protobuf
over HTTP/2). Reports wall time, completion tok/s, mean TTFT and mean TPOT as the client sees them, and what
the server's GET /metrics counted, and the CPU time of the server's own process per completion token (its front
ends; the engine core runs in a child process unless server.engine_process=false). Prints Markdown rows for
BENCHMARKS.md.

--runs N (default 3) rounds on the one server, interleaved: gRPC run 1, HTTP run 1, gRPC run 2, ...; round i
uses workload seed bench.seed + i on both front ends (no round is served from an earlier round's prefix
cache). Every figure is the median [min-max] over the rounds; the load average is printed at start and end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench_grpc import Result, stop_server, workload  # noqa: E402
from report import LoadWatch, add_runs_argument, interleave, spread  # noqa: E402


@dataclass
class StreamResult(Result):
    """bench_grpc's Result plus what a text stream shows: its texts and each request's time per output token."""

    tpot_s: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    server_cpu_s: float = 0.0       # CPU time of the server's own process during the run (its front ends)


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds process `pid` has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def with_server_cpu(pid: int, run: Callable[[int], StreamResult]) -> Callable[[int], StreamResult]:
    """`run`, its result carrying the CPU time the server process `pid` spent meanwhile."""
    def measured(i: int) -> StreamResult:
        before = process_cpu_s(pid)
        result = run(i)
        result.server_cpu_s = process_cpu_s(pid) - before
        return result
    return measured


def _summary(name: str, t0: float, wall: float, firsts: list[float], lasts: list[float], counts: list[int],
             texts: list[str]) -> StreamResult:
    tpot = [(last - first) / (n - 1) for first, last, n in zip(firsts, lasts, counts) if n > 1]
    return StreamResult(name, wall, sum(counts), [f - t0 for f in firsts], [], tpot, texts)


async def grpc_streams(address: str, batch, name: str) -> StreamResult:
    import grpc

    from appliance.serve.api import appliance_pb2_grpc as pb_grpc
    from appliance.serve.convert import generate_request

    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.ApplianceStub(channel)
        n = len(batch)
        texts, counts, firsts, lasts = [""] * n, [0] * n, [0.0] * n, [0.0] * n
        t0 = time.perf_counter()

        async def one(i, prompt, max_tokens):
            async for msg in stub.Generate(generate_request(prompt, max_tokens=max_tokens, ignore_eos=True)):
                now = time.perf_counter()
                if msg.token_ids and not counts[i]:
                    firsts[i] = now
                counts[i] += len(msg.token_ids)
                lasts[i] = now
                texts[i] += msg.text

        await asyncio.gather(*(one(i, p, m) for i, (p, m) in enumerate(batch)))
        return _summary(name, t0, time.perf_counter() - t0, firsts, lasts, counts, texts)


async def openai_streams(base_url: str, model: str, batch, name: str) -> StreamResult:
    import openai

    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600) as client:
        n = len(batch)
        texts, counts, firsts, lasts = [""] * n, [0] * n, [0.0] * n, [0.0] * n
        t0 = time.perf_counter()

        async def one(i, prompt, max_tokens):
            stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                                     temperature=0, stream=True,
                                                     stream_options={"include_usage": True},
                                                     extra_body={"ignore_eos": True})
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.choices and chunk.choices[0].text:
                    if not texts[i]:
                        firsts[i] = now
                    texts[i] += chunk.choices[0].text
                    lasts[i] = now
                if chunk.usage is not None:
                    counts[i] = chunk.usage.completion_tokens

        await asyncio.gather(*(one(i, p, m) for i, (p, m) in enumerate(batch)))
        return _summary(name, t0, time.perf_counter() - t0, firsts, lasts, counts, texts)


def start_server(overrides: list[str], run_dir: Path) -> tuple[subprocess.Popen, str, str]:
    """`python -m appliance` with both front ends on free ports: (process, gRPC address, HTTP address) once
    SERVING; its later output is drained by a thread so the pipe never fills."""
    proc = subprocess.Popen([sys.executable, "-m", "appliance", *overrides, "server.port=0", "server.http_port=0",
                             f"hydra.run.dir={run_dir}"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("SERVING on "):
            break
    out = "".join(lines)
    grpc_match = re.search(r"^listening on (\S+)", out, re.M)
    http_match = re.search(r"^http listening on (\S+)", out, re.M)
    if proc.poll() is not None or not grpc_match or not http_match:
        stop_server(proc)
        sys.exit("server did not start:\n" + "".join(lines[-40:]))
    threading.Thread(target=lambda: [lines.append(x) for x in proc.stdout], daemon=True).start()
    return proc, grpc_match.group(1), http_match.group(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for the server, e.g. +model=qwen3_tiny")
    ap.add_argument("--requests", type=int, default=None, help="concurrent requests (default bench.num_requests)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads of the server")
    add_runs_argument(ap)
    args = ap.parse_args()
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)

    from appliance.config.compose import load_runtime_config
    watch = LoadWatch()
    rc = load_runtime_config(args.overrides)
    n = args.requests or rc.bench.num_requests
    works = [workload(rc, n, rc.bench.seed + i) for i in range(args.runs)]
    warmup = workload(rc, 4, rc.bench.seed + 10_000)

    with tempfile.TemporaryDirectory() as tmp:
        proc, grpc_address, http_address = start_server(args.overrides, Path(tmp) / "run")
        try:
            base_url = f"http://{http_address}/v1"
            asyncio.run(grpc_streams(grpc_address, warmup, "warmup"))
            asyncio.run(openai_streams(base_url, rc.model.name, warmup, "warmup"))
            runs = interleave(args.runs, {
                "gRPC (grpc.aio streams)": with_server_cpu(proc.pid, lambda i: asyncio.run(
                    grpc_streams(grpc_address, works[i], "gRPC"))),
                "HTTP (openai.AsyncOpenAI, SSE)": with_server_cpu(proc.pid, lambda i: asyncio.run(
                    openai_streams(base_url, rc.model.name, works[i], "HTTP"))),
            }, "bench_http")
            with urllib.request.urlopen(f"http://{http_address}/metrics", timeout=30) as r:
                metrics = r.read().decode()
        finally:
            stop_server(proc)
    remotes, https = runs.values()
    for i, (remote, http) in enumerate(zip(remotes, https)):
        if http.texts != remote.texts:
            bad = sum(a != b for a, b in zip(http.texts, remote.texts))
            sys.exit(f"round {i + 1}: HTTP and gRPC outputs differ for {bad} of {n} requests: the timings would "
                     "not compare")

    mean = lambda xs: 1000 * sum(xs) / len(xs) if xs else float("nan")     # noqa: E731
    print(f"\n{n} concurrent streaming requests per round, model {rc.model.name}, overrides "
          f"{' '.join(args.overrides) or '-'}; one server for both front ends and every round (round i: workload "
          f"seed {rc.bench.seed} + i)")
    print(watch.header(args.runs))
    where = "front ends" if rc.server.engine_process else "front ends and engine"
    print(f"\n| path | completion tokens | wall s | completion tok/s | mean TTFT ms | mean TPOT ms | server process "
          f"CPU us / token ({where}) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, results in runs.items():
        tokens = sorted({r.completion_tokens for r in results})
        print(f"| {name} | {'/'.join(f'{t:,}' for t in tokens)} | {spread([r.wall_s for r in results], '{:.2f}')} | "
              f"{spread([r.tokens_per_s for r in results])} | {spread([mean(r.ttft_s) for r in results])} | "
              f"{spread([mean(r.tpot_s) for r in results], '{:,.2f}')} | "
              f"{spread([1e6 * r.server_cpu_s / r.completion_tokens for r in results], '{:,.0f}')} |")
    relative = [100 * (h.tokens_per_s / g.tokens_per_s - 1) for g, h in zip(remotes, https)]
    print(f"\nHTTP throughput vs gRPC (per round): {spread(relative, '{:+.1f}')} %; outputs identical")
    scraped = {m.group(1): m.group(2) for m in re.finditer(
        r"^appliance:(generation_tokens_total|prompt_tokens_total|time_to_first_token_seconds_count)\{[^}]*\} (\S+)$",
        metrics, re.M)}
    print(f"server /metrics after every round: {scraped}")
    print(watch.footer())


if __name__ == "__main__":
    main()
