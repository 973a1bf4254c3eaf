"""Backends: selection and its reasons, clear errors for missing devices, CPU memory probe, fake probe."""

import importlib.util
import logging

import pytest
import torch

from appliance.core.config import DeviceSettings
from npu.backends import (
    BackendUnavailableError,
    CpuBackend,
    MemoryStats,
    read_meminfo,
    select_backend,
)
from npu.cpu_memory import AllocationTracker
from npu.fake import FakeBackend, FakeMemoryProbe

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


class FakeAcceleratorModule:
    """Stands in for torch.cuda / torch.npu: memory counters a test can move."""

    def __init__(self, total, used, reserved, peak):
        self.total, self.used, self.reserved, self.peak = total, used, reserved, peak
        self.resets = []

    def mem_get_info(self, i):
        return self.total - self.used, self.total

    def memory_reserved(self, i):
        return self.reserved

    def max_memory_allocated(self, i):
        return self.peak

    def reset_peak_memory_stats(self, i):
        self.resets.append(i)

    def synchronize(self, i):
        pass

    def empty_cache(self):
        pass


def test_accelerator_probe_adds_non_torch_growth_and_honours_a_cap():
    from npu.backends import AcceleratorBackend

    class Accel(AcceleratorBackend):
        kind = "cuda"

    mod = FakeAcceleratorModule(total=80 * GiB, used=1 * GiB, reserved=GiB // 2, peak=0)
    backend = Accel(mod, count=2)
    backend.reset_peak()
    assert mod.resets == [0, 1]
    mod.used, mod.reserved, mod.peak = 11 * GiB, 9 * GiB, 8 * GiB   # torch grew by 8.5 GiB, the rest by 1.5 GiB
    stats = backend.memory(1)
    assert stats == MemoryStats(80 * GiB, 69 * GiB, 8 * GiB, 3 * GiB // 2)
    capped = Accel(mod, count=1, memory_bytes_per_device=40 * GiB).memory(0)
    assert (capped.total_bytes, capped.free_bytes) == (40 * GiB, 40 * GiB)
    with pytest.raises(BackendUnavailableError, match="exceeds cuda:0's physical memory"):
        Accel(mod, count=1, memory_bytes_per_device=81 * GiB)
