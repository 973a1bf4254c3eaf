"""What gRPC costs: the same streaming workload in-process (engine.submit) and over gRPC (many concurrent streams).

    python bench/bench_grpc.py                               # default model (dsv4_tiny) on this machine
    python bench/bench_grpc.py +model=qwen3_tiny device=cpu --requests 128

Side by side in one run, one after the other so they never share the CPU: (1) an Engine in this process,
every request submitted at once with an on_output callback; (2) `python -m appliance` as a server process
with the same overrides, every request a concurrent grpc.aio stream from this process. Greedy decoding with
ignore_eos and fixed lengths makes both do identical work, and the token ids are checked to be equal, so the
throughput difference is the API's cost (serialization, HTTP/2, the event loop, a second process's client).

--runs N (default 3) rounds, interleaved: in-process run 1, gRPC run 1, in-process run 2, ... The engine and
the server are each started once and reused across rounds (their start-up is not what is measured); round i
uses workload seed bench.seed + i on both sides, so no round is served from the prefix cache of an earlier one.
Every figure is the median [min-max] over the rounds. Prints Markdown rows for BENCHMARKS.md. Target: gRPC
throughput within 10% of in-process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from report import LoadWatch, add_runs_argument, interleave, median, spread  # noqa: E402

TARGET_OVERHEAD = 0.10


@dataclass
class Result:
    name: str
    wall_s: float
    completion_tokens: int
    ttft_s: list[float]
    tokens: list[list[int]]

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s

    @property
    def mean_ttft_ms(self) -> float:
        return 1000 * sum(self.ttft_s) / len(self.ttft_s)


def workload(rc, n: int, seed: int) -> list[tuple[list[int], int]]:
    """n (prompt token ids, max_tokens) pairs from rc.bench's length ranges, within max_model_len."""
    rng = random.Random(seed)
    vocab, b = rc.model.layout.vocab_size, rc.bench
    out = []
    for _ in range(n):
        plen = rng.randint(b.prompt_len_min, b.prompt_len_max)
        olen = rng.randint(b.output_len_min, b.output_len_max)
        plen = min(plen, rc.max_model_len - olen)
        out.append(([rng.randrange(3, vocab) for _ in range(plen)], olen))
    return out


def submit_all(engine, batch, name: str) -> Result:
    """Every request of the batch submitted at once to an in-process engine; waits for the last to finish."""
    from appliance.core.request import SamplingParams

    done = threading.Event()
    left = [len(batch)]
    tokens: list[list[int]] = [[] for _ in batch]
    first: list[float] = [0.0] * len(batch)
    lock = threading.Lock()

    def callback(i):
        def on_output(out):
            if out.new_token_ids and not tokens[i]:
                first[i] = time.perf_counter()
            tokens[i].extend(out.new_token_ids)
            if out.finished:
                if out.error:
                    print(f"request {i} failed: {out.error}", file=sys.stderr)
                with lock:
                    left[0] -= 1
                    if left[0] == 0:
                        done.set()
        return on_output

    t0 = time.perf_counter()
    for i, (prompt, max_tokens) in enumerate(batch):
        engine.submit(f"{name}-{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                      on_output=callback(i))
    done.wait()
    wall = time.perf_counter() - t0
    return Result(name, wall, sum(map(len, tokens)), [f - t0 for f in first], tokens)


@contextlib.contextmanager
def in_process_engine(rc, warmup):
    """A started, warmed-up Engine in this process, shut down on exit."""
    from appliance.engine.engine import Engine

    engine = Engine(rc)
    engine.start()
    try:
        submit_all(engine, warmup, "warmup")
        yield engine
    finally:
        engine.shutdown()


async def _streams(address: str, batch, name: str) -> Result:
    import grpc

    from appliance.serve.api import appliance_pb2_grpc as pb_grpc
    from appliance.serve.convert import generate_request

    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.ApplianceStub(channel)
        tokens: list[list[int]] = [[] for _ in batch]
        first: list[float] = [0.0] * len(batch)
        t0 = time.perf_counter()

        async def one(i, prompt, max_tokens):
            async for msg in stub.Generate(generate_request(prompt, max_tokens=max_tokens, ignore_eos=True)):
                if msg.token_ids and not tokens[i]:
                    first[i] = time.perf_counter()
                tokens[i].extend(msg.token_ids)

        await asyncio.gather(*(one(i, p, m) for i, (p, m) in enumerate(batch)))
        wall = time.perf_counter() - t0
    return Result(name, wall, sum(map(len, tokens)), [f - t0 for f in first], tokens)


@contextlib.contextmanager
def grpc_server(overrides: list[str], warmup, run_dir: Path):
    """`python -m appliance` with the gRPC front end on a free port, SERVING and warmed up: yields its address."""
    from appliance.client import ApplianceClient

    proc = subprocess.Popen([sys.executable, "-m", "appliance", *overrides, "server.port=0", "server.http_port=null",
                             f"hydra.run.dir={run_dir}"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    address = None
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("listening on "):
                address = line.split()[2]
            if line.startswith("SERVING on "):
                break
        if address is None or proc.poll() is not None:
            sys.exit("server did not start:\n" + "".join(lines[-40:]))
        threading.Thread(target=lambda: [lines.append(x) for x in proc.stdout], daemon=True).start()
        ApplianceClient(address).wait_until_serving(timeout=60)
        asyncio.run(_streams(address, warmup, "warmup"))
        yield address
    finally:
        stop_server(proc)


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM (the server drains and exits), then kill if it has not exited within a minute."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for both sides, e.g. +model=qwen3_tiny")
    ap.add_argument("--requests", type=int, default=None, help="concurrent requests (default bench.num_requests)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads on both sides (OMP_NUM_THREADS); on a small shared CPU box the "
                         "default oversubscribes the cores once a second process (the server) runs")
    add_runs_argument(ap)
    args = ap.parse_args()
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)     # before torch is imported; the server inherits it

    from appliance.config.compose import load_runtime_config
    watch = LoadWatch()
    rc = load_runtime_config(args.overrides)
    n = args.requests or rc.bench.num_requests
    works = [workload(rc, n, rc.bench.seed + i) for i in range(args.runs)]
    warmup = workload(rc, 4, rc.bench.seed + 10_000)

    with tempfile.TemporaryDirectory() as tmp, in_process_engine(rc, warmup) as engine, \
            grpc_server(args.overrides, warmup, Path(tmp) / "run") as address:
        runs = interleave(args.runs, {
            "in-process": lambda i: submit_all(engine, works[i], "in-process"),
            "gRPC": lambda i: asyncio.run(_streams(address, works[i], "gRPC")),
        }, "bench_grpc")
    locals_, remotes = runs["in-process"], runs["gRPC"]
    for i, (local, remote) in enumerate(zip(locals_, remotes)):
        if remote.tokens != local.tokens:
            bad = sum(a != b for a, b in zip(remote.tokens, local.tokens))
            sys.exit(f"round {i + 1}: gRPC and in-process outputs differ for {bad} of {n} requests: the timings "
                     "would not compare")

    overheads = [1 - r.tokens_per_s / l.tokens_per_s for l, r in zip(locals_, remotes)]  # noqa: E741
    print(f"\n{n} concurrent streaming requests per round, model {rc.model.name}, overrides "
          f"{' '.join(args.overrides) or '-'}; the engine and the server each started once and reused across "
          f"rounds (round i: workload seed {rc.bench.seed} + i, the same on both sides)")
    print(watch.header(args.runs))
    print("\n| path | completion tokens | wall s | completion tok/s | mean TTFT ms |")
    print("|---|---:|---:|---:|---:|")
    for name, results in (("in-process", locals_), ("gRPC", remotes)):
        tokens = sorted({r.completion_tokens for r in results})
        print(f"| {name} | {'/'.join(f'{t:,}' for t in tokens)} | {spread([r.wall_s for r in results], '{:.2f}')} | "
              f"{spread([r.tokens_per_s for r in results])} | {spread([r.mean_ttft_ms for r in results])} |")
    verdict = "meets" if median(overheads) < TARGET_OVERHEAD else "MISSES"
    print(f"\ngRPC throughput cost (per round, 1 - gRPC / in-process): {spread([100 * o for o in overheads], '{:.1f}')}"
          f" % ({verdict} the < {TARGET_OVERHEAD:.0%} target at the median); outputs identical")
    print(watch.footer())


if __name__ == "__main__":
    main()
