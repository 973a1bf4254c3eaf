"""Run every benchmark BENCHMARKS.md reports, in sequence, into one results directory (`make bench-all`).

    python bench/run_all.py                      # everything, 3 interleaved runs each (about 20 min when quiet)
    python bench/run_all.py --only engine,grpc   # a subset (names: --list)
    python bench/run_all.py --runs 1 --dry-run   # the plan and its time estimate, nothing run

Each benchmark's stdout (its Markdown) goes to bench/results/<UTC time>/<name>.md and its stderr to <name>.log;
summary.md holds the machine, the load average at start and end, each benchmark's command, status, wall time
and estimate, and then every benchmark's Markdown, ready to paste into BENCHMARKS.md. A script that does not
exist (yet) is skipped and named as skipped; a failing one is recorded and the rest still run. --runs is passed
to the scripts that take it (see bench/report.py); the others run as their own defaults say.

The figures mean something only on a quiet machine: the summary calls out a busy start, and BENCHMARKS.md's
figures come from a run of this driver with nothing else on the cores.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
sys.path.insert(0, str(BENCH))

from report import LoadWatch  # noqa: E402


@dataclass(frozen=True)
class Benchmark:
    """One script with the arguments its BENCHMARKS.md section names, and what it costs on a quiet 2-core host
    (setup_s once, run_s per --runs round; rough, for planning the whole run)."""

    name: str
    script: str
    args: tuple[str, ...] = ()
    setup_s: float = 10.0
    run_s: float = 30.0
    by_default: bool = True
    needs: tuple[str, ...] = field(default=())    # executables that must be on PATH, else skipped

    def path(self) -> Path:
        return BENCH / self.script

    def takes_runs(self) -> bool:
        """Whether the script has the shared --runs flag (read from its source: cheaper than starting it)."""
        if not self.path().exists():
            return False
        text = self.path().read_text()
        return "add_runs_argument" in text or '"--runs"' in text

    def estimate_s(self, runs: int) -> float:
        return self.setup_s + self.run_s * (runs if self.takes_runs() else 1)

    def command(self, runs: int, out_dir: Path) -> list[str]:
        """The script's command line; "{out_dir}" in an argument becomes the results directory."""
        extra = ["--runs", str(runs)] if self.takes_runs() else []
        args = [a.replace("{out_dir}", str(out_dir)) for a in self.args]
        return [sys.executable, str(self.path()), *args, *extra]


GRPC_SERVER = ("device=cpu", "max_model_len=128", "kv_cache.num_slots_override=64", "max_num_seqs=64",
               "--requests", "64", "--threads", "1")
BENCHMARKS = (
    Benchmark("plan", "bench_plan_sweep.py", setup_s=0, run_s=85),
    Benchmark("engine", "bench_engine.py", ("--workload", "mixed"), setup_s=60, run_s=20),   # + the HF search
    Benchmark("grpc", "bench_grpc.py", GRPC_SERVER, setup_s=20, run_s=15),
    Benchmark("http", "bench_http.py", GRPC_SERVER, setup_s=15, run_s=15),
    Benchmark("health", "bench_health_under_big_prompts.py", ("--seconds", "5"), setup_s=10, run_s=16),
    Benchmark("tp", "bench_tp.py", setup_s=5, run_s=10),
    Benchmark("startup", "bench_startup.py", setup_s=0, run_s=5),          # one 8 GiB CPU start per run
    Benchmark("step", "bench_step.py", ("--threads", "1"), setup_s=60, run_s=30),
    Benchmark("dsv4", "bench_dsv4.py", setup_s=300, run_s=60),    # transformers one request at a time: slow
    Benchmark("peers", "bench_peers.py", setup_s=120, run_s=120),
    Benchmark("engine-scale", "bench_engine.py", ("--workload", "scale"), setup_s=180, run_s=90, by_default=False),
    Benchmark("guidellm", "bench_guidellm.py", ("--guidellm", "guidellm", "--out", "{out_dir}/guidellm.json"),
              setup_s=30, run_s=60,
              by_default=False, needs=("guidellm",)),
    # Needs $VLLM_VENV (vLLM in a venv of its own) and guidellm on PATH (`pip install -e '.[bench]'`).
    Benchmark("serve-peers", "bench_serve_peers.py", setup_s=60, run_s=330, by_default=False, needs=("guidellm",)),
)


def why_skipped(bench: Benchmark) -> str | None:
    if not bench.path().exists():
        return f"bench/{bench.script} does not exist (yet)"
    missing = [exe for exe in bench.needs if not any(
        os.access(Path(d) / exe, os.X_OK) for d in os.environ.get("PATH", "").split(os.pathsep))]
    if missing:
        return f"{', '.join(missing)} not on PATH"
    return None


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def selected(only: str | None) -> list[Benchmark]:
    if not only:
        return [b for b in BENCHMARKS if b.by_default]
    names = [n.strip() for n in only.split(",") if n.strip()]
    known = {b.name: b for b in BENCHMARKS}
    unknown = [n for n in names if n not in known]
    if unknown:
        sys.exit(f"--only: unknown benchmark(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return [known[n] for n in names]


@dataclass
class Outcome:
    bench: Benchmark
    status: str
    wall_s: float = 0.0
    command: str = ""


def run_one(bench: Benchmark, runs: int, out_dir: Path, timeout_s: float) -> Outcome:
    reason = why_skipped(bench)
    if reason:
        print(f"[run_all] {bench.name}: SKIPPED, {reason}", flush=True)
        (out_dir / f"{bench.name}.md").write_text(f"skipped: {reason}\n")
        return Outcome(bench, f"skipped: {reason}")
    cmd = bench.command(runs, out_dir)
    shown = shlex.join(["python", *[str(Path(c).relative_to(REPO)) if c.startswith(str(REPO)) else c
                                    for c in cmd[1:]]])
    print(f"[run_all] {bench.name}: {shown} (estimate {minutes(bench.estimate_s(runs))}) ...", flush=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    t0 = time.perf_counter()
    with (out_dir / f"{bench.name}.md").open("w") as out, (out_dir / f"{bench.name}.log").open("w") as err:
        try:
            rc = subprocess.run(cmd, cwd=REPO, stdout=out, stderr=err, env=env, timeout=timeout_s).returncode
            status = "ok" if rc == 0 else f"FAILED (exit {rc}; see {bench.name}.log)"
        except subprocess.TimeoutExpired:
            status = f"TIMED OUT after {timeout_s:.0f} s"
    wall = time.perf_counter() - t0
    print(f"[run_all] {bench.name}: {status}, {wall:.0f} s", flush=True)
    return Outcome(bench, status, wall, shown)


def summary(outcomes: list[Outcome], watch: LoadWatch, runs: int, out_dir: Path, started: str,
            total_s: float) -> str:
    lines = ["# Benchmark run", "", f"`python bench/run_all.py {shlex.join(sys.argv[1:])}` started "
             f"{started} UTC; {minutes(total_s)} in all", "", watch.header(runs), watch.footer(), "",
             "| benchmark | status | wall | estimate | command |", "|---|---|---:|---:|---|"]
    for o in outcomes:
        ran = bool(o.command)
        lines.append(f"| {o.bench.name} | {o.status} | {f'{o.wall_s:.0f} s' if ran else '-'} | "
                     f"{f'{o.bench.estimate_s(runs):.0f} s' if ran else '-'} | {f'`{o.command}`' if ran else '-'} |")
    for o in outcomes:
        text = (out_dir / f"{o.bench.name}.md").read_text().strip()
        lines += ["", f"## {o.bench.name}", "", text or "(no output)"]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated benchmark names (see --list); default: every default one")
    ap.add_argument("--runs", type=int, default=3, help="interleaved runs per benchmark (scripts that take it)")
    ap.add_argument("--out", type=Path, default=None, help="results directory (default bench/results/<UTC time>)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds one benchmark may take before it is stopped")
    ap.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and the time estimate, run nothing")
    args = ap.parse_args()
    if args.runs < 1:
        ap.error("--runs must be >= 1")

    chosen = selected(args.only)
    for b in BENCHMARKS if args.list else chosen:
        reason = why_skipped(b)
        state = f"skipped: {reason}" if reason else f"~{minutes(b.estimate_s(args.runs))}"
        print(f"  {b.name:<13} {'default' if b.by_default else 'opt-in ':<8} bench/{b.script} "
              f"{' '.join(b.args)}  [{state}]")
    total = sum(b.estimate_s(args.runs) for b in chosen if not why_skipped(b))
    print(f"estimated total of {'the default set' if args.list and not args.only else 'this run'} with --runs "
          f"{args.runs} on a quiet 2-core machine: {minutes(total)}", flush=True)
    if args.list or args.dry_run:
        return

    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    out_dir = args.out or BENCH / "results" / stamp
    out_dir.mkdir(parents=True, exist_ok=True)
    watch = LoadWatch()
    t0 = time.perf_counter()
    outcomes = [run_one(b, args.runs, out_dir, args.timeout) for b in chosen]
    (out_dir / "summary.md").write_text(summary(outcomes, watch, args.runs, out_dir, stamp, time.perf_counter() - t0))
    print(f"[run_all] results in {out_dir.relative_to(REPO) if out_dir.is_relative_to(REPO) else out_dir}/"
          "summary.md", flush=True)
    if any(o.status != "ok" and not o.status.startswith("skipped") for o in outcomes):
        sys.exit(1)


if __name__ == "__main__":
    main()
