"""DeepSeek V4's RMS norm kernels (npu/deepseek_v4/norms_triton.py), run in Triton's interpreter on the CPU
(tests/conftest.py sets TRITON_INTERPRET=1 where there is no GPU) against the torch functions they replace
(attention.rms_norm, hyper.unweighted_rms, which a CPU tensor runs): float32 to a few units in the last place,
bfloat16 to at most one and mostly to the bit (the squares are summed in another order, the roundings are torch's),
rows narrower and
wider than one pass, and the ops on fake CUDA.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in Triton's interpreter")]
triton = pytest.importorskip("triton")

from npu.deepseek_v4.attention import rms_norm  # noqa: E402
from npu.deepseek_v4.hyper import unweighted_rms  # noqa: E402
from npu.deepseek_v4.norms_triton import MAX_BLOCK, norm_kernel_applies, rms_norm_op, unweighted_rms_op  # noqa: E402


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between a and b in units in the last place of their dtype (same signs assumed)."""
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[a.dtype]
    return int((a.view(bits).int() - b.view(bits).int()).abs().max())


@pytest.mark.parametrize("dtype,max_ulps", [(torch.float32, 4), (torch.bfloat16, 1)])
@pytest.mark.parametrize("shape", [(5, 32), (3, 4, 512), (2, MAX_BLOCK + 476)])   # the last: two passes per row
def test_kernels_give_the_torch_functions_results(dtype, max_ulps, shape):
    gen = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(*shape, generator=gen) * 3).to(dtype)
    weight = torch.randn(shape[-1], generator=gen)                     # a float32 gain, as released
    eps = 1e-6
    for got, want in ((rms_norm_op(x, weight, eps), rms_norm(x, weight, eps)),
                      (unweighted_rms_op(x, eps), unweighted_rms(x, eps))):
        assert got.shape == want.shape and got.dtype == want.dtype == dtype
        assert ulps_apart(got, want) <= max_ulps
        if dtype == torch.bfloat16:         # a row's float32 factor may part in its last place, its bf16 values rarely
            assert (got == want).float().mean() > 0.95


def test_unweighted_rms_rounds_the_factor_before_the_product_in_bfloat16():
    """torch rounds rsqrt(...) to bfloat16 before multiplying: a kernel that multiplied by the float32 factor would
    part from it by more than one unit on some values."""
    x = torch.linspace(-4, 4, 4096).view(8, 512).to(torch.bfloat16)
    want = unweighted_rms(x, 1e-6)
    unrounded = (x.float() * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    assert not torch.equal(want, unrounded)                            # the two roundings do differ here
    assert ulps_apart(unweighted_rms_op(x, 1e-6), want) <= 1


def test_the_torch_functions_take_the_kernels_on_cuda_only():
    assert not norm_kernel_applies(torch.device("cpu"))
    assert norm_kernel_applies(torch.device("cuda"))
    from tests.support.fake_cuda import fake_cuda
    with fake_cuda():
        x = torch.empty(4, 64, device="cuda", dtype=torch.bfloat16)
        assert rms_norm(x, torch.empty(64, device="cuda"), 1e-6).shape == (4, 64)
        assert unweighted_rms(x, 1e-6).shape == (4, 64)
