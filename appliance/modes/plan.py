"""`mode=plan`: the capacity plan from a device profile and an estimated (or given) peak; no device, no torch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from appliance.core.config import RuntimeConfig
from appliance.core.estimate import offline_devices
from appliance.core.planner import CapacityPlan, plan_for_config
from appliance.core.tables import capacity_plan_table
from appliance.modes.results import write_result


def make_plan(rc: RuntimeConfig) -> CapacityPlan:
    return plan_for_config(rc, offline_devices(rc))


def run_plan(rc: RuntimeConfig, output_dir: Path | None = None, quiet: bool = False) -> dict[str, Any]:
    """Print the plan and write plan.json. quiet (a job of a sweep): print nothing; the sweep prints one
    progress line per job and the table of all jobs at the end."""
    plan = make_plan(rc)
    result = {"status": "ok", "mode": "plan", "model": rc.model.name, "plan": plan.to_dict()}
    path = write_result(output_dir, "plan.json", result)
    if quiet:
        return result
    source = ("given plan.peak_non_kv_bytes" if rc.plan.peak_non_kv_bytes is not None else
              f"estimated: each rank's shard of the weights (from the layout) + activation allowance "
              f"{rc.plan.activation_allowance_bytes:,} B")
    par = rc.parallel
    ranks = (f"tensor {par.tensor_parallel_size} x data {par.data_parallel_size}, "
             f"expert {par.expert_parallel_size}")
    print(capacity_plan_table(plan, title=f"KV-cache capacity plan: {rc.model.name} on {len(plan.devices)} x "
                                          f"{rc.device.kind}, {ranks} (peak_non_kv {source})"))
    if path:
        print(f"plan written to {path}")
    return result
