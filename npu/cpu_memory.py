"""Peak memory of CPU tensors: torch keeps no allocator statistics on the CPU, so the CPU backend counts
allocations itself, from inside torch's dispatcher, while a profiling step runs."""

from __future__ import annotations

import itertools
import weakref
from typing import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class AllocationTracker(TorchDispatchMode):
    """Peak bytes of live CPU tensors, observed from inside torch's dispatcher.

    torch has no allocator statistics on CPU, so while this mode is active it sees every op:
    - storages an op *allocates* count from allocation until torch frees them (a weakref finalizer);
    - storages that already existed and an op *reads or writes* (weights, KV pools, inputs) are adopted:
      they count as resident for the whole window, once each (views share a storage).
    peak = resident bytes adopted + the highest live bytes of allocated storages.
    A model's forward touches all of its weights, so after one profiling step the peak is weights +
    pools touched + the activation high-water mark. Buffers a kernel allocates internally and frees
    before returning are not seen; they are small next to activations. Not thread-safe (one window
    per thread), and only CPU tensors are counted.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch would wrap __torch_dispatch__ in dynamo.disable, importing torch._dynamo (seconds) on the
        # first op; nothing here is compiled, so skip that.
        return False

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[int, int]] = {}     # storage data_ptr -> (nbytes, token)
        self._resident: dict[int, int] = {}            # storage data_ptr -> nbytes
        self._tokens = itertools.count()
        self.live_bytes = 0
        self.peak_live_bytes = 0

    @property
    def resident_bytes(self) -> int:
        return sum(self._resident.values())

    @property
    def peak_bytes(self) -> int:
        return self.resident_bytes + self.peak_live_bytes

    def reset_peak(self) -> None:
        self.peak_live_bytes = self.live_bytes

    def adopt(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count tensors that existed before the window (e.g. weights) as resident."""
        for t in tensors:
            self._adopt(t)

    def _adopt(self, t: torch.Tensor) -> None:
        if t.device.type != "cpu":
            return
        try:
            s = t.untyped_storage()
            key, nbytes = s.data_ptr(), s.nbytes()
        except NotImplementedError:     # an opaque tensor (MKL's packed weights): its own buffer, sized by numel
            key, nbytes = id(t), t.numel() * t.element_size()
        if key and key not in self._live and key not in self._resident:
            self._resident[key] = nbytes

    def _allocated(self, t: torch.Tensor) -> None:
        if t.device.type != "cpu":
            return
        s = t.untyped_storage()
        key, nbytes = s.data_ptr(), s.nbytes()
        if not key or key in self._live or key in self._resident:
            return
        token = next(self._tokens)
        self._live[key] = (nbytes, token)
        self.live_bytes += nbytes
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)
        weakref.finalize(s, self._freed, key, token)

    def _freed(self, key: int, token: int) -> None:
        entry = self._live.get(key)
        if entry is not None and entry[1] == token:
            del self._live[key]
            self.live_bytes -= entry[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = [x for x in tree_flatten((args, kwargs or {}))[0] if isinstance(x, torch.Tensor)]
        for t in inputs:
            self._adopt(t)
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._allocated(t)
        return out
