"""Sweeps: a Hydra callback that shows progress and collects every job's result into a table and a plot.

Each job writes its result as JSON into its own job directory (plan.json, bench.json or result.json),
so the collector reads files, not JobReturn objects: that works the same for the basic launcher, joblib
workers and cluster launchers (submitit, Ray) as long as the sweep directory is on a shared filesystem.

    python -m appliance -m +model=dsv4 device=ascend_a3 mode=plan +sweep=capacity
    python -m appliance.sweep multirun/2026-01-01/12-00-00      # collect (again) after the fact

Outputs in the sweep directory: sweep.csv (every column, raw numbers), sweep.md (the same table for
people), sweep.png (capacity against the swept value; throughput and latency for bench sweeps).
Nothing here imports torch; matplotlib is imported only when the plot is drawn.

Modules: jobs (read job directories), tables (csv / md / terminal), plot (png), collect (all three),
progress (k/N lines), callback (the Hydra callback, conf/config.yaml hydra.callbacks.sweep).
"""

from appliance.sweep.callback import SweepCollector
from appliance.sweep.collect import collect_sweep
from appliance.sweep.progress import count_jobs

__all__ = ["SweepCollector", "collect_sweep", "count_jobs"]
