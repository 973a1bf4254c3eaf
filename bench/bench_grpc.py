"""What gRPC costs: the same streaming workload in-process (engine.submit) and over gRPC (many concurrent streams).

    python bench/bench_grpc.py                               # default model (dsv4_tiny) on this machine
    python bench/bench_grpc.py +model=qwen3_tiny device=cpu --requests 128

Side by side in one run, one after the other so they never share the CPU: (1) an Engine in this process,
every request submitted at once with an on_output callback; (2) `python -m appliance` as a server process
with the same overrides, every request a concurrent grpc.aio stream from this process. Greedy decoding with
ignore_eos and fixed lengths makes both do identical work, and the token ids are checked to be equal, so the
throughput difference is the API's cost (serialization, HTTP/2, the event loop, a second process's client).
Prints Markdown rows for BENCHMARKS.md. Target: gRPC throughput within 10% of in-process.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
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


def run_in_process(rc, work, warmup) -> Result:
    from appliance.core.request import SamplingParams
    from appliance.engine.loop import Engine

    engine = Engine(rc)
    engine.start()
    try:
        for name, batch in (("warmup", warmup), ("in-process", work)):
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
        return Result("in-process", wall, sum(map(len, tokens)), [f - t0 for f in first], tokens)
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


def run_grpc(overrides: list[str], work, warmup, run_dir: Path) -> Result:
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
        return asyncio.run(_streams(address, work, "gRPC"))
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
    ap.add_argument("--repeats", type=int, default=1, help="runs of each side; the best of each is reported")
    args = ap.parse_args()
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)     # before torch is imported; the server inherits it

    from appliance.config.compose import load_runtime_config
    rc = load_runtime_config(args.overrides)
    n = args.requests or rc.bench.num_requests
    work = workload(rc, n, rc.bench.seed)
    warmup = workload(rc, 4, rc.bench.seed + 1)

    best = lambda results: max(results, key=lambda r: r.tokens_per_s)          # noqa: E731
    locals_, remotes = [], []
    for _ in range(args.repeats):                 # interleaved, so a busy neighbour hurts both sides alike
        locals_.append(run_in_process(rc, work, warmup))
        with tempfile.TemporaryDirectory() as tmp:
            remotes.append(run_grpc(args.overrides, work, warmup, Path(tmp) / "run"))
    local, remote = best(locals_), best(remotes)
    if remote.tokens != local.tokens:
        bad = sum(a != b for a, b in zip(remote.tokens, local.tokens))
        sys.exit(f"gRPC and in-process outputs differ for {bad} of {n} requests: the timings would not compare")

    overhead = 1 - remote.tokens_per_s / local.tokens_per_s
    print(f"\n{n} concurrent streaming requests, {local.completion_tokens} completion tokens, model "
          f"{rc.model.name}, {platform.machine()} x {os.cpu_count()} CPUs, OMP_NUM_THREADS "
          f"{os.environ.get('OMP_NUM_THREADS', 'default')}, best of {args.repeats}, overrides "
          f"{' '.join(args.overrides) or '-'}")
    print("| path | wall s | completion tok/s | mean TTFT ms |")
    print("|---|---:|---:|---:|")
    for r in (local, remote):
        print(f"| {r.name} | {r.wall_s:.2f} | {r.tokens_per_s:,.1f} | {r.mean_ttft_ms:,.1f} |")
    verdict = "meets" if overhead < TARGET_OVERHEAD else "MISSES"
    print(f"\ngRPC throughput cost: {overhead:+.1%} ({verdict} the < {TARGET_OVERHEAD:.0%} target); "
          "outputs identical")


if __name__ == "__main__":
    main()
