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
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402

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
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--senders", type=int, default=2, help="threads sending big prompts back to back")
    args = ap.parse_args()
    rc = load_runtime_config(args.overrides)
    bound = (rc.max_model_len - 1) * load_tokenizer_for(rc.model).max_token_bytes
    with tempfile.TemporaryDirectory() as run_dir:
        proc, address = start_server(args.overrides, run_dir)
        try:
            results = {
                "idle": phase(address, args.seconds, None, 0),
                "15MiB": phase(address, args.seconds, "a" * (15 << 20), args.senders),
                "at-bound": phase(address, args.seconds, text_of_bytes(bound), args.senders),
            }
        finally:
            proc.terminate()
            proc.wait(60)
    print(f"{rc.model.name}, max_model_len {rc.max_model_len}, byte bound {bound:,} B; {args.senders} sender(s), "
          f"{args.seconds:g} s per phase; {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
    print("| phase | health checks | p50 ms | p99 ms | max ms | big prompts answered |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        answered = ", ".join(f"{n} {code}" for code, n in sorted(r["big_prompts"].items())) or "-"
        print(f"| {name} | {r['checks']} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['max_ms']:.1f} | {answered} |")


if __name__ == "__main__":
    main()
