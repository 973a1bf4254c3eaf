"""device.cpu_threads on a shared host: time to serving and tok/s of `python -m appliance mode=bench` with N CPU
burners (busy Python loops, each killed after its runs) beside it (issue 24, item 8).

    python bench/bench_shared_host.py                                   # both tiny models, 0 / 2 / 4 burners
    python bench/bench_shared_host.py --burners 0,4 --threads default,1,2 --models dsv4_tiny

Each run is a fresh process, so the figures include Python start, imports and the compiled kernels' load:
`to serving` is the process's wall time until its engine was ready (wall time minus the workload's elapsed time
bench.json reports), `tok/s` the workload's (4 requests, 16-32 prompt tokens, 16 new tokens each). `threads`
`default` is whatever the build's default picks (its log line says which and why). Every run is bounded
(--timeout, then killed: the row says so).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKLOAD = ["bench.num_requests=4", "bench.prompt_len_min=16", "bench.prompt_len_max=32", "bench.output_len_min=16",
            "bench.output_len_max=16"]
MODELS = {"dsv4_tiny": [], "qwen3_tiny": ["+model=qwen3_tiny"]}


def burners(n: int, timeout_s: float) -> list[subprocess.Popen]:
    """n busy loops, each ending by itself after timeout_s (and killed after its runs)."""
    loop = f"import time\nend = time.monotonic() + {timeout_s}\nwhile time.monotonic() < end: pass"
    return [subprocess.Popen([sys.executable, "-c", loop]) for _ in range(n)]


def one_run(model: str, threads: str, timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory() as run_dir:
        args = [sys.executable, "-m", "appliance", "mode=bench", "device=cpu", *MODELS[model], *WORKLOAD,
                f"hydra.run.dir={run_dir}"]
        if threads != "default":
            args.append(f"device.cpu_threads={threads}")
        start = time.monotonic()
        try:
            proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"wall_s": timeout_s, "timed_out": True}
        wall = time.monotonic() - start
        if proc.returncode != 0:
            return {"wall_s": wall, "failed": proc.stderr[-500:]}
        metrics = json.loads((Path(run_dir) / "bench.json").read_text())["metrics"]
        chosen = next((ln for ln in (proc.stdout + proc.stderr).splitlines() if "intra-op thread" in ln), "")
        return {"wall_s": wall, "to_serving_s": wall - metrics["elapsed_s"], "tok_s": metrics["output_tokens_per_s"],
                "tpot_p50_ms": metrics["tpot_p50_s"] * 1e3, "chosen": chosen.split("] ")[-1][:90]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--burners", default="0,2,4")
    ap.add_argument("--threads", default="default,1")
    ap.add_argument("--models", default="dsv4_tiny,qwen3_tiny")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds per run before it is killed")
    args = ap.parse_args()
    print(f"host: {os.cpu_count()} CPUs, affinity {len(os.sched_getaffinity(0))}", flush=True)
    print("| burners | load at start | model | threads | to serving (s) | tok/s | TPOT p50 (ms) | default chose |")
    print("|---|---|---|---|---|---|---|---|")
    for n in (int(b) for b in args.burners.split(",")):
        procs = burners(n, args.timeout * 8)
        try:
            time.sleep(2 if n else 0)            # the burners running before the launch
            for model in args.models.split(","):
                for threads in args.threads.split(","):
                    load = os.getloadavg()[0]
                    r = one_run(model, threads, args.timeout)
                    if "to_serving_s" in r:
                        figures = f"{r['to_serving_s']:.1f} | {r['tok_s']:.1f} | {r['tpot_p50_ms']:.0f} | {r['chosen']}"
                    else:
                        figures = f"> {r['wall_s']:.0f} (killed) | - | - |" if r.get("timed_out") else \
                            f"failed | - | - | {r['failed'][-80:]!r}"
                    print(f"| {n} | {load:.1f} | {model} | {threads} | {figures} |", flush=True)
        finally:
            for p in procs:
                p.kill()
                p.wait()


if __name__ == "__main__":
    main()
