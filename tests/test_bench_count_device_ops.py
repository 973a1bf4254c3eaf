"""bench/count_device_ops.py: the ops a decode step dispatches on fake CUDA, with the Sinkhorn normalization as torch
ops and as the one-launch kernel a CUDA runner holds."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from appliance.config.compose import load_runtime_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

count_device_ops = pytest.importorskip("count_device_ops")
LAYOUT = load_runtime_config(["+model=dsv4_tiny"]).model.layout     # the device guard's tiny DeepSeek V4


def test_the_kernel_takes_each_hc_pre_to_one_launch(one_torch_thread):
    counts = count_device_ops.decode_ops("dsv4", 1)
    torch_ops, kernel = counts["Sinkhorn as torch ops"], counts["Sinkhorn kernel (as built on CUDA)"]
    hc_pre = 2 * LAYOUT.num_layers                                  # attention's and the MoE's per layer
    assert kernel["appliance::sinkhorn"] == hc_pre and "appliance::sinkhorn" not in torch_ops
    iters = LAYOUT.hc_sinkhorn_iters
    assert torch_ops["aten::div_"] - kernel["aten::div_"] == hc_pre * (2 * iters - 1)
    assert sum(torch_ops.values()) - sum(kernel.values()) >= hc_pre * 2 * (2 * iters - 1) - hc_pre


def test_quantized_linears_make_no_tile_table_and_each_swiglu_makes_one(one_torch_thread):
    """As released (FP8 linears, FP4 experts): the linears' and wo_a's tables come made from the host (uniform_tiles),
    and a MoE layer's three expert GEMMs share one, made in one launch (group_tiles' kernel); searchsorted runs only
    for the experts' ends."""
    ops = count_device_ops.decode_ops("dsv4_fp8", 1)["Sinkhorn kernel (as built on CUDA)"]
    layers = LAYOUT.num_layers
    assert ops["appliance::grouped_gemm"] > 3 * layers               # the linears run through the kernel too
    assert ops["appliance::group_tiles"] == layers
    assert ops["aten::searchsorted"] == layers
