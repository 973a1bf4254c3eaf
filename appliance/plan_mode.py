"""`mode=plan`: the capacity plan from a device profile and an estimated (or given) peak, no device, no torch."""

from __future__ import annotations

from typing import Any

from appliance.config import ConfigError, ConfigIssue, RuntimeConfig
from appliance.estimate import estimate_peak_non_kv
from appliance.planner import CapacityPlan, DeviceMemory, plan_capacity


def offline_devices(rc: RuntimeConfig) -> list[DeviceMemory]:
    dev = rc.device
    if dev.memory_bytes_per_device is None:
        raise ConfigError([ConfigIssue(
            "device.memory_bytes_per_device", None,
            "mode=plan needs memory per device: pick a planning profile (device=ascend_a2, device=ascend_a3) "
            "or set device.memory_bytes_per_device")])
    count = dev.count or 1
    if rc.plan.peak_non_kv_bytes is not None:
        peak = rc.plan.peak_non_kv_bytes
    else:
        peak = estimate_peak_non_kv(rc.model, count, rc.plan.activation_allowance_bytes).peak_non_kv_bytes
    prefix = "cpu" if dev.kind in ("cpu", "auto") else dev.kind
    total = dev.memory_bytes_per_device
    return [DeviceMemory(f"{prefix}:{i}", total, total, peak) for i in range(count)]


def make_plan(rc: RuntimeConfig) -> CapacityPlan:
    return plan_capacity(
        rc.model.cache_groups, offline_devices(rc), utilization=rc.npu_memory_utilization,
        decode_batch=rc.decode_batch, max_model_len=rc.max_model_len, block_size=rc.block_size,
        kv_cache_memory_bytes=rc.kv_cache.kv_cache_memory_bytes, num_slots_override=rc.kv_cache.num_slots_override,
    )


def run_plan(rc: RuntimeConfig) -> dict[str, Any]:
    from appliance.cli import write_result
    from appliance.report import capacity_plan_table

    plan = make_plan(rc)
    source = ("given plan.peak_non_kv_bytes" if rc.plan.peak_non_kv_bytes is not None else
              f"estimated: weights from the layout / {len(plan.devices)} devices + activation allowance "
              f"{rc.plan.activation_allowance_bytes:,} B")
    print(capacity_plan_table(plan, title=f"KV-cache capacity plan: {rc.model.name} on {len(plan.devices)} x "
                                          f"{rc.device.kind} (peak_non_kv {source})"))
    result = {"status": "ok", "mode": "plan", "model": rc.model.name, "plan": plan.to_dict()}
    path = write_result("plan.json", result)
    if path:
        print(f"plan written to {path}")
    return result
