"""Device backends: which accelerator to run on, and a memory probe per device.

A Backend answers, per device: total and free memory, the peak allocated since the last reset, what this
process's tensors hold now, and (for accelerators) memory outside torch's allocator that grew since the
backend was created. The launcher resets the peak once weights and scratch pools are in place, runs the
worst steps, and turns what the probes say into each device's peak non-KV memory for the pure planner.

A backend touches only its configured devices (device.count; null = one), so probing never opens a
context on a device this process does not use, and every thread that runs device work first makes its
device current (set_device): the CUDA and NPU runtimes keep the current device per thread.

    npu   Ascend through torch_npu (imported lazily; only this backend needs it)
    cuda  NVIDIA through torch.cuda
    cpu   the host; total = device.memory_bytes_per_device or /proc/meminfo MemAvailable (npu.host), and the
          peak comes from AllocationTracker, because torch keeps no allocator statistics on CPU

tests/support/fake_device.py has a scripted backend with NPU-sized numbers (tests); npu.cpu_memory has the
allocation tracker that gives the CPU backend its peak; npu.host reads the host's memory and chooses its threads.
"""

from __future__ import annotations

import contextlib
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from appliance.core.config import DeviceSettings
from appliance.core.errors import StartupError
from npu.cpu_malloc import keep_freed_memory
from npu.cpu_memory import AllocationTracker
from npu.host import MEMINFO, available_bytes, intra_op_threads

log = logging.getLogger("npu.backends")

NPU_INSTALL_HINT = ("install the torch-npu package (pip install '.[npu]') on a host with the Ascend CANN toolkit "
                    "installed and sourced (set_env.sh)")


class BackendUnavailableError(StartupError, RuntimeError):
    """The requested device kind (or count) is not available on this machine (the CLI exits 2 with the message)."""


@dataclass(frozen=True)
class MemoryStats:
    """One device's memory as the probe sees it, in bytes."""

    total_bytes: int
    free_bytes: int
    peak_allocated_bytes: int      # highest bytes held by this process's tensors since the last reset_peak
    non_torch_bytes: int = 0       # this process's device memory outside torch's allocator (see AcceleratorBackend)
    allocated_bytes: int = 0       # bytes this process's tensors hold now (0 where torch keeps no count: cpu)
    peak_reserved_bytes: int = 0   # highest bytes the caching allocator held from the driver (0: it keeps none)

    @property
    def peak_torch_bytes(self) -> int:
        """What torch took from the driver at its peak: the allocator's reserved bytes (allocated ones plus its cache
        and fragmentation), or the allocated ones where there is no such allocator (the CPU)."""
        return max(self.peak_reserved_bytes, self.peak_allocated_bytes)


class Backend(ABC):
    """One device kind with `count` devices used by this process."""

    kind: str = ""

    def __init__(self, count: int):
        self.count = count

    def device_name(self, index: int) -> str:
        return f"{self.kind}:{index}"

    @abstractmethod
    def torch_device(self, index: int = 0) -> torch.device:
        """The torch device tensors of device `index` live on."""

    @abstractmethod
    def memory(self, index: int = 0) -> MemoryStats:
        ...

    @abstractmethod
    def reset_peak(self, index: int | None = None) -> None:
        """Start a new peak window on one device (None: every device)."""

    def synchronize(self, index: int | None = None) -> None:
        """Wait for queued device work, so timings and peaks are complete."""

    def set_device(self, index: int) -> None:
        """Make device `index` the calling thread's current device (the runtimes keep one per thread)."""
        self._indices(index)

    def tracking(self) -> contextlib.AbstractContextManager:
        """Context in which allocations must be observed for the peak to be right (CPU needs it)."""
        return contextlib.nullcontext()

    def empty_cache(self) -> None:
        """Return cached, unused blocks to the device (before a retry of a failed allocation)."""

    def _indices(self, index: int | None) -> range:
        if index is None:
            return range(self.count)
        if not 0 <= index < self.count:
            raise IndexError(f"{self.kind} backend has {self.count} device(s); no device {index}")
        return range(index, index + 1)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(count={self.count})"


# -- accelerators (npu, cuda) -------------------------------------------------------------------------

class AcceleratorBackend(Backend):
    """Shared by npu and cuda: torch.npu mirrors torch.cuda's memory API.

    Memory as the driver sees it: besides torch's allocator (reserved bytes), a process holds its runtime context,
    library handles and workspaces outside torch. non_torch_bytes = device used (total - free) - reserved - the
    device's use by others, where others' use is read from the driver (NVML: torch.cuda.device_memory_used) before
    this process opens its context, so the context counts as ours. Where the driver cannot be asked (no NVML, or
    torch_npu), others' use is taken when the backend starts, after the context: the context is then in the
    planner's non_torch_margin_bytes, not in the measurement.

    `first` is the physical index of this backend's device 0: a rank process uses one device, its local rank
    on its host, and names and touches only that one."""

    def __init__(self, module: Any, count: int, memory_bytes_per_device: int | None = None, first: int = 0):
        super().__init__(count)
        self.mod = module
        self.first = first
        self.memory_cap = memory_bytes_per_device
        before_context = [self._driver_used(i) for i in range(count)]
        self._non_torch_base = [self._non_torch_now(i) if used is None else used
                                for i, used in enumerate(before_context)]
        self.context_counted = all(used is not None for used in before_context)
        if memory_bytes_per_device is not None:
            for i in range(count):
                physical = self.mod.mem_get_info(self.first + i)[1]
                if memory_bytes_per_device > physical:
                    raise BackendUnavailableError(
                        f"device.memory_bytes_per_device {memory_bytes_per_device:,} exceeds {self.device_name(i)}'s "
                        f"physical memory {physical:,}")

    def _driver_used(self, index: int) -> int | None:
        """The device's used bytes in the driver's view, read without opening a context (NVML); None: unknown."""
        read = getattr(self.mod, "device_memory_used", None)
        if read is None:
            return None
        try:
            return int(read(self.first + index))
        except Exception:  # noqa: BLE001 - no NVML (pynvml missing, driver without it): measure after the context
            return None

    def device_name(self, index: int) -> str:
        return f"{self.kind}:{self.first + index}"

    def torch_device(self, index: int = 0) -> torch.device:
        return torch.device(self.kind, self.first + index)

    def _non_torch_now(self, index: int) -> int:
        free, total = self.mod.mem_get_info(self.first + index)
        return (total - free) - self.mod.memory_reserved(self.first + index)

    def memory(self, index: int = 0) -> MemoryStats:
        self._indices(index)
        physical = self.first + index
        free, total = self.mod.mem_get_info(physical)
        if self.memory_cap is not None:
            total, free = self.memory_cap, min(free, self.memory_cap)
        grown = max(0, self._non_torch_now(index) - self._non_torch_base[index])
        reserved = getattr(self.mod, "max_memory_reserved", None)
        return MemoryStats(total, free, self.mod.max_memory_allocated(physical), grown,
                           self.mod.memory_allocated(physical), 0 if reserved is None else reserved(physical))

    def reset_peak(self, index: int | None = None) -> None:
        for i in self._indices(index):
            self.mod.reset_peak_memory_stats(self.first + i)

    def synchronize(self, index: int | None = None) -> None:
        for i in self._indices(index):
            self.mod.synchronize(self.first + i)

    def set_device(self, index: int) -> None:
        self._indices(index)
        self.mod.set_device(self.first + index)

    def empty_cache(self) -> None:
        self.mod.empty_cache()


class CudaBackend(AcceleratorBackend):
    kind = "cuda"

    def __init__(self, count: int | None = None, memory_bytes_per_device: int | None = None, first: int = 0):
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
            raise BackendUnavailableError(f"device.kind=cuda but torch.cuda.is_available() is False (torch "
                                          f"{torch.__version__} is {build}). Fix: install a CUDA build of torch on a "
                                          f"host with an NVIDIA GPU and driver, or use device=auto or device=cpu")
        super().__init__(torch.cuda, _resolve_count("cuda", count, torch.cuda.device_count(), first),
                         memory_bytes_per_device, first)


def import_torch_npu() -> Any:
    """torch_npu, imported only when an NPU is asked for; a missing install names what to install.

    Any exception counts, not only ImportError: a torch_npu built for another torch, or a CANN that is not
    sourced, raises RuntimeError or OSError on import, and device=auto must still fall back to cuda or cpu."""
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)
    except Exception as exc:  # any exception: see the docstring
        raise BackendUnavailableError(f"device.kind=npu needs torch_npu, which is not importable "
                                      f"({type(exc).__name__}: {exc}). Fix: {NPU_INSTALL_HINT}, or use device=auto "
                                      f"or device=cpu") from exc
    return torch.npu  # type: ignore[attr-defined]


class NpuBackend(AcceleratorBackend):
    kind = "npu"

    def __init__(self, count: int | None = None, memory_bytes_per_device: int | None = None, first: int = 0):
        mod = import_torch_npu()
        if not mod.is_available():
            raise BackendUnavailableError("torch_npu is installed but no NPU is visible (torch.npu.is_available() "
                                          "is False): check the driver, ASCEND_RT_VISIBLE_DEVICES and npu-smi")
        super().__init__(mod, _resolve_count("npu", count, mod.device_count(), first), memory_bytes_per_device, first)


def _resolve_count(kind: str, wanted: int | None, visible: int, first: int = 0) -> int:
    """device.count, checked against what is visible; null means one device (never every visible one). A rank
    process opens one device, `first` (its local rank), which must be visible."""
    if visible < 1:
        raise BackendUnavailableError(f"no {kind} device is visible")
    if first >= visible:
        raise BackendUnavailableError(f"this rank uses {kind}:{first} (its local rank) but only {visible} {kind} "
                                      f"device(s) are visible on this host: run at most {visible} ranks per host")
    if wanted is None:
        return 1
    if wanted > visible:
        raise BackendUnavailableError(f"device.count={wanted} but only {visible} {kind} device(s) are visible")
    return wanted


# -- cpu ----------------------------------------------------------------------------------------------

class CpuBackend(Backend):
    """The host as one device. Peak is tracked by AllocationTracker inside `tracking()` windows."""

    kind = "cpu"

    def __init__(self, count: int | None = None, memory_bytes_per_device: int | None = None,
                 meminfo_path: str = MEMINFO, threads: int | None = None, ranks_on_host: int = 1):
        if count not in (None, 1):
            raise BackendUnavailableError(f"device.count={count}: the cpu backend has exactly one device")
        super().__init__(1)
        torch.set_num_threads(intra_op_threads(ranks_on_host) if threads is None else threads)
        keep_freed_memory()          # a step reuses the last step's pages instead of faulting in new ones
        self.memory_cap = memory_bytes_per_device
        self.meminfo_path = meminfo_path
        self._tracker: AllocationTracker | None = None
        self._last_peak = 0

    def torch_device(self, index: int = 0) -> torch.device:
        self._indices(index)
        return torch.device("cpu")

    def memory(self, index: int = 0) -> MemoryStats:
        self._indices(index)
        available = available_bytes(self.meminfo_path)
        if available is None:
            raise BackendUnavailableError(f"{self.meminfo_path} has no MemAvailable line; "
                                          "set device.memory_bytes_per_device")
        total = self.memory_cap if self.memory_cap is not None else available
        peak = self._tracker.peak_bytes if self._tracker is not None else self._last_peak
        return MemoryStats(total, min(total, available), peak)

    def reset_peak(self, index: int | None = None) -> None:
        self._indices(index)
        if self._tracker is not None:
            self._tracker.reset_peak()
        self._last_peak = 0

    @contextlib.contextmanager
    def tracking(self) -> Iterator[AllocationTracker]:
        tracker = AllocationTracker()
        self._tracker = tracker
        try:
            with tracker:
                yield tracker
        finally:
            self._last_peak = tracker.peak_bytes
            self._tracker = None


# -- selection ----------------------------------------------------------------------------------------

def _npu_visible() -> tuple[bool, str]:
    try:
        mod = import_torch_npu()
    except BackendUnavailableError as exc:
        cause = exc.__cause__
        if isinstance(cause, ModuleNotFoundError):
            return False, "torch_npu is not installed"
        return False, f"torch_npu failed to import ({type(cause).__name__}: {cause})"
    try:
        n = mod.device_count() if mod.is_available() else 0
    except Exception as exc:  # a broken driver must not stop the fallback to cuda/cpu
        return False, f"torch_npu failed to list devices ({exc})"
    return (n > 0), (f"{n} NPU(s) visible" if n else "torch_npu is installed but no NPU is visible")


def select_backend(device: DeviceSettings, first: int = 0, ranks_on_host: int = 1) -> Backend:
    """The backend for rc.device: an explicit kind, or auto = npu, then cuda, then cpu (logged with why).

    `first`: the physical index of its device 0 on this host (a rank's local rank; the host CPU has one);
    `ranks_on_host`: the ranks whose processes share the host CPU (its cores are divided among them)."""
    kind, count, cap = device.kind, device.count, device.memory_bytes_per_device
    if device.offline:
        raise BackendUnavailableError("this device profile is an offline planning profile (device.offline=true); "
                                      "it can only be used with mode=plan or mode=validate")
    if kind == "npu":
        return NpuBackend(count, cap, first)
    if kind == "cuda":
        return CudaBackend(count, cap, first)
    if kind == "cpu":
        return CpuBackend(count, cap, threads=device.cpu_threads, ranks_on_host=ranks_on_host)
    if kind != "auto":
        raise BackendUnavailableError(f"device.kind={kind!r}: must be one of auto, cpu, cuda, npu")
    npu_ok, npu_why = _npu_visible()
    if npu_ok:
        log.info("device=auto chose npu: %s", npu_why)
        return NpuBackend(count, cap, first)
    cuda_n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cuda_n:
        log.info("device=auto chose cuda: %s; %d CUDA device(s) visible", npu_why, cuda_n)
        return CudaBackend(count, cap, first)
    cuda_why = "torch.cuda.is_available() is False" if torch.version.cuda else "torch is a CPU-only build"
    cpu_cap = cap if cap is not None else device.cpu_memory_bytes
    log.info("device=auto chose cpu: %s; %s (memory: %s)", npu_why, cuda_why,
             f"a budget of {cpu_cap:,} B" if cpu_cap else f"MemAvailable of {MEMINFO}")
    return CpuBackend(None if count is None else count, cpu_cap, threads=device.cpu_threads,
                      ranks_on_host=ranks_on_host)
