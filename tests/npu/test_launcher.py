"""Startup sequence: NPU-scale plans through the fake probe equal mode=plan's, fail-fast per device (free
memory before loading, budget after profiling), re-planning after a failed allocation, and a real tiny
Qwen3 start on the CPU whose capacities equal the planner's."""


import pytest
import torch

from appliance.config.compose import load_runtime_config
from appliance.core.kv_cache_spec import scratch_bytes
from appliance.core.planner import DeviceMemory, InsufficientMemoryError, plan_capacity
from appliance.modes.plan import make_plan
from npu.backends import CpuBackend
from npu.launcher import launch
from npu.qwen3.runner import Qwen3Runner
from npu.registry import runner_class
from npu.step import SeqStep, StepBatch
from tests.support.fake_device import FakeBackend, FakeMemoryProbe, ShapeOnlyRunner

GiB = 1 << 30
MiB = 1 << 20
A3_BYTES = 65_787_658_240      # what torch.npu.mem_get_info reports for one A3 die (conf/device/ascend_a3.yaml)
NPU_64G = 64 * GiB
DSV4_SERVE = ["+model=dsv4", "max_model_len=8192", "device=npu", "device.count=16",
              f"device.memory_bytes_per_device={A3_BYTES}"]


def fake_npus(peak_non_kv, rc, count=16, free=None):
    """16 A3 dies whose allocator peak is the non-KV peak plus the scratch pools, as on a real device."""
    scratch = scratch_bytes(rc.model.cache_groups, rc.decode_batch)
    peaks = [p + scratch for p in peak_non_kv] if isinstance(peak_non_kv, list) else peak_non_kv + scratch
    return FakeBackend(FakeMemoryProbe(count, A3_BYTES, peaks, free), kind="npu")


def test_npu_scale_startup_equals_mode_plan():
    rc = load_runtime_config(DSV4_SERVE)
    peak = 40 * GiB + 123_457
    runner, report = launch(rc, fake_npus(peak, rc), ShapeOnlyRunner(rc.model))
    offline = make_plan(load_runtime_config(["+model=dsv4", "max_model_len=8192", "mode=plan", "device=ascend_a3",
                                             f"plan.peak_non_kv_bytes={peak}"]))
    assert report.plan == offline
    # The same plan from DESIGN.md section 4's figures, by hand (not through the planner both sides above use):
    # usable = 65,787,658,240 x 0.9 = 59,208,892,416 B; budget = usable - peak_non_kv 42,949,796,417
    # - non-torch margin 1 GiB (conf/device/npu.yaml) = 15,185,354,175 B; scratch 63,591,424 B (decode_batch 8);
    # one slot at max_model_len 8,192 is 160,940,032 B: (15,185,354,175 - 63,591,424) // 160,940,032 = 93.
    assert (report.plan.budget_bytes, report.plan.scratch_bytes, report.plan.bytes_per_slot) == (
        15_185_354_175, 63_591_424, 160_940_032)
    assert report.capacity_slots == 93
    assert report.num_blocks == {"ori": 93 * 4, "cmp_c128": 93 * 64, "cmp_c4": 93 * 64, "idx": 93 * 64,
                                 "hca_state": 93 * 48, "csa_state": 93 * 65, "csa_inner_state": 93 * 65}
    assert (report.device_kind, report.device_count, report.allocation_retries) == ("npu", 16, 0)
    assert report.capacity_slots > 0
    for spec in rc.model.cache_groups:
        assert runner.pools[spec.name].shape[1] == report.num_blocks[spec.name] + rc.decode_batch
        assert runner.pools[spec.name].device.type == "meta"


def test_peak_non_kv_is_what_the_driver_sees_reserved_bytes_and_memory_outside_torch():
    """The promise is kept in the driver's view: the caching allocator's reserved peak (not its allocated one) plus
    the process's memory outside torch, less the scratch pools the planner counts itself."""
    rc = load_runtime_config(DSV4_SERVE)
    probe = FakeMemoryProbe(16, A3_BYTES, 40 * GiB, reserved_bytes=44 * GiB, non_torch_bytes=GiB)
    runner, report = launch(rc, FakeBackend(probe, kind="npu"), ShapeOnlyRunner(rc.model))
    scratch = scratch_bytes(rc.model.cache_groups, rc.decode_batch)
    assert {d.peak_non_kv_bytes for d in report.plan.devices} == {45 * GiB - scratch}
    note = next(n for n in report.notes if n.startswith("peak_non_kv"))
    assert f"{40 * GiB:,} B allocated and {44 * GiB:,} B reserved at peak, {GiB:,} B outside torch" in note


def test_one_device_over_budget_fails_fast_naming_it():
    rc = load_runtime_config(DSV4_SERVE)
    peaks = [40 * GiB] * 16
    peaks[5] = int(A3_BYTES * 0.9) + 1         # nothing left for the KV cache on npu:5 only
    runner = ShapeOnlyRunner(rc.model)
    with pytest.raises(InsufficientMemoryError, match="device npu:5: .*peak_non_kv alone exceeds"):
        launch(rc, fake_npus(peaks, rc), runner)
    assert len(runner.allocation_attempts) == 1 and runner.pools == {}   # only the scratch-only profile pools


def test_too_little_free_memory_fails_before_loading_naming_the_device():
    rc = load_runtime_config(DSV4_SERVE)
    free = [A3_BYTES] * 16
    free[3] = 40 * GiB                         # another process holds about 21 GiB of npu:3
    runner = ShapeOnlyRunner(rc.model)
    with pytest.raises(InsufficientMemoryError) as err:
        launch(rc, fake_npus(40 * GiB, rc, free=free), runner)
    msg = str(err.value)
    assert msg.startswith("device npu:3: free memory 42,949,672,960 B (40.00 GiB) is less than total "
                          "65,787,658,240 B (61.27 GiB) x npu_memory_utilization 0.9")
    assert "lower npu_memory_utilization to at most 0.653" in msg
    assert runner.allocation_attempts == []    # failed before loading weights or allocating anything


class DeviceThatShrinks(FakeBackend):
    """After a failed allocation (the launcher empties the cache), the devices report `free_after` free."""

    def __init__(self, probe, free_after):
        super().__init__(probe, kind="npu")
        self.free_after = free_after

    def empty_cache(self):
        self.probe.free = [self.free_after] * self.count


def test_failed_allocation_replans_from_the_free_memory_reported_after_it():
    rc = load_runtime_config(DSV4_SERVE)
    peak = 40 * GiB
    planned = make_plan(load_runtime_config(["+model=dsv4", "max_model_len=8192", "mode=plan", "device=ascend_a3",
                                             f"plan.peak_non_kv_bytes={peak}"]))
    fits = planned.capacity_slots - 5
    margin = rc.device.non_torch_margin_bytes
    # Another process took memory after startup: the pools now get what is left after the activations still
    # to come (peak_non_kv, the probe holds nothing now) and the margin, plus part of one more slot.
    free_after = margin + peak + planned.scratch_bytes + fits * planned.bytes_per_slot + planned.bytes_per_slot // 2
    runner = ShapeOnlyRunner(rc.model, max_pool_bytes=planned.scratch_bytes + fits * planned.bytes_per_slot)
    backend = DeviceThatShrinks(fake_npus(peak, rc).probe, free_after)
    runner, report = launch(rc, backend, runner)
    assert report.allocation_retries == 1 and report.capacity_slots == fits      # one re-plan, not 5 tries
    assert report.plan.override == f"num_slots_override={fits}"
    assert [sum(a.values()) for a in runner.allocation_attempts[1:]] == [
        s * sum(g.max_blocks_per_seq for g in rc.model.cache_groups) for s in (planned.capacity_slots, fits)]
    for g in report.plan.groups:
        assert runner.pools[g.name].shape[1] == g.num_blocks + rc.decode_batch


def test_failed_allocation_with_no_room_left_is_a_clear_error():
    rc = load_runtime_config(DSV4_SERVE)
    runner = ShapeOnlyRunner(rc.model, max_pool_bytes=scratch_bytes(rc.model.cache_groups, rc.decode_batch))
    backend = DeviceThatShrinks(fake_npus(40 * GiB, rc).probe, free_after=41 * GiB)
    with pytest.raises(InsufficientMemoryError, match=r"too little free memory for one slot .*npu:0 free "
                                                      r"44,023,414,784 B"):
        launch(rc, backend, runner)
    assert runner.pools == {}


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
    # By hand: a kv page is 2 layers x 16 tokens x (K and V of 2 kv heads x 16 dims) x 4 B = 8,192 B; a slot is
    # 512 / 16 = 32 pages, scratch 8 pages; the CPU keeps no non-torch margin.
    lay = rc.model.layout
    page = lay.num_layers * lay.block_size * 2 * lay.num_kv_heads * lay.head_dim * 4
    assert (page, rc.max_model_len, rc.decode_batch, lay.dtype) == (8192, 512, 8, "float32")
    budget = int(64 * MiB * 0.9) - peak_non_kv
    assert report.plan.budget_bytes == budget
    assert report.capacity_slots == (budget - 8 * page) // (32 * page) > 0
    assert runner.pools["kv"].shape[1] == report.num_blocks["kv"] + rc.decode_batch
    assert report.num_blocks["kv"] == report.capacity_slots * rc.model.group("kv").max_blocks_per_seq
    assert report.weights == "random (seed 0)" and report.allocation_retries == 0


def test_tiny_qwen3_peak_covers_weights_and_activations(tiny_qwen3_start):
    rc, backend, runner, report = tiny_qwen3_start
    # one per storage; a oneDNN-packed weight (fp32 on non-Intel CPUs) is opaque: its own buffer
    weights = sum(t.numel() * t.element_size() for t in {id(t) if t.is_mkldnn else t.untyped_storage().data_ptr(): t
                                                          for t in runner.weight_tensors()}.values())
    peak = report.plan.devices[0].peak_non_kv_bytes
    hidden_bytes = rc.max_num_batched_tokens * rc.model.layout.hidden_size * 4
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
    from appliance.core.parallel import RankPlace
    from npu.launcher import check_backend_fit

    rc = load_runtime_config(["+model=dsv4", "device=npu", "npu_memory_utilization=0.85"])
    weights = estimate_peak_non_kv(rc.model, RankPlace.single(), rc.plan.activation_allowance_bytes).weight_bytes_per_device
    totals = [NPU_64G * 8] * 4
    totals[2] = NPU_64G                                     # one small device is enough to refuse
    with pytest.raises(InsufficientMemoryError) as err:
        check_backend_fit(rc, FakeBackend(FakeMemoryProbe(4, totals), kind="npu"))
    msg = str(err.value)
    usable = int(NPU_64G * 0.85)
    assert msg.startswith(f"{rc.model.name} does not fit on device npu:2; nothing was loaded")
    assert f"{NPU_64G:,} B (64.00 GiB) x 0.85 = {usable:,} B" in msg
    assert f"estimated weights               {weights:,} B" in msg
    assert "shortfall" in msg and "Fix:" in msg and "mode=plan device=ascend_a3" in msg
    assert weights > usable


def test_weights_that_fit_pass_the_check():
    from npu.launcher import check_backend_fit

    rc = load_runtime_config(["+model=dsv4", "device=npu"])
    check_backend_fit(rc, FakeBackend(FakeMemoryProbe(2, 512 * GiB), kind="npu"))
    tiny = load_runtime_config(["device=cpu"])
    check_backend_fit(tiny, CpuBackend(memory_bytes_per_device=64 * MiB))


def test_the_check_counts_the_least_kv_cache_too():
    """Weights that fit alone still fail when no slot of KV cache fits beside them."""
    from appliance.core.estimate import estimate_peak_non_kv
    from appliance.core.kv_cache_spec import bytes_per_slot
    from appliance.core.parallel import RankPlace
    from npu.launcher import check_backend_fit

    rc = load_runtime_config(["+model=qwen3_tiny", "device=cpu", "npu_memory_utilization=1.0"])
    weights = estimate_peak_non_kv(rc.model, RankPlace.single(), 0).weight_bytes_per_device
    need = weights + scratch_bytes(rc.model.cache_groups, rc.decode_batch) + bytes_per_slot(rc.model.cache_groups)
    check_backend_fit(rc, CpuBackend(memory_bytes_per_device=need))
    with pytest.raises(InsufficientMemoryError, match="shortfall                       1 B"):
        check_backend_fit(rc, CpuBackend(memory_bytes_per_device=need - 1))


def test_startup_reports_each_phase_in_order(caplog):
    rc = load_runtime_config(DSV4_SERVE)
    with caplog.at_level("INFO", logger="npu.launcher"):
        launch(rc, fake_npus(40 * GiB, rc), ShapeOnlyRunner(rc.model))
    phases = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[")]
    assert [p[:5] for p in phases] == ["[1/4]", "[2/4]", "[3/4]", "[4/4]"]
    assert "loading weights" in phases[0] and "profiling" in phases[1]
    assert "planning" in phases[2] and "allocating" in phases[3] and "GiB of KV cache" in phases[3]


@pytest.mark.parametrize("make", ["random", "checkpoint"])
def test_weights_load_with_a_progress_bar(monkeypatch, tmp_path, make):
    """Loading shows a per-tensor bar (tqdm on stderr) that reaches every tensor."""
    import npu.weights as weights
    bars = []

    class Recorder(weights.tqdm):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            bars.append(self)
    monkeypatch.setattr(weights, "tqdm", Recorder)
    expected = {"a.weight": ((4, 4), torch.float32), "norm.weight": ((4,), torch.float32)}
    if make == "random":
        weights.random_state_dict(expected, seed=0, device="cpu")
    else:
        from safetensors.torch import save_file
        save_file({"a.weight": torch.ones(4, 4), "norm.weight": torch.ones(4)}, str(tmp_path / "m.safetensors"))
        weights.load_state_dict(tmp_path, expected, "cpu")
    assert [(b.total, b.n) for b in bars] == [(2, 2)]
    assert bars[0].desc in ("making random weights", "loading weights")


@pytest.mark.parametrize("utilization", [0.85, 0.9, 0.93, 1.0])
def test_the_fit_before_loading_and_the_plan_agree_at_the_boundary(utilization):
    """One fit check (planner.kv_shortfall) and one total x utilization (planner.usable_bytes): a device that
    passes the check before loading, with the estimated weights as its peak, plans at least one slot; a device
    one byte smaller fails both, each naming a shortfall of the same size."""
    from appliance.core.estimate import estimate_peak_non_kv
    from appliance.core.parallel import RankPlace
    from appliance.core.planner import kv_shortfall, least_kv_bytes, usable_bytes
    from npu.launcher import check_backend_fit

    rc = load_runtime_config(["+model=qwen3_tiny", "device=cpu", f"npu_memory_utilization={utilization}"])
    specs = rc.model.cache_groups
    weights = estimate_peak_non_kv(rc.model, RankPlace.single(), 0).weight_bytes_per_device
    total = next(t for t in range(int((weights + least_kv_bytes(specs, rc.decode_batch)) / utilization) - 2, 1 << 40)
                 if usable_bytes(t, utilization) - weights >= least_kv_bytes(specs, rc.decode_batch))
    for size, fits in ((total, True), (total - 1, False)):
        shortfall = kv_shortfall(usable_bytes(size, utilization) - weights, specs, rc.decode_batch)
        assert (shortfall == 0) == fits
        device = DeviceMemory("cpu", size, size, weights)
        if fits:
            check_backend_fit(rc, CpuBackend(memory_bytes_per_device=size))
            assert plan_capacity(specs, [device], utilization=utilization, decode_batch=rc.decode_batch,
                                 max_model_len=rc.max_model_len, block_size=rc.block_size).capacity_slots >= 1
            continue
        with pytest.raises(InsufficientMemoryError, match=f"shortfall +{shortfall:,} B"):
            check_backend_fit(rc, CpuBackend(memory_bytes_per_device=size))
        with pytest.raises(InsufficientMemoryError, match=f"shortfall {shortfall:,} B"):
            plan_capacity(specs, [device], utilization=utilization, decode_batch=rc.decode_batch,
                          max_model_len=rc.max_model_len, block_size=rc.block_size)
