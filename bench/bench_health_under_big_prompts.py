"""Health-check latency while huge prompts arrive: one request must never stall the server.

    python bench/bench_health_under_big_prompts.py                   # default model (dsv4_tiny) on this machine
    python bench/bench_health_under_big_prompts.py --seconds 20 --senders 2

Starts `python -m appliance` (as users do) and measures grpc.health.v1 Check latency from this process in
three phases of --seconds each, one after the other:
  idle      nothing else arrives;
  15MiB     --senders threads send 15 MiB text prompts (under the 16 MiB message limit) back to back; the
            server refuses them by their size in bytes, before tokenizing (INVALID_ARGUMENT);
  at-bound  the same with prompts exactly at that byte bound ((max_model_len - 1) x the longest token's
            bytes), which are tokenized in full (in a worker thread, with the GIL released) and then refused
            for having more than max_model_len tokens.
Before the fix a 15 MiB prompt was tokenized on arrival and stalled health for 12-14 s. Prints p50 / p99 / max
per phase and how many big prompts were answered, and with which status.

--runs N (default 3) rounds of the three phases, interleaved (idle 1, 15MiB 1, at-bound 1, idle 2, ...) on one
server started once; every figure is the median [min-max] over the rounds, with the load average at start and end.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import grpc  # noqa: E402
from report import LoadWatch, add_runs_argument, interleave, spread  # noqa: E402

from appliance.client import ApplianceClient  # noqa: E402
from appliance.config.compose import load_runtime_config  # noqa: E402
from appliance.core.tokenizer import load_tokenizer_for  # noqa: E402
from appliance.modes.bench import percentile  # noqa: E402

WORDS = "the appliance serves language models on accelerator servers with a paged cache".split()


def start_server(overrides: list[str], run_dir: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "appliance", *overrides, "server.port=0", "server.http_port=null",
                             f"hydra.run.dir={run_dir}"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    address = None
    for line in proc.stdout:
        if line.startswith("listening on "):
            address = line.split()[2]
        if line.startswith("SERVING on "):
            break
    if address is None:
        raise SystemExit(f"the server did not start (exit {proc.poll()})")
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()   # keep the pipe drained
    return proc, address


def text_of_bytes(n: int) -> str:
    words, size, i = [], 0, 0
    while size < n:
        w = WORDS[i % len(WORDS)] + " "
        words.append(w)
        size += len(w)
        i += 1
    return "".join(words)[:n]


def phase(address: str, seconds: float, prompt: str | None, senders: int) -> dict:
    stop = threading.Event()
    codes: dict[str, int] = {}
    lock = threading.Lock()

    def send() -> None:
        with ApplianceClient(address) as c:
            while not stop.is_set():
                try:
                    c.complete(prompt, max_tokens=1)
                    code = "OK"
                except grpc.RpcError as exc:
                    code = exc.code().name
                with lock:
                    codes[code] = codes.get(code, 0) + 1

    threads = [threading.Thread(target=send, daemon=True) for _ in range(senders if prompt else 0)]
    for t in threads:
        t.start()
    latencies = []
    with ApplianceClient(address) as c:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t0 = time.perf_counter()
            status = c.health(timeout=60)
            latencies.append(time.perf_counter() - t0)
            assert status == "SERVING", status
            time.sleep(0.01)
    stop.set()
    for t in threads:
        t.join(120)
    return {"checks": len(latencies), "p50_ms": 1e3 * percentile(latencies, 50),
            "p99_ms": 1e3 * percentile(latencies, 99), "max_ms": 1e3 * max(latencies), "big_prompts": codes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("overrides", nargs="*", default=["device=cpu", "kv_cache.num_slots_override=16"])
    ap.add_argument("--seconds", type=float, default=10.0, help="length of each phase")
    ap.add_argument("--senders", type=int, default=2, help="threads sending big prompts back to back")
    add_runs_argument(ap)
    args = ap.parse_args()
    watch = LoadWatch()
    rc = load_runtime_config(args.overrides)
    bound = (rc.max_model_len - 1) * load_tokenizer_for(rc.model).max_token_bytes
    with tempfile.TemporaryDirectory() as run_dir:
        proc, address = start_server(args.overrides, run_dir)
        try:
            results = interleave(args.runs, {
                "idle": lambda i: phase(address, args.seconds, None, 0),
                "15MiB": lambda i: phase(address, args.seconds, "a" * (15 << 20), args.senders),
                "at-bound": lambda i: phase(address, args.seconds, text_of_bytes(bound), args.senders),
            }, "bench_health")
        finally:
            proc.terminate()
            proc.wait(60)
    print(f"{rc.model.name}, max_model_len {rc.max_model_len}, byte bound {bound:,} B; {args.senders} sender(s), "
          f"{args.seconds:g} s per phase; one server for every round")
    print(watch.header(args.runs))
    print("\n| phase | health checks | p50 ms | p99 ms | max ms | big prompts answered (all rounds) |")
    print("|---|---:|---:|---:|---:|---|")
    for name, rounds in results.items():
        codes: dict[str, int] = {}
        for r in rounds:
            for code, n in r["big_prompts"].items():
                codes[code] = codes.get(code, 0) + n
        answered = ", ".join(f"{n} {code}" for code, n in sorted(codes.items())) or "-"
        print(f"| {name} | {spread([r['checks'] for r in rounds], '{:,.0f}')} | "
              f"{spread([r['p50_ms'] for r in rounds])} | {spread([r['p99_ms'] for r in rounds])} | "
              f"{spread([r['max_ms'] for r in rounds])} | {answered} |")
    print(watch.footer())


if __name__ == "__main__":
    main()
