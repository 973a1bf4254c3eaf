"""A stand-in for torch_npu: the torch.npu API surface the backends use, recording who touched what.

FakeNpuRuntime answers like torch.npu (mem_get_info, memory_reserved, memory_allocated, max_memory_allocated,
reset_peak_memory_stats, empty_cache, set_device, current_device, device_count, is_available, synchronize)
with scripted memory figures, and records every call that would open a context on a device, with the device
and the calling thread. install() makes `import torch_npu` succeed (registering torch.npu) or raise any
exception, the way a broken install does.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from dataclasses import dataclass, field

import torch


@dataclass
class FakeNpuDevice:
    total: int
    used_by_others: int = 0          # memory another process holds (what mem_get_info's free lacks)
    reserved: int = 0                # this process's torch allocator: reserved, allocated now, peak
    allocated: int = 0
    peak: int = 0
    peak_reserved: int = 0


@dataclass(frozen=True)
class Touch:
    thread: str
    call: str
    device: int


@dataclass
class FakeNpuRuntime:
    devices: list[FakeNpuDevice]
    touches: list[Touch] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._current = threading.local()
        self._lock = threading.Lock()

    def _touch(self, call: str, index: int | None) -> FakeNpuDevice:
        index = self.current_device() if index is None else int(index)
        if not 0 <= index < len(self.devices):
            raise RuntimeError(f"invalid device ordinal {index}")
        with self._lock:
            self.touches.append(Touch(threading.current_thread().name, call, index))
        return self.devices[index]

    def touched_devices(self) -> set[int]:
        return {t.device for t in self.touches}

    # -- what opens no context ------------------------------------------------------------------------
    def is_available(self) -> bool:
        return bool(self.devices)

    def device_count(self) -> int:
        return len(self.devices)

    def current_device(self) -> int:
        return getattr(self._current, "index", 0)

    # -- what does --------------------------------------------------------------------------------------
    def set_device(self, index: int) -> None:
        self._touch("set_device", index)
        self._current.index = int(index)

    def mem_get_info(self, index: int | None = None) -> tuple[int, int]:
        d = self._touch("mem_get_info", index)
        return d.total - d.used_by_others - d.reserved, d.total

    def memory_reserved(self, index: int | None = None) -> int:
        return self._touch("memory_reserved", index).reserved

    def memory_allocated(self, index: int | None = None) -> int:
        return self._touch("memory_allocated", index).allocated

    def max_memory_allocated(self, index: int | None = None) -> int:
        return self._touch("max_memory_allocated", index).peak

    def max_memory_reserved(self, index: int | None = None) -> int:
        return self._touch("max_memory_reserved", index).peak_reserved

    def reset_peak_memory_stats(self, index: int | None = None) -> None:
        d = self._touch("reset_peak_memory_stats", index)
        d.peak, d.peak_reserved = d.allocated, d.reserved

    def synchronize(self, index: int | None = None) -> None:
        self._touch("synchronize", index)

    def empty_cache(self) -> None:
        d = self._touch("empty_cache", None)
        d.reserved = d.allocated


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `torch_npu`; executing it registers torch.npu, or raises what the test asked for."""

    def __init__(self, runtime: FakeNpuRuntime | None, error: BaseException | None, attrs: dict):
        self.runtime, self.error, self.attrs = runtime, error, attrs

    def find_spec(self, name, path=None, target=None):
        return importlib.machinery.ModuleSpec(name, self) if name == "torch_npu" else None

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        if self.error is not None:
            raise self.error
        torch.npu = self.runtime                    # what the real torch_npu does on import
        module.__dict__.update(self.attrs)


def install(monkeypatch, runtime: FakeNpuRuntime | None = None, error: BaseException | None = None,
            **attrs) -> None:
    """Make `import torch_npu` find the fake, with `attrs` (e.g. kernels) on the module; undone by monkeypatch
    at the end of the test."""
    monkeypatch.setitem(sys.modules, "torch_npu", None)      # so that undo removes what the import adds
    del sys.modules["torch_npu"]
    monkeypatch.setattr(torch, "npu", None, raising=False)
    monkeypatch.setattr(sys, "meta_path", [_Finder(runtime, error, attrs)] + sys.meta_path)
