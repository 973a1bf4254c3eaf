"""Startup sequence: NPU-scale plans through the fake probe equal mode=plan's, fail-fast per device,
allocation retries, and a real tiny Qwen3 start on the CPU whose capacities equal the planner's."""


import pytest
import torch

from appliance.config.compose import load_runtime_config
from appliance.core.kv_cache_spec import scratch_bytes
from appliance.core.planner import DeviceMemory, InsufficientMemoryError, plan_capacity
from appliance.modes.plan import make_plan
from npu.backends import CpuBackend
from npu.fake import FakeBackend, FakeMemoryProbe, ShapeOnlyRunner
from npu.launcher import launch, profile_shape
from npu.qwen3 import Qwen3Runner
from npu.registry import runner_class
from npu.step import SeqStep, StepBatch

GiB = 1 << 30
MiB = 1 << 20
NPU_64G = 64 * GiB
DSV4_SERVE = ["+model=dsv4", "max_model_len=8192", "device=npu", "device.count=16",
              f"device.memory_bytes_per_device={NPU_64G}"]


def fake_npus(peak_non_kv, rc, count=16):
    """16 x 64 GiB whose allocator peak is the non-KV peak plus the scratch pools, as on a real device."""
    scratch = scratch_bytes(rc.model.cache_groups, rc.decode_batch)
    peaks = [p + scratch for p in peak_non_kv] if isinstance(peak_non_kv, list) else peak_non_kv + scratch
    return FakeBackend(FakeMemoryProbe(count, NPU_64G, peaks), kind="npu")


def test_npu_scale_startup_equals_mode_plan():
    rc = load_runtime_config(DSV4_SERVE)
    peak = 40 * GiB + 123_457
    runner, report = launch(rc, fake_npus(peak, rc), ShapeOnlyRunner(rc.model))
    offline = make_plan(load_runtime_config(["+model=dsv4", "max_model_len=8192", "mode=plan", "device=ascend_a3",
                                             f"plan.peak_non_kv_bytes={peak}"]))
    assert report.plan == offline
    assert (report.device_kind, report.device_count, report.allocation_retries) == ("npu", 16, 0)
    assert report.capacity_slots > 0
    for spec in rc.model.cache_groups:
        assert runner.pools[spec.name].shape[1] == report.num_blocks[spec.name] + rc.decode_batch
        assert runner.pools[spec.name].device.type == "meta"


def test_one_device_over_budget_fails_fast_naming_it():
    rc = load_runtime_config(DSV4_SERVE)
    peaks = [40 * GiB] * 16
    peaks[5] = int(NPU_64G * 0.9) + 1          # nothing left for the KV cache on npu:5 only
    runner = ShapeOnlyRunner(rc.model)
    with pytest.raises(InsufficientMemoryError, match="device npu:5: .*peak_non_kv alone exceeds"):
        launch(rc, fake_npus(peaks, rc), runner)
    assert len(runner.allocation_attempts) == 1 and runner.pools == {}   # only the scratch-only profile pools


def test_failed_allocation_gives_back_slots_until_it_fits():
    rc = load_runtime_config(DSV4_SERVE)
    peak = 40 * GiB
    planned = make_plan(load_runtime_config(["+model=dsv4", "max_model_len=8192", "mode=plan", "device=ascend_a3",
                                             f"plan.peak_non_kv_bytes={peak}"]))
    fits = planned.capacity_slots - 3
    runner = ShapeOnlyRunner(rc.model, max_pool_bytes=planned.scratch_bytes + fits * planned.bytes_per_slot)
    runner, report = launch(rc, fake_npus(peak, rc), runner)
    assert report.allocation_retries == 3 and report.capacity_slots == fits
    assert report.plan.override == f"num_slots_override={fits}"
    assert [sum(a.values()) for a in runner.allocation_attempts[1:]] == [
        s * sum(g.max_blocks_per_seq for g in rc.model.cache_groups) for s in range(planned.capacity_slots, fits - 1, -1)]
    for g in report.plan.groups:
        assert runner.pools[g.name].shape[1] == g.num_blocks + rc.decode_batch


def test_profile_shape_caps_deepseek_steps_at_tokens_in_flight():
    dsv4 = load_runtime_config(["max_num_seqs=4", "max_num_batched_tokens=512"])   # default dsv4_tiny, 32 in flight
    assert dsv4.model.layout.tokens_in_flight == 32
    assert profile_shape(dsv4) == (4 * 32, 4)
    qwen = load_runtime_config(["+model=qwen3_tiny", "max_num_seqs=4", "max_num_batched_tokens=512"])
    assert profile_shape(qwen) == (512, 4)
    few = load_runtime_config(["+model=qwen3_tiny", "max_num_seqs=32", "max_num_batched_tokens=16"])
    assert profile_shape(few) == (16, 16)                          # no more sequences than tokens


def test_runner_registry():
    assert runner_class("qwen3") is Qwen3Runner
    with pytest.raises(ValueError, match="model.arch = 'llama': must be one of"):
        runner_class("llama")
    assert runner_class("deepseek_v4").__name__ == "DeepseekV4Runner"


@pytest.fixture(scope="module")
def tiny_qwen3_start():
    rc = load_runtime_config(["+model=qwen3_tiny", "device=cpu", f"device.memory_bytes_per_device={64 * MiB}"])
    backend = CpuBackend(memory_bytes_per_device=64 * MiB)
    runner, report = launch(rc, backend)
    return rc, backend, runner, report


def test_tiny_qwen3_on_cpu_reports_exactly_the_planner_result(tiny_qwen3_start):
    rc, backend, runner, report = tiny_qwen3_start
    assert isinstance(runner, Qwen3Runner) and report.device_kind == "cpu" and report.device_count == 1
    # The measured inputs, read back from the probe: allocator peak of the profile step minus the scratch pools.
    stats = backend.memory(0)
    peak_non_kv = stats.peak_allocated_bytes - scratch_bytes(rc.model.cache_groups, rc.decode_batch)
    expected = plan_capacity(rc.model.cache_groups, [DeviceMemory("cpu:0", 64 * MiB, stats.free_bytes, peak_non_kv)],
                             utilization=rc.npu_memory_utilization, decode_batch=rc.decode_batch,
                             max_model_len=rc.max_model_len, block_size=rc.block_size)
    assert report.plan == expected
    assert runner.pools["kv"].shape[1] == report.num_blocks["kv"] + rc.decode_batch
    assert report.num_blocks["kv"] == report.capacity_slots * rc.model.group("kv").max_blocks_per_seq
    assert report.weights == "random (seed 0)" and report.allocation_retries == 0


def test_tiny_qwen3_peak_covers_weights_and_activations(tiny_qwen3_start):
    rc, backend, runner, report = tiny_qwen3_start
    weights = sum(t.numel() * t.element_size() for t in {t.untyped_storage().data_ptr(): t
                                                          for t in runner.weight_tensors()}.values())
    peak = report.plan.devices[0].peak_non_kv_bytes
    tokens, _ = profile_shape(rc)
    hidden_bytes = tokens * rc.model.layout.hidden_size * 4
    assert peak >= weights + hidden_bytes          # weights + at least the residual stream of the profile step
    assert peak < weights + 200 * hidden_bytes     # but not the KV pools or anything unbounded


def test_started_runner_serves_a_step(tiny_qwen3_start):
    rc, _, runner, report = tiny_qwen3_start
    out = runner.execute(StepBatch([SeqStep("a", [5, 6, 7], 0, {"kv": [report.num_blocks["kv"] - 1]})]))
    assert out.shape == (1, rc.model.layout.vocab_size) and torch.isfinite(out).all()


def test_tiny_deepseek_v4_starts_on_cpu():
    rc = load_runtime_config(["device=cpu", f"device.memory_bytes_per_device={256 * MiB}"])
    runner, report = launch(rc, CpuBackend(memory_bytes_per_device=256 * MiB))
    assert report.arch == "deepseek_v4" and report.capacity_slots > 0
    for g in report.plan.groups:
        assert runner.pools[g.name].shape[1] == g.num_blocks + rc.decode_batch


# -- before any weight is materialized: can the weights fit at all? -----------------------------------------

def test_weights_that_cannot_fit_fail_before_the_runner_exists_naming_every_number():
    from appliance.core.estimate import estimate_peak_non_kv
    from npu.launcher import check_weights_fit

    rc = load_runtime_config(["+model=dsv4", "device=npu", "npu_memory_utilization=0.85"])
    weights = estimate_peak_non_kv(rc.model, 1, rc.plan.activation_allowance_bytes).weight_bytes_per_device
    totals = [NPU_64G * 8] * 4
    totals[2] = NPU_64G                                     # one small device is enough to refuse
    with pytest.raises(InsufficientMemoryError) as err:
        check_weights_fit(rc, FakeBackend(FakeMemoryProbe(4, totals), kind="npu"))
    msg = str(err.value)
    usable = int(NPU_64G * 0.85)
    assert msg.startswith(f"{rc.model.name} does not fit on device npu:2; nothing was loaded")
    assert f"{NPU_64G:,} B (64.00 GiB) x 0.85 = {usable:,} B" in msg
    assert f"estimated weights               {weights:,} B" in msg
    assert "shortfall" in msg and "Fix:" in msg and "mode=plan device=ascend_a3" in msg
    assert weights > usable


def test_weights_that_fit_pass_the_check():
    from npu.launcher import check_weights_fit

    rc = load_runtime_config(["+model=dsv4", "device=npu"])
    check_weights_fit(rc, FakeBackend(FakeMemoryProbe(2, 512 * GiB), kind="npu"))
    tiny = load_runtime_config(["device=cpu"])
    check_weights_fit(tiny, CpuBackend(memory_bytes_per_device=64 * MiB))


def test_the_check_counts_the_least_kv_cache_too():
    """Weights that fit alone still fail when no slot of KV cache fits beside them."""
    from appliance.core.estimate import estimate_peak_non_kv
    from appliance.core.kv_cache_spec import bytes_per_slot
    from npu.launcher import check_weights_fit

    rc = load_runtime_config(["+model=qwen3_tiny", "device=cpu", "npu_memory_utilization=1.0"])
    weights = estimate_peak_non_kv(rc.model, 1, 0).weight_bytes_per_device
    need = weights + scratch_bytes(rc.model.cache_groups, rc.decode_batch) + bytes_per_slot(rc.model.cache_groups)
    check_weights_fit(rc, CpuBackend(memory_bytes_per_device=need))
    with pytest.raises(InsufficientMemoryError, match="shortfall                       1 B"):
        check_weights_fit(rc, CpuBackend(memory_bytes_per_device=need - 1))
