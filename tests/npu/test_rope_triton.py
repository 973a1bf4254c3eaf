"""DeepSeek V4's one-launch RoPE rotation (npu/deepseek_v4/rope_triton.py) in Triton's interpreter (tests/conftest.py
sets TRITON_INTERPRET=1 where there is no GPU): bit for bit Rotation.apply's torch ops, forward and inverse, for
queries [N, heads, d], keys [N, d] and a rope part narrower than the head, in float32 and bfloat16, at the real
widths, with heads not a multiple of a program's; where it is chosen; and the runner on fake CUDA reaching it."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from appliance.config.compose import load_runtime_config
from npu.deepseek_v4.rope import layer_ropes
from npu.deepseek_v4.rope_triton import BLOCK_ROWS, rotate
from npu.triton_runtime import triton

pytestmark = [pytest.mark.skipif(triton is None, reason="Triton is not installed"),
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in Triton's interpreter")]

LAYOUT = load_runtime_config(["+model=dsv4_tiny"]).model.layout


@pytest.mark.parametrize("shape, dim", [((5, 3, 64), 16), ((7, 64), 16), ((2, BLOCK_ROWS + 1, 32), 32),
                                        ((3, 2, 512), 64), ((1, 1, 10), 4)],
                         ids=["queries", "keys", "all_rope", "real_widths", "one_row"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("compressed", [False, True], ids=["window", "yarn"])
@pytest.mark.parametrize("inverse", [False, True], ids=["forward", "inverse"])
def test_the_kernel_gives_the_bits_of_the_torch_rotation(shape, dim, dtype, compressed, inverse):
    lay = dataclasses.replace(LAYOUT, qk_rope_head_dim=dim)
    rope = dataclasses.replace(layer_ropes(lay, torch.device("cpu"), dtype)[compressed], dtype=dtype)
    gen = torch.Generator().manual_seed(sum(shape) + dim)
    positions = torch.randint(0, 4096, (shape[0],), generator=gen)
    rotation = rope.at(positions)
    assert not rotation.fused                                  # on the CPU Rotation.apply runs the torch ops
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    want = rotation.apply(x, inverse=inverse)
    got = rotate(x, rotation.cos, rotation.inverse_sin if inverse else rotation.sin)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got, want)
    assert torch.equal(got[..., :shape[-1] - dim], x[..., :shape[-1] - dim])      # the other channels, as they were


def test_the_runner_on_fake_cuda_rotates_through_the_kernel():
    from bench.count_device_ops import decode_ops
    ops = decode_ops("dsv4", 1)["Triton kernels (as built on CUDA)"]
    assert ops["appliance::rope_rotate"] > 2 * LAYOUT.num_layers           # queries, keys and outputs per layer
    assert ops["aten::flip"] == 0
