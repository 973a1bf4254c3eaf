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


def run_plan(rc: RuntimeConfig, output_dir: Path | None = None) -> dict[str, Any]:
    plan = make_plan(rc)
    source = ("given plan.peak_non_kv_bytes" if rc.plan.peak_non_kv_bytes is not None else
              f"estimated: weights from the layout / {len(plan.devices)} devices + activation allowance "
              f"{rc.plan.activation_allowance_bytes:,} B")
    print(capacity_plan_table(plan, title=f"KV-cache capacity plan: {rc.model.name} on {len(plan.devices)} x "
                                          f"{rc.device.kind} (peak_non_kv {source})"))
    result = {"status": "ok", "mode": "plan", "model": rc.model.name, "plan": plan.to_dict()}
    path = write_result(output_dir, "plan.json", result)
    if path:
        print(f"plan written to {path}")
    return result
