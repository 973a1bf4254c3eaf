"""The planner's per-group rows, its config adapter and the retry sizing at their edges (written against the
mutants docs/TESTING.md lists: each asserts a figure the startup table or the launcher's retry relies on)."""

import pytest

from appliance.config.compose import load_runtime_config
from appliance.core.planner import (
    DeviceMemory,
    InsufficientMemoryError,
    format_bytes,
    plan_capacity,
    plan_for_config,
    slots_that_fit,
)

GiB = 1 << 30


@pytest.fixture(scope="module")
def dsv4():
    return load_runtime_config(["+model=dsv4", "max_model_len=8192"])


def plan(specs, devices, **kw):
    return plan_capacity(specs, devices, **{"utilization": 0.9, "decode_batch": 8, "max_model_len": 8192,
                                            "block_size": 128, **kw})


def test_each_group_row_describes_its_spec_and_its_share_of_the_budget(dsv4):
    specs = dsv4.model.cache_groups
    p = plan(specs, [DeviceMemory("npu:0", 64 * GiB, 64 * GiB, 20 * GiB)])
    assert [g.name for g in p.groups] == [s.name for s in specs]
    for g, s in zip(p.groups, specs):
        assert (g.history, g.num_layers, g.rows_per_block, g.page_size_bytes, g.max_blocks_per_seq) == (
            s.history, len(s.layer_ids), s.rows_per_block, s.page_size_bytes, s.max_blocks_per_seq)
        assert g.share_of_budget == pytest.approx(g.num_blocks * s.page_size_bytes / p.budget_bytes)
        assert p.group(s.name) is g
    assert {g.history for g in p.groups} == {"full", "ring"}       # both kinds are checked above
    # The shares add up to the KV cache's part of the budget; scratch and the unused rest make up the remainder.
    assert sum(g.share_of_budget for g in p.groups) == pytest.approx(p.kv_cache_bytes / p.budget_bytes)
    assert p.kv_cache_bytes + p.scratch_bytes + p.unused_bytes == p.budget_bytes
    assert p.to_dict()["groups"][0]["num_blocks"] == p.groups[0].num_blocks
    assert p.to_dict()["override"] is None             # nothing pinned: null in mode=plan's JSON


def test_plan_for_config_applies_the_configured_kv_cache_memory(dsv4):
    rc = load_runtime_config(["+model=dsv4", "max_model_len=8192", f"kv_cache.kv_cache_memory_bytes={8 * GiB}"])
    p = plan_for_config(rc, [DeviceMemory("npu:0", 64 * GiB, 64 * GiB, 20 * GiB)])
    assert p.budget_bytes == 8 * GiB and p.override == f"kv_cache_memory_bytes={8 * GiB}"
    assert p.capacity_slots == (8 * GiB - p.scratch_bytes) // p.bytes_per_slot


def test_a_retry_counts_no_activations_once_the_weights_hold_the_whole_peak(dsv4):
    """held >= peak_non_kv: nothing is still to come, so free memory of exactly margin + scratch + k slots fits
    exactly k slots (one byte less would fit k - 1)."""
    margin = GiB
    devs = [DeviceMemory("npu:0", 64 * GiB, 64 * GiB, 20 * GiB, margin)]
    p = plan(dsv4.model.cache_groups, devs)
    exact = margin + p.scratch_bytes + 3 * p.bytes_per_slot
    assert slots_that_fit(p, devs, [exact], [20 * GiB]) == 3
    assert slots_that_fit(p, devs, [exact], [25 * GiB]) == 3
    assert slots_that_fit(p, devs, [exact - 1], [20 * GiB]) == 2


def test_an_unexplained_failure_of_a_small_plan_gives_back_exactly_one_slot(dsv4):
    devs = [DeviceMemory("npu:0", 64 * GiB, 64 * GiB, 20 * GiB)]
    p = plan(dsv4.model.cache_groups, devs, num_slots_override=5)
    assert slots_that_fit(p, devs, [64 * GiB], [0]) == 4


def test_plan_for_config_counts_every_data_parallel_rank_in_max_concurrency():
    """Each data-parallel rank holds its own pools: two ranks serve twice one device's capacity slots."""
    rc = load_runtime_config(["+model=qwen3_tiny", "device=cpu", "device.count=2", "parallel.data_parallel_size=2"])
    devices = [DeviceMemory(f"cpu:{i}", 8 * GiB, 8 * GiB, 1 * GiB) for i in range(2)]
    p = plan_for_config(rc, devices)
    assert p.data_parallel_size == 2 and p.capacity_slots > 0
    assert p.max_concurrency == 2 * p.capacity_slots


def test_plan_for_config_applies_the_configured_slot_override_unless_the_launcher_gives_one():
    rc = load_runtime_config(["+model=qwen3_tiny", "device=cpu", "kv_cache.num_slots_override=3"])
    devices = [DeviceMemory("cpu:0", 8 * GiB, 8 * GiB, 1 * GiB)]
    assert plan_for_config(rc, devices).override == "num_slots_override=3"
    assert plan_for_config(rc, devices).capacity_slots == 3
    assert plan_for_config(rc, devices, num_slots_override=2).capacity_slots == 2


def test_a_plan_without_devices_is_refused():
    with pytest.raises(ValueError) as info:
        plan([], [])
    assert str(info.value) == "plan_capacity needs at least one device"


@pytest.mark.parametrize("utilization", [0.0, 1.5])
def test_a_utilization_outside_0_to_1_is_refused_before_any_sizing(dsv4, utilization):
    with pytest.raises(ValueError) as info:
        plan(dsv4.model.cache_groups, [DeviceMemory("npu:0", 64 * GiB, 64 * GiB, 20 * GiB)], utilization=utilization)
    assert str(info.value) == f"utilization {utilization!r} must be in (0, 1]"


def test_a_utilization_of_exactly_1_is_allowed(dsv4):
    p = plan(dsv4.model.cache_groups, [DeviceMemory("npu:0", 64 * GiB, 64 * GiB, 20 * GiB)], utilization=1.0)
    assert p.devices[0].usable_bytes == 64 * GiB


def test_a_device_without_room_for_kv_says_what_exceeds_and_by_how_much(dsv4):
    """10 GiB x 0.5 usable: a 6 GiB peak alone exceeds it by 1 GiB; a 4.5 GiB peak with a 1 GiB margin by 0.5 GiB."""
    specs = dsv4.model.cache_groups
    for peak, margin, words in ((6 * GiB, 0, "peak_non_kv alone exceeds"),
                                (9 * GiB // 2, 1 * GiB, "peak_non_kv + the non-torch margin exceed")):
        with pytest.raises(InsufficientMemoryError) as info:
            plan(specs, [DeviceMemory("npu:0", 10 * GiB, 10 * GiB, peak, margin)], utilization=0.5)
        over = peak + margin - 5 * GiB
        assert f"utilization 0.5: {words} total x utilization ({format_bytes(5 * GiB)}) by {format_bytes(over)}; " \
            in str(info.value)


def test_a_kv_cache_memory_equal_to_the_budget_is_allowed_one_byte_more_is_refused(dsv4):
    specs, dev = dsv4.model.cache_groups, DeviceMemory("npu:0", 64 * GiB, 64 * GiB, 20 * GiB)
    budget = plan(specs, [dev]).budget_bytes
    assert plan(specs, [dev], kv_cache_memory_bytes=budget).budget_bytes == budget
    with pytest.raises(InsufficientMemoryError) as info:
        plan(specs, [dev], kv_cache_memory_bytes=budget + 1)
    assert f"exceeds the budget {format_bytes(budget)} by {format_bytes(1)}." in str(info.value)


def test_a_slot_override_that_fills_the_budget_exactly_is_allowed_one_more_is_refused(dsv4):
    specs, dev = dsv4.model.cache_groups, DeviceMemory("npu:0", 64 * GiB, 64 * GiB, 20 * GiB)
    first = plan(specs, [dev])
    # The plan records what it was sized for.
    assert (first.utilization, first.decode_batch, first.max_model_len, first.block_size) == (0.9, 8, 8192, 128)
    n, scratch, slot = first.capacity_slots, first.scratch_bytes, first.bytes_per_slot
    exact = plan(specs, [dev], kv_cache_memory_bytes=scratch + n * slot, num_slots_override=n)
    assert exact.capacity_slots == n and exact.unused_bytes == 0
    with pytest.raises(InsufficientMemoryError) as info:
        plan(specs, [dev], kv_cache_memory_bytes=scratch + n * slot, num_slots_override=n + 1)
    assert (f"num_slots_override {n + 1} needs {format_bytes(scratch + (n + 1) * slot)} but the budget is "
            f"{format_bytes(scratch + n * slot)}; at most {n} slots fit") in str(info.value)


def test_each_device_budget_names_its_device_and_what_is_left_after_scratch_and_slots(dsv4):
    specs = dsv4.model.cache_groups
    devices = [DeviceMemory("npu:0", 64 * GiB, 64 * GiB, 20 * GiB), DeviceMemory("npu:1", 64 * GiB, 60 * GiB, 21 * GiB)]
    p = plan(specs, devices, utilization=0.9)
    assert [d.name for d in p.devices] == ["npu:0", "npu:1"]
    for d in p.devices:        # the startup table's headroom column: budget - scratch - the planned slots
        assert d.headroom_bytes == d.budget_bytes - p.scratch_bytes - p.kv_cache_bytes >= 0


def test_format_bytes_adds_the_binary_unit_from_1_kib_on():
    assert format_bytes(1023) == "1,023 B" and format_bytes(-1023) == "-1,023 B"
    assert format_bytes(1024) == "1,024 B (1.00 KiB)"
