"""Time the 27-point DeepSeek V4 capacity sweep (mode=plan, no device, no torch) as a user runs it.

    python bench/bench_plan_sweep.py            # multirun (basic launcher) vs joblib vs 27 single runs
    python bench/bench_plan_sweep.py --quick    # the multirun only

Side by side in one run: the exact sweep command, the same sweep through the joblib launcher, and the
peer a user would otherwise write (a shell loop of 27 separate `mode=plan` runs). The sweep's table is
checked against the peer's plan.json files, so the timings compare runs that computed the same numbers.
Prints Markdown rows for BENCHMARKS.md. Target: the multirun under 30 s.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SWEEP = ["+model=dsv4", "device=ascend_a3", "mode=plan", "+sweep=capacity"]
AXES = {"npu_memory_utilization": ("0.7", "0.8", "0.9"), "max_model_len": ("512", "4096", "16384"),
        "decode_batch": ("8", "32", "128")}
TARGET_S = 30.0


def run(args: list[str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "appliance", *args], cwd=REPO, capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): python -m appliance {' '.join(args)}\n{proc.stderr[-3000:]}")
    return elapsed


def sweep_rows(sweep_dir: Path) -> list[dict[str, str]]:
    with (sweep_dir / "sweep.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    if len(rows) != 27 or any(r["status"] != "ok" for r in rows):
        sys.exit(f"expected 27 ok rows in {sweep_dir / 'sweep.csv'}, got {[r['status'] for r in rows]}")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="time the multirun only")
    p.add_argument("--n-jobs", type=int, default=os.cpu_count() or 2, help="joblib workers")
    args = p.parse_args()

    results: list[tuple[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cmd = ["-m", *SWEEP, f"hydra.sweep.dir={tmp / 'basic'}"]
        results.append(("`python -m appliance -m " + " ".join(SWEEP) + "` (basic launcher)", run(cmd)))
        rows = sweep_rows(tmp / "basic")
        if not args.quick:
            cmd = ["-m", *SWEEP, "hydra/launcher=joblib", f"hydra.launcher.n_jobs={args.n_jobs}",
                   f"hydra.sweep.dir={tmp / 'joblib'}"]
            results.append((f"same sweep, `hydra/launcher=joblib hydra.launcher.n_jobs={args.n_jobs}`", run(cmd)))
            if sweep_rows(tmp / "joblib") != rows:
                sys.exit("the joblib sweep's table differs from the basic launcher's")
            # Peer: 27 separate single runs, as a shell loop would do them.
            t0 = time.perf_counter()
            for i, values in enumerate(itertools.product(*AXES.values())):
                overrides = [f"{k}={v}" for k, v in zip(AXES, values)]
                run([*SWEEP[:3], *overrides, f"hydra.run.dir={tmp / 'single' / str(i)}"])
                plan = json.loads((tmp / "single" / str(i) / "plan.json").read_text())["plan"]
                row = next(r for r in rows if all(r[k] == v for k, v in zip(AXES, values)))
                if any(int(row[k]) != plan[k] for k in ("capacity_slots", "budget_bytes", "bytes_per_slot")):
                    sys.exit(f"sweep row {row} differs from the single run's plan.json")
            results.append(("peer: 27 separate `python -m appliance mode=plan ...` runs", time.perf_counter() - t0))

    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    print(f"\n27-point DeepSeek V4 capacity sweep (mode=plan, 16 x Ascend A3 profile) on {machine}:\n")
    print("| run | wall time | per point |")
    print("|---|---:|---:|")
    for name, seconds in results:
        print(f"| {name} | {seconds:.1f} s | {seconds / 27:.2f} s |")
    basic = results[0][1]
    verdict = "meets" if basic < TARGET_S else "MISSES"
    print(f"\nmultirun {basic:.1f} s: {verdict} the {TARGET_S:.0f} s target; tables equal"
          + (" across launchers and the single runs" if not args.quick else ""))
    if basic >= TARGET_S:
        sys.exit(1)


if __name__ == "__main__":
    main()
