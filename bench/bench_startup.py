"""Start to healthy: seconds from `python -m appliance ...` starting until its gRPC health check answers SERVING, and
where they went (issue 37, item 4: a large KV pool must not delay SERVING by touching every page at start).

    python bench/bench_startup.py                                        # this checkout, 3 runs
    python bench/bench_startup.py --checkouts before=../main,after=. --runs 3    # two checkouts, runs interleaved
    python bench/bench_startup.py -- +model=qwen3_tiny device=cpu device.memory_bytes_per_device=1073741824

Each run is a fresh `python -m appliance` (default: +model=qwen3_tiny device=cpu device.memory_bytes_per_device=8 GiB,
the gRPC front end on a free port, no HTTP) started in the checkout's directory, so it runs that checkout's code
(`python -m` puts the working directory first on sys.path). Its output lines are timestamped as they arrive; from the
moment it prints its address, grpc.health.v1 Check is polled every 20 ms; at the first SERVING it is stopped with
SIGTERM. Reported per checkout: start -> weights ready (the "weights loaded" line), the pools' allocation (the
"allocated N slots ... in X s" line's own figure), weights ready -> SERVING, and start -> SERVING.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.report import LoadWatch, add_runs_argument, interleave, spread  # noqa: E402

DEFAULT = ["+model=qwen3_tiny", "device=cpu", "device.memory_bytes_per_device=8589934592"]
POLL_S = 0.02
ALLOCATED = re.compile(r"allocated (\d+) slots .* in ([\d.]+) s")
THREADS = re.compile(r"device\.cpu_threads=null: (\d+) intra-op thread")


def one_run(checkout: Path, overrides: list[str], timeout_s: float) -> dict[str, float]:
    """One start of the server in `checkout`, until health says SERVING; the phases' times in seconds."""
    seen: dict[str, float] = {}
    lines: list[str] = []
    address = [""]                                              # set by the reader thread
    with tempfile.TemporaryDirectory() as run_dir:
        start = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "appliance", *overrides, "server.port=0",
                                 "server.http_port=null", f"hydra.run.dir={run_dir}"], cwd=checkout,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})

        def read() -> None:
            for line in proc.stdout:                            # type: ignore[union-attr]
                now = time.monotonic() - start
                lines.append(line)
                if line.startswith("listening on "):
                    address[0] = line.split()[2]
                elif (t := THREADS.search(line)) is not None:
                    seen["threads"] = float(t.group(1))
                elif "weights loaded in" in line:
                    seen["weights"] = now
                elif (m := ALLOCATED.search(line)) is not None:
                    seen["allocate_s"] = float(m.group(2))
                    seen["slots"] = float(m.group(1))
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            while not address[0]:
                if proc.poll() is not None or time.monotonic() - start > timeout_s:
                    sys.exit(f"{checkout}: the server did not start:\n" + "".join(lines[-30:]))
                time.sleep(POLL_S)
            with grpc.insecure_channel(address[0]) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                while True:
                    try:
                        status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status
                    except grpc.RpcError:
                        status = None
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        seen["serving"] = time.monotonic() - start
                        break
                    if proc.poll() is not None or time.monotonic() - start > timeout_s:
                        sys.exit(f"{checkout}: never SERVING:\n" + "".join(lines[-30:]))
                    time.sleep(POLL_S)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
            reader.join(5)
    return {"weights": seen["weights"], "allocate_s": seen.get("allocate_s", float("nan")),
            "after_weights": seen["serving"] - seen["weights"], "serving": seen["serving"],
            "threads": seen.get("threads", float("nan"))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkouts", default=".",
                    help="comma-separated checkout directories (NAME=DIR to name one), each run in turn")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a run may take before it is abandoned")
    ap.add_argument("overrides", nargs="*", help=f"Hydra overrides (default: {' '.join(DEFAULT)})")
    add_runs_argument(ap)
    args = ap.parse_args()
    overrides = args.overrides or DEFAULT
    checkouts = {name or path: Path(path).resolve()
                 for name, _, path in (c.rpartition("=") for c in args.checkouts.split(","))}
    watch = LoadWatch()
    results = interleave(args.runs, {name: (lambda i, path=path: one_run(path, overrides, args.timeout))
                                     for name, path in checkouts.items()}, "startup")
    print(f"`python -m appliance {' '.join(overrides)} server.port=0 server.http_port=null`\n")
    print(watch.header(args.runs))
    print()
    print("| checkout | start -> weights ready (s) | pool allocation (s) | weights ready -> SERVING (s) "
          "| start -> SERVING (s) | threads chosen |")
    print("|---|---|---|---|---|---|")
    for name, runs in results.items():
        figure = lambda key: spread([r[key] for r in runs], "{:,.2f}")  # noqa: E731
        threads = ", ".join(sorted({f"{r['threads']:g}" for r in runs}))
        print(f"| {name} ({checkouts[name]}) | {figure('weights')} | {figure('allocate_s')} | "
              f"{figure('after_weights')} | {figure('serving')} | {threads} |")
    print()
    print(watch.footer())


if __name__ == "__main__":
    main()
