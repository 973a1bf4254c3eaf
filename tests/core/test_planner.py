"""Planner: reference figures, slot alignment, fail-fast paths, overrides, and `mode=plan` from the CLI."""

import json

import pytest

from appliance.config.compose import load_runtime_config
from appliance.core.kv_cache_spec import bytes_per_slot, scratch_bytes
from appliance.core.planner import DeviceMemory, InsufficientMemoryError, check_weights_fit, plan_capacity
from appliance.modes.plan import make_plan

GiB = 1 << 30


@pytest.fixture(scope="module")
def dsv4_8k():
    return load_runtime_config(["+model=dsv4", "max_model_len=8192"]).model.cache_groups


def devices(n, total=64 * GiB, peak=20 * GiB, peaks=None):
    return [DeviceMemory(f"npu:{i}", total, total - 1 * GiB, (peaks or {}).get(i, peak)) for i in range(n)]


def plan(specs, devs, **kw):
    args = dict(utilization=0.9, decode_batch=8, max_model_len=8192, block_size=128)
    args.update(kw)
    return plan_capacity(specs, devs, **args)


def test_scratch_reference(dsv4_8k):
    assert scratch_bytes(dsv4_8k, 8) == 63_591_424


def slot_blocks(specs, slots):
    return {s.name: slots * s.max_blocks_per_seq for s in specs}


def test_three_slots_reference(dsv4_8k):
    assert plan(dsv4_8k, devices(2), num_slots_override=3).num_blocks == {
        "ori": 12, "cmp_c128": 192, "cmp_c4": 192, "idx": 192, "hca_state": 144, "csa_state": 195,
        "csa_inner_state": 195}


def test_budget_for_exactly_three_slots_gives_reference_blocks(dsv4_8k):
    slot, scratch = 160_940_032, 63_591_424
    # total x 1.0 - peak = scratch + 3 slots + (one slot - 1 byte): still 3 slots.
    total = 40 * GiB
    peak = total - (scratch + 4 * slot - 1)
    p = plan(dsv4_8k, [DeviceMemory("npu:0", total, total, peak)], utilization=1.0)
    assert p.capacity_slots == 3 and p.bytes_per_slot == slot and p.scratch_bytes == scratch
    assert p.num_blocks == slot_blocks(dsv4_8k, 3)
    assert p.unused_bytes == slot - 1


def test_plan_arithmetic_and_slot_alignment(dsv4_8k):
    p = plan(dsv4_8k, devices(8), data_parallel_size=8)
    budget = int(64 * GiB * 0.9) - 20 * GiB
    assert p.budget_bytes == budget
    assert p.capacity_slots == (budget - p.scratch_bytes) // bytes_per_slot(dsv4_8k)
    assert 0 <= p.unused_bytes < p.bytes_per_slot
    for g, spec in zip(p.groups, dsv4_8k):
        assert g.num_blocks == p.capacity_slots * spec.max_blocks_per_seq
        assert g.bytes == g.num_blocks * spec.page_size_bytes
    assert sum(g.bytes for g in p.groups) == p.kv_cache_bytes
    assert p.kv_tokens_per_device == p.capacity_slots * 8192
    assert p.max_concurrency == p.capacity_slots * 8
    # Concurrency counts data-parallel ranks (each with its own pools), not devices: 8 devices as 4 x TP 2.
    assert plan(dsv4_8k, devices(8), data_parallel_size=4).max_concurrency == p.capacity_slots * 4


def test_minimum_device_wins(dsv4_8k):
    p = plan(dsv4_8k, devices(16, peaks={5: 30 * GiB}))
    assert p.limiting_device == "npu:5"
    alone = plan(dsv4_8k, [DeviceMemory("npu:5", 64 * GiB, 63 * GiB, 30 * GiB)])
    assert p.capacity_slots == alone.capacity_slots


def test_fail_fast_when_peak_exceeds_usable(dsv4_8k):
    with pytest.raises(InsufficientMemoryError) as info:
        plan(dsv4_8k, devices(16, peaks={7: 60 * GiB}))
    msg = str(info.value)
    for words in ("npu:7", "total", "free", "peak_non_kv", "utilization 0.9", "exceeds", "raise npu_memory_utilization",
                  "max_model_len", "more devices"):
        assert words in msg


def test_fail_fast_when_budget_below_one_slot(dsv4_8k):
    total = 64 * GiB
    peak = int(total * 0.9) - (63_591_424 + 160_940_032 - 1)  # one byte short
    with pytest.raises(InsufficientMemoryError) as info:
        plan(dsv4_8k, [DeviceMemory("npu:0", total, total, peak)])
    msg = str(info.value)
    assert "shortfall 1 B" in msg and "budget" in msg and "scratch" in msg and "npu:0" in msg
    # One more byte of budget fits exactly one slot, with nothing unused.
    p = plan(dsv4_8k, [DeviceMemory("npu:0", total, total, peak - 1)])
    assert p.capacity_slots == 1 and p.unused_bytes == 0


def test_kv_cache_memory_override(dsv4_8k):
    p = plan(dsv4_8k, devices(2), kv_cache_memory_bytes=10 * GiB)
    assert p.override == f"kv_cache_memory_bytes={10 * GiB}"
    assert p.capacity_slots == (10 * GiB - p.scratch_bytes) // p.bytes_per_slot
    with pytest.raises(InsufficientMemoryError, match="kv_cache_memory_bytes"):
        plan(dsv4_8k, devices(2), kv_cache_memory_bytes=60 * GiB)


def test_num_slots_override(dsv4_8k):
    p = plan(dsv4_8k, devices(2), num_slots_override=5)
    assert p.capacity_slots == 5 and p.override == "num_slots_override=5"
    assert p.num_blocks == slot_blocks(dsv4_8k, 5)
    with pytest.raises(InsufficientMemoryError, match="at most"):
        plan(dsv4_8k, devices(2), num_slots_override=10_000)


def test_make_plan_uses_profile_and_given_peak():
    rc = load_runtime_config(["+model=dsv4", "mode=plan", "device=ascend_a3", "max_model_len=8192",
                              f"plan.peak_non_kv_bytes={30 * GiB}"])
    p = make_plan(rc)
    a3 = 65_787_658_240                        # what the runtime reports for one A3 die
    assert len(p.devices) == 16 and all(d.total_bytes == a3 for d in p.devices)
    assert all(d.non_torch_margin_bytes == GiB for d in p.devices)      # conf/device/ascend_a3.yaml
    assert p.budget_bytes == int(a3 * 0.9) - 30 * GiB - GiB


def test_cli_plan_prints_table_and_writes_json(cli, tmp_path):
    proc = cli("+model=dsv4", "mode=plan", "device=ascend_a3", "npu_memory_utilization=0.85",
               env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert proc.returncode == 0, proc.stderr
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "appliance.core.planner" in imported and "torch" not in imported
    for words in ("csa_inner_state", "capacity_slots", "limiting device", "share of budget", "5,636,096"):
        assert words in proc.stdout
    result = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert result["plan"]["capacity_slots"] > 0
    rc = load_runtime_config(["+model=dsv4", "mode=plan", "device=ascend_a3", "npu_memory_utilization=0.85"])
    assert result["plan"]["capacity_slots"] == make_plan(rc).capacity_slots


def test_cli_plan_too_small_exits_2_with_message(cli):
    proc = cli("+model=dsv4", "mode=plan", "device=ascend_a3", "npu_memory_utilization=0.3")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "npu:0" in proc.stderr and "peak_non_kv" in proc.stderr and "raise npu_memory_utilization" in proc.stderr


def test_non_torch_margin_comes_off_every_budget(dsv4_8k):
    margin = 1 << 30
    devs = [DeviceMemory(f"npu:{i}", 64 * GiB, 64 * GiB, 20 * GiB, margin) for i in range(2)]
    p = plan(dsv4_8k, devs)
    assert p.budget_bytes == int(64 * GiB * 0.9) - 20 * GiB - margin
    assert p.capacity_slots == (p.budget_bytes - p.scratch_bytes) // p.bytes_per_slot
    assert all(d.non_torch_margin_bytes == margin for d in p.devices)
    with pytest.raises(InsufficientMemoryError, match="peak_non_kv \\+ the non-torch margin exceed"):
        plan(dsv4_8k, [DeviceMemory("npu:0", 64 * GiB, 64 * GiB, int(64 * GiB * 0.9) - 1, margin)])


def test_non_torch_margin_follows_the_device_kind():
    from appliance.core.config import DeviceSettings
    from appliance.core.planner import non_torch_margin
    auto = DeviceSettings(kind="auto", non_torch_margin_bytes=GiB)
    assert (non_torch_margin(auto, "npu"), non_torch_margin(auto, "cuda"), non_torch_margin(auto, "cpu")) == (GiB, GiB, 0)
    cpu = DeviceSettings(kind="cpu", non_torch_margin_bytes=123)
    assert non_torch_margin(cpu, "cpu") == 123          # asked for explicitly: kept


def test_free_memory_below_total_x_utilization_is_refused(dsv4_8k):
    from appliance.core.planner import check_free_memory
    ok = DeviceMemory("npu:0", 64 * GiB, int(64 * GiB * 0.9), 0)
    check_free_memory([ok], 0.9)
    busy = DeviceMemory("npu:1", 64 * GiB, 32 * GiB, 0)
    with pytest.raises(InsufficientMemoryError) as err:
        plan(dsv4_8k, [ok, busy])
    assert str(err.value) == (
        "device npu:1: free memory 34,359,738,368 B (32.00 GiB) is less than total 68,719,476,736 B (64.00 GiB) x "
        "npu_memory_utilization 0.9 = 61,847,529,062 B (57.60 GiB); something else holds 34,359,738,368 B "
        "(32.00 GiB) of it. Fix: free the device (npu-smi info / nvidia-smi show its processes) or lower "
        "npu_memory_utilization to at most 0.500.")


def test_slots_that_fit_after_a_failed_allocation(dsv4_8k):
    from appliance.core.planner import UNEXPLAINED_FAILURE_SHRINK, slots_that_fit
    margin = GiB
    devs = [DeviceMemory(f"npu:{i}", 64 * GiB, 64 * GiB, 20 * GiB, margin) for i in range(2)]
    p = plan(dsv4_8k, devs)
    held = 15 * GiB                          # weights still resident: 5 GiB of activations are still to come
    free = [margin + 5 * GiB + p.scratch_bytes + 7 * p.bytes_per_slot + 5,
            margin + 5 * GiB + p.scratch_bytes + 9 * p.bytes_per_slot]
    assert slots_that_fit(p, devs, free, [held, held]) == 7              # the device with less room decides
    assert slots_that_fit(p, devs, [0, 0], [held, held]) == 0
    # A report that cannot explain the failure (the plan would fit): give back a fraction, not one slot.
    assert slots_that_fit(p, devs, [64 * GiB] * 2, [held, held]) == (
        p.capacity_slots - p.capacity_slots // UNEXPLAINED_FAILURE_SHRINK)


def test_weights_fit_is_weights_plus_scratch_plus_one_slot_within_total_times_utilization():
    """planner.check_weights_fit, the fit before loading, on numbers alone: the boundary is exact to the byte and the
    error names the device, every figure and a fix."""
    specs = load_runtime_config(["+model=qwen3_tiny"]).model.cache_groups
    least = scratch_bytes(specs, 2) + bytes_per_slot(specs)
    weights, u = 10_000_000, 0.5
    total = 2 * (weights + least)
    args = dict(model_name="m", utilization=u, decode_batch=2, max_model_len=64, shard="a full copy on each device")
    check_weights_fit([("cpu", total)], weights, specs, **args)
    with pytest.raises(InsufficientMemoryError) as err:
        check_weights_fit([("npu:0", total), ("npu:1", total - 2)], weights, specs, **args, fallback=" (why)")
    msg = str(err.value)
    assert msg.startswith("m does not fit on device npu:1 (why); nothing was loaded")
    assert f"{total - 2:,} B" in msg and "shortfall                       1 B" in msg and "Fix:" in msg
