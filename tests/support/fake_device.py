"""Stand-ins that run the real startup code with NPU-sized numbers on any machine, allocating nothing.

FakeMemoryProbe scripts each device's total, free and profiled peak; FakeBackend serves those numbers
through the Backend interface; ShapeOnlyRunner has a model's cache groups and pools (on the meta device)
without its math. Together they plan a 16 x 64 GiB startup on a laptop.
"""

from __future__ import annotations

from typing import Sequence

import torch

from appliance.core.config import ModelSpec
from appliance.core.parallel import RankPlace
from npu.backends import Backend, MemoryStats
from npu.runner import ModelRunner
from npu.step import StepBatch, logits_offsets


class FakeMemoryProbe:
    """Scripted per-device memory: totals, free, and the allocator peak a profiling step would report."""

    def __init__(self, count: int, total_bytes: int | Sequence[int], peak_bytes: int | Sequence[int] = 0,
                 free_bytes: int | Sequence[int] | None = None, reserved_bytes: int | Sequence[int] = 0,
                 non_torch_bytes: int | Sequence[int] = 0):
        def per_device(v: int | Sequence[int], what: str) -> list[int]:
            vals = [int(v)] * count if isinstance(v, int) else [int(x) for x in v]
            if len(vals) != count:
                raise ValueError(f"{what}: {len(vals)} values for {count} devices")
            return vals

        self.count = count
        self.total = per_device(total_bytes, "total_bytes")
        self.peak = per_device(peak_bytes, "peak_bytes")
        self.free = per_device(free_bytes, "free_bytes") if free_bytes is not None else list(self.total)
        self.reserved = per_device(reserved_bytes, "reserved_bytes")     # the caching allocator's peak (0: none)
        self.non_torch = per_device(non_torch_bytes, "non_torch_bytes")

    def stats(self, index: int) -> MemoryStats:
        return MemoryStats(self.total[index], self.free[index], self.peak[index], self.non_torch[index],
                           peak_reserved_bytes=self.reserved[index])


class FakeBackend(Backend):
    """A backend whose memory numbers come from a FakeMemoryProbe; tensors live on `tensor_device`.

    Lets NPU-sized startups (e.g. 16 x 64 GiB with a per-device peak) run the real launcher on a CPU;
    pair it with a shape-only runner on the meta device so nothing is really allocated.
    """

    def __init__(self, probe: FakeMemoryProbe, kind: str = "npu", tensor_device: str | torch.device = "meta"):
        super().__init__(probe.count)
        self.kind = kind
        self.probe = probe
        self._device = torch.device(tensor_device)
        self.resets = 0

    def torch_device(self, index: int = 0) -> torch.device:
        self._indices(index)
        return self._device

    def memory(self, index: int = 0) -> MemoryStats:
        self._indices(index)
        return self.probe.stats(index)

    def reset_peak(self, index: int | None = None) -> None:
        self._indices(index)
        self.resets += 1


class ShapeOnlyRunner(ModelRunner):
    """A model's cache groups and pools without its math: pools live on the meta device (no memory),
    weights are skipped and a step returns meta logits. Plans NPU-scale startups on a laptop.

    max_pool_bytes simulates a device whose allocator refuses pools larger than that (retry tests).
    """

    def __init__(self, model: ModelSpec, device: torch.device | str = "meta", max_pool_bytes: int | None = None,
                 place: RankPlace | None = None):
        super().__init__(model, torch.device(device), place)
        self.max_pool_bytes = max_pool_bytes
        self.allocation_attempts: list[dict[str, int]] = []

    def expected_weights(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {}

    def load_weights(self) -> None:
        pass

    def install_weights(self, weights: dict[str, torch.Tensor]) -> None:
        pass

    def weight_tensors(self) -> list[torch.Tensor]:
        return []

    def allocate_pools(self, num_blocks, num_scratch: int) -> None:
        self.allocation_attempts.append(dict(num_blocks))
        if self.max_pool_bytes is not None:
            need = sum((num_blocks[s.name] + num_scratch) * s.page_size_bytes for s in self.cache_specs)
            if need > self.max_pool_bytes:
                self.free_pools()
                raise RuntimeError(f"simulated out of memory: pools need {need:,} B, the device gives "
                                   f"{self.max_pool_bytes:,} B")
        super().allocate_pools(num_blocks, num_scratch)

    def prepare(self, batch: StepBatch) -> int:
        return sum(len(logits_offsets(s)) for s in batch.seqs)

    def forward(self, rows: int) -> torch.Tensor:
        return torch.zeros(rows, self.model.layout.vocab_size, dtype=torch.float32, device=self.device)
