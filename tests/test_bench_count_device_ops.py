"""bench/count_device_ops.py: the ops a decode step dispatches on fake CUDA, with the Sinkhorn normalization as torch
ops and as the one-launch kernel a CUDA runner holds."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from appliance.config.compose import load_runtime_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

count_device_ops = pytest.importorskip("count_device_ops")


def test_the_kernel_takes_each_hc_pre_to_one_launch(one_torch_thread):
    counts = count_device_ops.decode_ops("dsv4", 1)
    torch_ops, kernel = counts["Sinkhorn as torch ops"], counts["Sinkhorn kernel (as built on CUDA)"]
    hc_pre = 2 * load_runtime_config(["+model=dsv4_tiny"]).model.layout.num_layers    # attention's and the MoE's
    assert kernel["appliance::sinkhorn"] == hc_pre and "appliance::sinkhorn" not in torch_ops
    iters = load_runtime_config(["+model=dsv4_tiny"]).model.layout.hc_sinkhorn_iters
    assert torch_ops["aten::div_"] - kernel["aten::div_"] == hc_pre * (2 * iters - 1)
    assert sum(torch_ops.values()) - sum(kernel.values()) >= hc_pre * 2 * (2 * iters - 1) - hc_pre
