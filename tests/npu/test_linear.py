"""npu.linear.Projection: every path computes x W^T, whatever the row count, and holds what it says."""

import pytest
import torch

from npu.linear import Projection

ROWS = [0, 1, 2, 7, 32, 64, 65, 300]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(16384, 512), (96, 64)])      # packed by MKL in fp32 / left plain
def test_projection_equals_x_times_w_transposed(dtype, shape):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(*shape, generator=g).to(dtype)
    proj = Projection.of(w)
    for rows in ROWS:
        x = torch.randn(rows, shape[1], generator=g).to(dtype)
        y = proj(x)
        assert y.shape == (rows, shape[0]) and y.dtype == dtype and y.is_contiguous()
        exact = x.double() @ w.double().t()
        # the float32 reference's own rounding, or one bf16 rounding of the output plus the sum's
        tol = 1e-4 if dtype == torch.float32 else 2 ** -7
        torch.testing.assert_close(y.double(), exact, rtol=tol, atol=tol * float(exact.abs().amax()) if rows else 0.0)


def test_bfloat16_weight_is_held_once_as_onednn_packed_copy():
    proj = Projection.of(torch.randn(256, 128, dtype=torch.bfloat16))
    if proj.onednn_packed is None:
        pytest.skip("no oneDNN bf16 support on this CPU")
    assert proj.weight is None and proj.tensors() == [proj.onednn_packed]
