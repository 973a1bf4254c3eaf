"""Time the 27-point DeepSeek V4 capacity sweep (mode=plan, no device, no torch) as a user runs it.

    python bench/bench_plan_sweep.py            # multirun (basic launcher) vs joblib vs 27 single runs
    python bench/bench_plan_sweep.py --quick    # the multirun only
    python bench/bench_plan_sweep.py --runs 5   # 5 interleaved rounds (default 3)

Side by side in one run: a single `mode=validate` and a single `mode=plan` run (the config-and-planning
table's commands), the exact sweep command, the same sweep through the joblib launcher, and the peer a user
would otherwise write (a shell loop of 27 separate `mode=plan` runs). The sweep's table is checked against the
peer's plan.json files, so the timings compare runs that computed the same numbers. --runs N rounds of all of
them, interleaved; every time is the median [min-max] over the rounds, with the load average at start and end.
Prints Markdown rows for BENCHMARKS.md. Target: the multirun's median under 30 s.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from report import LoadWatch, add_runs_argument, interleave, median, spread  # noqa: E402

SWEEP = ["+model=dsv4", "device=ascend_a3", "mode=plan", "+sweep=capacity"]
AXES = {"npu_memory_utilization": ("0.7", "0.8", "0.9"), "max_model_len": ("512", "4096", "16384"),
        "decode_batch": ("8", "32", "128")}
TARGET_S = 30.0
VALIDATE = ["+model=dsv4", "mode=validate"]
PLAN = ["+model=dsv4", "mode=plan", "device=ascend_a3", "npu_memory_utilization=0.85"]


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


def peer_single_runs(tmp: Path, rows: list[dict[str, str]]) -> float:
    """The 27 points as separate `mode=plan` runs, as a shell loop would do them; each checked against the sweep."""
    t0 = time.perf_counter()
    for i, values in enumerate(itertools.product(*AXES.values())):
        overrides = [f"{k}={v}" for k, v in zip(AXES, values)]
        run([*SWEEP[:3], *overrides, f"hydra.run.dir={tmp / str(i)}"])
        plan = json.loads((tmp / str(i) / "plan.json").read_text())["plan"]
        row = next(r for r in rows if all(r[k] == v for k, v in zip(AXES, values)))
        if any(int(row[k]) != plan[k] for k in ("capacity_slots", "budget_bytes", "bytes_per_slot")):
            sys.exit(f"sweep row {row} differs from the single run's plan.json")
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="time the multirun only")
    p.add_argument("--n-jobs", type=int, default=os.cpu_count() or 2, help="joblib workers")
    add_runs_argument(p)
    args = p.parse_args()
    watch = LoadWatch()

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        first_rows: list[list[dict[str, str]]] = []

        def basic(i: int) -> float:
            seconds = run(["-m", *SWEEP, f"hydra.sweep.dir={tmp / 'basic' / str(i)}"])
            first_rows.append(sweep_rows(tmp / "basic" / str(i)))
            if first_rows[-1] != first_rows[0]:
                sys.exit("the sweep's table differs between rounds")
            return seconds

        def joblib(i: int) -> float:
            seconds = run(["-m", *SWEEP, "hydra/launcher=joblib", f"hydra.launcher.n_jobs={args.n_jobs}",
                           f"hydra.sweep.dir={tmp / 'joblib' / str(i)}"])
            if sweep_rows(tmp / "joblib" / str(i)) != first_rows[0]:
                sys.exit("the joblib sweep's table differs from the basic launcher's")
            return seconds

        systems = {"`python -m appliance -m " + " ".join(SWEEP) + "` (basic launcher)": basic}
        if not args.quick:
            systems.update({
                f"same sweep, `hydra/launcher=joblib hydra.launcher.n_jobs={args.n_jobs}`": joblib,
                "peer: 27 separate `python -m appliance mode=plan ...` runs":
                    lambda i: peer_single_runs(tmp / "single" / str(i), first_rows[0]),
                f"single `python -m appliance {' '.join(VALIDATE)}`":
                    lambda i: run([*VALIDATE, f"hydra.run.dir={tmp / 'validate' / str(i)}"]),
                f"single `python -m appliance {' '.join(PLAN)}`":
                    lambda i: run([*PLAN, f"hydra.run.dir={tmp / 'plan' / str(i)}"]),
            })
        results = interleave(args.runs, systems, "bench_plan_sweep")

    print("\n27-point DeepSeek V4 capacity sweep (mode=plan, 16 x Ascend A3 profile), and single runs:\n")
    print(watch.header(args.runs))
    print("\n| run | wall time s | per point s |")
    print("|---|---:|---:|")
    for name, seconds in results.items():
        per_point = "" if name.startswith("single") else spread([s / 27 for s in seconds], "{:.2f}")
        print(f"| {name} | {spread(seconds, '{:.2f}')} | {per_point} |")
    basic = median(next(iter(results.values())))
    verdict = "meets" if basic < TARGET_S else "MISSES"
    print(f"\nmultirun median {basic:.1f} s: {verdict} the {TARGET_S:.0f} s target; tables equal"
          + (" across rounds, launchers and the single runs" if not args.quick else " across rounds"))
    print(watch.footer())
    if basic >= TARGET_S:
        sys.exit(1)


if __name__ == "__main__":
    main()
