"""`python -m appliance.sweep SWEEP_DIR [--x KEY]`: collect a finished (or aborted) sweep again."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

from appliance.sweep.collect import collect_sweep
from appliance.sweep.jobs import load_yaml


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m appliance.sweep SWEEP_DIR [--x KEY]`: collect a finished (or aborted) sweep again."""
    p = argparse.ArgumentParser(prog="python -m appliance.sweep", description=main.__doc__)
    p.add_argument("sweep_dir", type=Path)
    p.add_argument("--x", dest="plot_x", default=None, help="swept key for the plot's x axis")
    args = p.parse_args(argv)
    if not args.sweep_dir.is_dir():
        p.error(f"{args.sweep_dir} is not a directory")
    plot_x = args.plot_x
    multirun_yaml = args.sweep_dir / "multirun.yaml"
    if plot_x is None and multirun_yaml.is_file():   # the sweep's own choice (e.g. conf/sweep/capacity.yaml)
        callbacks = ((load_yaml(multirun_yaml) or {}).get("hydra") or {}).get("callbacks") or {}
        plot_x = (callbacks.get("sweep") or {}).get("plot_x")
    summary = collect_sweep(args.sweep_dir, plot_x=plot_x)
    return 1 if not summary.rows or summary.crashed else 0


if __name__ == "__main__":
    raise SystemExit(main())
