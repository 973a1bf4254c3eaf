"""Capacity with MTP speculation on: the MTP layer's window group is planned, the startup profile runs decode
rows that verify K drafts (with the MTP layer drafting them), and mode=plan equals the runtime plan."""

from __future__ import annotations

import math

import pytest

from appliance.config.compose import load_runtime_config
from appliance.core.kv_cache_spec import scratch_bytes
from appliance.core.planner import DeviceMemory, plan_capacity
from appliance.core.step_limits import step_limits, worst_steps
from appliance.modes.plan import make_plan
from npu.backends import CpuBackend
from npu.launcher import launch
from tests.support.fake_device import FakeBackend, FakeMemoryProbe, ShapeOnlyRunner

GiB, MiB = 1 << 30, 1 << 20
A3_BYTES = 65_787_658_240


def speculative(k: int) -> list[str]:
    return ["speculative.method=mtp", f"speculative.num_tokens={k}"]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_dsv4_startup_with_speculation_equals_mode_plan(k):
    rc = load_runtime_config(["+model=dsv4", "max_model_len=8192", "device=npu", "device.count=1",
                              f"device.memory_bytes_per_device={A3_BYTES}", *speculative(k)])
    peak = 40 * GiB + 123_457
    scratch = scratch_bytes(rc.model.cache_groups, rc.decode_batch)
    runner, report = launch(rc, FakeBackend(FakeMemoryProbe(1, A3_BYTES, peak + scratch), kind="npu"),
                            ShapeOnlyRunner(rc.model))
    offline = make_plan(load_runtime_config(["+model=dsv4", "max_model_len=8192", "mode=plan", "device=ascend_a3",
                                             "device.count=1", f"plan.peak_non_kv_bytes={peak}", *speculative(k)]))
    assert report.plan == offline
    # By hand (DESIGN.md section 4): the MTP layer's window rows are one layer of ori's page (5,636,096 B / 43),
    # in a ring reaching the window (128) plus k + 1 tokens back, with 256 tokens in flight.
    mtp_page = 5_636_096 // 43
    mtp_blocks = math.ceil((128 + k + 1 - 1 + 256) / 128) + 1
    assert rc.model.group("mtp").page_size_bytes == mtp_page and mtp_blocks == 5
    assert report.plan.bytes_per_slot == 160_940_032 + mtp_blocks * mtp_page
    assert report.num_blocks["mtp"] == report.capacity_slots * mtp_blocks
    assert report.num_blocks["ori"] == report.capacity_slots * 4


def test_speculation_off_keeps_the_released_groups():
    rc = load_runtime_config(["+model=dsv4", "max_model_len=8192"])
    assert [g.name for g in rc.model.cache_groups] == ["ori", "cmp_c128", "cmp_c4", "idx", "hca_state", "csa_state",
                                                      "csa_inner_state"]


@pytest.mark.parametrize("k", [1, 3])
def test_worst_decode_rows_verify_k_drafts_within_the_budget(k):
    limits = step_limits(load_runtime_config(["max_num_batched_tokens=16", "decode_batch=8", *speculative(k)]))
    assert limits.max_decode_rows == min(8, 16 // (k + 1))
    steps = {s.name: s for s in worst_steps(limits)}
    gather = steps["decode_gather"].seqs
    assert len(gather) == limits.max_decode_rows
    assert all((s.num_tokens, s.draft_tokens, s.end) == (k + 1, k, limits.max_context) for s in gather)
    assert all(step.num_tokens <= limits.max_tokens for step in steps.values())


@pytest.mark.usefixtures("one_torch_thread")
def test_tiny_dsv4_profiles_drafting_rows_and_reports_the_planner_result():
    rc = load_runtime_config(["device=cpu", f"device.memory_bytes_per_device={256 * MiB}", "max_model_len=128",
                              "decode_batch=4", "max_num_seqs=4", "max_num_batched_tokens=32", *speculative(2)])
    backend = CpuBackend(memory_bytes_per_device=256 * MiB)
    runner, report = launch(rc, backend)
    assert "decode_gather: 12 tokens over 4 sequences" in report.notes[0]      # 4 rows of 1 token + 2 drafts
    stats = backend.memory(0)
    peak_non_kv = stats.peak_allocated_bytes - scratch_bytes(rc.model.cache_groups, rc.decode_batch)
    expected = plan_capacity(rc.model.cache_groups, [DeviceMemory("cpu:0", 256 * MiB, stats.free_bytes, peak_non_kv)],
                             utilization=rc.npu_memory_utilization, decode_batch=rc.decode_batch,
                             max_model_len=rc.max_model_len, block_size=rc.block_size)
    assert report.plan == expected and "mtp" in report.num_blocks
