"""DeepSeek V4's step with every kernel a GPU runner takes (Triton: Sinkhorn, RoPE, the RMS norms, the
hyper-connections' mixing, the attention over its paged rows and the indexer's scores, the clamped SwiGLU), run in Triton's interpreter on the CPU
(tests/conftest.py sets TRITON_INTERPRET=1 where there is no GPU), against the same runner on the torch ops a CPU
runs: the device guard's serving steps (prompts, a chunk after cached tokens beside a prompt's second chunk, decode
rows with more CSA rows than index_topk, so the indexer picks), in float32: close, and the same greedy tokens.
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from unittest import mock

import pytest
import torch

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in Triton's interpreter")]
triton = pytest.importorskip("triton")

from appliance.config.compose import load_runtime_config  # noqa: E402
from npu.deepseek_v4 import attention, hyper, moe, rope  # noqa: E402
from npu.deepseek_v4.sinkhorn_triton import triton_sinkhorn  # noqa: E402
from npu.registry import build_runner  # noqa: E402
from tests.npu.test_device_guard import BLOCKS, DSV4, serving_steps  # noqa: E402


def gpu_kernels(runner) -> ExitStack:
    """The CPU runner with every Triton kernel a CUDA runner takes, its tensors staying on the CPU."""
    stack = ExitStack()
    stack.enter_context(mock.patch.object(runner, "sinkhorn", triton_sinkhorn))
    stack.enter_context(mock.patch.object(runner.attention, "in_place", True))
    stack.enter_context(mock.patch.object(rope, "rotation_kernel_applies", lambda device: True))
    for module in (hyper, attention):
        stack.enter_context(mock.patch.object(module, "norm_kernel_applies", lambda device: True))
    stack.enter_context(mock.patch.object(hyper, "hyper_kernels_apply", lambda device, hc: True))
    stack.enter_context(mock.patch.object(moe, "activation_kernel_applies", lambda device: True))
    return stack


def test_the_step_with_every_gpu_kernel_matches_the_cpu_path():
    """float32 (the GPU oracle's dtype): each kernel's bfloat16 rounding is its own test's. Three layers, one of each
    kind (window only, CSA, HCA): interpreted kernels are slow."""
    rc = load_runtime_config([*DSV4, "model.layout.num_layers=3", "model.layout.compress_ratios=[0,4,16,0]"])
    assert rc.model.layout.dtype == "float32"
    outs = []
    for kernels in (False, True):
        runner = build_runner(rc.model, torch.device("cpu"))
        runner.load_weights()
        runner.allocate_pools({g.name: BLOCKS for g in rc.model.cache_groups}, rc.decode_batch)
        with ExitStack() as stack, torch.inference_mode():
            if kernels:
                stack.enter_context(gpu_kernels(runner))
            outs.append(torch.cat([runner.execute(step) for step in serving_steps(runner)]).float())
    assert not outs[1].isnan().any()
    assert torch.allclose(outs[0], outs[1], atol=2e-4, rtol=2e-4), (outs[0] - outs[1]).abs().max()
    assert outs[0].argmax(-1).tolist() == outs[1].argmax(-1).tolist()
