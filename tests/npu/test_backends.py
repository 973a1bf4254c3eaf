"""Backends: selection and its reasons, clear errors for missing devices, CPU memory probe, fake probe, and,
through a fake torch_npu, which devices and threads the NPU backend, the launcher and the engine touch."""

import importlib.util
import logging
import threading

import pytest
import torch

from appliance.config.compose import load_runtime_config
from appliance.core.config import DeviceSettings
from appliance.core.planner import InsufficientMemoryError
from appliance.core.request import SamplingParams
from appliance.engine.engine import Engine
from npu.backends import (
    BackendUnavailableError,
    CpuBackend,
    MemoryStats,
    NpuBackend,
    select_backend,
)
from npu.cpu_memory import AllocationTracker
from npu.host import read_meminfo
from npu.launcher import launch
from tests.npu import fake_torch_npu
from tests.npu.fake_torch_npu import FakeNpuDevice, FakeNpuRuntime
from tests.support.fake_device import FakeBackend, FakeMemoryProbe, ShapeOnlyRunner

MiB = 1 << 20
GiB = 1 << 30
HAS_TORCH_NPU = importlib.util.find_spec("torch_npu") is not None


def device(kind="auto", count=None, memory=None, offline=False):
    return DeviceSettings(kind=kind, count=count, memory_bytes_per_device=memory, offline=offline)


@pytest.fixture
def meminfo(tmp_path):
    path = tmp_path / "meminfo"
    path.write_text("MemTotal:       16000000 kB\nMemFree:         1000000 kB\nMemAvailable:    7340032 kB\n"
                    "HugePages_Total:       0\n")
    return str(path)


@pytest.mark.skipif(HAS_TORCH_NPU or torch.cuda.is_available(), reason="needs a machine without npu and cuda")
def test_auto_picks_cpu_and_says_why(caplog):
    with caplog.at_level(logging.INFO, logger="npu.backends"):
        backend = select_backend(device("auto"))
    assert isinstance(backend, CpuBackend) and backend.count == 1
    assert backend.torch_device(0) == torch.device("cpu")
    assert "device=auto chose cpu: torch_npu is not installed" in caplog.text


@pytest.mark.skipif(HAS_TORCH_NPU, reason="torch_npu is installed here")
def test_npu_without_torch_npu_names_the_package_and_cann():
    with pytest.raises(BackendUnavailableError) as err:
        select_backend(device("npu"))
    msg = str(err.value)
    assert "torch-npu" in msg and "pip install '.[npu]'" in msg and "CANN" in msg


@pytest.mark.skipif(torch.cuda.is_available(), reason="cuda is available here")
def test_cuda_without_cuda_is_a_clear_error():
    with pytest.raises(BackendUnavailableError, match="device.kind=cuda but torch.cuda.is_available\\(\\) is False"):
        select_backend(device("cuda"))


def test_offline_profile_and_bad_counts_are_rejected():
    with pytest.raises(BackendUnavailableError, match="offline planning profile"):
        select_backend(device("npu", 16, 64 * GiB, offline=True))
    with pytest.raises(BackendUnavailableError, match="device.count=2: the cpu backend has exactly one device"):
        select_backend(device("cpu", 2))


def test_cpu_total_is_the_configured_budget_else_mem_available(meminfo):
    assert read_meminfo(meminfo)["MemAvailable"] == 7340032 * 1024
    unset = CpuBackend(memory_bytes_per_device=None, meminfo_path=meminfo).memory(0)
    assert (unset.total_bytes, unset.free_bytes) == (7340032 * 1024, 7340032 * 1024)
    capped = CpuBackend(memory_bytes_per_device=4 * GiB, meminfo_path=meminfo).memory(0)
    assert (capped.total_bytes, capped.free_bytes) == (4 * GiB, 4 * GiB)
    small = CpuBackend(memory_bytes_per_device=64 * GiB, meminfo_path=meminfo).memory(0)
    assert small.free_bytes == 7340032 * 1024 < small.total_bytes
    with pytest.raises(IndexError, match="cpu backend has 1 device"):
        CpuBackend().memory(1)


def test_select_cpu_honours_memory_bytes_per_device():
    backend = select_backend(device("cpu", 1, 3 * GiB))
    assert isinstance(backend, CpuBackend) and backend.memory(0).total_bytes == 3 * GiB


def test_tracker_counts_live_allocations_not_freed_ones():
    with AllocationTracker() as t:
        a = torch.empty(MiB, dtype=torch.uint8)
        del a
        b = torch.empty(2 * MiB, dtype=torch.uint8)
        view = b[: MiB]                      # a view: no new storage
        assert t.live_bytes == 2 * MiB
    assert t.peak_bytes == 2 * MiB
    with AllocationTracker() as t2:
        keep = [torch.empty(MiB, dtype=torch.uint8), torch.empty(3 * MiB, dtype=torch.uint8)]
    assert t2.peak_bytes == 4 * MiB
    del keep, view, b


def test_tracker_adopts_existing_tensors_once_as_resident():
    weights = torch.ones(MiB // 4)           # 1 MiB of float32, made before the window
    with AllocationTracker() as t:
        y = weights * 2                      # reads weights (adopted) and allocates y (live)
        z = weights[:10].sum()               # a view of the same storage: adopted once
        del y, z
    assert t.resident_bytes == MiB
    assert t.peak_bytes == MiB + MiB + 4     # weights + y + the 4-byte sum


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tracker_adopts_a_packed_weight_it_cannot_see_the_storage_of(dtype):
    from npu.linear import Projection

    proj = Projection.of(torch.randn(16384, 512, dtype=dtype))  # large enough to be packed (npu.linear)
    packed = proj.onednn_packed if proj.onednn_packed is not None else proj.mkl_packed   # fp32: by the CPU's maker
    if proj.kernel_packed is not None:                          # bf16 on AVX512-BF16 without AMX: the own kernel's
        packed = proj.kernel_packed.packed
    # No oneDNN bf16 on this CPU (AVX2 only): the bf16 weight stays plain, and the tracker counts just it.
    assert packed is not None or (dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported())
    with AllocationTracker() as t:
        t.adopt(proj.tensors())
        proj(torch.randn(8, 512, dtype=dtype))   # an op reading the packed tensor: adopted, not an error
    plain = 0 if proj.weight is None else proj.weight.numel() * proj.weight.element_size()
    assert t.resident_bytes == plain + (0 if packed is None else packed.numel() * packed.element_size()) > 0


def test_cpu_backend_peak_covers_weights_and_activation_high_water(meminfo):
    backend = CpuBackend(memory_bytes_per_device=GiB, meminfo_path=meminfo)
    w = torch.randn(256, 256)                                       # 256 KiB "weights"
    x = torch.randn(64, 256)
    backend.reset_peak()
    with backend.tracking() as tracker:
        tracker.adopt([w])
        h = torch.relu(x @ w)                                       # 64 KiB result + a 64 KiB temporary
        out = h.sum()
        del h
    # weights and input (both read) + x @ w and relu's output, alive together; the later 4-byte sum is not a peak
    assert backend.memory(0).peak_allocated_bytes == w.nbytes + x.nbytes + 2 * 64 * 256 * 4
    backend.reset_peak()
    assert backend.memory(0).peak_allocated_bytes == 0
    del out


def test_fake_backend_reports_per_device_npu_numbers():
    peaks = [20 * GiB] * 16
    peaks[5] = 61 * GiB
    probe = FakeMemoryProbe(16, 64 * GiB, peaks, free_bytes=[63 * GiB] * 16)
    backend = FakeBackend(probe, kind="npu")
    assert backend.count == 16 and backend.device_name(15) == "npu:15"
    assert backend.torch_device(3) == torch.device("meta")
    assert backend.memory(5) == MemoryStats(64 * GiB, 63 * GiB, 61 * GiB)
    assert backend.memory(0).peak_allocated_bytes == 20 * GiB
    with pytest.raises(IndexError):
        backend.memory(16)
    with pytest.raises(ValueError, match="3 values for 16 devices"):
        FakeMemoryProbe(16, [1, 2, 3])


def npu_runtime(count=8, total=64 * GiB, used_by_others=0):
    return FakeNpuRuntime([FakeNpuDevice(total, used_by_others) for _ in range(count)])


def test_accelerator_probe_adds_non_torch_growth_and_honours_a_cap(monkeypatch):
    runtime = npu_runtime(count=2, total=80 * GiB)
    fake_torch_npu.install(monkeypatch, runtime)
    for d in runtime.devices:
        d.used_by_others, d.reserved = GiB // 2, GiB // 2
    backend = NpuBackend(count=2)
    backend.reset_peak()
    assert [t.device for t in runtime.touches if t.call == "reset_peak_memory_stats"] == [0, 1]
    dev = runtime.devices[1]
    dev.used_by_others, dev.reserved, dev.allocated, dev.peak = 2 * GiB, 9 * GiB, 7 * GiB, 8 * GiB
    dev.peak_reserved = 10 * GiB
    # outside torch the device grew by 1.5 GiB (0.5 -> 2 GiB); free = 80 - 2 - 9 GiB
    stats = backend.memory(1)
    assert stats == MemoryStats(80 * GiB, 69 * GiB, 8 * GiB, 3 * GiB // 2, 7 * GiB, 10 * GiB)
    assert stats.peak_torch_bytes == 10 * GiB and not backend.context_counted
    capped = NpuBackend(count=1, memory_bytes_per_device=40 * GiB).memory(0)
    assert (capped.total_bytes, capped.free_bytes) == (40 * GiB, 40 * GiB)
    with pytest.raises(BackendUnavailableError, match="exceeds npu:0's physical memory"):
        NpuBackend(count=1, memory_bytes_per_device=81 * GiB)


def test_only_configured_npus_are_touched(monkeypatch):
    runtime = npu_runtime(count=8)
    fake_torch_npu.install(monkeypatch, runtime)
    backend = select_backend(device("npu"))                 # device.count null: one device, not all eight
    backend.set_device(0)
    backend.reset_peak()
    backend.memory(0)
    backend.synchronize()
    assert backend.count == 1 and runtime.touched_devices() == {0}
    runtime.touches.clear()
    two = select_backend(device("npu", count=2))
    two.reset_peak()
    [two.memory(i) for i in range(2)]
    assert runtime.touched_devices() == {0, 1}
    with pytest.raises(BackendUnavailableError, match="device.count=9 but only 8 npu device"):
        select_backend(device("npu", count=9))


def test_a_rank_opens_only_its_local_device(monkeypatch):
    """A rank process of a multi-device deployment uses one device, its local rank on the host."""
    runtime = npu_runtime(count=8)
    fake_torch_npu.install(monkeypatch, runtime)
    backend = select_backend(device("npu", count=1), 5)
    backend.set_device(0)
    backend.reset_peak()
    backend.memory(0)
    backend.synchronize()
    assert (backend.count, backend.device_name(0)) == (1, "npu:5")
    assert runtime.touched_devices() == {5}
    with pytest.raises(BackendUnavailableError, match="this rank uses npu:8 .* only 8 npu device"):
        select_backend(device("npu", count=1), 8)


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto would pick cuda here")
@pytest.mark.parametrize("error", [RuntimeError("NPU device conflict: the device is in use"),
                                   OSError("libascendcl.so: cannot open shared object file"),
                                   ImportError("torch_npu was built for torch 2.5")])
def test_auto_survives_torch_npu_raising_anything_on_import(monkeypatch, caplog, error):
    fake_torch_npu.install(monkeypatch, error=error)
    with caplog.at_level(logging.INFO, logger="npu.backends"):
        backend = select_backend(device("auto"))
    assert isinstance(backend, CpuBackend)
    assert f"device=auto chose cpu: torch_npu failed to import ({type(error).__name__}: {error})" in caplog.text
    with pytest.raises(BackendUnavailableError, match=f"not importable \\({type(error).__name__}: "):
        select_backend(device("npu"))


def test_too_little_free_npu_memory_fails_before_loading(monkeypatch):
    runtime = npu_runtime(count=1, total=64 * GiB, used_by_others=10 * GiB)   # 54 GiB free < 0.9 x 64 GiB
    fake_torch_npu.install(monkeypatch, runtime)
    rc = load_runtime_config(["+model=qwen3_tiny", "device=npu"])
    runner = ShapeOnlyRunner(rc.model)
    with pytest.raises(InsufficientMemoryError, match=r"device npu:0: free memory 57,982,058,496 B \(54.00 GiB\) is "
                                                      r"less than total 68,719,476,736 B \(64.00 GiB\) x "
                                                      r"npu_memory_utilization 0.9"):
        launch(rc, NpuBackend(), runner)
    assert runner.allocation_attempts == [] and runtime.touched_devices() == {0}


class NpuOnCpu(NpuBackend):
    """The NPU backend over the fake torch_npu, with tensors on the host (torch has no npu device here)."""

    def torch_device(self, index=0):
        self._indices(index)
        return torch.device("cpu")


def test_the_loop_thread_launches_and_steps_with_the_npu_current(monkeypatch):
    """Engine.start waits on the caller's thread; the launch and every step run on the loop thread, which makes
    the device current first (the NPU runtime keeps one current device per thread)."""
    runtime = npu_runtime(count=4)
    fake_torch_npu.install(monkeypatch, runtime)
    rc = load_runtime_config(["+model=qwen3_tiny", "device=npu", f"device.memory_bytes_per_device={64 * MiB}",
                              "device.non_torch_margin_bytes=0"])
    runtime.devices[0].allocated = 8 * MiB       # the "weights": what the profile's peak starts from
    monkeypatch.setattr("npu.launcher.select_backend",
                        lambda device, first=0, ranks_on_host=1: NpuOnCpu(memory_bytes_per_device=64 * MiB))
    engine = Engine(rc)
    starter = threading.Thread(target=engine.start, name="engine-start")
    starter.start()
    starter.join()
    try:
        outputs = list(engine.submit("r1", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True)))
        assert outputs[-1].finished and sum(len(o.new_token_ids) for o in outputs) == 3
        set_by = {(t.thread, t.device) for t in runtime.touches if t.call == "set_device"}
        assert set_by == {("engine-loop", 0)}       # the starting thread does no device work
        assert runtime.touched_devices() == {0}      # devices 1-3 are visible but never opened
    finally:
        engine.shutdown()


def test_the_runtime_context_counts_as_this_process_memory_where_the_driver_is_asked_first(monkeypatch):
    """With NVML (device_memory_used) others' use is read before this process opens its context, so what the context
    and other non-torch allocations take is this process's, in non_torch_bytes (the driver's view of the promise)."""
    runtime = npu_runtime(count=1, total=80 * GiB)
    dev = runtime.devices[0]
    dev.used_by_others = 3 * GiB                       # another process, before this one starts
    runtime.device_memory_used = lambda index: runtime.devices[index].used_by_others   # NVML, no context opened
    fake_torch_npu.install(monkeypatch, runtime)
    backend = NpuBackend(count=1)
    assert backend.context_counted
    dev.used_by_others += GiB // 2                     # this process's context and workspaces, outside torch
    dev.reserved = 4 * GiB
    assert backend.memory(0).non_torch_bytes == GiB // 2
