"""Collect a sweep: read every job, write sweep.csv / sweep.md / sweep.png, print the table."""

from __future__ import annotations

import sys
from pathlib import Path

from appliance.sweep.jobs import SweepSummary, collect
from appliance.sweep.plot import plot_sweep
from appliance.sweep.tables import (
    fixed_overrides,
    metric_keys,
    sweep_title,
    terminal_table,
    write_csv,
    write_markdown,
)


def collect_sweep(sweep_dir: Path, *, plot_x: str | None = None, echo: bool = True) -> SweepSummary:
    """Read every job of a sweep and write sweep.csv, sweep.md and sweep.png into the sweep directory."""
    sweep_dir = Path(sweep_dir)
    rows = collect(sweep_dir)
    summary = SweepSummary(sweep_dir, rows, sweep_dir / "sweep.csv", sweep_dir / "sweep.md", sweep_dir / "sweep.png")
    if not rows:
        if echo:
            print(f"[sweep] no job directories under {sweep_dir}", file=sys.stderr)
        return summary
    write_csv(rows, summary.csv_path)
    write_markdown(rows, summary.md_path)
    plot_sweep(rows, summary.png_path, x_key=plot_x)
    if echo:
        ok = sum(r.ok for r in rows)
        print(f"\n== {sweep_title(rows)}: {len(rows)} jobs, {ok} ok, {len(rows) - ok} not ok ==")
        fixed = fixed_overrides(rows)
        if fixed:
            print(f"fixed overrides: {' '.join(fixed)}")
        print(terminal_table(rows))
        if any(k.startswith("num_blocks_") for k in metric_keys(rows)):
            print("(per-group num_blocks are in sweep.csv and sweep.md)")
        print(f"table: {summary.csv_path}\n       {summary.md_path}\nplot:  {summary.png_path}")
    return summary
