"""What every bench script prints around its figures: the machine, the load, and each figure as a spread.

A single timing on a shared 2-core machine says little: a neighbour's job can halve it. So every script runs
each system N times, interleaved run by run (ours, the peer's, ours, ...) so that a burst of load hurts both
alike, and prints each figure as "median [min-max]" over those N runs, with the load average at start and end.
This module holds the pieces they share: the machine header, the load watch, the interleaving loop and the
formatting. It imports neither torch nor transformers (versions come from package metadata), so the plan
benchmark, which must not import torch, can use it too.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from typing import TypeVar

T = TypeVar("T")


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (platform.processor() is empty or just the ISA on Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


CPU_FEATURES = ("avx512f", "avx512_bf16", "amx_bf16")    # what decides which bf16 kernels a CPU engine can use


def cpu_features() -> str:
    """Which of CPU_FEATURES /proc/cpuinfo's flags show, e.g. "avx512f avx512_bf16, no amx_bf16": a table's
    figures mean little without them (vLLM's and our bf16 paths differ with AVX-512 BF16 and AMX)."""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        pass
    has = [name for name in CPU_FEATURES if name in flags]
    lacks = [name for name in CPU_FEATURES if name not in flags]
    return " ".join(has) + (", " if has and lacks else "") + ("no " + " ".join(lacks) if lacks else "")


def cpu_and_load() -> str:
    """The line heading each table of the peer benchmarks: the CPU, its bf16-relevant flags, the load now."""
    return (f"CPU: {cpu_model()} ({cpu_features()}), {usable_cores()} cores; "
            f"load average (1/5/15 min) {format_load(os.getloadavg())}")


def memory_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / (1 << 20)
    except OSError:
        pass
    return None


def package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def machine_line() -> str:
    """One line naming what the figures were measured on."""
    mem = memory_gib()
    return (f"{cpu_model()}, {usable_cores()} cores, {f'{mem:.0f} GiB' if mem else 'RAM unknown'}; "
            f"Python {platform.python_version()}, torch {package_version('torch')}, "
            f"transformers {package_version('transformers')}; OMP_NUM_THREADS "
            f"{os.environ.get('OMP_NUM_THREADS', 'unset')}")


def format_load(load: Sequence[float]) -> str:
    return " / ".join(f"{x:.2f}" for x in load)


@dataclass
class LoadWatch:
    """The load average when a benchmark starts and when it ends; a busy start is called out, not hidden."""

    start: tuple[float, float, float] = field(default_factory=os.getloadavg)

    def header(self, runs: int) -> str:
        busy = self.start[0] > 0.5 * usable_cores()
        return "\n".join([
            f"- machine: {machine_line()}",
            f"- load average (1/5/15 min) at start: {format_load(self.start)}"
            + (" — BUSY: another job shares the cores, the figures are pessimistic" if busy else ""),
            f"- every figure: median [min-max] over {runs} run{'s' if runs != 1 else ''}, the compared "
            "systems (or phases) interleaved run by run",
        ])

    def footer(self) -> str:
        return f"- load average (1/5/15 min) at end: {format_load(os.getloadavg())} (start {format_load(self.start)})"


def interleave(runs: int, systems: dict[str, Callable[[int], T]], label: str = "bench") -> dict[str, list[T]]:
    """Run every system once per round, for `runs` rounds (run i of each system is given i); results by name.

    Interleaving rather than all-of-one-then-all-of-the-other keeps a burst of outside load from landing on one
    system only."""
    results: dict[str, list[T]] = {name: [] for name in systems}
    for i in range(runs):
        for name, run in systems.items():
            progress(f"[{label}] run {i + 1}/{runs}: {name} ...")
            results[name].append(run(i))
    return results


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def spread(values: Sequence[float], fmt: str = "{:,.1f}") -> str:
    """'median [min-max]' of the runs' values (just the value for one run); 'min to max' when a sign would
    make the dash ambiguous."""
    if not values:
        return "-"
    middle = fmt.format(statistics.median(values))
    if len(values) == 1:
        return middle
    low, high = min(values), max(values)
    sep = " to " if low < 0 or fmt.startswith("{:+") else "-"
    return f"{middle} [{fmt.format(low)}{sep}{fmt.format(high)}]"


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def add_runs_argument(parser, default: int = 3) -> None:
    """--runs, the same flag and meaning in every bench script (run_all.py passes it on)."""
    parser.add_argument("--runs", type=int, default=default,
                        help=f"runs of each system, interleaved; figures are median [min-max] (default {default})")
