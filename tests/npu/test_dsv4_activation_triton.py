"""DeepSeek V4's clamped SwiGLU kernel (npu/deepseek_v4/activation_triton.py), run in Triton's interpreter on the CPU
(tests/conftest.py sets TRITON_INTERPRET=1 where there is no GPU) against moe.clamped_swiglu's torch ops (which a CPU
tensor runs): with and without the clamp, float32 close, bfloat16 within one unit in the last place and mostly to
the bit, sizes off the kernel's block; and the op on fake CUDA.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in Triton's interpreter")]
triton = pytest.importorskip("triton")

from npu.deepseek_v4.activation_triton import BLOCK, activation_kernel_applies, clamped_swiglu_op  # noqa: E402
from npu.deepseek_v4.moe import clamped_swiglu  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("limit", [None, 7.0])
def test_kernel_matches_the_torch_ops(dtype, limit):
    gen = torch.Generator().manual_seed(3)
    gate = (torch.randn(5, BLOCK // 4 + 3, generator=gen) * 6).to(dtype)     # past the limit on both sides
    up = (torch.randn(5, BLOCK // 4 + 3, generator=gen) * 6).to(dtype)
    want = clamped_swiglu(gate, up, limit)
    got = clamped_swiglu_op(gate, up, limit)
    assert got.shape == want.shape and got.dtype == dtype
    if dtype == torch.float32:
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-6), (got - want).abs().max()
    else:
        assert int((got.view(torch.int16).int() - want.view(torch.int16).int()).abs().max()) <= 1
        assert (got == want).float().mean() > 0.95
    if limit is not None:
        assert clamped_swiglu_op(gate, up, None).ne(got).any()          # the clamp does something here


def test_where_it_applies_and_the_fake():
    assert not activation_kernel_applies(torch.device("cpu")) and activation_kernel_applies(torch.device("cuda"))
    from tests.support.fake_cuda import fake_cuda
    with fake_cuda():
        x = torch.empty(4, 96, device="cuda", dtype=torch.bfloat16)
        assert clamped_swiglu(x, x, 7.0).shape == (4, 96)
