"""KV pools that start full of NaN: the worst an uninitialized pool (ModelRunner.allocate_pools, torch.empty) can hold.

Every byte 0xFF reads as NaN in each float dtype a pool may have (float32, bfloat16, float16, float8 e4m3; an fp32
scale stored inline too), so a step that lets one never-written row reach its math, even under a mask applied by
multiplication (NaN x 0 = NaN), turns its logits NaN. What allocate_pools zeroes itself (page 0, the scratch pages)
is zeroed after this fill, as in serving.

    def test_x(monkeypatch):
        pools_start_full_of_nan(monkeypatch)       # every runner built in this test, the engine's included
"""

from __future__ import annotations

import pytest
import torch

from npu.runner import ModelRunner


def nan_pool(pool: torch.Tensor) -> torch.Tensor:
    """Fill a pool's bytes with 0xFF (NaN in every float dtype); meta and fake tensors hold no bytes to fill."""
    if pool.device.type != "meta" and type(pool) is torch.Tensor:
        pool.view(torch.uint8).fill_(0xFF)
    return pool


def pools_start_full_of_nan(monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on (this test), every runner's pools start as memory full of NaN instead of torch.empty's bytes."""
    real = ModelRunner.empty_pool
    monkeypatch.setattr(ModelRunner, "empty_pool",
                        lambda self, shape, dtype: nan_pool(real(self, shape, dtype)))
