"""ModelRunner: the interface every model runner implements, and the pool handling they share.

Pools are allocated at runtime from the plan: one tensor per cache group shaped
[num_blocks + num_scratch, num_layers_in_group, rows_per_block, row_width]. Kernels take block tables
and read strides from these tensors, so no pool size is baked into any shape.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Mapping

import torch

from appliance.config.runtime import ModelSpec
from appliance.kv_cache_spec import CacheGroupSpec
from npu.step import StepBatch


def contiguous_runs(pages: list[int]) -> list[tuple[int, int]]:
    """[3, 4, 5, 9, 10] -> [(3, 6), (9, 11)]: half-open runs, so each run is cleared in one copy."""
    runs: list[tuple[int, int]] = []
    for p in sorted(set(pages)):
        if runs and runs[-1][1] == p:
            runs[-1] = (runs[-1][0], p + 1)
        else:
            runs.append((p, p + 1))
    return runs


class ModelRunner(ABC):
    """One model on one device: weights, pools, and a batched step over paged caches."""

    def __init__(self, model: ModelSpec, device: torch.device):
        self.model = model
        self.device = device
        self.pools: dict[str, torch.Tensor] = {}
        self.num_blocks: dict[str, int] = {}
        self.num_scratch = 0

    # -- weights -----------------------------------------------------------------------------------
    @abstractmethod
    def expected_weights(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Every parameter the model needs: name -> (shape, dtype). Checkpoints are checked against it."""

    @abstractmethod
    def load_weights(self) -> None:
        """Load model.weights (a checkpoint directory) or make seeded random weights ("random")."""

    # -- pools -------------------------------------------------------------------------------------
    def pool_dtype(self, spec: CacheGroupSpec) -> torch.dtype:
        return getattr(torch, spec.row_dtype)

    def allocate_pools(self, num_blocks: Mapping[str, int], num_scratch: int) -> None:
        """Allocate every group's pool: num_blocks[group] pages plus num_scratch scratch pages at the end."""
        self.free_pools()
        try:
            for spec in self.model.cache_groups:
                pages = num_blocks[spec.name] + num_scratch
                self.pools[spec.name] = torch.zeros(
                    (pages, spec.num_layers, spec.rows_per_block, self.row_elements(spec)),
                    dtype=self.pool_dtype(spec), device=self.device)
        except Exception:
            self.free_pools()
            raise
        self.num_blocks = dict(num_blocks)
        self.num_scratch = num_scratch

    def row_elements(self, spec: CacheGroupSpec) -> int:
        """Elements per row in the pool dtype (extra bytes, e.g. an fp32 scale, are stored inline)."""
        elem = torch.empty((), dtype=self.pool_dtype(spec)).element_size()
        extra = -(-spec.row_extra_bytes // elem)
        return spec.row_width + extra

    def free_pools(self) -> None:
        self.pools.clear()
        self.num_blocks = {}

    def scratch_page(self, group: str, row: int) -> int:
        """Scratch page of a padding row: padding rows write there, never into a real page."""
        return self.num_blocks[group] + row

    def zero_pages(self, group: str, pages: list[int]) -> None:
        pool = self.pools[group]
        for start, stop in contiguous_runs(pages):
            pool[start:stop].zero_()

    # -- steps -------------------------------------------------------------------------------------
    @abstractmethod
    def execute(self, batch: StepBatch) -> torch.Tensor:
        """Run one step; return float32 logits [number of seqs with sample=True, vocab], in batch order."""

    @abstractmethod
    def profile_batch(self, max_num_tokens: int, max_num_seqs: int) -> StepBatch:
        """The largest step the config allows, on scratch pages only, for measuring peak non-KV memory."""
