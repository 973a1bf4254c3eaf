"""bench/count_device_ops.py: the device ops a decode step dispatches on fake CUDA, with the torch ops a CPU runs and
with the Triton kernels a CUDA runner holds (Sinkhorn, RoPE, the RMS norms, the hyper-connections' mixing, the
attention over the paged rows): each kernel once where its torch ops were many."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from appliance.config.compose import load_runtime_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

count_device_ops = pytest.importorskip("count_device_ops")
LAYOUT = load_runtime_config(["+model=dsv4_tiny"]).model.layout     # the device guard's tiny DeepSeek V4


def test_the_kernels_take_their_torch_ops_to_one_launch_each(one_torch_thread):
    counts = count_device_ops.decode_ops("dsv4", 1)
    torch_ops, kernel = counts["torch ops (as on a CPU)"], counts["Triton kernels (as built on CUDA)"]
    layers = LAYOUT.num_layers
    hc_pre = 2 * layers                                             # attention's and the MoE's per layer
    assert kernel["appliance::sinkhorn"] == kernel["appliance::dsv4_hc_mix"] == hc_pre
    assert kernel["appliance::dsv4_hc_post"] == hc_pre
    assert kernel["appliance::dsv4_sparse_attention"] == layers      # one query group: every row decodes
    assert kernel["appliance::dsv4_rms_norm"] >= 4 * layers          # attn_norm, ffn_norm, q latent, KV row
    assert kernel["appliance::dsv4_unweighted_rms"] >= hc_pre + layers     # streams before mixing, query heads
    experts = {"appliance::grouped_gemm", "appliance::group_tiles"}  # the stacked experts' kernels: in both variants
    assert not any(name.startswith("appliance::") and name not in experts for name in torch_ops)
    iters = LAYOUT.hc_sinkhorn_iters
    assert torch_ops["aten::div_"] - kernel["aten::div_"] == hc_pre * (2 * iters - 1)
    assert sum(torch_ops.values()) - sum(kernel.values()) >= hc_pre * 2 * (2 * iters - 1) + hc_pre * 10


def test_quantized_linears_make_no_tile_table_and_each_swiglu_makes_one(one_torch_thread):
    """As released (FP8 linears, FP4 experts): the linears' and wo_a's tables come made from the host (uniform_tiles),
    and a MoE layer's three expert GEMMs share one, made in one launch (group_tiles' kernel); searchsorted runs only
    for the experts' ends."""
    ops = count_device_ops.decode_ops("dsv4_fp8", 1)["Triton kernels (as built on CUDA)"]
    layers = LAYOUT.num_layers
    assert ops["appliance::grouped_gemm"] > 3 * layers               # the linears run through the kernel too
    assert ops["appliance::group_tiles"] == layers
    assert ops["aten::searchsorted"] == layers
